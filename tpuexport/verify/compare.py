"""Comparing outputs with explicit tolerances, and the per-output result.

An element matches when |actual - expected| <= atol + rtol * |expected| (numpy.isclose's rule;
NaN matches NaN at the same place). Integer and bool outputs must match exactly.

Quantized programs (int8) are compared with the PT2E-converted model: an element also matches
when it is within `quantization_steps` steps of the output, one step being max|expected| / 127
(the step of int8 symmetric per-tensor quantization of that output), and an output passes when
at least `min_fraction` of its elements match (a value that lands on the other side of a
rounding boundary in one layer moves the outputs it feeds by a step or so).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Tolerances:
    """Absolute and relative tolerance of the elementwise rule above, and for quantized programs
    the allowance in quantization steps and the fraction of elements that must match."""

    atol: float
    rtol: float
    quantization_steps: float = 0.0
    min_fraction: float = 1.0


# f32: XLA CPU and PyTorch CPU differ by reassociated sums (~1e-6 relative on the examples).
# bf16: 8 mantissa bits give ~4e-3 relative error per rounding, compounding over layers.
DEFAULT_TOLERANCES = {"f32": Tolerances(atol=1e-4, rtol=1e-4), "bf16": Tolerances(atol=5e-2, rtol=5e-2)}
# int8: within one quantization step of the output on >= 99.9% of elements.
QUANTIZED_TOLERANCES = Tolerances(atol=1e-4, rtol=1e-4, quantization_steps=1.0, min_fraction=0.999)


@dataclasses.dataclass(frozen=True)
class OutputComparison:
    """How one output compares with eager PyTorch.

    Attributes:
      name: the output's name.
      max_abs_error: largest |actual - expected|.
      max_rel_error: largest |actual - expected| / |expected| over elements with expected != 0.
      mismatched: number of elements outside tolerance (or of a different shape: all of them).
      elements: number of elements.
      allowed_mismatches: mismatched elements tolerated (0 unless Tolerances.min_fraction < 1).
    """

    name: str
    max_abs_error: float
    max_rel_error: float
    mismatched: int
    elements: int
    allowed_mismatches: int = 0

    @property
    def passed(self) -> bool:
        return self.mismatched <= self.allowed_mismatches


def compare_output(name: str, actual: np.ndarray, expected: np.ndarray, tolerances: Tolerances) -> OutputComparison:
    """Compares one output; see the module docstring for the rule."""
    if actual.shape != expected.shape:
        return OutputComparison(name, float("inf"), float("inf"), max(expected.size, 1), expected.size)
    if not np.issubdtype(expected.dtype, np.floating):
        differ = actual != expected
        error = float(np.abs(actual.astype(np.float64) - expected.astype(np.float64)).max(initial=0.0))
        return OutputComparison(name, error, error, int(differ.sum()), expected.size)
    actual64, expected64 = actual.astype(np.float64), expected.astype(np.float64)
    step = float(np.nan_to_num(np.abs(expected64), posinf=0.0).max(initial=0.0)) / 127.0
    atol = tolerances.atol + tolerances.quantization_steps * step
    close = np.isclose(actual64, expected64, atol=atol, rtol=tolerances.rtol, equal_nan=True)
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
        int((1.0 - tolerances.min_fraction) * expected.size),
    )


def sqnr_db(reference: Sequence[np.ndarray], quantized: Sequence[np.ndarray]) -> float | None:
    """Signal-to-quantization-noise ratio in dB over paired arrays:
    10*log10(sum(reference^2) / sum((reference - quantized)^2)); None when they are identical."""
    signal = sum(float(np.sum(np.square(r.astype(np.float64)))) for r in reference)
    noise = sum(float(np.sum(np.square(r.astype(np.float64) - q.astype(np.float64)))) for r, q in zip(reference, quantized))
    if noise == 0.0:
        return None
    return round(10.0 * math.log10(max(signal, 1e-300) / noise), 2)
