"""Is padding the batch dim safe? One padded bucket run against eager PyTorch on the real rows.

A server fills a bucket with fewer rows than it holds by appending rows of zeros (the runtime,
tpuexport/runtime) and drops their outputs. That is only right when rows are independent — true of
inference for most models, false of a model that mixes rows (a batch statistic, attention across
the batch). So conversion runs the program at the largest padded bucket with the fewest rows a
server would route to it (one more than the next smaller bucket), the rest zeros, and compares the
real rows' outputs with eager PyTorch on those rows alone, in both runs (TPU-faithful and f32)
under the verification tolerances. Whether rows are independent is a property of the program, not
of a bucket's other sizes: when the bucket's inputs or outputs are beyond what an optional run may
hold (sizes.within_memory_bound; a language model's logits at 8 x 2048), its other dims run at their
example sizes and the check says so. The manifest records the outcome ("padding"); the runtime pads
only when it passed, and otherwise serves exact bucket sizes.

Other dims (a sequence) are not padded: that needs to know which input masks them and what pad
value the tokens take.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

from tpuexport.compile import Bucket
from tpuexport.lower import LoweredProgram
from tpuexport.verify.compare import OutputComparison, compare_output
from tpuexport.verify.row_padding import PAD_VALUE, pad_rows
from tpuexport.memory import gib
from tpuexport.verify.sizes import FIXED_RUN_MEMORY, RunMemory, output_bytes, within_memory_bound
from tpuexport.verify.tolerances import VerificationTolerances
from tpuexport.verify.verification import ProgramRuns, eager_outputs, make_inputs, short_error, to_numpy

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
      sizes: the sizes the program ran at (the bucket's, unless they were beyond the memory bound).
      note: why `sizes` are not the bucket's ("" when they are).
    """

    dim: str
    rows: int
    bucket: Bucket
    comparisons: dict[str, tuple[OutputComparison, ...]]
    error: str | None = None
    sizes: dict[str, int] = dataclasses.field(default_factory=dict)
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.error is None and all(c.passed for run in self.comparisons.values() for c in run)

    def describe(self) -> str:
        outcome = "passed" if self.passed else f"FAILED ({self.error or self.failure()}); the runtime serves exact bucket sizes only"
        shrunk = f" ({self.note})" if self.note else ""
        return f"{self.rows} {self.dim} rows padded to bucket {self.bucket.name} with {PAD_VALUE}s{shrunk}: {outcome}"

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
            "sizes": dict(self.sizes),
            "note": self.note,
            "error": self.error,
            "outputs": {run: [{**dataclasses.asdict(c), "passed": c.passed} for c in outputs] for run, outputs in self.comparisons.items()},
        }


def padded_case(lowered: LoweredProgram, buckets: Sequence[Bucket],
                memory: RunMemory = FIXED_RUN_MEMORY) -> tuple[str, int, Bucket, dict[str, int], str] | None:
    """(batch dim, real rows, bucket, sizes run, note) of the padded run, or None when no bucket is
    ever padded (no batch dim, or every bucket at the dim's minimum) or none can be run on CPU.

    Whether rows are independent is a property of the program, not of a bucket's size, so the run
    takes the largest padded bucket whose run stays within what verification holds in memory
    (sizes.within_memory_bound of `memory`): at the bucket's sizes when they fit, else with its other dims at
    their example sizes (the note says so); a bucket of a million rows is not run whole on the CPU.
    """
    signature = lowered.signature
    dim = signature.batch_dim()
    if dim is None:
        return None
    minimum = signature.dim(dim).min
    sizes = sorted({bucket.as_dict()[dim] for bucket in buckets})
    example = signature.example_sizes()
    for bucket in sorted(buckets, key=lambda bucket: bucket.as_dict()[dim], reverse=True):
        size = bucket.as_dict()[dim]
        smaller = [other for other in sizes if other < size]
        rows = max(smaller) + 1 if smaller else minimum
        if rows >= size:
            continue
        if within_memory_bound(signature, bucket.as_dict(), memory):
            return dim, rows, bucket, bucket.as_dict(), ""
        shrunk = {**example, dim: size}
        if within_memory_bound(signature, shrunk, memory):
            others = ", ".join(f"{name} {example[name]}" for name in example if name != dim and example[name] != bucket.as_dict()[name])
            return dim, rows, bucket, shrunk, (f"{others or 'other dims'} at the example's size: the bucket's outputs, "
                                               f"{gib(output_bytes(signature, bucket.as_dict()))}, are beyond the "
                                               f"{gib(memory.output_bytes)} a verification run may hold"
                                               + (f" within {memory.why()}" if memory.budget_limits else ""))
    return None


def verify_padding(lowered: LoweredProgram, reference, example_inputs: Sequence[torch.Tensor], buckets: Sequence[Bucket],
                   tolerances: VerificationTolerances, memory: RunMemory = FIXED_RUN_MEMORY) -> PaddingCheck | None:
    """Runs the padded bucket (see the module docstring) and compares the real rows with eager PyTorch.

    Args:
      lowered: the lowered program.
      reference: the eager model.
      example_inputs: the flat example inputs (their values shape the random inputs).
      buckets: the compiled buckets.
      tolerances: the verification tolerances.
      memory: what the run may hold (sizes.run_memory of the conversion's memory budget).
    Returns:
      The PaddingCheck, or None when no bucket is ever padded.
    """
    case = padded_case(lowered, buckets, memory)
    if case is None:
        return None
    dim, rows, bucket, sizes, note = case
    inputs = make_inputs(lowered.signature.inputs, example_inputs, {**sizes, dim: rows}, seed=PADDING_SEED)
    try:
        expected = eager_outputs(reference, inputs)
        padded = [pad_rows(to_numpy(tensor), sizes[dim]) for tensor in inputs]
        actual = ProgramRuns(lowered).run(padded)
    except Exception as error:  # the model or the program may raise anything
        return PaddingCheck(dim, rows, bucket, {}, f"{type(error).__name__}: {short_error(error)}", sizes, note)
    outputs = lowered.signature.outputs
    comparisons = {
        run: tuple(compare_output(spec.name, np.asarray(a)[:rows], e, getattr(tolerances, run)) for spec, a, e in zip(outputs, actual[run], expected))
        for run in ("tpu", "cpu")
    }
    return PaddingCheck(dim, rows, bucket, comparisons, sizes=sizes, note=note)
