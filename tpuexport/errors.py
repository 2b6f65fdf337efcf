"""The two ways a conversion fails, and the exit codes the CLI maps them to."""

from __future__ import annotations

EXIT_OK = 0
EXIT_VERIFICATION_FAILED = 1
EXIT_BAD_INPUT = 2


class TpuExportError(Exception):
    """Bad input: the message is one line naming the problem and how to fix it (exit code 2)."""

    exit_code = EXIT_BAD_INPUT


class UnsupportedOperatorsError(TpuExportError):
    """The program uses operators that have no lowering; all of them are listed at once.

    Attributes:
      operators: one `UnsupportedOperator` per distinct (operator, source line).
    """

    def __init__(self, operators):
        self.operators = tuple(operators)
        listed = "; ".join(f"{op.name} at {op.source}" for op in self.operators)
        super().__init__(
            f"{len(self.operators)} operator(s) have no TPU lowering: {listed}. "
            "Rewrite these lines with supported torch ops, or file an issue with tpuexport."
        )


class VerificationError(Exception):
    """The lowered program does not match eager PyTorch (exit code 1).

    Attributes:
      report: the `VerificationReport` of the verify stage.
      report_path: where the report was written, or None.
    """

    exit_code = EXIT_VERIFICATION_FAILED

    def __init__(self, report, report_path=None, summary: str | None = None):
        """`summary` names what failed when it is not `report` itself (e.g. the TF SavedModel check)."""
        self.report = report
        self.report_path = report_path
        where = f"; report: {report_path}" if report_path else ""
        super().__init__(f"verification failed: {summary or report.failure_summary()}{where}")
