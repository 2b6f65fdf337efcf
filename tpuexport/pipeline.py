"""A conversion: named passes run in order, each taking the previous one's value.

  export   load/capture with torch.export           -> CapturedModel
  lower    torchax op library -> jax.export          -> LoweredProgram
  verify   CPU run vs eager PyTorch (fails fast)     -> VerificationReport
  compile  libtpu AOT per target and bucket          -> CompileReport
  write    the artifact directory, atomically        -> Artifact
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import time
from typing import Callable

from tpuexport import artifact as artifact_stage
from tpuexport import compile as compile_stage
from tpuexport import export as export_stage
from tpuexport import lower as lower_stage
from tpuexport import verify as verify_stage
from tpuexport.errors import TpuExportError, VerificationError


@dataclasses.dataclass(frozen=True)
class ConversionOptions:
    """What to build.

    Attributes:
      targets: TPU target names.
      out: the artifact directory.
      buckets: {dim name: sizes} to compile, or None for the example shapes.
      precision: "f32" or "bf16".
      tolerances: verification tolerances, or None for the precision's defaults.
      overwrite: replace an existing artifact at `out`.
    """

    targets: tuple[str, ...]
    out: pathlib.Path
    buckets: dict[str, list[int]] | None = None
    precision: str = "f32"
    tolerances: verify_stage.Tolerances | None = None
    overwrite: bool = False


class StageClock:
    """Times the stages and reports each one to an optional listener (the CLI's progress lines)."""

    def __init__(self, listener: Callable[[str, float, str], None] | None):
        self.listener = listener
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str, detail: Callable[[], str] = lambda: ""):
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start
        if self.listener:
            self.listener(name, self.seconds[name], detail())

    def event(self, name: str, seconds: float, detail: str) -> None:
        if self.listener:
            self.listener(name, seconds, detail)


def run_conversion(loaded: export_stage.LoadedSource, options: ConversionOptions, progress=None) -> artifact_stage.Artifact:
    """Converts a loaded source into an artifact.

    Args:
      loaded: the source (from `load_source` or the Python API).
      options: what to build.
      progress: optional callable (stage, seconds, detail) called as each stage ends.
    Returns:
      The written Artifact.
    Raises:
      TpuExportError: bad input (exit code 2); nothing is written.
      VerificationError: the lowered program does not match eager PyTorch (exit code 1); only the
        verification report is written, next to `out`.
    """
    targets = compile_stage.resolve_targets(list(options.targets))
    artifact_stage.check_destination(options.out, options.overwrite)
    if options.precision not in lower_stage.PRECISIONS:
        raise TpuExportError(f"unknown precision {options.precision!r}; use one of {', '.join(lower_stage.PRECISIONS)}")
    clock = StageClock(progress)

    with clock.stage("export", lambda: _describe_dims(captured.signature)):
        captured = export_stage.capture(loaded)
    buckets = compile_stage.make_buckets(captured.signature, options.buckets)
    with clock.stage("lower", lambda: f"{len(lowered.weights)} weight arrays, precision {options.precision}"):
        lowered = lower_stage.lower(captured.program, captured.signature, options.precision)
    with clock.stage("verify", lambda: f"{len(report.cases)} size(s), {'passed' if report.passed else 'FAILED'}"):
        report = verify_stage.verify(lowered, captured.reference, captured.example_inputs, options.tolerances)
    if not report.passed:
        report_path = options.out.parent / f"{options.out.name}.verification-report.json"
        report_path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        raise VerificationError(report, report_path)

    def compiled_one(result: compile_stage.CompiledBucket) -> None:
        clock.event(
            f"compile {result.target.name} {result.bucket.name}", result.compile_seconds,
            f"{result.memory['total_bytes'] / 2**20:.1f} MiB of {result.target.hbm_bytes / 2**30:.0f} GiB HBM, "
            f"{result.cost['flops']:.3g} flops",
        )

    with clock.stage("compile", lambda: f"{len(compiled.results)} executable(s)"):
        compiled = compile_stage.compile_program(lowered, targets, buckets, on_compiled=compiled_one)
    with clock.stage("write", lambda: str(options.out)):
        stage_seconds = dict(clock.seconds)
        artifact_stage.write_artifact(
            options.out, source=captured.source, lowered=lowered, compiled=compiled, verification=report,
            stage_seconds=stage_seconds, overwrite=options.overwrite,
        )
    return artifact_stage.load(options.out)


def _describe_dims(signature) -> str:
    dims = ", ".join(f"{d.name} in [{d.min}, {d.max if d.max is not None else 'inf'}]" for d in signature.dims)
    return f"inputs {', '.join(s.name for s in signature.inputs)}" + (f"; dims {dims}" if dims else "; static shapes")
