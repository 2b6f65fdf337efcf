"""A conversion: named passes run in order, each taking the previous one's value.

  export   load/capture with torch.export           -> CapturedModel
  quantize PT2E int8 (optional), re-exported         -> CapturedModel (reference: the PT2E model)
           (weight-only int8/int4 is no pass of its own: lower takes the scheme, the weights pass
           quantizes a checkpoint's tensors as they stream, verification's reference is the float
           model with those weights dequantized; quantize/weight_only.py)
  lower    torchax op library -> jax.export          -> LoweredProgram
  weights  (a source with a checkpoint) streamed into the artifact's weights file, tensor by
           tensor, and memory-mapped back                          -> LoweredProgram with weights
           (with a SavedModel: the program is checked to load in TensorFlow)
  plan     a sharding plan per slice target          -> {target: ShardingPlan}
  kernels  (--kernels auto) each bucket lowered again at its static shapes with Pallas TPU
           kernels where they pay, each kernel use run in interpret mode against the portable
           lowering (lower/kernels.py, verify/kernels.py)  -> {bucket: BucketKernels}
  compile  libtpu AOT per target and bucket          -> CompileReport      (child processes, in the
                                                                             background from here)
  verify   CPU runs vs eager PyTorch (fails fast)    -> VerificationReport
  verify sharded  each plan on N CPU devices vs eager -> ShardedVerification per plan (slices only)
  verify padding  the largest bucket padded with zero rows vs eager on the real rows -> PaddingCheck
  write    the artifact directory, atomically        -> Artifact
           (with the TF Serving SavedModel, checked in TensorFlow before the rename, and the
           quantization report; the executables once compile is done)

A source with a checkpoint (export/checkpoints.py) never holds its weights: export runs on a meta
copy, lower from shapes, and the weights pass copies the checkpoint's tensors into the artifact one
at a time; verification, the SavedModel and the writer use that file, memory-mapped.

A plan (`weights=False`, `tpuexport plan`, for models larger than the build machine, built on the
meta device) runs export, lower (from the weights' shapes and dtypes; no weight is read), plan,
compile and write: no quantization, verification or SavedModel, and no weights in the artifact.

What is independent overlaps: the TensorFlow process that checks the SavedModel imports TensorFlow
from the start, and the TPU compiler works while verify and the SavedModel run. A failure anywhere
kills the background processes; nothing is written but a failed verification's report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import os
import pathlib
import re
import shutil
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from tpuexport import artifact as artifact_stage
from tpuexport import compile as compile_stage
from tpuexport import export as export_stage
from tpuexport import lower as lower_stage
from tpuexport import verify as verify_stage
from tpuexport.artifact import tf_serving as serving_stage
from tpuexport.errors import TpuExportError, VerificationError

if TYPE_CHECKING:  # torchao loads only for quantized conversions
    from tpuexport.quantize import QuantizedModel
    from tpuexport.quantize.weight_only import WeightOnlyScheme

# errno values of a write that found no room: disk full, over RLIMIT_FSIZE, over quota.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


@dataclasses.dataclass(frozen=True)
class ConversionOptions:
    """What to build.

    Attributes:
      targets: TPU target names.
      out: the artifact directory.
      buckets: {dim name: sizes} to compile, or None for the example shapes.
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
      saved_model: also write the TF Serving SavedModel (tf_serving/) and check it in TensorFlow.
      model_name: TF Serving's model name, or None for the stem of `out`.
      model_version: TF Serving's version number.
      quantize: None (float), "int8" or "int8-dynamic" (PT2E, see tpuexport.quantize), or
        "int8-weight-only" or "int4-weight-only" (quantize/weight_only.py).
      group_size: int4-weight-only's elements per scale along the contraction dim.
      keep_float: a regex over state_dict names of weights weight-only quantization keeps float, or None.
      calibration: calibration samples (tuples of inputs) for static int8, or None.
      calibration_file: a .npz / .safetensors calibration file (wins over `calibration`), or None.
      random_calibration: allow static int8 without samples, calibrated on random inputs (warned).
      sharding: mesh, preset and rules for slice targets (compile.make_request); the default lays
        every weight and input whole on every device of a slice.
      weights: False for a plan: lowered from the weights' shapes alone and compiled, not verified;
        the artifact has no weights, golden data or SavedModel (the verification, quantization and
        SavedModel options do not apply).
      task: "forward" (one program: the model's forward) or "text-generation" (a Hugging Face
        causal LM as prefill and decode entry points over a KV cache; see `_run_generation`).
      max_batch, max_context: the KV cache's slots and positions (text-generation).
      cache_layout: the KV cache's layout (export.CACHE_LAYOUTS; text-generation).
      kv_cache_dtype: "model" (the cache in the model's dtype) or "int8" (int8 keys and values
        with per-vector scales; export.KV_CACHE_DTYPES; text-generation).
      sliding_window_cache: "bounded" (a ring of W positions per slot when every layer attends
        within one window W < max_context) or "full" (export.SLIDING_WINDOW_CACHES; text-generation).
      new_tokens: tokens generated per prompt by the generation verification.
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
    new_tokens: int = verify_stage.DEFAULT_NEW_TOKENS


TASKS = ("forward", "text-generation")

# The one line a PT2E mode gets with a checkpoint.
PT2E_CHECKPOINT_ERROR = ("--quantize with --checkpoint is not supported: PT2E calibrates and rounds the weights in memory; load the weights "
                         "into the model and convert it without --checkpoint, or use --quantize int8-weight-only / int4-weight-only")
# The one line a model without weights gets from a conversion that needs them.
META_WEIGHTS_ERROR = "the model's weights are on the meta device; use `tpuexport plan` or --no-weights"


class StageClock:
    """Times the stages and reports each one to an optional listener (the CLI's progress lines).

    Events from other threads (compilation in the background) are held and reported by the main
    thread with its next event: the main thread may have the process's stderr redirected for a
    moment (TensorFlow's native logging), and a line written then would be lost.
    """

    def __init__(self, listener: Callable[[str, float, str], None] | None):
        self.listener = listener
        self.seconds: dict[str, float] = {}
        self.held: list[tuple[str, float, str]] = []

    @contextlib.contextmanager
    def stage(self, name: str, detail: Callable[[], str] = lambda: ""):
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start
        self.event(name, self.seconds[name], detail())

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
        """A stage timed elsewhere (e.g. compilation running in the background): kept and reported."""
        self.seconds[name] = seconds
        self.event(name, seconds, detail)


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
    """Converts a loaded source into an artifact.

    Args:
      loaded: the source (from `load_source` or the Python API).
      options: what to build.
      progress: optional callable (stage, seconds, detail) called as each stage ends.
    Returns:
      The written Artifact (a plan-only one when `options.weights` is False).
    Raises:
      TpuExportError: bad input (exit code 2), including a model whose weights are on the meta
        device without `options.weights` False; nothing is written.
      VerificationError: the lowered program or its TF SavedModel does not match eager PyTorch
        (exit code 1); only the verification report is written, next to `out`.
    """
    targets, slices = _check_options(options)
    clock = StageClock(progress)
    if options.task == "text-generation":
        return _run_generation(loaded, options, targets, slices, clock)
    if isinstance(loaded.model, torch.nn.Module) and loaded.args is None:
        raise TpuExportError("the source gives a model without example inputs; return (model, args) from the factory, "
                             "or convert a causal LM with --task text-generation")
    if not options.weights:
        return _run_plan(loaded, options, targets, slices, clock)
    if loaded.checkpoint is None and export_stage.weights_on_meta(loaded.model):
        raise TpuExportError(f"{META_WEIGHTS_ERROR} (tpuexport.plan or convert(weights=False) in Python)")
    weight_only = _weight_only_scheme(options)
    if loaded.checkpoint is not None and options.quantize and weight_only is None:
        raise TpuExportError(PT2E_CHECKPOINT_ERROR)
    model_name = serving_stage.check_model_name(options.model_name or serving_stage.default_model_name(options.out))
    serving_stage.check_model_version(options.model_version)
    with contextlib.ExitStack() as running:
        # TensorFlow's import (seconds) overlaps export and lowering in the checking process.
        scratch = running.enter_context(_scratch_directory(options.out))
        # Entered last, ended first: the TensorFlow process may still write into `scratch`.
        tensorflow = running.enter_context(serving_stage.TensorFlowProcess()) if options.saved_model else None
        with clock.stage("export", lambda: _describe_dims(captured.signature)):
            captured = export_stage.capture(loaded)
        buckets = compile_stage.make_buckets(captured.signature, options.buckets)
        requested_sizes = verify_stage.resolve_requested_sizes(captured.signature, options.verify_sizes)
        forward = lower_forward(captured, options, clock)
        captured, quantized, lowered = forward.captured, forward.quantized, forward.lowered
        for target in targets:  # seconds, not a verification and a compile, to say a bucket cannot fit
            if not target.is_slice:
                compile_stage.check_chip_fit(lowered.weight_names, lowered.weight_specs, lowered.signature, target, buckets)
        weights_file = None
        if captured.checkpoint_state is not None:
            lowered, weights_file = _stream_weights(captured, lowered, scratch, clock, weight_only)

        if options.saved_model:
            # Before verification and compilation: a program TensorFlow cannot load fails in seconds;
            # then TensorFlow saves the SavedModel in its process while verify and compile run.
            with clock.stage("tensorflow", lambda: "TensorFlow loads the program; it saves the SavedModel meanwhile"):
                saved_model_build = serving_stage.SavedModelBuild(lowered, tensorflow, scratch, weights_file)
                weights_file = saved_model_build.weights_file

        plans = _plan_slices(options.sharding, slices, lowered, buckets, clock)
        kernels, kernel_checks = _bucket_kernels(options.kernels, lowered, buckets, targets, clock)

        # The TPU compiler runs in its own processes from here on, while verify and the SavedModel run.
        compiling = running.enter_context(compile_stage.CompileJob(lowered, targets, buckets, _compiled_event(clock, lowered), plans,
                                                                   kernels))
        with clock.stage("verify", lambda: _describe_verification(report)):
            report = verify_forward(dataclasses.replace(forward, lowered=lowered), options, requested_sizes)
        tolerances = report.tolerances
        if not report.passed:
            raise VerificationError(report, _write_failed_report(options.out, report.to_json()))
        sharded = []
        for plan, names in _distinct_plans(plans):
            with clock.stage(f"verify sharded {plan.mesh_text}", lambda: sharded[-1].describe()):
                sharded.append(verify_stage.verify_sharded(lowered, plan, names, report, captured.reference, captured.example_inputs,
                                                           buckets))
            if not sharded[-1].passed:
                failed = {**report.to_json(), "sharded": [result.to_json() for result in sharded]}
                raise VerificationError(report, _write_failed_report(options.out, failed), sharded[-1].failure_summary())

        # A server pads requests to the next bucket: run one padded bucket against eager on the real rows.
        with clock.stage("verify padding", lambda: padding.describe() if padding else "no bucket is padded"):
            padding = verify_stage.verify_padding(lowered, captured.reference, captured.example_inputs, buckets, tolerances)

        @functools.cache
        def compiled() -> compile_stage.CompileReport:
            result = compiling.result()
            alongside = "verify and the SavedModel" if options.saved_model else "verify"
            clock.record("compile", compiling.seconds, f"{len(result.results)} executable(s), alongside {alongside}")
            return result

        extra_writers = _source_writers(loaded)
        if options.saved_model:
            extra_writers = (serving_stage.TfServingExport(
                lowered, report, buckets, model_name, options.model_version, options.out, saved_model_build, scratch,
                buckets_compiled=compiled, on_step=clock.event,
            ),)
        if quantized:
            extra_writers += (_quantization_report(quantized, lowered, compiled, clock),)
        if weight_only is not None:
            extra_writers += (_weight_only_report(weight_only, lowered, forward.float_reference, captured.example_inputs, clock),)
        if padding:
            extra_writers += (lambda staging: {"padding": padding.to_json()},)
        extra_writers += (artifact_stage.kernels_writer(options.kernels, kernels, [check.to_json() for check in kernel_checks.values()]),)
        with clock.stage("write", lambda: str(options.out)):
            try:
                artifact_stage.write_artifact(
                    options.out, source=captured.source, lowered=lowered, compiled=compiled, verification=report,
                    stage_seconds=clock.seconds, overwrite=options.overwrite, extra_writers=extra_writers,
                    sharded_verification=[result.to_json() for result in sharded],
                    weights_file=weights_file,
                )
            except serving_stage.SavedModelMismatch as mismatch:
                raise VerificationError(report, _write_failed_report(options.out, mismatch.report), mismatch.summary) from None
    return artifact_stage.load(options.out)


@dataclasses.dataclass(frozen=True)
class LoweredForward:
    """A forward conversion after its quantize and lower passes.

    Attributes:
      captured: the captured model the program comes from (the quantize pass's for PT2E modes);
        its `reference` is what verification compares with: the eager model, the PT2E model, or
        for weight-only modes the float model with its quantized weights dequantized.
      float_reference: the float eager model (weight-only reports measure their distance from it).
      quantized: the quantize pass's QuantizedModel (PT2E modes), or None.
      weight_only: the weight-only scheme (quantize/weight_only.py), or None.
      lowered: the lowered program (without weights when a checkpoint streams them later).
    """

    captured: export_stage.CapturedModel
    float_reference: Callable
    quantized: QuantizedModel | None
    weight_only: WeightOnlyScheme | None
    lowered: lower_stage.LoweredProgram


def lower_forward(captured: export_stage.CapturedModel, options: ConversionOptions, clock: StageClock | None = None) -> LoweredForward:
    """The quantize and lower passes of a forward conversion, with the reference verification
    compares the program with (run_conversion runs them; so does the fuzz harness,
    benchmarks/fuzz_models.py, which needs no TPU compile or artifact).

    Args:
      captured: the export pass's result.
      options: the conversion's options (precision, matmul precision, scan, quantize and its settings).
      clock: times the passes, or None.
    Returns:
      The LoweredForward.
    Raises:
      TpuExportError: bad quantize options or calibration, an unsupported operator, a failed lowering.
    """
    clock = clock or StageClock(None)
    weight_only = _weight_only_scheme(options)
    quantized = None
    if options.quantize and weight_only is None:
        quantized = _quantize(captured, options, clock)
        captured = quantized.captured
    with clock.stage("lower", lambda: f"{len(lowered.weight_names)} weight arrays, precision {_describe_precision(lowered)}, "
                                      f"matmul precision {options.matmul_precision}; {_describe_scans(lowered.scanned)}"):
        lowered = lower_stage.lower(captured.program, captured.signature, options.precision, options.matmul_precision,
                                    options.scan, weights=captured.checkpoint_state is None, keep_f32=captured.keep_f32,
                                    weight_only=weight_only)
    float_reference = captured.reference
    if weight_only is not None:
        captured = dataclasses.replace(captured, reference=_dequantized_reference(captured, lowered, weight_only))
    return LoweredForward(captured, float_reference, quantized, weight_only, lowered)


def _verification_tolerances(lowered: lower_stage.LoweredProgram, options: ConversionOptions,
                             quantized: bool) -> verify_stage.VerificationTolerances:
    """The tolerances a program is verified with: the defaults of what it computes in and of its
    quantization (PT2E int8), with the options' overrides."""
    return verify_stage.with_overrides(
        verify_stage.default_tolerances(lowered.resolved_precision, options.matmul_precision, quantized),
        **options.tolerance_overrides,
    )


def verify_forward(forward: LoweredForward, options: ConversionOptions,
                   requested_sizes: tuple[dict[str, int], ...] = ()) -> verify_stage.VerificationReport:
    """The verify pass of a forward conversion: the program's CPU runs at the planned sizes against
    its reference, within the tolerances of its precision and quantization (and the options'
    overrides); PT2E programs are also checked op by op.

    Args:
      forward: the program and its reference (`lower_forward`; its program has its weights).
      options: the conversion's options (matmul precision, tolerance overrides, budget).
      requested_sizes: sizes that must be verified, resolved (verify.resolve_requested_sizes).
    Returns:
      The VerificationReport, passed or not (its `tolerances` are the ones applied).
    """
    quantized = forward.quantized is not None
    tolerances = _verification_tolerances(forward.lowered, options, quantized)
    report = verify_stage.verify(forward.lowered, forward.captured.reference, forward.captured.example_inputs, tolerances,
                                 options.verify_budget_flops, requested_sizes, check_op_by_op=quantized)
    if quantized:
        report = dataclasses.replace(report, against="the PT2E-converted model, eager PyTorch")
    if forward.weight_only is not None:
        report = dataclasses.replace(report, against="the model with its quantized weights dequantized, eager PyTorch")
    return report


def _check_options(options: ConversionOptions) -> tuple[list, list]:
    """Checks what can be checked before any work: targets, mesh sizes, destination, precisions.

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
    artifact_stage.check_destination(options.out, options.overwrite)
    if options.precision not in lower_stage.PRECISIONS:
        raise TpuExportError(f"unknown precision {options.precision!r}; use one of {', '.join(lower_stage.PRECISIONS)}")
    if options.matmul_precision not in lower_stage.MATMUL_PRECISIONS:
        raise TpuExportError(f"unknown matmul precision {options.matmul_precision!r}; use one of {', '.join(lower_stage.MATMUL_PRECISIONS)}")
    if options.task not in TASKS:
        raise TpuExportError(f"unknown task {options.task!r}; use one of {', '.join(TASKS)}")
    lower_stage.check_kernel_mode(options.kernels)
    if options.task == "text-generation":
        if options.max_context is None:
            raise TpuExportError("--task text-generation needs --max-context N (positions per cache slot), e.g. --max-context 2048")
    elif options.max_context is not None or options.max_batch != 1:
        raise TpuExportError("--max-context / --max-batch apply to --task text-generation only; add --task text-generation or drop them")
    export_stage.check_kv_cache_dtype(options.kv_cache_dtype)
    export_stage.check_sliding_window_cache(options.sliding_window_cache)
    if options.kv_cache_dtype != "model" and options.task != "text-generation":
        raise TpuExportError(f"--kv-cache-dtype {options.kv_cache_dtype} applies to --task text-generation only (a forward program has "
                             "no KV cache); add --task text-generation or drop it")
    if options.kv_cache_dtype == "int8" and options.quantize in ("int8", "int8-dynamic"):
        raise TpuExportError(f"--kv-cache-dtype int8 with --quantize {options.quantize} is not supported yet (PT2E would quantize "
                             "around the cache's own int8 rounding); use it with a weight-only mode or without --quantize")
    if options.quantize and not options.weights and _weight_only_scheme(options) is None:
        raise TpuExportError("--quantize int8/int8-dynamic needs the model's weights (it calibrates and rounds them); plan without it "
                             "or with a weight-only mode")
    _weight_only_scheme(options)
    return targets, slices


def _bucket_kernels(mode: str, lowered: lower_stage.LoweredProgram, buckets: list, targets: list,
                    clock: StageClock) -> tuple[dict | None, dict]:
    """The kernels pass: with mode "auto", each bucket lowered again with TPU kernels where they pay,
    and each distinct kernel use run in Pallas interpret mode against the portable lowering; a bucket
    whose kernel use fails keeps the portable program, and says so.

    Args:
      mode: "auto" or "none"; lowered: the portable program; buckets: the compile buckets;
      targets: the resolved targets (kernels are lowered only when one is a single TPU chip);
      clock: times the passes.
    Returns:
      ({bucket name: BucketKernels} for the compile stage, or None for mode "none";
      {verify.kernel_check_key(use): KernelCheck}).
    """
    if mode == "none":
        return None, {}
    # Nothing a kernel computes, or no target that compiles kernels: no stage to report.
    chips = [target for target in targets if target.platform == "tpu" and not target.is_slice]
    reason = None if chips else "no single TPU chip among the targets: kernels are compiled for single chips only"
    if reason is None and not lower_stage.has_attention(lowered):
        reason = lower_stage.NO_ATTENTION
    if reason:
        return {bucket.name: lower_stage.BucketKernels(bucket.as_dict(), None, reason=reason) for bucket in buckets}, {}
    with clock.stage("kernels", lambda: _describe_kernels(kernels)):
        kernels = {bucket.name: lower_stage.lower_bucket_kernels(lowered, bucket.as_dict()) for bucket in buckets}
    uses = [use for lowering in kernels.values() for use in lowering.kernels]
    if not uses:
        return kernels, {}
    with clock.stage("verify kernels", lambda: f"{len(checks)} kernel use(s) in Pallas interpret mode, "
                                               f"{sum(check.passed for check in checks.values())} passed"):
        checks = verify_stage.verify_kernels(uses)
    for name, lowering in kernels.items():
        failed = [checks[verify_stage.kernel_check_key(use)] for use in lowering.kernels
                  if not checks[verify_stage.kernel_check_key(use)].passed]
        if failed:
            kernels[name] = dataclasses.replace(lowering, exported=None, reason=(
                f"the kernel failed verification in interpret mode (relative RMS error {failed[0].error:.2e} > "
                f"{failed[0].tolerance:g} vs the portable lowering): the portable program is used"))
    return kernels, checks


def _describe_kernels(kernels: dict) -> str:
    used = [name for name, lowering in kernels.items() if lowering.exported is not None]
    return f"{len(used)} of {len(kernels)} bucket(s) with flash attention" + (f" ({', '.join(used)})" if used else "")


def _weight_only_scheme(options: ConversionOptions):
    """The weight-only scheme the options ask for (quantize/weight_only.py), or None.

    Raises:
      TpuExportError: a bad --group-size or --keep-float regex.
    """
    if options.quantize not in ("int8-weight-only", "int4-weight-only"):
        return None
    from tpuexport.quantize import weight_only

    scheme = weight_only.check_scheme(options.quantize, options.group_size)
    if options.keep_float:
        try:
            re.compile(options.keep_float)
        except re.error as error:
            raise TpuExportError(f"--keep-float {options.keep_float!r} is not a regular expression ({error}); give one such as 'lm_head'") from None
    return dataclasses.replace(scheme, keep_float=options.keep_float or None)


def _run_plan(loaded: export_stage.LoadedSource, options: ConversionOptions, targets: list, slices: list,
              clock: StageClock) -> artifact_stage.Artifact:
    """A conversion without weights: export, lower from shapes, plan, compile, write.

    Args:
      loaded: the source; its weights may be on the meta device (they are never read).
      options: what to build (`options.weights` is False).
      targets: the resolved targets; slices: those that are slices.
      clock: times the stages.
    Returns:
      The plan-only Artifact (manifest "plan_only": true).
    Raises:
      TpuExportError: bad input, a failed export or lowering, or a bucket that does not fit a
        device's HBM (naming the largest buffers).
    """
    with clock.stage("export", lambda: _describe_dims(captured.signature)):
        captured = export_stage.capture(export_stage.on_meta_device(dataclasses.replace(loaded, checkpoint=None)))
    buckets = compile_stage.make_buckets(captured.signature, options.buckets)
    with clock.stage("lower", lambda: f"{len(lowered.weight_names)} weight shapes ({lowered.weight_bytes / 2**30:.2f} GiB, "
                                      f"not read), precision {_describe_precision(lowered)}, matmul precision {options.matmul_precision}; "
                                      f"{_describe_scans(lowered.scanned)}"):
        lowered = lower_stage.lower(captured.program, captured.signature, options.precision, options.matmul_precision,
                                    options.scan, weights=False, keep_f32=captured.keep_f32, weight_only=_weight_only_scheme(options))
    plans = _plan_slices(options.sharding, slices, lowered, buckets, clock)
    kernels, kernel_checks = _bucket_kernels(options.kernels, lowered, buckets, targets, clock)
    with compile_stage.CompileJob(lowered, targets, buckets, _compiled_event(clock, lowered), plans, kernels) as compiling:
        report = compiling.result()
    clock.record("compile", compiling.seconds, f"{len(report.results)} executable(s)")
    with clock.stage("write", lambda: f"{options.out} (plan only: no weights, not verified)"):
        artifact_stage.write_artifact(options.out, source=captured.source, lowered=lowered, compiled=lambda: report, verification=None,
                                      stage_seconds=clock.seconds, overwrite=options.overwrite,
                                      extra_writers=_source_writers(loaded) + (artifact_stage.kernels_writer(
                                          options.kernels, kernels, [check.to_json() for check in kernel_checks.values()]),))
    return artifact_stage.load(options.out)


def _source_writers(loaded: export_stage.LoadedSource) -> tuple:
    """Writers of what the source brings beside the model (a Hugging Face directory's tokenizer,
    processor and config files, and its manifest section)."""
    return (artifact_stage.huggingface_writer(loaded.huggingface),) if loaded.huggingface is not None else ()


def _stream_weights(captured: export_stage.CapturedModel, lowered: lower_stage.LoweredProgram, scratch: pathlib.Path,
                    clock: StageClock, weight_only=None) -> tuple[lower_stage.LoweredProgram, pathlib.Path]:
    """The weights pass: copies the checkpoint's tensors into the artifact's weights file one at a
    time (in their stored layouts, cast to the program's dtypes, scanned blocks stacked, weight-only ones quantized) and
    maps the file back.

    Args:
      captured: the export stage's result, with `checkpoint_state`.
      lowered: the program lowered from the weights' shapes (`weights` None).
      scratch: the conversion's scratch directory (the file moves into the artifact from there).
      clock: times the pass.
      weight_only: the weight-only scheme (quantize/weight_only.py), or None.
    Returns:
      (the program with its weights as read-only memory maps of the file, the file).
    """
    path = scratch / "weights.safetensors"

    def parts(name: str):
        layout = lowered.weight_layouts.get(name)
        tensors = (lower_stage.in_stored_layout(captured.checkpoint_state[part], layout) for part in lowered.weight_parts[name])
        return stored.parts(name, tensors) if weight_only is not None else tensors

    if weight_only is not None:
        from tpuexport.quantize.weight_only import StoredWeights

        stored = StoredWeights(lowered.quantized, weight_only)
    with clock.stage("weights", lambda: f"{len(lowered.weight_names)} arrays, {written / 2**30:.2f} GiB streamed from the checkpoint "
                                        f"{captured.source.checkpoint}"):
        written = artifact_stage.write_weights(path, lowered.weight_names, lowered.weight_specs, parts)
        arrays = artifact_stage.map_weights(path)
    return dataclasses.replace(lowered, weights=tuple(arrays[name] for name in lowered.weight_names)), path


def _plan_slices(request: compile_stage.ShardingRequest, slices: list, lowered: lower_stage.LoweredProgram,
                 buckets: list, clock: StageClock) -> dict[str, compile_stage.ShardingPlan]:
    """The sharding plan of every slice target, from the weights' shapes (arrays are not needed).

    Returns:
      {slice target name: ShardingPlan}.
    """
    plans = {}
    for target in slices:
        with clock.stage(f"plan {target.name}", lambda: _describe_plan(plans[target.name])):
            plans[target.name] = compile_stage.plan_sharding(request, target, lowered.weight_names, lowered.weight_specs,
                                                             lowered.signature, buckets, lowered.stacked, lowered.weight_layouts)
    return plans


def _compiled_event(clock: StageClock, lowered: lower_stage.LoweredProgram,
                    entry_point: str | None = None) -> Callable[[compile_stage.CompiledBucket], None]:
    """Reports each executable as it is compiled (from the compile job's threads); `entry_point`
    names a text-generation artifact's entry point."""
    prefix = f"{entry_point} " if entry_point else ""

    def compiled_one(result: compile_stage.CompiledBucket) -> None:
        clock.event(f"compile {result.target.name} {prefix}{result.bucket.name}", result.compile_seconds,
                    _describe_compiled(result, lowered))

    return compiled_one


def _quantize(captured: export_stage.CapturedModel, options: ConversionOptions, clock: StageClock):
    """The quantize pass (imported here: torchao loads only for quantized conversions)."""
    from tpuexport import quantize as quantize_stage

    with clock.stage("quantize", lambda: quantized.describe()):
        quantized = quantize_stage.quantize(
            captured, options.quantize, options.calibration, options.calibration_file, options.random_calibration,
        )
    return quantized


def _dequantized_reference(captured: export_stage.CapturedModel, lowered: lower_stage.LoweredProgram, scheme):
    """Verification's reference for a weight-only program: the float model, its quantized weights
    rounded and dequantized as it runs (quantize/weight_only.py)."""
    from tpuexport.quantize.weight_only import DequantizedReference

    return DequantizedReference(captured.reference, lowered.quantized_state_axes, scheme)


def _weight_only_report(scheme, lowered: lower_stage.LoweredProgram, float_reference, example_inputs, clock: StageClock):
    """The writer that measures a weight-only program's SQNR against the float model and puts the
    manifest's quantization section (which weights, how) in the artifact."""
    from tpuexport.verify.quantization_report import weight_only_section

    def write(staging: pathlib.Path) -> dict:
        with clock.stage("quantization report", lambda: _describe_weight_only(section)):
            section = weight_only_section(lowered, scheme, float_reference, example_inputs)
        return {"quantization": section}

    return write


def _describe_weight_only(section: dict) -> str:
    outputs = ", ".join(f"{o['name']} {o['sqnr_db']:.1f} dB" if o["sqnr_db"] is not None else f"{o['name']} exact"
                        for o in section["outputs"])
    return (f"{section['mode']}: {len(section['weights'])} weight(s) quantized; SQNR vs float: {outputs}; "
            f"weights {section['weight_bytes']['ratio']}x f32")


def _quantization_report(quantized, lowered: lower_stage.LoweredProgram, compiled: Callable[[], compile_stage.CompileReport],
                         clock: StageClock):
    """The writer that measures SQNR against the float model and the integer share of the first
    TPU executable's matmul FLOPs, and puts the report in the artifact."""
    from tpuexport.verify import quantization_report

    def write(staging: pathlib.Path) -> dict:
        executable = compiled().results[0]
        with clock.stage("quantization report", lambda: quantization_report.describe_report(report)):
            matmuls = quantization_report.CompiledMatmuls(executable.target.name, executable.bucket.name, executable.matmul_flops)
            report = quantization_report.build_report(quantized, lowered, matmuls)
        return quantization_report.report_writer(report)(staging)

    return write


@contextlib.contextmanager
def _scratch_directory(out: pathlib.Path):
    """A hidden directory next to `out` (same filesystem: its files are moved into the artifact),
    removed when the conversion ends, failed or not."""
    scratch = pathlib.Path(tempfile.mkdtemp(prefix=artifact_stage.sibling_prefix(out, "scratch"), dir=out.parent))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _write_failed_report(out: pathlib.Path, report: dict) -> pathlib.Path:
    """Writes a failed conversion's verification report next to `out` (which is not created)."""
    report_path = out.parent / f"{out.name}.verification-report.json"
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    return report_path


def _describe_verification(report: verify_stage.VerificationReport) -> str:
    worst = report.worst_errors()
    return (f"{len(report.cases)} size(s), {'passed' if report.passed else 'FAILED'}; worst relative RMS error "
            f"{worst['tpu']:.1e} as the TPU computes (matmul precision {report.matmul_precision}), {worst['cpu']:.1e} in f32")


def _distinct_plans(plans: dict[str, compile_stage.ShardingPlan]) -> list[tuple[compile_stage.ShardingPlan, tuple[str, ...]]]:
    """Each distinct plan once, with the targets that use it (two slices of one size share a plan)."""
    grouped: dict[compile_stage.ShardingPlan, list[str]] = {}
    for name, plan in plans.items():
        grouped.setdefault(plan, []).append(name)
    return [(plan, tuple(names)) for plan, names in grouped.items()]


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


def _describe_precision(lowered: lower_stage.LoweredProgram) -> str:
    """"auto (bf16)": the requested precision and, when they differ, what the program computes in."""
    resolved = lowered.resolved_precision
    return lowered.precision if resolved == lowered.precision else f"{lowered.precision} ({resolved})"


def _describe_scans(scanned: tuple[dict, ...]) -> str:
    """"scanned model.layers (32 blocks)", or "no layers scanned"."""
    if not scanned:
        return "no layers scanned"
    return "scanned " + ", ".join(f"{run['module']} ({run['count']} blocks)" for run in scanned)


def _describe_dims(signature) -> str:
    dims = ", ".join(f"{d.name} {d.range_text}" for d in signature.dims)
    return f"inputs {', '.join(s.name for s in signature.inputs)}" + (f"; dims {dims}" if dims else "; static shapes")


def _run_generation(loaded: export_stage.LoadedSource, options: ConversionOptions, targets: list, slices: list,
                    clock: StageClock) -> artifact_stage.Artifact:
    """A text-generation conversion: the entry points are the unit every pass handles.

      export   prefill and decode modules over the one model, each torch.exported   -> {name: CapturedModel}
      quantize PT2E int8 / int8-dynamic (optional), each entry point with its own activation
               observers, calibrated as it is driven; one set of weights         -> {name: QuantizedModel}
      lower    each entry point lowered; one set of weights kept                   -> GenerationProgram
      weights  (a source with a checkpoint) the entry points exported on the meta device and lowered
               from shapes; the checkpoint's tensors streamed once into the one weights file
               (weight-only modes quantized as they stream) and memory-mapped back for every entry point
      plan     per slice target and entry point, the cache split with the heads (tensor-parallel)
               or the batch (data-parallel)
      compile  per target, entry point and bucket, the cache donated (in the background)
      verify   greedy generation vs Hugging Face generate, teacher-forced, both CPU runs (int8:
               vs the PT2E entry points' greedy generation, verify/quantized_generation.py)
      verify sharded  per slice plan, a verified case's prefill and decode steps partitioned on N
               CPU devices, the cache carried between calls, vs the same references (verify/sharded_generation.py)
      write    one weights file, each entry point's program files, "entry_points" in the manifest

    With a checkpoint, the eager model that generate() runs in verification is a copy of the model whose
    parameters are the checkpoint's memory-mapped tensors (export.with_checkpoint_weights), and the
    program's are the artifact's weights file, memory-mapped: neither is a copy the process owns.

    Args:
      loaded: the source: a Hugging Face causal LM (args not needed).
      options: what to build (`options.task` is "text-generation").
      targets: the resolved targets; slices: those that are slices.
      clock: times the stages.
    Returns:
      The written Artifact (a plan when `options.weights` is False).
    Raises:
      TpuExportError: bad input; VerificationError: generation does not match (only the report is written).
    """
    model = loaded.model
    if not isinstance(model, torch.nn.Module):
        raise TpuExportError(f"--task text-generation needs the nn.Module of a Hugging Face causal LM, not a {type(model).__name__}")
    plan_only = not options.weights
    streamed = loaded.checkpoint is not None and not plan_only
    if not plan_only and not streamed and export_stage.weights_on_meta(model):
        raise TpuExportError(f"{META_WEIGHTS_ERROR} (tpuexport.plan or convert(weights=False) in Python)")
    if streamed and options.quantize and _weight_only_scheme(options) is None:
        raise TpuExportError(PT2E_CHECKPOINT_ERROR)
    if export_stage.is_encoder_decoder(model):
        return _seq2seq_passes(loaded, options, targets, slices, clock)
    with _scratch_directory(options.out) if streamed else contextlib.nullcontext() as scratch:
        return _generation_passes(loaded, options, targets, slices, clock, scratch)


def _seq2seq_passes(loaded: export_stage.LoadedSource, options: ConversionOptions, targets: list, slices: list,
                    clock: StageClock) -> artifact_stage.Artifact:
    """The passes of `_run_generation` for an encoder-decoder (export/seq2seq.py): encode and decode
    entry points over one set of weights, each exported, lowered, compiled per bucket with its
    caches donated, greedy generation verified against generate() (verify/seq2seq.py), written as a
    text-generation artifact. Sizes: --max-batch, --max-context (decoder positions), --bucket seq=
    (source lengths; the longest is the cross cache's positions; not for audio sources, whose length
    is the encoder's), --bucket batch= (encode batches).

    Raises:
      TpuExportError: what the encoder-decoder entry points do not support yet (quantization, a
        checkpoint, slices, plans), bad sizes; VerificationError: generation does not match.
    """
    model = loaded.model
    unsupported = [what for what, given in (("--quantize", options.quantize), ("--checkpoint", loaded.checkpoint is not None),
                                             ("--kv-cache-dtype int8", options.kv_cache_dtype == "int8"),
                                             ("a slice target", slices), ("a plan (--no-weights)", not options.weights)) if given]
    if unsupported:
        raise TpuExportError(f"--task text-generation of an encoder-decoder ({type(model).__name__}) does not support {unsupported[0]} yet; "
                             "convert it in float on single-chip targets with its weights")
    requested = dict(options.buckets or {})
    unknown = sorted(set(requested) - {"batch", "seq"})
    if unknown:
        raise TpuExportError(f"--bucket {unknown[0]} is not a dim of encoder-decoder generation; encode's dims are batch and seq (source length)")
    spec = export_stage.seq2seq_spec(model, options.max_batch, options.max_context, tuple(requested["seq"]) if "seq" in requested else None)
    encode_batches = tuple(sorted(set(requested.get("batch") or {1, options.max_batch})))
    if not all(1 <= batch <= options.max_batch for batch in encode_batches):
        raise TpuExportError(f"--bucket batch={','.join(map(str, encode_batches))} is out of range: encode batches are 1..{options.max_batch} "
                             "(--max-batch)")
    sources = f"{spec.features[0]} x {spec.features[1]} features" if spec.source == "features" else f"source {list(spec.source_buckets)}"
    with clock.stage("export", lambda: f"entry points encode (batch {list(encode_batches)} x {sources}) and "
                                       f"decode (batch {spec.max_batch}); caches {list(spec.cache_shape)} + cross {list(spec.cross_shape)} {spec.dtype}"):
        modules = export_stage.seq2seq_entry_point_modules(model, spec)
        captured = {name: export_stage.capture(export_stage.LoadedSource(modules[name], args, shapes, None, loaded.info))
                    for name, (args, shapes) in export_stage.seq2seq_example_arguments(spec).items()}
    # Unscanned: encode would scan the encoder's layers (their weights stacked) while decode, which
    # does not run the encoder, keeps them apart, and the two must take one set of weights.
    with clock.stage("lower", lambda: f"{len(lowered['decode'].weight_names)} weight arrays shared by "
                                      f"{', '.join(lowered)}, precision {_describe_precision(lowered['decode'])}"):
        lowered = {name: lower_stage.lower(entry.program, entry.signature, options.precision, options.matmul_precision, scan=False)
                   for name, entry in captured.items()}
    lowered["encode"] = dataclasses.replace(lowered["encode"], weights=lowered["decode"].weights)
    program = lower_stage.Seq2SeqProgram(spec, lowered, encode_batches)
    # Audio features have no seq dim (their frames are static); batch is a dim unless max batch is 1.
    encode_dims = {dim.name for dim in lowered["encode"].signature.dims}
    encode_sizes = {name: sizes for name, sizes in (("seq", list(spec.source_buckets)), ("batch", list(encode_batches))) if name in encode_dims}
    buckets = {"encode": compile_stage.make_buckets(lowered["encode"].signature, encode_sizes),
               "decode": compile_stage.make_buckets(lowered["decode"].signature, None)}
    with contextlib.ExitStack() as running:
        # Every executable donates its inputs (compile_child.py): the caches' buffers become its outputs.
        jobs = {name: running.enter_context(compile_stage.CompileJob(entry, targets, buckets[name], _compiled_event(clock, entry, name)))
                for name, entry in lowered.items()}
        report = None
        with clock.stage("verify", lambda: _describe_generation(report, "encode")):
            report = verify_stage.verify_seq2seq(program, model, _verification_tolerances(lowered["decode"], options, False), options.new_tokens)
        if not report.passed:
            raise VerificationError(report, _write_failed_report(options.out, report.to_json()))
        compiled = {name: job.result() for name, job in jobs.items()}
        clock.record("compile", max(job.seconds for job in jobs.values()),
                     f"{sum(len(result.results) for result in compiled.values())} executable(s), alongside verify")
    with clock.stage("write", lambda: str(options.out)):
        artifact_stage.write_generation_artifact(options.out, source=loaded.info, program=program, compiled=compiled, verification=report,
                                                 stage_seconds=clock.seconds, overwrite=options.overwrite, extra_writers=_source_writers(loaded))
    return artifact_stage.load(options.out)


def _generation_passes(loaded: export_stage.LoadedSource, options: ConversionOptions, targets: list, slices: list,
                       clock: StageClock, scratch: pathlib.Path | None) -> artifact_stage.Artifact:
    """The passes of `_run_generation` (its arguments, checked), with the conversion's scratch
    directory when the weights stream from a checkpoint (else None)."""
    model = loaded.model
    plan_only = not options.weights
    checkpoint_model = export_stage.with_checkpoint_weights(model, loaded.checkpoint) if scratch is not None else None
    requested = dict(options.buckets or {})
    unknown = sorted(set(requested) - {"batch", "seq"})
    if unknown:
        raise TpuExportError(f"--bucket {unknown[0]} is not a dim of text generation; prefill's dims are batch and seq (prompt length)")
    spec = export_stage.generation_spec(model, options.max_batch, options.max_context, options.cache_layout,
                                        tuple(requested["seq"]) if "seq" in requested else None, options.kv_cache_dtype,
                                        options.sliding_window_cache)
    prefill_batches = tuple(sorted(set(requested.get("batch") or {1, options.max_batch})))
    if not all(1 <= batch <= options.max_batch for batch in prefill_batches):
        raise TpuExportError(f"--bucket batch={','.join(map(str, prefill_batches))} is out of range: prefill batches are 1..{options.max_batch} "
                             "(--max-batch)")
    with clock.stage("export", lambda: f"entry points prefill (batch {list(prefill_batches)} x seq {list(spec.prefill_buckets)}) and "
                                       f"decode (batch {spec.max_batch}); cache {spec.layout} {list(spec.cache_shape)} "
                                       f"{_describe_window_cache(spec)}"
                                       f"{f'int8 + {spec.scale_dtype} scales' if spec.quantized else spec.dtype}"):
        modules = export_stage.entry_point_modules(model, spec)
        # With a checkpoint, each entry point is exported on the meta device and its weights are the one
        # checkpoint copy's tensors (the same tensors for both: one set of weights, streamed once).
        state = None if checkpoint_model is None else export_stage.Checkpoint(
            {**dict(checkpoint_model.named_parameters(remove_duplicate=False)), **dict(checkpoint_model.named_buffers(remove_duplicate=False))},
            loaded.checkpoint.description, loaded.checkpoint.name)
        captured = {}
        # A plan of a model built on the CPU exports with its CPU weights, as a forward plan does.
        on_meta = state is not None or (plan_only and export_stage.weights_on_meta(model))
        for name, (args, dynamic_shapes) in export_stage.example_arguments(spec, "meta" if on_meta else "cpu").items():
            source = export_stage.LoadedSource(modules[name], args, dynamic_shapes, None, loaded.info, checkpoint=state)
            captured[name] = export_stage.capture(export_stage.on_meta_device(source) if plan_only else source)
    weight_only = _weight_only_scheme(options)
    quantized = None
    if options.quantize and weight_only is None:
        quantized = _quantize_entry_points(captured, spec, options, clock)
        captured = {name: result.captured for name, result in quantized.items()}
    with clock.stage("lower", lambda: f"{len(lowered['decode'].weight_names)} weight arrays shared by "
                                      f"{', '.join(lowered)}, precision {_describe_precision(lowered['decode'])}"):
        lowered = {name: lower_stage.lower(entry.program, entry.signature, options.precision, options.matmul_precision, options.scan,
                                           weights=not plan_only and scratch is None, weight_only=weight_only)
                   for name, entry in captured.items()}
    weights_file = None
    if scratch is not None:  # the entry points take the same weights: decode's names and parts stream them for both
        lowered["decode"], weights_file = _stream_weights(captured["decode"], lowered["decode"], scratch, clock, weight_only)
    # Both programs collected the same weights; the artifact and the runs keep decode's.
    lowered["prefill"] = dataclasses.replace(lowered["prefill"], weights=lowered["decode"].weights)
    program = lower_stage.GenerationProgram(spec, lowered, prefill_batches)
    # With one cache slot, prefill's batch is static (no batch dim to bucket).
    prefill_sizes = {"seq": list(spec.prefill_buckets)}
    if any(dim.name == "batch" for dim in lowered["prefill"].signature.dims):
        prefill_sizes["batch"] = list(prefill_batches)
    buckets = {"prefill": compile_stage.make_buckets(lowered["prefill"].signature, prefill_sizes),
               "decode": compile_stage.make_buckets(lowered["decode"].signature, None)}
    plans = {name: _plan_generation_slices(options.sharding, slices, spec, entry, buckets[name], clock, name)
             for name, entry in lowered.items()}
    with contextlib.ExitStack() as running:
        # Every executable donates its inputs (compile_child.py): the cache's buffers become its outputs.
        kernels, kernel_checks = _generation_kernels(options.kernels, lowered, buckets, targets, clock)
        jobs = {name: running.enter_context(compile_stage.CompileJob(entry, targets, buckets[name], _compiled_event(clock, entry, name),
                                                                     plans[name], kernels[name]))
                for name, entry in lowered.items()}
        report, sharded = None, []
        if not plan_only:
            with clock.stage("verify", lambda: _describe_generation(report)):
                tolerances = _verification_tolerances(lowered["decode"], options, quantized is not None)
                if quantized:  # int8: against the PT2E entry points, as forward int8 programs are
                    references = {name: result.captured.reference for name, result in quantized.items()}
                    report = verify_stage.verify_quantized_generation(program, model, references, tolerances, options.new_tokens)
                elif spec.quantized:
                    report = _verify_int8_kv(program, model, modules, checkpoint_model, lowered, weight_only, tolerances, options, scratch, clock)
                else:
                    # A weight-only program is compared with generate() on the model with those weights dequantized;
                    # its distance from the float model's generate() is measured too.
                    if checkpoint_model is None:
                        float_reference = verify_stage.eager_references(program, model, options.new_tokens) if weight_only else None
                        with _dequantized_weights(modules["decode"], lowered["decode"], weight_only):
                            report = verify_stage.verify_generation(program, model, tolerances, options.new_tokens, float_reference)
                    else:
                        float_reference = verify_stage.eager_references(program, checkpoint_model, options.new_tokens) if weight_only else None
                        eager_model = checkpoint_model if weight_only is None else _dequantized_checkpoint_model(
                            model, checkpoint_model, lowered["decode"], weight_only, scratch, clock)
                        report = verify_stage.verify_generation(program, eager_model, tolerances, options.new_tokens, float_reference)
            if not report.passed:
                raise VerificationError(report, _write_failed_report(options.out, report.to_json()))
            sharded = _verify_generation_slices(program, plans, report, options.out, clock)
        compiled = {name: job.result() for name, job in jobs.items()}
        clock.record("compile", max(job.seconds for job in jobs.values()),
                     f"{sum(len(result.results) for result in compiled.values())} executable(s), alongside verify")
    with clock.stage("write", lambda: str(options.out) + (" (plan only: no weights, not verified)" if plan_only else "")):
        artifact_stage.write_generation_artifact(options.out, source=loaded.info, program=program, compiled=compiled,
                                                 verification=report, stage_seconds=clock.seconds, overwrite=options.overwrite,
                                                 weights_file=weights_file, sharded_verification=[result.to_json() for result in sharded],
                                                 extra_writers=_source_writers(loaded) + _generation_quantization(lowered["decode"], weight_only)
                                                 + _generation_int8_report(quantized, program, compiled, report, clock) + (artifact_stage.kernels_writer(
                                                     options.kernels, {f"{name}/{bucket}": lowering for name, entry in kernels.items()
                                                                       for bucket, lowering in (entry or {}).items()},
                                                     [check.to_json() for check in kernel_checks.values()]),))
    return artifact_stage.load(options.out)


def _verify_generation_slices(program: lower_stage.GenerationProgram, plans: dict, report, out: pathlib.Path,
                              clock: StageClock) -> list:
    """The verify sharded pass of a text-generation conversion: per distinct set of entry-point plans
    (one per slice target; equal sizes share one), a verified case's prefill and decode steps
    partitioned by them on as many CPU devices (verify/sharded_generation.py).

    Args:
      program: the generation program (with weights); plans: {entry point: {slice target: ShardingPlan}};
      report: the passed generation report (its stored cases and tolerances are reused);
      out: the artifact's path (a failure's report goes beside it); clock: times each plan's run.
    Returns:
      The passed ShardedGenerationVerification of each distinct set of plans ([] without slices).
    Raises:
      VerificationError: a plan's run does not match (its report written next to `out`).
    """
    grouped: dict[tuple, list[str]] = {}
    for target in plans["decode"]:
        grouped.setdefault(tuple(plans[name][target] for name in plans), []).append(target)
    results = []
    for entry_plans, targets in grouped.items():
        entry_plans = dict(zip(plans, entry_plans))
        with clock.stage(f"verify sharded {entry_plans['decode'].mesh_text}", lambda: results[-1].describe()):
            results.append(verify_stage.verify_sharded_generation(program, entry_plans, targets, report))
        if not results[-1].passed:
            failed = {**report.to_json(), "sharded": [result.to_json() for result in results]}
            raise VerificationError(report, _write_failed_report(out, failed), results[-1].failure_summary())
    return results


# Why decode keeps XLA's attention: its query is one token over the whole cache (flash's blocks are
# query-by-key tiles); a ragged/paged decode kernel reads the cache in the layout it pages.
DECODE_KERNEL_REASON = ("decode: one query per row over the KV cache; the flash kernel tiles queries, and a ragged/paged "
                        "decode attention kernel is not used yet")


def _verify_int8_kv(program: lower_stage.GenerationProgram, model: torch.nn.Module, modules: dict, checkpoint_model, lowered: dict,
                    weight_only, tolerances, options: ConversionOptions, scratch: pathlib.Path | None, clock: StageClock):
    """The verify pass of an int8-KV program: against its entry points run eagerly with the artifact's
    weights (a weight-only program's rounded, as `_generation_passes` rounds them for generate()),
    and measured against the float model's generate() (verify/int8_kv_generation.py).

    Args:
      program, lowered: the generation program and its entry points; model: the user's model;
      modules: the entry-point modules over `model`; checkpoint_model: the model with the
      checkpoint's tensors (streamed conversions) or None; weight_only: the weight-only scheme or
      None; tolerances: the float tolerances; options, scratch, clock: the conversion's.
    Returns:
      The GenerationReport.
    """
    float_model = model if checkpoint_model is None else checkpoint_model
    float_reference = verify_stage.eager_references(program, float_model, options.new_tokens)
    if checkpoint_model is None:
        with _dequantized_weights(modules["decode"], lowered["decode"], weight_only):
            return verify_stage.verify_int8_kv_generation(program, modules, tolerances, float_reference, options.new_tokens)
    eager_model = checkpoint_model if weight_only is None else _dequantized_checkpoint_model(
        model, checkpoint_model, lowered["decode"], weight_only, scratch, clock)
    return verify_stage.verify_int8_kv_generation(program, export_stage.entry_point_modules(eager_model, program.spec), tolerances,
                                                  float_reference, options.new_tokens)


def _generation_kernels(mode: str, lowered: dict, buckets: dict, targets: list, clock: StageClock) -> tuple[dict, dict]:
    """The kernels pass of a text-generation conversion: prefill's buckets as a forward program's
    (its causal attention over the prompt is flash attention's form), decode without kernels.

    Returns:
      ({entry point: {bucket name: BucketKernels} or None for mode "none"}, prefill's kernel checks).
    """
    if mode == "none":
        return {name: None for name in lowered}, {}
    prefill, checks = _bucket_kernels(mode, lowered["prefill"], buckets["prefill"], targets, clock)
    decode = {bucket.name: lower_stage.BucketKernels(bucket.as_dict(), None, reason=DECODE_KERNEL_REASON) for bucket in buckets["decode"]}
    return {"prefill": prefill, "decode": decode}, checks


def _dequantized_weights(module: torch.nn.Module, lowered: lower_stage.LoweredProgram, scheme):
    """While open, eager PyTorch computes with `module`'s weight-only weights rounded and dequantized
    (quantize/weight_only.py); a no-op without a scheme."""
    if scheme is None:
        return contextlib.nullcontext()
    from tpuexport.quantize.weight_only import DequantizedReference, DequantizedWeights

    return DequantizedWeights(DequantizedReference(module, lowered.quantized_state_axes, scheme).weights, scheme)


def _dequantized_checkpoint_model(model: torch.nn.Module, checkpoint_model: torch.nn.Module, lowered: lower_stage.LoweredProgram,
                                  scheme, scratch: pathlib.Path, clock: StageClock) -> torch.nn.Module:
    """The eager reference of a weight-only generation program streamed from a checkpoint: a copy of
    `model` whose quantized weights are the checkpoint's rounded and dequantized (from its float
    tensors, not from the artifact's integers) once, written to a scratch file and memory-mapped,
    and whose other weights are `checkpoint_model`'s (the checkpoint's memory maps).

    Rounding at every use (DequantizedWeights) would round every weight again at each generate()
    step: for Llama-3.2-1B, minutes per step on two cores. The file is written one weight at a time
    and its pages are file-backed, so the process owns no rounded copy of the model.

    Args:
      model: the user's model (parameters on the meta device); checkpoint_model: its copy with the
        checkpoint's tensors; lowered: the weight-only entry point (its `quantized` weights and their
        state names under the entry points' `model.` prefix); scheme: the weight-only scheme;
      scratch: the conversion's scratch directory; clock: times the pass.
    Returns:
      The copy, ready for generate().
    """
    import jax

    from tpuexport.arrays import numpy_dtype
    from tpuexport.quantize.weight_only import fake_quantized, scheme_for

    # The entry points hold the causal LM as `model` (export/generation.py), so their state names carry that prefix.
    axes = {part.removeprefix("model."): axis for part, axis in lowered.quantized_state_axes.items()}
    state = {**dict(checkpoint_model.named_parameters()), **dict(checkpoint_model.named_buffers())}  # one name per tensor (tied once)
    names = [name for name in state if name in axes]
    path = scratch / "dequantized.safetensors"
    with clock.stage("dequantize", lambda: f"{len(names)} weight(s) rounded and dequantized once for generate(), "
                                           f"{written / 2**30:.2f} GiB memory-mapped"):
        specs = [jax.ShapeDtypeStruct(tuple(state[name].shape), numpy_dtype(str(state[name].dtype).removeprefix("torch."))) for name in names]
        written = artifact_stage.write_weights(path, names, specs, lambda name: [fake_quantized(state[name], scheme_for(scheme, state[name].shape, axes[name]), axes[name])])
        dequantized = export_stage.open_checkpoint(path)
        tensors = {name: dequantized[name] if name in axes else tensor for name, tensor in state.items()}
        reference = export_stage.with_checkpoint_weights(model, export_stage.Checkpoint(tensors, "the dequantized weights"))
    return reference


def _generation_quantization(lowered: lower_stage.LoweredProgram, scheme) -> tuple:
    """The manifest's quantization section of a weight-only generation artifact (which weights, how,
    bytes vs f32; its outputs are compared with generate() by verification, not by SQNR)."""
    if scheme is None:
        return ()
    from tpuexport.verify.quantization_report import weight_only_section

    return (lambda staging: {"quantization": weight_only_section(lowered, scheme)},)


def _quantize_entry_points(captured: dict, spec: export_stage.GenerationSpec, options: ConversionOptions, clock: StageClock) -> dict:
    """The quantize pass of a text-generation conversion: every entry point quantized with PT2E,
    calibrated as it is driven, one set of weights (quantize/generation.py)."""
    from tpuexport.quantize.generation import quantize_entry_points

    with clock.stage("quantize", lambda: "; ".join(f"{name} {result.describe()}" for name, result in quantized.items())):
        quantized = quantize_entry_points(captured, spec, options.quantize, options.calibration, options.calibration_file,
                                          options.random_calibration)
    return quantized


def _generation_int8_report(quantized: dict | None, program: lower_stage.GenerationProgram, compiled: dict, report,
                            clock: StageClock) -> tuple:
    """The writer of an int8 generation artifact's quantization report (SQNR per entry point and of
    the verified logits against the float model, the integer share of each entry point's first
    TPU executable's matmul FLOPs); none without PT2E quantization."""
    if not quantized:
        return ()
    from tpuexport.verify import quantization_report

    def write(staging: pathlib.Path) -> dict:
        with clock.stage("quantization report", lambda: quantization_report.describe_report(content)):
            matmuls = {name: quantization_report.CompiledMatmuls(result.results[0].target.name, result.results[0].bucket.name,
                                                                 result.results[0].matmul_flops)
                       for name, result in compiled.items()}
            content = quantization_report.generation_report(quantized, program, matmuls, report.float_comparison)
        return quantization_report.report_writer(content)(staging)

    return (write,)


def _describe_window_cache(spec: export_stage.GenerationSpec) -> str:
    """The window-bounded cache in the export stage's line ('' for a max-context cache)."""
    if spec.window_layers:
        return (f"+ window cache {list(spec.window_cache_shape)} (rings of sliding window {spec.cache_window}, layers "
                f"{','.join(map(str, spec.window_layers))}) ")
    return f"(a ring: sliding window {spec.cache_window}) " if spec.cache_window else ""


def _plan_generation_slices(request: compile_stage.ShardingRequest, slices: list, spec: export_stage.GenerationSpec,
                            lowered: lower_stage.LoweredProgram, buckets: list, clock: StageClock, entry_point: str) -> dict:
    """Each slice target's plan for one entry point, the KV cache laid out by the preset: its
    kv-heads axis on the model axis (tensor-parallel), its batch axis on the data axis
    (data-parallel, fsdp, or a tensor-parallel mesh with a data axis). The user's --shard-input
    rules come after these, so they win.

    Returns:
      {slice target name: ShardingPlan}.
    """
    plans = {}
    for target in slices:
        axes = dict(compile_stage.resolve_mesh(request, target))
        cache_spec = [None] * len(spec.cache_shape)
        if request.preset in ("tensor-parallel",) and "model" in axes:
            cache_spec[2 if spec.layout == "layer_batch_head_pos" else 3] = "model"
        if "data" in axes and request.preset in ("data-parallel", "fsdp", "tensor-parallel"):
            cache_spec[1] = "data"
        # An int8 cache's scales ([layers, batch, kv_heads, context]) split alike: heads on axis 2, batch on 1.
        scale_spec = [None, cache_spec[1], cache_spec[2 if spec.layout == "layer_batch_head_pos" else 3], None]
        # The sliding layers' rings (a model mixing full and sliding layers) split as the cache does.
        caches = export_stage.CACHE_INPUTS + export_stage.WINDOW_CACHE_INPUTS
        rules = (tuple((name, tuple(cache_spec)) for name in spec.cache_inputs if name in caches)
                 + tuple((name, tuple(scale_spec)) for name in spec.cache_inputs if name not in caches))
        entry_request = dataclasses.replace(request, input_rules=rules + request.input_rules)
        with clock.stage(f"plan {target.name} {entry_point}", lambda: _describe_plan(plans[target.name])):
            plans[target.name] = compile_stage.plan_sharding(entry_request, target, lowered.weight_names, lowered.weight_specs,
                                                             lowered.signature, buckets, lowered.stacked, lowered.weight_layouts)
    return plans


def _describe_generation(report, first_entry_point: str = "prefill") -> str:
    worst = report.worst_errors()
    reference = ("the PT2E entry points" if isinstance(report, verify_stage.QuantizedGenerationReport)
                 else "the eager int8-KV entry points" if report.against == verify_stage.INT8_KV_AGAINST else "generate()")
    described = (f"{len(report.cases)} {first_entry_point} bucket(s) + decode, {report.tokens_compared()} tokens compared with {reference}, "
                 f"{'passed' if report.passed else 'FAILED'} ({report.ties()} tie(s)); worst logits relative RMS error {worst['tpu']:.1e} "
                 f"as the TPU computes, {worst['cpu']:.1e} in f32")
    if isinstance(report, verify_stage.QuantizedGenerationReport) or report.float_divergence() is None:
        return described
    divergence = report.float_divergence()
    first = divergence["first"]
    sqnr = "identical" if divergence["sqnr_db"] is None else f"{divergence['sqnr_db']:.1f} dB"
    return (described + "; vs the float model: " + ("same greedy tokens" if first is None else f"first differs at step {first['step']}")
            + f", logits SQNR {sqnr}")
