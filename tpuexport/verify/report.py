"""The verification report: one case per set of dim sizes, two runs per case, one comparison per output."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from tpuexport.verify.compare import OutputComparison
from tpuexport.verify.tolerances import VerificationTolerances

if TYPE_CHECKING:  # conformance.py imports torch; artifacts are read (artifact/layout.py imports this module) without it
    from tpuexport.verify.conformance import OpConformance

RUNS = {
    "tpu": "the lowered program on CPU with the TPU's matmul arithmetic (operands rounded as the pinned precision rounds them)",
    "cpu": "the lowered program on XLA:CPU in plain f32",
}
_RULE = ("element matches when |actual - expected| <= atol + rtol * |expected| + scale_tol * rms(expected) "
         "+ quantization_steps * max|expected| / 127; an output passes when at least min_fraction of its elements "
         "match and its SQNR is at least min_sqnr_db (when set); integer and bool outputs exactly; both runs must pass")


def describe_sizes(sizes: dict[str, int]) -> str:
    """Dim sizes as "batch=4,seq=16", or "static shapes" when there are none."""
    return ",".join(f"{k}={v}" for k, v in sizes.items()) or "static shapes"


# The fix a failed verification names when the CPU run departs too, by the program's precision. Fuzzing
# found both kinds on correct lowerings: bf16 rounding of a LayerNorm over 2 features whose output
# then loses its leading digits (|t| - 1), and a GroupNorm over one element, where f32 rounding noise
# times 1/sqrt(eps) is all the output holds (eager PyTorch's own f32 noise is as large).
_CPU_RUN_FIXES = {
    "bf16": ("every op computes in bfloat16 (--precision bf16) and these outputs depart by more than its rounding allows: "
             "--precision bf16-mixed keeps norms, softmax and reductions in f32 and f32 computes as eager PyTorch does, "
             "or loosen --atol/--rtol/--scale-tol if this error is acceptable"),
    "bf16-mixed": ("elementwise ops compute in bfloat16 (--precision bf16-mixed) and these outputs depart by more than its "
                   "rounding allows: --precision f32 computes as eager PyTorch does, or loosen --atol/--rtol/--scale-tol if "
                   "this error is acceptable"),
    "f32": ("the plain CPU run departs too: outputs that amplify rounding (a norm over a near-constant group, a difference "
            "of nearly equal values) do; loosen --atol/--rtol/--scale-tol if this error is acceptable, and if these outputs "
            "should not depend on rounding, report the model: it is a lowering error"),
}


@dataclasses.dataclass(frozen=True)
class VerificationCase:
    """The lowered program against eager PyTorch at one set of sizes.

    Attributes:
      label: what the sizes are ("example", "min", "max", "mid", ...; see sizes.py).
      sizes: the dim sizes of this case.
      runs: {"tpu": comparisons, "cpu": comparisons}, one comparison per output (empty on error).
      error: the failure message if the lowered or eager run raised, else None.
      golden: whether this case's inputs and eager outputs are stored as golden data.
      reason: why the case ran ("always", "coverage", "requested", "within budget").
      flops: the program's matmul FLOPs at these sizes.
    """

    label: str
    sizes: dict[str, int]
    runs: dict[str, tuple[OutputComparison, ...]]
    error: str | None = None
    golden: bool = False
    reason: str = "always"
    flops: float = 0.0

    @property
    def passed(self) -> bool:
        return self.error is None and all(o.passed for outputs in self.runs.values() for o in outputs)

    def describe_sizes(self) -> str:
        return describe_sizes(self.sizes)


# Where every artifact keeps its verification report and golden data (artifact/layout.py's names).
REPORT_PATH, GOLDEN_PATH = "verification/report.json", "verification/golden.safetensors"


def tpu_arithmetic_hint(matmul_precision: str) -> str:
    """The clause a failure ends with when only the TPU-faithful run departs (the plain f32 run of
    the same program passes): the program is right, the TPU's matmul rounding is what departs."""
    return (f"only the TPU's arithmetic (matmul precision {matmul_precision}) departs from eager PyTorch this "
            "much: --matmul-precision high or highest computes closer to f32 on the TPU (at 3x or 6x the matmul "
            "passes), or loosen --rtol/--scale-tol if this error is acceptable")


def _not_finite_reference_clause(failed: list) -> str:
    """Says that eager PyTorch's own output is an infinity or a NaN where a run departs from it: the
    model overflowed or divided by about zero in f32 at the verification's inputs (ALIGN's random tiny
    model: image activations of 1e-24 whose squares underflow, an L2 norm of 0, every embedding +-inf;
    one bf16-rounded product then flips an infinity's sign), which says nothing of the conversion."""
    names = ", ".join(dict.fromkeys(repr(output.name) for _, output in failed if output.reference_not_finite))
    where = ", ".join(dict.fromkeys(case.describe_sizes() for case, output in failed if output.reference_not_finite))
    count = sum(output.reference_not_finite for _, output in failed)
    return (f"eager PyTorch's own {names} is inf or NaN at {count} of the elements the runs depart at ({where}): the model "
            "overflows or divides by about zero in f32 at these inputs (random or untrained weights can), and no precision "
            "reproduces such a value's sign; that is the model's arithmetic, not the conversion's: check its weights")


def summary_section(report) -> dict:
    """What the manifest's "verification" block says of any report (forward or generation): outcome,
    reference, arithmetic, tolerances, and where the report and golden data are."""
    return {"passed": report.passed, "against": report.against, "matmul_precision": report.matmul_precision,
            "tolerances": report.tolerances.to_json(), "report": REPORT_PATH, "golden": GOLDEN_PATH}


@dataclasses.dataclass(frozen=True)
class VerificationReport:
    """The verify stage's result.

    Attributes:
      precision: the program's precision ("f32", "bf16").
      matmul_precision: the TPU matmul precision pinned in it.
      tolerances: the tolerances of both runs.
      cases: the cases run, in order.
      golden: arrays to store, keyed "<case index>/input/<name>" and "<case index>/output/<name>".
      against: what the program was compared with (e.g. "eager PyTorch").
      budget_flops: the FLOPs budget the optional cases were chosen within.
      conformance: the op-by-op check (quantized programs), or None.
      skipped: the optional cases left out, with why (sizes.SkippedCase: the FLOPs budget, the
        memory a run may hold).
    """

    precision: str
    matmul_precision: str
    tolerances: VerificationTolerances
    cases: tuple[VerificationCase, ...]
    golden: dict[str, np.ndarray]
    against: str = "eager PyTorch"
    budget_flops: float = 0.0
    conformance: OpConformance | None = None
    skipped: tuple = ()

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(case.passed for case in self.cases) and (self.conformance is None or self.conformance.passed)

    def failure_summary(self, hint: bool = True) -> str:
        """Names every mismatched output of every run, one clause each, and (with `hint`) what the
        arithmetic that departs suggests doing."""
        clauses = []
        if self.conformance is not None and not self.conformance.passed:
            shown = "; ".join(self.conformance.failures[:5])
            more = len(self.conformance.failures) - 5
            clauses.append(f"{len(self.conformance.failures)} op(s) do not reproduce the reference given its own inputs, at "
                           f"{describe_sizes(self.conformance.sizes)}: {shown}" + (f"; and {more} more" if more > 0 else ""))
        for case in self.cases:
            if case.error is not None:
                clauses.append(f"{case.label} case ({case.describe_sizes()}) raised: {case.error}")
            for run, outputs in case.runs.items():
                tolerances = getattr(self.tolerances, run)
                for output in outputs:
                    if not output.passed:
                        clauses.append(f"output {output.name!r} at {case.describe_sizes()} ({run} run): "
                                       f"{output.describe_failure()} [{tolerances.describe()}]")
        failed = [(case, output) for case in self.cases for outputs in case.runs.values() for output in outputs if not output.passed]
        if any(output.reference_not_finite for _, output in failed):
            clauses.append(_not_finite_reference_clause(failed))
        # Departures only from the reference's infinities and NaNs name no arithmetic of the program's.
        if hint and not (failed and all(output.mismatched - output.reference_not_finite <= output.allowed_mismatches
                                        for _, output in failed)):
            if self._only_the_tpu_run_failed():
                clauses.append(tpu_arithmetic_hint(self.matmul_precision))
            elif self._the_cpu_run_failed():
                clauses.append(_CPU_RUN_FIXES.get(self.precision, _CPU_RUN_FIXES["f32"]))
        return "; ".join(clauses) or "all outputs match"

    def _the_cpu_run_failed(self) -> bool:
        """The plain CPU run (the program's own arithmetic, no TPU matmul rounding) departs, and
        every case ran: the departure is the program's, whatever the TPU's matmul precision."""
        return (self.conformance is None and all(case.error is None for case in self.cases)
                and any(not all(o.passed for o in case.runs.get("cpu", ())) for case in self.cases))

    def _only_the_tpu_run_failed(self) -> bool:
        failed = {run for case in self.cases for run, outputs in case.runs.items() if not all(o.passed for o in outputs)}
        return failed == {"tpu"} and self.matmul_precision != "highest" and all(case.error is None for case in self.cases)

    def worst_errors(self) -> dict[str, float]:
        """Per run, the largest relative RMS error of any output in any case (for progress lines)."""
        return {
            run: max((o.relative_rms_error for case in self.cases for o in case.runs.get(run, ())), default=0.0)
            for run in RUNS
        }

    def manifest_section(self) -> dict:
        """The manifest's "verification" block (its details are in verification/report.json)."""
        return {
            **summary_section(self),
            "cases": [{"label": c.label, "sizes": c.sizes, "reason": c.reason, "golden": c.golden} for c in self.cases],
            "skipped": [case.to_json() for case in self.skipped],
            "conformance": None if self.conformance is None else self.conformance.to_json(),
        }

    def to_json(self) -> dict:
        return {
            "passed": self.passed,
            "against": self.against,
            "precision": self.precision,
            "matmul_precision": self.matmul_precision,
            "runs": RUNS,
            "tolerances": self.tolerances.to_json(),
            "rule": _RULE,
            "budget_flops": self.budget_flops,
            "skipped": [case.to_json() for case in self.skipped],
            "conformance": None if self.conformance is None else self.conformance.to_json(),
            "cases": [
                {
                    "label": case.label,
                    "sizes": case.sizes,
                    "reason": case.reason,
                    "flops": case.flops,
                    "passed": case.passed,
                    "error": case.error,
                    "golden": case.golden,
                    "runs": {
                        run: [{**dataclasses.asdict(o), "passed": o.passed} for o in outputs]
                        for run, outputs in case.runs.items()
                    },
                }
                for case in self.cases
            ],
        }
