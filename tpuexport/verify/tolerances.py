"""Default tolerances of the two runs verification makes, per numeric setting, and why.

Every case runs the lowered program twice on CPU and compares both with eager PyTorch:

  tpu   the TPU-faithful run: every f32 dot and convolution computed with the operand rounding of
        the pinned matmul precision (tpu_numerics.py). This is what the deployment returns; its
        tolerances bound the numeric error the artifact's users get.
  cpu   the plain XLA:CPU run, true f32. It differs from eager PyTorch only by the order of float
        sums, so its tight tolerances catch lowering bugs far smaller than bf16 rounding noise.

Both must pass. The figures come from `benchmarks/float_errors.py` and `benchmarks/int8_errors.py`
over the coverage families and full-size configs (README, "Verification"): each default sits a
safety factor above the worst error measured on correct lowerings, and below the smallest error
any planted bug produced.
"""

from __future__ import annotations

import dataclasses

from tpuexport.verify.compare import Tolerances

# Plain f32 on XLA:CPU vs PyTorch: reassociated sums; grows with depth (ResNet-50: 50 layers).
EXACT_F32 = Tolerances(atol=1e-5, rtol=1e-4, scale_tol=1e-3)
# The TPU-faithful run per --matmul-precision, for f32 programs.
TPU_F32 = {
    "default": Tolerances(atol=1e-5, rtol=2e-2, scale_tol=4e-2),
    "high": Tolerances(atol=1e-5, rtol=1e-4, scale_tol=1e-3),
    "highest": EXACT_F32,
}
# bfloat16 programs: the same bf16 arithmetic on CPU and TPU, 8 mantissa bits compounding over layers.
BF16 = Tolerances(atol=5e-2, rtol=5e-2)
# int8 programs, compared with the PT2E-converted model.
QUANTIZED = Tolerances(atol=1e-4, rtol=1e-4, quantization_steps=1.0, min_fraction=0.999)


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
      precision: "f32" or "bf16".
      matmul_precision: "default", "high" or "highest".
      quantized: whether the program is int8 (compared with its PT2E model).
    Returns:
      The tolerances of both runs.
    """
    if quantized:
        return VerificationTolerances(QUANTIZED, QUANTIZED)
    if precision == "bf16":
        return VerificationTolerances(BF16, BF16)
    return VerificationTolerances(TPU_F32[matmul_precision], EXACT_F32)


def with_overrides(tolerances: VerificationTolerances, **overrides) -> VerificationTolerances:
    """The tolerances with the user's values (atol=, rtol=, scale_tol=; None keeps the default)
    applied to both runs."""
    given = {name: value for name, value in overrides.items() if value is not None}
    return VerificationTolerances(dataclasses.replace(tolerances.tpu, **given), dataclasses.replace(tolerances.cpu, **given))
