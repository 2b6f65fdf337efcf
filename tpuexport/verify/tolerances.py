"""Default tolerances of the two runs verification makes, per numeric setting, and why.

Every case runs the lowered program twice on CPU and compares both with eager PyTorch:

  tpu   the TPU-faithful run: every f32 dot and convolution computed with the operand rounding of
        the pinned matmul precision (tpu_numerics.py). This is what the deployment returns; its
        tolerances bound the numeric error the artifact's users get.
  cpu   the plain XLA:CPU run, true f32. It differs from eager PyTorch only by the order of float
        sums, so its tight tolerances catch lowering bugs far smaller than bf16 rounding noise.

Both must pass. The figures come from `benchmarks/studies/float_errors.py` and `benchmarks/studies/int8_errors.py`
over the coverage families and full-size configs (docs/verification.md): each default sits a
safety factor above the worst error measured on correct lowerings, and below the smallest error
any planted bug produced.
"""

from __future__ import annotations

import dataclasses

from tpuexport.verify.compare import Tolerances

# Worst errors of correct lowerings, as max |actual - expected| / (|expected| + rms(expected)) over
# every output (benchmarks/studies/float_errors.py; 27 tiny families, the 3 examples and 6 full-size configs:
# BERT-base, ViT-base, Swin-tiny, ResNet-50, wav2vec2-base, a 12-layer Llama):
#   plain f32 on XLA:CPU   1.1e-5 (llama-base); planted bugs 1.7e-2 and up
#   TPU, one bf16 pass     6.0e-2 (llama-base logits); 2.7e-2 at most on the tiny families
#   TPU, bf16x3            9.7e-5 (llama-base)
#   --precision bf16       7.0e-2 (resnet-50)
#   --precision bf16-mixed 9.2e-2 (llama-base logits)
# Each default is rtol = scale_tol = about 3 to 10 times the worst: errors grow about as the square
# root of depth, so the margin covers models several times deeper.
EXACT_F32 = Tolerances(atol=1e-5, rtol=1e-4, scale_tol=1e-4)
# Where the arithmetic rounds to bf16, a decision the model takes from computed values (a mixture of
# experts' top-k routing, an argmax) can flip for a token near a tie, and that token's outputs then
# differ by far more than rounding: Mixtral at batch 16 x seq 128 has 13 of 2,048,000 logits beyond
# the tolerance (relative RMS error 0.5%). Such outliers are allowed on one element in 10^4 of a
# float output (integer outputs stay exact; a NaN or infinity is never an outlier). Bugs change far
# more elements, and the exact cpu run of f32 programs allows none.
ROUNDED_OUTLIERS = 1e-4
TPU_F32 = {
    "default": Tolerances(atol=1e-5, rtol=0.2, scale_tol=0.2, min_fraction=1 - ROUNDED_OUTLIERS),
    "high": Tolerances(atol=1e-5, rtol=1e-3, scale_tol=1e-3, min_fraction=1 - ROUNDED_OUTLIERS),
    "highest": EXACT_F32,
}
# bfloat16 programs: the same bf16 arithmetic on CPU and TPU, 8 mantissa bits compounding over layers.
# A model that holds bfloat16 (or float16) weights itself ("auto" resolved to "bf16"/"f16") gets the
# same rule: eager PyTorch rounds as the program does, but in another order of operations.
BF16 = {name: Tolerances(atol=1e-3, rtol=0.25, scale_tol=0.25, min_fraction=1 - ROUNDED_OUTLIERS) for name in ("bf16", "bf16-mixed", "f16")}
# int8 programs, compared end to end with the PT2E-converted model (benchmarks/studies/int8_errors.py): correct
# lowerings reach down to 25.9 dB SQNR and 1% of elements beyond 8 int8 steps (ViT-base, 12 layers),
# rounding differences compounding through the layers; the strict check of an int8 program is the
# op-by-op one (conformance.py), this bound catches what that cannot see (e.g. a wrong program order).
QUANTIZED = Tolerances(atol=1e-4, rtol=1e-4, quantization_steps=8.0, min_fraction=0.98, min_sqnr_db=20.0)


@dataclasses.dataclass(frozen=True)
class VerificationTolerances:
    """The tolerances of both runs.

    Attributes:
      tpu: for the TPU-faithful run.
      cpu: for the plain XLA:CPU run (and for TensorFlow's CPU run of the SavedModel).
    """

    tpu: Tolerances
    cpu: Tolerances

    def to_json(self) -> dict:
        return {"tpu": dataclasses.asdict(self.tpu), "cpu": dataclasses.asdict(self.cpu)}

    @classmethod
    def from_json(cls, data: dict) -> "VerificationTolerances":
        return cls(Tolerances(**data["tpu"]), Tolerances(**data["cpu"]))


def default_tolerances(precision: str, matmul_precision: str, quantized: bool) -> VerificationTolerances:
    """The defaults for a program's settings.

    Args:
      precision: what the program computes in: "f32", "bf16", "f16" or "bf16-mixed"
        (LoweredProgram.resolved_precision; "auto" is resolved before).
      matmul_precision: "default", "high" or "highest".
      quantized: whether the program is int8 (compared with its PT2E model).
    Returns:
      The tolerances of both runs.
    """
    if quantized:
        if precision != "f32":  # int8 matmuls, bfloat16 elsewhere: the bf16 terms on top of the int8 ones
            rule = dataclasses.replace(QUANTIZED, rtol=BF16[precision].rtol, scale_tol=BF16[precision].scale_tol)
            return VerificationTolerances(rule, rule)
        return VerificationTolerances(QUANTIZED, QUANTIZED)
    if precision in BF16:
        return VerificationTolerances(BF16[precision], BF16[precision])
    return VerificationTolerances(TPU_F32[matmul_precision], EXACT_F32)


def with_overrides(tolerances: VerificationTolerances, **overrides) -> VerificationTolerances:
    """The tolerances with the user's values (atol=, rtol=, scale_tol=; None keeps the default)
    applied to both runs."""
    given = {name: value for name, value in overrides.items() if value is not None}
    return VerificationTolerances(dataclasses.replace(tolerances.tpu, **given), dataclasses.replace(tolerances.cpu, **given))
