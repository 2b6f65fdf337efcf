"""Is padding the batch dim safe? One padded bucket run against eager PyTorch on the real rows.

A server fills a bucket with fewer rows than it holds by appending rows of zeros (the runtime,
tpuexport/runtime) and drops their outputs. That is only right when rows are independent — true of
inference for most models, false of a model that mixes rows (a batch statistic, attention across
the batch). So conversion runs the program at the largest padded bucket with the fewest rows a
server would route to it (one more than the next smaller bucket), the rest zeros, and compares the
real rows' outputs with eager PyTorch on those rows alone, in both runs (TPU-faithful and f32)
under the verification tolerances. The manifest records the outcome ("padding"); the runtime pads
only when it passed, and otherwise serves exact bucket sizes.

Other dims (a sequence) are not padded: that needs to know which input masks them and what pad
value the tokens take.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
import torch

from tpuexport.compile import Bucket
from tpuexport.lower import LoweredProgram
from tpuexport.verify.compare import OutputComparison, compare_output
from tpuexport.verify.sizes import MAX_OPTIONAL_INPUT_ELEMENTS
from tpuexport.verify.tolerances import VerificationTolerances
from tpuexport.verify.verification import ProgramRuns, eager_outputs, make_inputs, short_error, to_numpy

# The value padded rows hold, in every input (the runtime pads with the same).
PAD_VALUE = 0
# Keeps the inputs of the padding case apart from the verification cases' (seeds 0..).
PADDING_SEED = 5_000


@dataclasses.dataclass(frozen=True)
class PaddingCheck:
    """The padded-bucket run.

    Attributes:
      dim: the batch dim.
      rows: the real rows sent.
      bucket: the bucket they were padded to.
      comparisons: {"tpu"|"cpu": per-output comparisons of the real rows}.
      error: why the run failed, or None.
    """

    dim: str
    rows: int
    bucket: Bucket
    comparisons: dict[str, tuple[OutputComparison, ...]]
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and all(c.passed for run in self.comparisons.values() for c in run)

    def describe(self) -> str:
        outcome = "passed" if self.passed else f"FAILED ({self.error or self.failure()}); the runtime serves exact bucket sizes only"
        return f"{self.rows} {self.dim} rows padded to bucket {self.bucket.name} with {PAD_VALUE}s: {outcome}"

    def failure(self) -> str:
        return "; ".join(f"{run} run output {c.name!r} relative RMS error {c.relative_rms_error:.2g}"
                         for run, outputs in self.comparisons.items() for c in outputs if not c.passed)

    def to_json(self) -> dict:
        """The manifest's "padding" section."""
        return {
            "dim": self.dim,
            "pad_value": PAD_VALUE,
            "passed": self.passed,
            "rows": self.rows,
            "bucket": self.bucket.as_dict(),
            "error": self.error,
            "outputs": {run: [{**dataclasses.asdict(c), "passed": c.passed} for c in outputs] for run, outputs in self.comparisons.items()},
        }


def padded_case(lowered: LoweredProgram, buckets: Sequence[Bucket]) -> tuple[str, int, Bucket] | None:
    """(batch dim, real rows, bucket) of the padded run, or None when no bucket is ever padded (no
    batch dim, or every bucket at the dim's minimum) or none can be run on CPU.

    Whether rows are independent is a property of the program, not of a bucket's size, so the run
    takes the largest padded bucket whose inputs stay within what verification holds in memory
    (sizes.MAX_OPTIONAL_INPUT_ELEMENTS): a bucket of a million rows is not run whole on the CPU.
    """
    signature = lowered.signature
    dim = signature.batch_dim()
    if dim is None:
        return None
    minimum = signature.dim(dim).min
    sizes = sorted({bucket.as_dict()[dim] for bucket in buckets})
    for bucket in sorted(buckets, key=lambda bucket: bucket.as_dict()[dim], reverse=True):
        size = bucket.as_dict()[dim]
        smaller = [other for other in sizes if other < size]
        rows = max(smaller) + 1 if smaller else minimum
        elements = sum(math.prod(spec.concrete_shape(bucket.as_dict())) for spec in signature.inputs)
        if rows < size and elements <= MAX_OPTIONAL_INPUT_ELEMENTS:
            return dim, rows, bucket
    return None


def verify_padding(lowered: LoweredProgram, reference, example_inputs: Sequence[torch.Tensor], buckets: Sequence[Bucket],
                   tolerances: VerificationTolerances) -> PaddingCheck | None:
    """Runs the padded bucket (see the module docstring) and compares the real rows with eager PyTorch.

    Args:
      lowered: the lowered program.
      reference: the eager model.
      example_inputs: the flat example inputs (their values shape the random inputs).
      buckets: the compiled buckets.
      tolerances: the verification tolerances.
    Returns:
      The PaddingCheck, or None when no bucket is ever padded.
    """
    case = padded_case(lowered, buckets)
    if case is None:
        return None
    dim, rows, bucket = case
    sizes = {**bucket.as_dict(), dim: rows}
    inputs = make_inputs(lowered.signature.inputs, example_inputs, sizes, seed=PADDING_SEED)
    try:
        expected = eager_outputs(reference, inputs)
        padded = [pad_rows(to_numpy(tensor), bucket.as_dict()[dim]) for tensor in inputs]
        actual = ProgramRuns(lowered).run(padded)
    except Exception as error:  # the model or the program may raise anything
        return PaddingCheck(dim, rows, bucket, {}, f"{type(error).__name__}: {short_error(error)}")
    outputs = lowered.signature.outputs
    comparisons = {
        run: tuple(compare_output(spec.name, np.asarray(a)[:rows], e, getattr(tolerances, run)) for spec, a, e in zip(outputs, actual[run], expected))
        for run in ("tpu", "cpu")
    }
    return PaddingCheck(dim, rows, bucket, comparisons)


def padding_policy(signature, passed: bool | None) -> tuple[str | None, str]:
    """(the dim a runtime may pad to the next bucket, or None; why not, or "") for a program whose
    padded-bucket run `passed` (None: no padded run, no bucket is ever padded).

    Args:
      signature: the program's signature (a ProgramSignature).
      passed: PaddingCheck.passed, or None.
    """
    dim = signature.batch_dim()
    if dim is None:
        return None, "the program has no batch dim shared by every input and output"
    if passed is None:
        return None, "no padded bucket was verified (the artifact predates padding checks, or no bucket is ever padded)"
    if not passed:
        return None, "padding the batch dim failed verification (manifest padding)"
    return dim, ""


def pad_rows(array: np.ndarray, size: int) -> np.ndarray:
    """`array` with rows of PAD_VALUE appended along axis 0 up to `size` rows."""
    if array.shape[0] == size:
        return array
    padding = np.full((size - array.shape[0], *array.shape[1:]), PAD_VALUE, dtype=array.dtype)
    return np.concatenate([array, padding])
