"""Comparing outputs with explicit tolerances, and the per-output result.

An element matches when |actual - expected| <= atol + rtol * |expected| (numpy.isclose's rule;
NaN matches NaN at the same place). Integer and bool outputs must match exactly.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Tolerances:
    """Absolute and relative tolerance of the elementwise rule above."""

    atol: float
    rtol: float


# f32: XLA CPU and PyTorch CPU differ by reassociated sums (~1e-6 relative on the examples).
# bf16: 8 mantissa bits give ~4e-3 relative error per rounding, compounding over layers.
DEFAULT_TOLERANCES = {"f32": Tolerances(atol=1e-4, rtol=1e-4), "bf16": Tolerances(atol=5e-2, rtol=5e-2)}


@dataclasses.dataclass(frozen=True)
class OutputComparison:
    """How one output compares with eager PyTorch.

    Attributes:
      name: the output's name.
      max_abs_error: largest |actual - expected|.
      max_rel_error: largest |actual - expected| / |expected| over elements with expected != 0.
      mismatched: number of elements outside tolerance (or of a different shape: all of them).
      elements: number of elements.
    """

    name: str
    max_abs_error: float
    max_rel_error: float
    mismatched: int
    elements: int

    @property
    def passed(self) -> bool:
        return self.mismatched == 0


def compare_output(name: str, actual: np.ndarray, expected: np.ndarray, tolerances: Tolerances) -> OutputComparison:
    """Compares one output; see the module docstring for the rule."""
    if actual.shape != expected.shape:
        return OutputComparison(name, float("inf"), float("inf"), max(expected.size, 1), expected.size)
    if not np.issubdtype(expected.dtype, np.floating):
        differ = actual != expected
        error = float(np.abs(actual.astype(np.float64) - expected.astype(np.float64)).max(initial=0.0))
        return OutputComparison(name, error, error, int(differ.sum()), expected.size)
    actual64, expected64 = actual.astype(np.float64), expected.astype(np.float64)
    close = np.isclose(actual64, expected64, atol=tolerances.atol, rtol=tolerances.rtol, equal_nan=True)
    difference = np.abs(actual64 - expected64)
    difference = np.where(np.isnan(actual64) & np.isnan(expected64), 0.0, difference)
    nonzero = expected64 != 0
    relative = difference[nonzero] / np.abs(expected64[nonzero])
    return OutputComparison(
        name,
        float(np.nan_to_num(difference, nan=np.inf).max(initial=0.0)),
        float(np.nan_to_num(relative, nan=np.inf).max(initial=0.0)),
        int((~close).sum()),
        expected.size,
    )
