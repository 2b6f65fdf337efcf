"""A conversion: one list of named passes, the same for every program. Each pass reads what the passes
before it set on the Conversion (tasks/conversion.py) and sets its own part; the task (tasks/)
decides the entry points and how they are verified, every pass handles entry points.

  export    the task's entry points, each captured with torch.export       -> captured, buckets
  start tensorflow  (a task TF Serving serves) TensorFlow's process, importing while the rest runs
                                                                             -> tensorflow
  quantize  PT2E int8 (optional), calibrated, re-exported                  -> quantized, captured
            (weight-only int8/int4 is no pass of its own: lower takes the scheme, the weights pass
            quantizes the tensors as they are written; quantize/weight_only.py)
  lower     each entry point through torchax's op library -> jax.export, from the weights' shapes
            and dtypes; one set of weights for all of them                   -> program
  weights   the weights (a checkpoint's tensors, or the model's) written into the artifact's weights
            file one at a time, memory-mapped back for every entry point     -> program, weights_file
  saved model  (a task TF Serving serves) TensorFlow loads the program and saves the SavedModel
            in its own process while the conversion goes on                  -> saved_model
  plan      a sharding plan per slice target and entry point                -> plans
  kernels   (--kernels auto) each bucket lowered again at its static shapes with Pallas TPU kernels
            where they pay, each kernel use run in interpret mode against the portable lowering
                                                                             -> kernels, kernel_checks
  compile   libtpu AOT per target, entry point and bucket, state donated, in one child process per
            target in the background from here; each --compile-env probed first, then compiled
            for under its own interpreter too                                 -> compile_envs, job
  verify    the task's verification on CPU (fails fast)                      -> verified
  write     the artifact directory, atomically (one writer)                  -> the Artifact

A source with a checkpoint (export/checkpoints.py) never holds its weights: export runs on a meta
copy, and the weights pass copies the checkpoint's tensors into the artifact one at a time. A model
held in memory takes the same pass from its own tensors: the program's stacked (scanned) weights
exist only in that file, not as a second copy beside the model. Verification, the SavedModel and
the writer use the file, memory-mapped; from a checkpoint, so do the eager references' parameters
the file stores as they are, and the checkpoint is unmapped.

A plan (`weights=False`, `tpuexport plan`, for models larger than the build machine, built on the
meta device) runs export, lower (from the weights' shapes and dtypes; no weight is read), plan,
kernels, compile and write: no quantization, verification or SavedModel, and no weights.

A failure anywhere kills the background processes; nothing is written but a failed verification's
report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import os
import pathlib
import shutil
import tempfile
from typing import Callable, Iterator

import numpy as np
import torch

from tpuexport import artifact as artifact_stage
from tpuexport import compile as compile_stage
from tpuexport import export as export_stage
from tpuexport import lower as lower_stage
from tpuexport import verify as verify_stage
from tpuexport.artifact import tf_serving as serving_stage
from tpuexport.arrays import to_numpy, torch_view
from tpuexport.devices import on_host_cpu
from tpuexport.errors import TpuExportError, VerificationError
from tpuexport.lower.program import DEFAULT_ENTRY_POINT
from tpuexport.memory import MemoryMonitor, resident_bytes
from tpuexport.tasks import Conversion, ConversionOptions, StageClock, task_named
from tpuexport.tasks.conversion import (describe_dims, describe_precision, describe_scans, lower_entry_point, weight_only_scheme,
                                        write_failed_report)
from tpuexport.tasks.forward import lower_forward, model_name, verify_forward

__all__ = ["PASSES", "ConversionOptions", "StageClock", "lower_forward", "passes", "run_conversion", "verify_forward"]

# errno values of a write that found no room: disk full, over RLIMIT_FSIZE, over quota.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


def _disk_full_is_bad_input(convert):
    """A write that fails for lack of space (or over the file size limit), in this process or a
    compiler's, becomes one TpuExportError line; the artifact's staging and scratch directories
    are already gone by then (they are removed on any exception)."""

    @functools.wraps(convert)
    def run(loaded, options, progress=None):
        try:
            return convert(loaded, options, progress)
        except OSError as error:
            if error.errno not in DISK_FULL_ERRNOS:
                raise
            where = error.filename or f"next to {options.out}"
            raise TpuExportError(f"could not write {where}: {error.strerror or os.strerror(error.errno)}; nothing was written "
                                 f"to {options.out}: free space on that filesystem (or raise the file size limit) and convert again") from None

    return run


@_disk_full_is_bad_input
def run_conversion(loaded: export_stage.LoadedSource, options: ConversionOptions, progress=None) -> artifact_stage.Artifact:
    """Converts a loaded source into an artifact: the task's checks, then every pass of PASSES.

    Args:
      loaded: the source (from `load_source` or the Python API).
      options: what to build.
      progress: optional callable (stage, seconds, detail) called as each stage ends.
    Returns:
      The written Artifact (a plan-only one when `options.weights` is False).
    Raises:
      TpuExportError: bad input (exit code 2), including a model whose weights are on the meta
        device without `options.weights` False; nothing is written.
      VerificationError: the program or its TF SavedModel does not match its reference (exit code
        1); only the verification report is written, next to `out`.
    """
    with passes(loaded, options, "write", progress):
        pass
    return artifact_stage.load(options.out)


@contextlib.contextmanager
def passes(loaded: export_stage.LoadedSource, options: ConversionOptions, through: str = "write", progress=None) -> Iterator[Conversion]:
    """Runs the task's checks and PASSES up to and including `through`, and yields the Conversion (what a
    benchmark measures of a stage: `with passes(loaded, options, "lower") as conversion: conversion.program`).
    Leaving the block ends what runs in the background and removes the scratch directory.

    Raises:
      TpuExportError, VerificationError: as `run_conversion`.
    """
    if through not in dict(PASSES):
        raise TpuExportError(f"unknown pass {through!r}; the passes are {', '.join(dict(PASSES))}")
    targets, slices = _check_options(options)
    with contextlib.ExitStack() as running:
        running.enter_context(on_host_cpu())  # whatever platform the process chose (devices.py)
        clock = StageClock(progress, running.enter_context(MemoryMonitor()))  # each stage's seconds and peak memory
        conversion = Conversion(loaded, options, task_named(options.task), targets, slices, clock, running)
        conversion.task.check(conversion)
        conversion.weight_only = weight_only_scheme(options)
        if not conversion.plan_only:
            if conversion.task.saved_model and options.saved_model:
                model_name(options)
                serving_stage.check_model_version(options.model_version)
            conversion.scratch = running.enter_context(_scratch_directory(options.out))
        for name, run in PASSES:
            run(conversion)
            if name == through:
                break
        yield conversion


def export(conversion: Conversion) -> None:
    """The task's entry points, captured; their buckets."""
    with conversion.clock.stage("export", lambda: _describe_export(conversion)):
        conversion.spec = conversion.task.specify(conversion)
        conversion.captured = {name: export_stage.capture(entry.source) for name, entry in conversion.spec.entry_points.items()}
    conversion.buckets = {name: compile_stage.make_buckets(conversion.captured[name].signature, entry.bucket_sizes)
                          for name, entry in conversion.spec.entry_points.items()}
    conversion.task.check_captured(conversion)


def _describe_export(conversion: Conversion) -> str:
    """The export line: the task's description (or the dims), then what the export decided (CapturedModel.notes)."""
    described = conversion.spec.description or describe_dims(next(iter(conversion.captured.values())).signature)
    return "; ".join([described, *(note for captured in conversion.captured.values() for note in captured.notes)])


def quantize(conversion: Conversion) -> None:
    """PT2E: the task's entry points that read weights quantized and calibrated; verification compares with the PT2E models."""
    if conversion.options.pt2e and not conversion.plan_only:
        conversion.quantized = conversion.task.quantize(conversion)
        conversion.captured = {**conversion.captured, **{name: result.captured for name, result in conversion.quantized.items()}}


def lower(conversion: Conversion) -> None:
    """Each entry point lowered; every one keeps the last weight reader's weight arrays (they are the same
    weights), and one that reads none takes them as unused arguments."""
    options, plan_only, entry_points = conversion.options, conversion.plan_only, conversion.spec.entry_points
    with conversion.clock.stage("lower", lambda: _describe_lowered(conversion.program, options, plan_only)):
        # From the weights' shapes and dtypes: the weights pass writes the arrays into the artifact.
        lowered = {name: lower_entry_point(captured, options if entry_points[name].precision is None
                                           else dataclasses.replace(options, precision=entry_points[name].precision),
                                           conversion.weight_only if entry_points[name].reads_weights else None, conversion.spec.scan,
                                           weights=False)
                   for name, captured in conversion.captured.items()}
        shared = lowered[weight_readers(conversion)[-1]]
        conversion.program = conversion.spec.program({
            name: dataclasses.replace(entry, weights=shared.weights) if entry_points[name].reads_weights else lower_stage.taking_weights(entry, shared)
            for name, entry in lowered.items()})
    if not plan_only:  # seconds, not a verification and a compile, to say a bucket cannot fit
        for name, entry in conversion.program.entry_points.items():
            for target in conversion.targets:
                if not target.is_slice:
                    compile_stage.check_chip_fit(entry.weight_names, entry.weight_specs, entry.signature, target, conversion.buckets[name])


def weights(conversion: Conversion) -> None:
    """The weights written into the artifact's weights file one at a time (in their stored layouts,
    cast to the program's dtypes, scanned blocks stacked, weight-only ones quantized) and mapped back
    for every entry point: a checkpoint's tensors as they stream, or the model's own tensors. The
    program's weights are then file-backed pages, not a second copy of the model beside it."""
    if conversion.plan_only:
        return
    reader = weight_readers(conversion)[-1]
    captured, shared = conversion.captured[reader], conversion.program.weights_program
    if captured.checkpoint_state is not None:
        state, origin = captured.checkpoint_state, f"streamed from the checkpoint {captured.source.checkpoint}"
    else:
        state, origin = lower_stage.stored_state(conversion.program.entry_points[reader]), "written from the model's tensors"
    path = conversion.scratch / "weights.safetensors"
    stored = None
    if conversion.weight_only is not None:
        from tpuexport.quantize.weight_only import StoredWeights

        stored = StoredWeights(shared.quantized, conversion.weight_only)

    checkpoint = conversion.loaded.checkpoint if isinstance(conversion.loaded.checkpoint, export_stage.Checkpoint) else None

    def sources(name: str):
        for part in shared.weight_parts[name]:
            tensor = as_tensor(state[part])
            yield tensor
            if checkpoint is not None:  # consumed: its pages are the checkpoint's, read once (export/mapped_pages.py)
                export_stage.MappedTensors(checkpoint, [tensor]).drop()

    def parts(name: str):
        layout = shared.weight_layouts.get(name)
        tensors = (lower_stage.in_stored_layout(tensor, layout) for tensor in sources(name))
        return stored.parts(name, tensors) if stored is not None else tensors

    streamed = captured.checkpoint_state is not None
    with conversion.clock.stage("weights", lambda: f"{len(shared.weight_names)} arrays, {written / 2**30:.2f} GiB {origin}"
                                                   + (f"; the eager reference reads {shared_bytes / 2**30:.2f} GiB of them there" if streamed else "")):
        written = artifact_stage.write_weights(path, shared.weight_names, shared.weight_specs, parts)
        arrays = artifact_stage.map_weights(path)
        if streamed:
            shared_bytes = _share_with_references(conversion, shared, state, arrays)
    # A checkpoint's program reads the file's arrays: the references read them too now.
    held = [None if streamed else _held_as_stored(shared, state, name, spec) for name, spec in zip(shared.weight_names, shared.weight_specs)]
    conversion.program = conversion.program.with_weights(tuple(arrays[name] if view is None else view
                                                               for name, view in zip(shared.weight_names, held)))
    conversion.weights_file = path


def _share_with_references(conversion: Conversion, shared: lower_stage.LoweredProgram, state, arrays: dict[str, np.ndarray]) -> int:
    """Points the eager references' parameters (the entry points' and the task's other eager models')
    that the artifact stores as they are at the artifact's own arrays (a scanned stack's block: its
    slice of the stack), then unmaps the checkpoint: the weights exist once, in the artifact's file,
    instead of once there and once in the checkpoint's mapping. A weight stored otherwise (cast,
    transposed, quantized) keeps the checkpoint's tensor: the references compute with the original values.

    Returns:
      The bytes of the parameters now read from the artifact's file.
    """
    skipped = {*shared.weight_layouts, *shared.quantized, *(entry["scale"] for entry in shared.quantized.values())}
    replacements = []
    for name in shared.weight_names:
        if name in skipped:
            continue
        parts = shared.weight_parts[name]
        for index, part in enumerate(parts):
            tensor, array = state[part], arrays[name][index] if len(parts) > 1 else arrays[name]
            if (isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == array.shape
                    and str(tensor.dtype).removeprefix("torch.") == array.dtype.name):
                replacements.append((tensor, torch_view(array)))
    references = [captured.reference for captured in conversion.captured.values() if isinstance(captured.reference, torch.nn.Module)]
    shared_bytes = export_stage.share_parameters([*references, *conversion.spec.eager_models], replacements)
    if isinstance(conversion.loaded.checkpoint, export_stage.Checkpoint):
        # What the references still read from the checkpoint (weights stored cast, transposed or quantized) is
        # read at every forward: each module drops its pages after its own (export/mapped_pages.py).
        handles = export_stage.drop_pages_after_use([*references, *conversion.spec.eager_models], conversion.loaded.checkpoint)
        conversion.running.callback(lambda: [handle.remove() for handle in handles])
        conversion.loaded.checkpoint.release()
    return shared_bytes


def as_tensor(weight) -> torch.Tensor:
    """A checkpoint's tensor as it is; a model's weight as stored (a numpy array) as a torch view of its memory."""
    return weight if isinstance(weight, torch.Tensor) else torch_view(weight)


def _held_as_stored(shared: lower_stage.LoweredProgram, state, name: str, spec):
    """A weight whose source tensor (the model's, or the checkpoint's memory-mapped one) is already
    what the artifact stores (its own tensor, not stacked, transposed, quantized or cast), contiguous
    and aligned as XLA:CPU takes a host array in place: a numpy view of that tensor, so that the
    eager reference and the CPU runs read the same pages (the file holds a copy they do not touch);
    else None (the program reads the file's)."""
    if shared.weight_parts[name] != (name,) or name in shared.weight_layouts:
        return None
    tensor = state.tensor(name) if isinstance(state, lower_stage.StoredState) else state[name]
    if (tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.data_ptr() % artifact_stage.ALIGNMENT
            or tuple(tensor.shape) != tuple(spec.shape) or str(tensor.dtype).removeprefix("torch.") != np.dtype(spec.dtype).name):
        return None
    return to_numpy(tensor.detach())


def start_tensorflow(conversion: Conversion) -> None:
    """TensorFlow's process, for the SavedModel: started once the entry points exported (a source that does
    not export, most bad input, never pays its import: about 4 CPU-s), so its import runs while they lower."""
    if not conversion.plan_only and conversion.task.saved_model and conversion.options.saved_model:
        # Entered after the scratch directory, so ended first: TensorFlow may still write into it.
        conversion.tensorflow = conversion.running.enter_context(serving_stage.TensorFlowProcess())


def saved_model(conversion: Conversion) -> None:
    """Before verification and compilation: a program TensorFlow cannot load fails in seconds; then
    TensorFlow saves the SavedModel of the default entry point in its process while verify and compile run."""
    if conversion.tensorflow is None:
        return
    with conversion.clock.stage("tensorflow", lambda: "TensorFlow loads the program; it saves the SavedModel meanwhile"):
        conversion.saved_model = serving_stage.SavedModelBuild(conversion.program.entry_points[DEFAULT_ENTRY_POINT], conversion.tensorflow,
                                                               conversion.scratch, conversion.weights_file)
        conversion.weights_file = conversion.saved_model.weights_file


def plan(conversion: Conversion) -> None:
    """Each slice target's sharding plan per entry point, from the weights' shapes; the task's input
    rules (a KV cache's layout) come before the user's --shard-input rules, so those win."""
    request = conversion.options.sharding
    named = len(conversion.program.entry_points) > 1
    for name, lowered in conversion.program.entry_points.items():
        plans = conversion.plans[name] = {}
        for target in conversion.slices:
            rules = conversion.task.input_rules(conversion, name, dict(compile_stage.resolve_mesh(request, target)))
            entry_request = dataclasses.replace(request, input_rules=rules + request.input_rules)
            with conversion.clock.stage(f"plan {target.name}{f' {name}' if named else ''}", lambda: _describe_plan(plans[target.name])):
                plans[target.name] = compile_stage.plan_sharding(entry_request, target, lowered.weight_names, lowered.weight_specs,
                                                                 lowered.signature, conversion.buckets[name], lowered.stacked, lowered.weight_layouts)


def kernels(conversion: Conversion) -> None:
    """With --kernels auto, each bucket of an entry point that may use kernels lowered again with TPU
    kernels where they pay; each distinct kernel use run in Pallas interpret mode against the portable
    lowering once; a bucket whose kernel use fails keeps the portable program, and says so."""
    if conversion.options.kernels == "none":
        conversion.kernels = {name: None for name in conversion.program.entry_points}
        return
    chips = [target for target in conversion.targets if target.platform == "tpu" and not target.is_slice]
    lowering = {}
    for name, lowered in conversion.program.entry_points.items():
        reason = conversion.spec.entry_points[name].kernels
        if reason is None and not chips:
            reason = "no single TPU chip among the targets: kernels are compiled for single chips only"
        if reason is None and not lower_stage.has_attention(lowered):
            reason = lower_stage.NO_ATTENTION
        if reason:
            conversion.kernels[name] = {bucket.name: lower_stage.BucketKernels(bucket.as_dict(), None, reason=reason)
                                        for bucket in conversion.buckets[name]}
        else:
            lowering[name] = lowered
    if not lowering:
        return
    with conversion.clock.stage("kernels", lambda: _describe_kernels(conversion.kernels, lowering)):
        for name, lowered in lowering.items():
            conversion.kernels[name] = {bucket.name: lower_stage.lower_bucket_kernels(lowered, bucket.as_dict())
                                        for bucket in conversion.buckets[name]}
    uses = [use for name in lowering for bucket in conversion.kernels[name].values() for use in bucket.kernels]
    if not uses:
        return
    with conversion.clock.stage("verify kernels", lambda: f"{len(checks)} kernel use(s) in Pallas interpret mode, "
                                                          f"{sum(check.passed for check in checks.values())} passed"):
        checks = conversion.kernel_checks = verify_stage.verify_kernels(uses)
    for name in lowering:
        for bucket, bucket_kernels in conversion.kernels[name].items():
            failed = [checks[verify_stage.kernel_check_key(use)] for use in bucket_kernels.kernels
                      if not checks[verify_stage.kernel_check_key(use)].passed]
            if failed:
                conversion.kernels[name][bucket] = dataclasses.replace(bucket_kernels, exported=None, reason=(
                    f"the kernel failed verification in interpret mode (relative RMS error {failed[0].error:.2e} > "
                    f"{failed[0].tolerance:g} vs the portable lowering): the portable program is used"))


def compile_executables(conversion: Conversion) -> None:
    """Every (target, entry point, bucket) compiled in child processes, in the background from here on
    (executables donate their inputs: a state's buffers become its outputs, compile_child.py)."""
    named = len(conversion.program.entry_points) > 1
    conversion.compile_envs = _probe_compile_envs(conversion)
    conversion.clock.start("compile")  # ends when the executables are waited for (Conversion.compiled)
    # One compiler process per target compiles every entry point (compile/aot.py).
    entry_points = {
        name: compile_stage.EntryPointCompile(lowered, conversion.buckets[name], _compiled_event(conversion.clock, lowered, name if named else None),
                                              conversion.plans.get(name, {}), conversion.kernels.get(name))
        for name, lowered in conversion.program.entry_points.items()}
    conversion.target_sizes = conversion.task.target_sizes(conversion, entry_points)
    conversion.job = conversion.running.enter_context(compile_stage.CompileJob(entry_points, conversion.targets, conversion.compile_envs,
                                                                               conversion.target_sizes))


def _probe_compile_envs(conversion: Conversion) -> tuple:
    """Each --compile-env probed (compile/compile_envs.py) with this conversion's programs and targets,
    before anything compiles; a bad one is refused in one line."""
    if not conversion.options.compile_envs:
        return ()
    envs = []
    with conversion.clock.stage("probe compile envs", lambda: "; ".join(f"{env.python}: {compile_stage.describe_versions(env.versions)}"
                                                                        for env in envs)):
        scratch = pathlib.Path(conversion.running.enter_context(tempfile.TemporaryDirectory(prefix="tpuexport-probe-")))
        programs = []
        for index, lowered in enumerate(conversion.program.entry_points.values()):
            programs.append(scratch / f"{index}.jaxexport")
            programs[-1].write_bytes(bytes(lowered.exported.serialize()))
        own = compile_stage.version_set_name(compile_stage.installed_versions())
        for python in conversion.options.compile_envs:
            env = compile_stage.probe(python, programs, conversion.targets)
            taken = {own: "the converting interpreter", **{earlier.name: f"--compile-env {earlier.python}" for earlier in envs}}
            if env.name in taken:
                raise TpuExportError(f"--compile-env {python} has the same versions as {taken[env.name]} "
                                     f"({compile_stage.describe_versions(env.versions)}); drop it")
            envs.append(env)
    return tuple(envs)


def verify(conversion: Conversion) -> None:
    """The task's verification (none for a plan)."""
    if not conversion.plan_only:
        # Decided before any case runs: what is left of the budget given what the process holds now.
        conversion.run_memory = verify_stage.run_memory(conversion.options.memory_budget, resident_bytes())
        conversion.verified = conversion.task.verify(conversion)


def write(conversion: Conversion) -> None:
    """The artifact directory, written atomically by the one writer."""
    options, verified = conversion.options, conversion.verified
    writers = (artifact_stage.huggingface_writer(conversion.loaded.huggingface),) if conversion.loaded.huggingface is not None else ()
    writers += verified.writers if verified else ()
    writers += (artifact_stage.kernels_writer(options.kernels, conversion.kernels, [check.to_json() for check in conversion.kernel_checks.values()]),)
    with conversion.clock.stage("write", lambda: str(options.out) + (" (plan only: no weights, not verified)" if conversion.plan_only else "")):
        try:
            artifact_stage.write_artifact(
                options.out, source=conversion.loaded.info, task=conversion.task.name, program=conversion.program,
                compiled=conversion.compiled, verification=verified.report if verified else None, stage_seconds=conversion.clock.seconds,
                stage_memory=conversion.clock.peaks,
                overwrite=options.overwrite, extra_writers=writers, sharded_verification=verified.sharded if verified else (),
                weights_file=conversion.weights_file, padding=verified.padding if verified else None, version_sets=conversion.version_sets,
                memory_budget=conversion.run_memory.to_json() if verified else {"budget": options.memory_budget.to_json()},
                bucket_figures=conversion.task.bucket_figures(conversion))
        except serving_stage.SavedModelMismatch as mismatch:
            raise VerificationError(verified.report, write_failed_report(options.out, mismatch.report), mismatch.summary) from None


def weight_readers(conversion: Conversion) -> list[str]:
    """The entry points that read the model's weights, in call order (the others take them unused)."""
    return [name for name, entry in conversion.spec.entry_points.items() if entry.reads_weights]


# Every conversion runs these, in this order.
PASSES: tuple[tuple[str, Callable[[Conversion], None]], ...] = (
    ("export", export), ("start tensorflow", start_tensorflow), ("quantize", quantize), ("lower", lower), ("weights", weights),
    ("saved model", saved_model), ("plan", plan), ("kernels", kernels), ("compile", compile_executables), ("verify", verify), ("write", write),
)


def _check_options(options: ConversionOptions) -> tuple[list, list]:
    """Checks what can be checked before any work: targets, mesh sizes, destination, precisions, task.

    Returns:
      (targets, the slice targets among them).
    Raises:
      TpuExportError: the first bad option.
    """
    targets = compile_stage.resolve_targets(list(options.targets))
    slices = [target for target in targets if target.is_slice]
    if options.sharding != compile_stage.ShardingRequest() and not slices:
        chips = ", ".join(t.name for t in targets)
        raise TpuExportError(f"sharding options need a slice target such as v5e-8; {chips} "
                             f"{'is a single chip' if len(targets) == 1 else 'are single chips'} (see `tpuexport targets`)")
    for target in slices:
        compile_stage.resolve_mesh(options.sharding, target)
    for python in options.compile_envs:
        compile_stage.check_interpreter(python)
    artifact_stage.check_destination(options.out, options.overwrite)
    if options.precision not in lower_stage.PRECISIONS:
        raise TpuExportError(f"unknown precision {options.precision!r}; use one of {', '.join(lower_stage.PRECISIONS)}")
    if options.matmul_precision not in lower_stage.MATMUL_PRECISIONS:
        raise TpuExportError(f"unknown matmul precision {options.matmul_precision!r}; use one of {', '.join(lower_stage.MATMUL_PRECISIONS)}")
    task_named(options.task)
    lower_stage.check_kernel_mode(options.kernels)
    export_stage.check_kv_cache_dtype(options.kv_cache_dtype)
    export_stage.check_sliding_window_cache(options.sliding_window_cache)
    export_stage.check_kv_cache(options.kv_cache)
    export_stage.check_page_options(options.page_size, options.num_pages, options.kv_cache, options.max_context)
    if options.kv_cache_dtype == "int8" and options.pt2e:
        raise TpuExportError(f"--kv-cache-dtype int8 with --quantize {options.quantize} is not supported yet (PT2E would quantize "
                             "around the cache's own int8 rounding); use it with a weight-only mode or without --quantize")
    if options.pt2e and not options.weights:
        raise TpuExportError("--quantize int8/int8-dynamic needs the model's weights (it calibrates and rounds them); plan without it "
                             "or with a weight-only mode")
    weight_only_scheme(options)
    return targets, slices


@contextlib.contextmanager
def _scratch_directory(out: pathlib.Path):
    """A hidden directory next to `out` (same filesystem: its files are moved into the artifact),
    removed when the conversion ends, failed or not."""
    scratch = pathlib.Path(tempfile.mkdtemp(prefix=artifact_stage.sibling_prefix(out, "scratch"), dir=out.parent))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _compiled_event(clock: StageClock, lowered: lower_stage.LoweredProgram,
                    entry_point: str | None) -> Callable[[compile_stage.CompiledBucket], None]:
    """Reports each executable as it is compiled (from the compile job's threads); `entry_point`
    names it when the program has several."""
    prefix = f"{entry_point} " if entry_point else ""

    def compiled_one(result: compile_stage.CompiledBucket) -> None:
        clock.event(f"compile {result.target.name} {prefix}{result.bucket.name}", result.compile_seconds, _describe_compiled(result, lowered))

    return compiled_one


def _describe_lowered(program: lower_stage.EntryPoints, options: ConversionOptions, plan_only: bool) -> str:
    shared = program.weights_program
    weights = (f"{len(shared.weight_names)} weight shapes ({shared.weight_bytes / 2**30:.2f} GiB, not read)" if plan_only
               else f"{len(shared.weight_names)} weight arrays")
    shared_by = f" shared by {', '.join(program.entry_points)}" if len(program.entry_points) > 1 else ""
    return (f"{weights}{shared_by}, precision {describe_precision(shared)}, matmul precision {options.matmul_precision}; "
            f"{describe_scans(shared.scanned)}")


def _describe_kernels(kernels: dict, lowering: dict) -> str:
    buckets = {f"{name}/{bucket}" if len(kernels) > 1 else bucket: entry for name in lowering for bucket, entry in kernels[name].items()}
    used = [name for name, entry in buckets.items() if entry.exported is not None]
    return f"{len(used)} of {len(buckets)} bucket(s) with flash attention" + (f" ({', '.join(used)})" if used else "")


def _describe_plan(plan: compile_stage.ShardingPlan) -> str:
    return plan.describe() + (f"; {len(plan.notes)} left whole (see the manifest's notes)" if plan.notes else "")


def _describe_compiled(result: compile_stage.CompiledBucket, lowered: lower_stage.LoweredProgram) -> str:
    target = result.target
    where = "per chip" if target.devices == target.chips else "per device"
    text = (f"{result.memory['total_bytes'] / 2**20:.1f} MiB{' ' + where if target.is_slice else ''} of "
            f"{target.hbm_bytes_per_device / 2**30:.0f} GiB HBM, "
            f"{lower_stage.flops_at(lowered.matmul_flops, result.bucket.as_dict()):.3g} matmul flops")
    if target.is_slice:
        exchanged = ", ".join(f"{kind} x{entry['count']} ({entry['bytes'] / 2**20:.2f} MiB)" for kind, entry in result.collectives.items())
        text += f"; {exchanged or 'no collectives'}"
    return text
