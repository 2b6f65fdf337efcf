"""The verification report: one case per set of dim sizes, one comparison per output."""

from __future__ import annotations

import dataclasses

import numpy as np

from tpuexport.verify.compare import OutputComparison, Tolerances


_RULE = "|actual - expected| <= atol + rtol * |expected| elementwise; integer and bool outputs exactly"
_QUANTIZED_RULE = (
    "|actual - expected| <= atol + rtol * |expected| + quantization_steps * max|expected| / 127 on at least "
    "min_fraction of each output's elements; integer and bool outputs exactly"
)


def describe_sizes(sizes: dict[str, int]) -> str:
    """Dim sizes as "batch=4,seq=16", or "static shapes" when there are none."""
    return ",".join(f"{k}={v}" for k, v in sizes.items()) or "static shapes"


@dataclasses.dataclass(frozen=True)
class VerificationCase:
    """One run of the lowered program against eager PyTorch.

    Attributes:
      label: why these sizes were chosen ("example", "min", "max", "mid").
      sizes: the dim sizes of this case.
      outputs: one comparison per output (empty when the run failed).
      error: the failure message if the lowered or eager run raised, else None.
      golden: whether this case's inputs and eager outputs are stored as golden data.
    """

    label: str
    sizes: dict[str, int]
    outputs: tuple[OutputComparison, ...]
    error: str | None = None
    golden: bool = False

    @property
    def passed(self) -> bool:
        return self.error is None and all(o.passed for o in self.outputs)

    def describe_sizes(self) -> str:
        return describe_sizes(self.sizes)


@dataclasses.dataclass(frozen=True)
class VerificationReport:
    """The verify stage's result.

    Attributes:
      precision: the precision verified ("f32", "bf16").
      tolerances: the tolerances applied.
      cases: the cases run, in order.
      golden: arrays to store, keyed "<case index>/input/<name>" and "<case index>/output/<name>".
      against: what the program was compared with (e.g. "eager PyTorch").
    """

    precision: str
    tolerances: Tolerances
    cases: tuple[VerificationCase, ...]
    golden: dict[str, np.ndarray]
    against: str = "eager PyTorch"

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(case.passed for case in self.cases)

    def failure_summary(self) -> str:
        """Names every mismatched output with its error, one clause each."""
        clauses = []
        for case in self.cases:
            if case.error is not None:
                clauses.append(f"{case.label} case ({case.describe_sizes()}) raised: {case.error}")
            for output in case.outputs:
                if not output.passed:
                    clauses.append(
                        f"output {output.name!r} at {case.describe_sizes()}: max abs error {output.max_abs_error:.3g}, "
                        f"max rel error {output.max_rel_error:.3g}, {output.mismatched}/{output.elements} elements "
                        f"outside atol={self.tolerances.atol:g} rtol={self.tolerances.rtol:g}"
                    )
        return "; ".join(clauses) or "all outputs match"

    def to_json(self) -> dict:
        return {
            "passed": self.passed,
            "against": self.against,
            "precision": self.precision,
            "tolerances": dataclasses.asdict(self.tolerances),
            "rule": _RULE if self.tolerances.quantization_steps == 0 else _QUANTIZED_RULE,
            "cases": [
                {
                    "label": case.label,
                    "sizes": case.sizes,
                    "passed": case.passed,
                    "error": case.error,
                    "golden": case.golden,
                    "outputs": [{**dataclasses.asdict(o), "passed": o.passed} for o in case.outputs],
                }
                for case in self.cases
            ],
        }
