"""What a task gives the pipeline: the entry points to capture (ProgramSpec), and, once verified, what
the artifact records of them (Verified). A Task is the small set of decisions that differ between
a forward model and a generator; every pass around them is the same (pipeline.py).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from tpuexport import export as export_stage
from tpuexport import lower as lower_stage

if TYPE_CHECKING:
    from tpuexport.compile import CompiledBucket
    from tpuexport.tasks.conversion import Conversion


@dataclasses.dataclass(frozen=True)
class EntryPointSpec:
    """One entry point a task asks for.

    Attributes:
      source: what torch.export captures: the module (a model, or tpuexport's module over it),
        its example inputs and dynamic shapes; with a checkpoint, the weights to stream.
      bucket_sizes: {dim: sizes} compiled as a cartesian product, or None for the example shapes.
      kernels: None when Pallas kernels may replace XLA's attention in its buckets where they pay
        (lower/kernels.py), else why its buckets keep XLA's.
      reads_weights: False for an entry point that reads none of the model's weights (a text
        generator's sample): it takes them as unused arguments (every entry point is called with
        the weights), and is not quantized.
      precision: the precision its program is lowered at whatever the conversion's (sampling
        computes in float32), or None for the conversion's.
    """

    source: export_stage.LoadedSource
    bucket_sizes: dict[str, list[int]] | None = None
    kernels: str | None = None
    reads_weights: bool = True
    precision: str | None = None


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
    """A task's program before capture.

    Attributes:
      entry_points: {name: EntryPointSpec}, in call order; they share the model's weights.
      program: makes the lowered program from {name: LoweredProgram} (lower.Program, or a
        generation program that also drives the entry points and records its cache).
      scan: whether runs of identical blocks may be lowered as one scan (an entry point that does
        not run every block of a run would stack other weights than the others).
      description: the export stage's progress line ("" for the entry points' dims).
      state: what the task keeps for its own verification (e.g. the eager modules), or None.
      eager_models: with a checkpoint, the modules holding its tensors besides the entry points'
        references (generate()'s model): the weights pass points them at the artifact's weights too.
    """

    entry_points: dict[str, EntryPointSpec]
    program: Callable[[dict[str, lower_stage.LoweredProgram]], lower_stage.EntryPoints]
    scan: bool = True
    description: str = ""
    state: object = None
    eager_models: tuple = ()


@dataclasses.dataclass(frozen=True)
class Verified:
    """A task's passed verification, as the writer records it.

    Attributes:
      report: the report (verify.VerificationReport or GenerationReport).
      sharded: each slice plan's run on N CPU devices (verify.ShardedVerification or
        ShardedGenerationVerification), [] without slices.
      padding: {entry point: (the dim a runtime pads to the next bucket, or None; why not)}.
      writers: the task's extra writers (write_artifact's extra_writers: SavedModel, quantization reports, ...).
    """

    report: object
    sharded: tuple = ()
    padding: dict[str, tuple[str | None, str]] = dataclasses.field(default_factory=dict)
    writers: tuple = ()


class Task:
    """A task of the registry: which entry points a source becomes, and how they are verified.

    Attributes:
      name: the task's name (manifest "task", --task).
      saved_model: whether its entry point is what TF Serving serves (a SavedModel is written).
      offers_against: whether `tpuexport verify --against SOURCE` can compare its artifacts with a
        reloaded source on fresh inputs.
    """

    name: str = ""
    saved_model: bool = False
    offers_against: bool = False

    def check(self, conversion: "Conversion") -> None:
        """Refuses options and sources the task cannot take, in one line, before any work (and fills
        the options' task defaults, e.g. a generator's max context from its config)."""

    def specify(self, conversion: "Conversion") -> ProgramSpec:
        """The entry points to capture (the export pass)."""
        raise NotImplementedError

    def check_captured(self, conversion: "Conversion") -> None:
        """Checks what needs the captured entry points (e.g. requested verification sizes) before lowering."""

    def quantize(self, conversion: "Conversion") -> dict:
        """PT2E quantization of the captured entry points, calibrated: {entry point: QuantizedModel}."""
        raise NotImplementedError

    def input_rules(self, conversion: "Conversion", entry_point: str, mesh: dict[str, int]) -> tuple:
        """Sharding rules for the entry point's inputs on a slice of this mesh, before the user's own."""
        return ()

    def verify(self, conversion: "Conversion") -> Verified:
        """Verifies the program (raising VerificationError with its report written beside the artifact)."""
        raise NotImplementedError

    def target_sizes(self, conversion: "Conversion", entry_points: dict) -> Callable | None:
        """Sizes of dims each target's buckets take in place of the shared ones (CompileJob's
        `target_sizes`; entry_points: {name: EntryPointCompile}), or None."""
        return None

    def bucket_figures(self, conversion: "Conversion") -> Callable[[str, "CompiledBucket"], dict] | None:
        """Figures the task adds to a compiled bucket's record, or None."""
        return None

    def replay_golden(self, artifact, tolerances):
        """The artifact's stored golden cases replayed on CPU (the gate's golden check): a report with
        `cases`, `passed`, `failure_summary()`, `to_json()` and `tolerances`."""
        raise NotImplementedError

    def describe_golden(self, report) -> str:
        """What a passed replay compared, for the gate's message."""
        raise NotImplementedError
