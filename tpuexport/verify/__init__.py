"""Verify stage: run the lowered program on CPU and compare with eager PyTorch."""

from tpuexport.verify.compare import DEFAULT_TOLERANCES, QUANTIZED_TOLERANCES, OutputComparison, Tolerances, compare_output
from tpuexport.verify.report import VerificationCase, VerificationReport
from tpuexport.verify.verification import make_inputs, verification_sizes, verify

__all__ = [
    "DEFAULT_TOLERANCES",
    "OutputComparison",
    "QUANTIZED_TOLERANCES",
    "Tolerances",
    "VerificationCase",
    "VerificationReport",
    "compare_output",
    "make_inputs",
    "verification_sizes",
    "verify",
]
