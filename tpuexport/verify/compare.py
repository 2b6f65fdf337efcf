"""Comparing outputs with explicit tolerances, and the per-output result.

An element matches when

    |actual - expected| <= atol + rtol * |expected| + scale_tol * rms(expected)
                           + quantization_steps * max|expected| / 127

(NaN matches NaN at the same place). `rms(expected)` is the output's scale: an error of 1e-3 means
little in logits of size 30 and much in probabilities, and a purely elementwise rule cannot say
so for elements near zero. `max|expected| / 127` is one step of int8 symmetric per-tensor
quantization of that output. An output passes when at least `min_fraction` of its elements match
and, when `min_sqnr_db` is set, its SQNR against the expected output is at least that many dB.
Integer and bool outputs must match exactly.

This module imports nothing from tpuexport: the TensorFlow-only SavedModel check loads it by path.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

# compare_output works through an output this many elements at a time (512 KiB of f32): its float64
# copies and temporaries then peak at 7.4 MiB whatever the output's size (done whole, they peaked at
# 17 times the output's f32 bytes), and a chunk's stay in the CPU's caches: a 64 MiB output took
# 0.39 s, 3.28 s whole (under tracemalloc: benchmarks/studies/compare_memory.py); chunks of 1M
# elements took 2.5 times as long as these.
CHUNK_ELEMENTS = 1 << 17


@dataclasses.dataclass(frozen=True)
class Tolerances:
    """The terms of the rule above.

    Attributes:
      atol: absolute tolerance.
      rtol: tolerance relative to |expected| of the element.
      scale_tol: tolerance relative to the output's scale, rms(expected).
      quantization_steps: allowance in int8 steps of the output (quantized programs).
      min_fraction: fraction of each output's elements that must match.
      min_sqnr_db: lowest SQNR (dB) of each output against the expected one, or None.
    """

    atol: float
    rtol: float
    scale_tol: float = 0.0
    quantization_steps: float = 0.0
    min_fraction: float = 1.0
    min_sqnr_db: float | None = None

    def describe(self) -> str:
        terms = [f"atol={self.atol:g}", f"rtol={self.rtol:g}"]
        if self.scale_tol:
            terms.append(f"scale_tol={self.scale_tol:g}")
        if self.quantization_steps:
            terms.append(f"{self.quantization_steps:g} int8 step(s) on {self.min_fraction:.4%} of elements")
        elif self.min_fraction < 1:
            terms.append(f"on {self.min_fraction:.4%} of elements")
        if self.min_sqnr_db is not None:
            terms.append(f"SQNR >= {self.min_sqnr_db:g} dB")
        return " ".join(terms)


@dataclasses.dataclass(frozen=True)
class OutputComparison:
    """How one output compares with the expected one.

    Attributes:
      name: the output's name.
      max_abs_error: largest |actual - expected|.
      max_rel_error: largest |actual - expected| / |expected| over elements with expected != 0.
      scale: rms(expected).
      relative_rms_error: rms(actual - expected) / rms(expected) (0 when both are all zero).
      sqnr_db: SQNR of actual against expected (None when identical).
      mismatched: number of elements outside tolerance (or of a different shape: all of them).
      elements: number of elements.
      allowed_mismatches: mismatched elements tolerated (0 unless Tolerances.min_fraction < 1).
      min_sqnr_db: the SQNR the output must reach, or None.
      reference_not_finite: of the mismatched elements, those whose expected value is an infinity or
        a NaN (no arithmetic is checked there: the reference itself overflowed or divided by zero).
    """

    name: str
    max_abs_error: float
    max_rel_error: float
    scale: float
    relative_rms_error: float
    sqnr_db: float | None
    mismatched: int
    elements: int
    allowed_mismatches: int = 0
    min_sqnr_db: float | None = None
    reference_not_finite: int = 0

    @property
    def passed(self) -> bool:
        sqnr_ok = self.min_sqnr_db is None or self.sqnr_db is None or self.sqnr_db >= self.min_sqnr_db
        return self.mismatched <= self.allowed_mismatches and sqnr_ok

    def describe_failure(self) -> str:
        """What is wrong with this output, in one clause."""
        text = (f"max abs error {self.max_abs_error:.3g}, max rel error {self.max_rel_error:.3g}, "
                f"relative RMS error {self.relative_rms_error:.3g}, {self.mismatched}/{self.elements} elements outside tolerance")
        if self.allowed_mismatches:
            text += f" ({self.allowed_mismatches} allowed)"
        if self.min_sqnr_db is not None and self.sqnr_db is not None and self.sqnr_db < self.min_sqnr_db:
            text += f", SQNR {self.sqnr_db:.1f} dB < {self.min_sqnr_db:g} dB"
        return text


def compare_output(name: str, actual: np.ndarray, expected: np.ndarray, tolerances: Tolerances) -> OutputComparison:
    """Compares one output; see the module docstring for the rule. It works through the outputs
    CHUNK_ELEMENTS at a time, twice: the tolerance needs the whole expected output's scale first."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        return OutputComparison(name, float("inf"), float("inf"), 0.0, float("inf"), None, max(expected.size, 1), expected.size)
    if not np.issubdtype(expected.dtype, np.floating):
        differ, error = 0, 0.0
        for a, e in _chunks(actual, expected):
            differ += int(np.count_nonzero(a != e))
            error = max(error, float(np.abs(a.astype(np.float64) - e.astype(np.float64)).max(initial=0.0)))
        return OutputComparison(name, error, error, 0.0, 0.0 if error == 0 else float("inf"), None, differ, expected.size)
    finite_count, finite_squares, finite_largest = 0, 0.0, 0.0
    for (e,) in _chunks(expected):
        e = e.astype(np.float64)
        e = e[np.isfinite(e)]
        finite_count += e.size
        finite_squares += float(np.sum(np.square(e)))
        finite_largest = max(finite_largest, float(np.abs(e).max(initial=0.0)))
    scale = math.sqrt(finite_squares / finite_count) if finite_count else 0.0
    atol = tolerances.atol + tolerances.scale_tol * scale + tolerances.quantization_steps * finite_largest / 127.0
    not_close, max_abs, max_relative, squared_error, signal, noise = 0, 0.0, 0.0, 0.0, 0.0, 0.0
    reference_not_finite = 0
    lost_a_number = False  # a NaN or an infinity where a number was expected
    for a, e in _chunks(actual, expected):
        a, e = a.astype(np.float64), e.astype(np.float64)
        far = ~np.isclose(a, e, atol=atol, rtol=tolerances.rtol, equal_nan=True)
        not_close += int(np.count_nonzero(far))
        reference_not_finite += int(np.count_nonzero(far & ~np.isfinite(e)))
        with np.errstate(invalid="ignore"):  # inf - inf and inf / inf: NaN, an infinite error below
            difference = np.abs(a - e)
            difference[(np.isnan(a) & np.isnan(e)) | (a == e)] = 0.0  # equal infinities differ by nothing, as equal NaNs
            nonzero = e != 0
            relative = np.nan_to_num(difference[nonzero] / np.abs(e[nonzero]), nan=np.inf, posinf=np.inf)
        difference = np.nan_to_num(difference, nan=np.inf, posinf=np.inf)
        max_abs = max(max_abs, float(difference.max(initial=0.0)))
        max_relative = max(max_relative, float(relative.max(initial=0.0)))
        squared_error += float(np.sum(np.square(difference)))
        finite, both_finite = np.isfinite(e), np.isfinite(e) & np.isfinite(a)
        lost_a_number = lost_a_number or bool(np.any(finite & ~both_finite))
        signal += float(np.sum(np.square(e[both_finite])))
        noise += float(np.sum(np.square(e[both_finite] - a[both_finite])))
    rms_error = math.sqrt(squared_error / expected.size) if expected.size else 0.0
    return OutputComparison(
        name, max_abs, max_relative, scale,
        rms_error / scale if scale else (0.0 if rms_error == 0 else float("inf")),
        _decibels(signal, noise),
        not_close,
        expected.size,
        # Outliers may be rounding's flipped decisions, never a NaN or an infinity where a number was expected.
        0 if lost_a_number else int((1.0 - tolerances.min_fraction) * expected.size),
        tolerances.min_sqnr_db,
        reference_not_finite,
    )


def _chunks(*arrays: np.ndarray):
    """The arrays' elements in C order, CHUNK_ELEMENTS at a time (views of contiguous arrays, small copies of others)."""
    flat = [array.reshape(-1) if array.flags.c_contiguous else array.flat for array in arrays]
    for start in range(0, arrays[0].size, CHUNK_ELEMENTS):
        yield [elements[start:start + CHUNK_ELEMENTS] for elements in flat]


def sqnr_db(reference: Sequence[np.ndarray], quantized: Sequence[np.ndarray]) -> float | None:
    """Signal-to-quantization-noise ratio in dB over paired arrays:
    10*log10(sum(reference^2) / sum((reference - quantized)^2)); None when they are identical."""
    signal = sum(float(np.sum(np.square(r.astype(np.float64)))) for r in reference)
    noise = sum(float(np.sum(np.square(r.astype(np.float64) - q.astype(np.float64)))) for r, q in zip(reference, quantized))
    return _decibels(signal, noise)


def _decibels(signal: float, noise: float) -> float | None:
    """10*log10(signal / noise) rounded to 0.01 dB; None when there is no noise."""
    if noise == 0.0:
        return None
    return round(10.0 * math.log10(max(signal, 1e-300) / noise), 2)
