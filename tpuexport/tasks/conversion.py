"""What a conversion is asked for (ConversionOptions), what it has built so far (Conversion, the value
the pipeline's passes fill in turn), and the clock that times its stages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import re
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable

from tpuexport import compile as compile_stage
from tpuexport import export as export_stage
from tpuexport import lower as lower_stage
from tpuexport import verify as verify_stage
from tpuexport.errors import TpuExportError, VerificationError
from tpuexport.memory import MemoryBudget, MemoryMonitor, PeakMemory, memory_budget, return_freed_memory

if TYPE_CHECKING:
    from tpuexport.tasks.spec import ProgramSpec, Task, Verified


# Weight-only quantization: no pass of its own, lower takes the scheme (quantize/weight_only.py).
WEIGHT_ONLY_MODES = ("int8-weight-only", "int4-weight-only")


@dataclasses.dataclass(frozen=True)
class ConversionOptions:
    """What to build.

    Attributes:
      targets: TPU target names.
      out: the artifact directory.
      buckets: {dim name: sizes} to compile, or None for the example shapes (text generation: the
        fill entry point's "seq" and "batch").
      precision: "auto" (the model's own dtypes), "f32", "bf16" or "bf16-mixed" (lower/mixed_precision.py).
      matmul_precision: the TPU arithmetic pinned on every dot and convolution: "default" (one
        bf16 pass), "high" (bf16x3) or "highest" (f32 accuracy).
      kernels: "auto" (single-chip TPU executables use Pallas kernels where they pay) or "none".
      tolerance_overrides: {"atol"|"rtol"|"scale_tol": value} replacing the defaults of both
        verification runs (verify/tolerances.py); empty for the defaults.
      verify_budget_flops: matmul FLOPs the optional verification sizes may add (verify/sizes.py).
      verify_sizes: dim sizes that must be verified ({dim: size}; other dims at their example size).
      overwrite: replace an existing artifact at `out`.
      scan: lower runs of identical blocks (a model's layers) as one jax.lax.scan each, their
        weights stacked (lower/scan.py); False lowers every block on its own. Sharding plans lay
        out a stacked weight as one block's weight, its stack axis whole.
      saved_model: also write the TF Serving SavedModel (tf_serving/) and check it in TensorFlow,
        for a task whose entry point TF Serving can serve (a forward model's).
      model_name: TF Serving's model name, or None for the stem of `out`.
      model_version: TF Serving's version number.
      quantize: None (float), "int8" or "int8-dynamic" (PT2E, see tpuexport.quantize), or
        "int8-weight-only" or "int4-weight-only" (quantize/weight_only.py).
      group_size: int4-weight-only's elements per scale along the contraction dim.
      keep_float: a regex over state_dict names of weights weight-only quantization keeps float, or None.
      calibration: calibration samples (tuples of inputs; text generation: prompts) for static int8, or None.
      calibration_file: a .npz / .safetensors calibration file (wins over `calibration`), or None.
      random_calibration: allow static int8 without samples, calibrated on random inputs (warned).
      sharding: mesh, preset and rules for slice targets (compile.make_request); the default lays
        every weight and input whole on every device of a slice.
      weights: False for a plan: lowered from the weights' shapes alone and compiled, not verified;
        the artifact has no weights, golden data or SavedModel (the verification, quantization and
        SavedModel options do not apply).
      task: a task of the registry (tpuexport/tasks: "forward", "text-generation").
      max_batch, max_context: the KV cache's slots and positions (text-generation).
      cache_layout: the KV cache's layout (export.CACHE_LAYOUTS; text-generation).
      kv_cache_dtype: "model" (the cache in the model's dtype) or "int8" (int8 keys and values
        with per-vector scales; export.KV_CACHE_DTYPES; text-generation).
      sliding_window_cache: "bounded" (a ring of W positions per slot when every layer attends
        within one window W < max_context) or "full" (export.SLIDING_WINDOW_CACHES; text-generation).
      kv_cache: "static" (max context per slot: prefill and decode) or "paged" (pages taken as rows
        grow: one step entry point; export/paged.py; text-generation).
      page_size, num_pages: the paged cache's positions per page and pages (None: the defaults; pages
        then differ per TPU target, tasks/page_count.py).
      new_tokens: tokens generated per prompt by the generation verification.
      compile_envs: Python interpreters of other environments (the serving image's jax/jaxlib/libtpu)
        the compiler also runs under, for executables of their versions (compile/compile_envs.py).
      memory_budget: what the converting process may hold (memory.memory_budget: --memory-budget
        GB); by default memory.memory_budget()'s share of the memory available when the options are
        made (the command line makes them before it loads the source). It sizes verification's
        optional runs (verify/sizes.py).
    """

    targets: tuple[str, ...]
    out: pathlib.Path
    buckets: dict[str, list[int]] | None = None
    precision: str = lower_stage.DEFAULT_PRECISION
    matmul_precision: str = "default"
    kernels: str = "auto"
    tolerance_overrides: dict[str, float] = dataclasses.field(default_factory=dict)
    verify_budget_flops: float = verify_stage.DEFAULT_BUDGET_FLOPS
    verify_sizes: tuple[dict[str, int], ...] = ()
    overwrite: bool = False
    scan: bool = True
    saved_model: bool = True
    model_name: str | None = None
    model_version: int = 1
    quantize: str | None = None
    group_size: int = 128
    keep_float: str | None = None
    calibration: Iterable | None = None
    calibration_file: pathlib.Path | None = None
    random_calibration: bool = False
    sharding: compile_stage.ShardingRequest = compile_stage.ShardingRequest()
    weights: bool = True
    task: str = "forward"
    max_batch: int = 1
    max_context: int | None = None
    cache_layout: str = export_stage.DEFAULT_CACHE_LAYOUT
    kv_cache_dtype: str = "model"
    sliding_window_cache: str = "bounded"
    kv_cache: str = "static"
    page_size: int | None = None
    num_pages: int | None = None
    new_tokens: int = verify_stage.DEFAULT_NEW_TOKENS
    compile_envs: tuple[str, ...] = ()
    memory_budget: MemoryBudget = dataclasses.field(default_factory=memory_budget)

    @property
    def pt2e(self) -> bool:
        """Whether the options ask for PT2E quantization (calibrated and rounded in memory, a quantize
        pass of its own; an unknown mode is refused there), not a weight-only mode."""
        return self.quantize is not None and self.quantize not in WEIGHT_ONLY_MODES


class StageClock:
    """Times the stages, measures their peak memory (with a MemoryMonitor) and reports each one to an
    optional listener (the CLI's progress lines).

    Events from other threads (compilation in the background) are held and reported by the main
    thread with its next event: the main thread may have the process's stderr redirected for a
    moment (TensorFlow's native logging), and a line written then would be lost.

    Attributes:
      seconds: {stage: wall seconds}.
      memory: {stage: PeakMemory} of the stages run (empty without a monitor).
    """

    def __init__(self, listener: Callable[[str, float, str], None] | None, monitor: MemoryMonitor | None = None):
        self.listener = listener
        self.monitor = monitor
        self.seconds: dict[str, float] = {}
        self.memory: dict[str, PeakMemory] = {}
        self.held: list[tuple[str, float, str]] = []
        self.open: dict[str, int] = {}

    @contextlib.contextmanager
    def stage(self, name: str, detail: Callable[[], str] = lambda: ""):
        self.start(name)
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start
        self._close(name)
        return_freed_memory()  # what the stage freed is the next one's (memory.return_freed_memory)
        self.event(name, self.seconds[name], detail())

    def start(self, name: str) -> None:
        """Starts measuring a stage's memory (`stage` does; a stage running in the background, such as
        compilation, is started here and ends with `record`)."""
        if self.monitor:
            self.open[name] = self.monitor.open()

    def peaks(self) -> dict[str, PeakMemory]:
        """{stage: PeakMemory} of the stages ended, and of those still open so far (the writer's,
        when it writes the manifest)."""
        return {**self.memory, **{name: self.monitor.peek(window) for name, window in self.open.items() if name not in self.memory}}

    def event(self, name: str, seconds: float, detail: str) -> None:
        if not self.listener:
            return
        if threading.current_thread() is not threading.main_thread():
            self.held.append((name, seconds, detail))
            return
        while self.held:
            self.listener(*self.held.pop(0))
        self.listener(name, seconds, detail)

    def record(self, name: str, seconds: float, detail: str) -> None:
        """A stage timed elsewhere (e.g. compilation running in the background): kept and reported,
        with its memory since `start(name)` when it was started."""
        self.seconds[name] = seconds
        self._close(name)
        self.event(name, seconds, detail)

    def _close(self, name: str) -> None:
        if name in self.open:
            self.memory[name] = self.monitor.close(self.open.pop(name))


@dataclasses.dataclass
class Conversion:
    """What a conversion has built so far: each pass of the pipeline reads what the passes before it
    set and sets its own part (pipeline.py lists them).

    Attributes:
      loaded: the source; options: what to build; task: the registry's task (tasks/__init__.py);
      targets: the resolved targets; slices: those that are slices; clock: times the stages;
      running: what must end with the conversion (scratch directory, TensorFlow and compiler processes);
      scratch: a directory of the conversion's own beside `options.out` (None for a plan);
      weight_only: the weight-only scheme the options ask for (quantize/weight_only.py), or None.
      tensorflow: the TensorFlow process that saves and checks the SavedModel (started first, so that
        its import overlaps export and lowering), or None.
      spec: the task's entry points (export).
      captured: {entry point: CapturedModel} (export; PT2E's after quantize).
      quantized: {entry point: QuantizedModel} (PT2E quantize), or None.
      program: the lowered entry points over one set of weights (lower; weights after `weights`).
      weights_file: the weights file already written (streamed from a checkpoint, or the SavedModel's), or None.
      saved_model: the TF Serving SavedModel being built (artifact/tf_serving), or None.
      buckets: {entry point: [Bucket]} compiled.
      plans: {entry point: {slice target: ShardingPlan}}.
      kernels: {entry point: {bucket name: BucketKernels} or None}; kernel_checks: the interpret-mode checks.
      target_sizes: the task's per-target dim sizes (Task.target_sizes: a paged cache's pages per target), or None.
      job: the CompileJob compiling every entry point in the background; reports: {entry point: CompileReport}, once waited for.
      compile_envs: the probed compile environments (compile.CompileEnv), in the order given.
      verified: the task's verification (tasks/spec.py), or None for a plan.
      run_memory: what one optional verification run may hold, from what is left of the budget when
        verification starts (verify.run_memory).
    """

    loaded: export_stage.LoadedSource
    options: ConversionOptions
    task: "Task"
    targets: list
    slices: list
    clock: StageClock
    running: contextlib.ExitStack
    scratch: pathlib.Path | None = None
    weight_only: object = None
    tensorflow: object = None
    spec: "ProgramSpec | None" = None
    captured: dict = dataclasses.field(default_factory=dict)
    quantized: dict | None = None
    program: lower_stage.EntryPoints | None = None
    weights_file: pathlib.Path | None = None
    saved_model: object = None
    buckets: dict = dataclasses.field(default_factory=dict)
    plans: dict = dataclasses.field(default_factory=dict)
    kernels: dict = dataclasses.field(default_factory=dict)
    kernel_checks: dict = dataclasses.field(default_factory=dict)
    target_sizes: object = None
    job: compile_stage.CompileJob | None = None
    reports: dict | None = None
    compile_envs: tuple = ()
    verified: "Verified | None" = None
    run_memory: verify_stage.RunMemory = verify_stage.RunMemory()

    @property
    def plan_only(self) -> bool:
        return not self.options.weights

    def compiled(self) -> dict[str, compile_stage.CompileReport]:
        """Waits for every entry point's executables (the first call records the compile stage)."""
        if self.reports is None:
            self.reports = self.job.result()
            count = sum(len(report.results) for report in self.reports.values())
            beside = "" if self.plan_only else (", alongside verify and the SavedModel" if self.saved_model else ", alongside verify")
            sets = self.job.version_sets()
            count += sum(len(report.results) for reports in sets.values() for report in reports.values())
            environments = f" for {1 + len(sets)} version sets" if sets else ""
            self.clock.record("compile", self.job.seconds, f"{count} executable(s){environments}{beside}")
        return self.reports

    def version_sets(self) -> dict[str, dict]:
        """The compile environments' executables: {version set name: {entry point: CompileReport}} (after `compiled`)."""
        self.compiled()
        return self.job.version_sets()


# The one line a PT2E mode gets with a checkpoint.
PT2E_CHECKPOINT_ERROR = ("--quantize with --checkpoint is not supported: PT2E calibrates and rounds the weights in memory; load the weights "
                         "into the model and convert it without --checkpoint, or use --quantize int8-weight-only / int4-weight-only")
# The one line a model without weights gets from a conversion that needs them.
META_WEIGHTS_ERROR = "the model's weights are on the meta device; use `tpuexport plan` or --no-weights"


def weight_only_scheme(options: ConversionOptions):
    """The weight-only scheme the options ask for (quantize/weight_only.py), or None.

    Raises:
      TpuExportError: a bad --group-size or --keep-float regex.
    """
    if options.quantize not in WEIGHT_ONLY_MODES:
        return None
    from tpuexport.quantize import weight_only

    scheme = weight_only.check_scheme(options.quantize, options.group_size)
    if options.keep_float:
        try:
            re.compile(options.keep_float)
        except re.error as error:
            raise TpuExportError(f"--keep-float {options.keep_float!r} is not a regular expression ({error}); give one such as 'lm_head'") from None
    return dataclasses.replace(scheme, keep_float=options.keep_float or None)


def lower_entry_point(captured: export_stage.CapturedModel, options: ConversionOptions, weight_only, scan: bool = True,
                      weights: bool = True) -> lower_stage.LoweredProgram:
    """Lowers one captured entry point with the options' precisions (lower.lower).

    Args:
      captured: the export (or PT2E quantize) pass's result; options: the conversion's;
      weight_only: the weight-only scheme, or None; scan: whether runs of identical blocks may be scanned;
      weights: False lowers from the weights' shapes (a plan, or a conversion whose weights pass writes them later).
    """
    return lower_stage.lower(captured.program, captured.signature, options.precision, options.matmul_precision, options.scan and scan,
                             weights=weights and captured.checkpoint_state is None, keep_f32=captured.keep_f32, weight_only=weight_only)


def verification_tolerances(lowered: lower_stage.LoweredProgram, options: ConversionOptions,
                            quantized: bool) -> verify_stage.VerificationTolerances:
    """The tolerances a program is verified with: the defaults of what it computes in and of its
    quantization (PT2E int8), with the options' overrides."""
    return verify_stage.with_overrides(verify_stage.default_tolerances(lowered.resolved_precision, options.matmul_precision, quantized),
                                       **options.tolerance_overrides)


def write_failed_report(out: pathlib.Path, report: dict) -> pathlib.Path:
    """Writes a failed conversion's verification report next to `out` (which is not created)."""
    report_path = out.parent / f"{out.name}.verification-report.json"
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    return report_path


def verification_failure(report, out: pathlib.Path, reference, inputs: Callable[[], tuple]) -> VerificationError:
    """The error of a failed verification, its report written next to `out`, with the tied top-k
    selections of `reference` (verify/topk_ties.py: run once more on `inputs()`) named in its
    line, in place of the arithmetic hints they make moot, and recorded in the report."""
    ties = verify_stage.selection_ties(lambda: reference(*inputs()), reference)
    failed = {**report.to_json(), **({"selection_ties": [tie.to_json() for tie in ties]} if ties else {})}
    summary = "; ".join([report.failure_summary(hint=not ties), *(tie.describe() for tie in ties)])
    return VerificationError(report, write_failed_report(out, failed), summary)


def describe_precision(lowered: lower_stage.LoweredProgram) -> str:
    """"auto (bf16)": the requested precision and, when they differ, what the program computes in."""
    resolved = lowered.resolved_precision
    return lowered.precision if resolved == lowered.precision else f"{lowered.precision} ({resolved})"


def describe_scans(scanned: tuple[dict, ...]) -> str:
    """"scanned model.layers (32 blocks)", or "no layers scanned"."""
    if not scanned:
        return "no layers scanned"
    return "scanned " + ", ".join(f"{run['module']} ({run['count']} blocks)" for run in scanned)


def describe_dims(signature) -> str:
    dims = ", ".join(f"{d.name} {d.range_text}" for d in signature.dims)
    return f"inputs {', '.join(s.name for s in signature.inputs)}" + (f"; dims {dims}" if dims else "; static shapes")
