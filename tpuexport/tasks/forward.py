"""The forward task: a model's forward as the one entry point "serving_default", verified against
eager PyTorch at several sizes of every dim (and, on slices, partitioned on N CPU devices; a padded
bucket as a server pads it), served by TF Serving from the SavedModel written beside it.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import TYPE_CHECKING, Callable

import torch

from tpuexport import export as export_stage
from tpuexport import lower as lower_stage
from tpuexport import verify as verify_stage
from tpuexport.artifact import tf_serving as serving_stage
from tpuexport.errors import TpuExportError, VerificationError
from tpuexport.lower.program import DEFAULT_ENTRY_POINT
from tpuexport.verify.verification import compare_case
from tpuexport.tasks.conversion import (META_WEIGHTS_ERROR, PT2E_CHECKPOINT_ERROR, Conversion, ConversionOptions, StageClock, lower_entry_point,
                                        verification_failure, verification_tolerances, weight_only_scheme,
                                        write_failed_report)
from tpuexport.tasks.spec import EntryPointSpec, ProgramSpec, Task, Verified

if TYPE_CHECKING:  # torchao loads only for quantized conversions
    from tpuexport.quantize import QuantizedModel
    from tpuexport.quantize.weight_only import WeightOnlyScheme


@dataclasses.dataclass(frozen=True)
class LoweredForward:
    """A forward program after its quantize and lower passes, with what verification compares it with.

    Attributes:
      captured: the captured model the program comes from (the quantize pass's for PT2E modes);
        its `reference` is what verification compares with: the eager model, the PT2E model, or
        for weight-only modes the float model with its quantized weights dequantized.
      float_reference: the float eager model (weight-only reports measure their distance from it).
      quantized: the quantize pass's QuantizedModel (PT2E modes), or None.
      weight_only: the weight-only scheme (quantize/weight_only.py), or None.
      lowered: the lowered program.
    """

    captured: export_stage.CapturedModel
    float_reference: Callable
    quantized: QuantizedModel | None
    weight_only: WeightOnlyScheme | None
    lowered: lower_stage.LoweredProgram


class ForwardTask(Task):
    name = "forward"
    saved_model = True
    offers_against = True

    def check(self, conversion: Conversion) -> None:
        options, loaded = conversion.options, conversion.loaded
        if options.max_context is not None or options.max_batch != 1:
            raise TpuExportError("--max-context / --max-batch apply to --task text-generation only; add --task text-generation or drop them")
        if options.kv_cache_dtype != "model":
            raise TpuExportError(f"--kv-cache-dtype {options.kv_cache_dtype} applies to --task text-generation only (a forward program has "
                                 "no KV cache); add --task text-generation or drop it")
        if isinstance(loaded.model, torch.nn.Module) and loaded.args is None:
            raise TpuExportError("the source gives a model without example inputs; return (model, args) from the factory, "
                                 "or convert a causal LM with --task text-generation")
        if not conversion.plan_only and loaded.checkpoint is None and export_stage.weights_on_meta(loaded.model):
            raise TpuExportError(f"{META_WEIGHTS_ERROR} (tpuexport.plan or convert(weights=False) in Python)")
        if not conversion.plan_only and loaded.checkpoint is not None and options.pt2e:
            raise TpuExportError(PT2E_CHECKPOINT_ERROR)

    def specify(self, conversion: Conversion) -> ProgramSpec:
        loaded = conversion.loaded
        if conversion.plan_only:  # the weights, if any, are never read
            loaded = export_stage.on_meta_device(dataclasses.replace(loaded, checkpoint=None))
        return ProgramSpec({DEFAULT_ENTRY_POINT: EntryPointSpec(loaded, conversion.options.buckets)},
                           lambda lowered: lower_stage.Program(lowered), conversion.options.scan)

    def check_captured(self, conversion: Conversion) -> None:
        verify_stage.resolve_requested_sizes(conversion.captured[DEFAULT_ENTRY_POINT].signature, conversion.options.verify_sizes)

    def quantize(self, conversion: Conversion) -> dict:
        return {DEFAULT_ENTRY_POINT: pt2e_quantize(conversion.captured[DEFAULT_ENTRY_POINT], conversion.options, conversion.clock)}

    def verify(self, conversion: Conversion) -> Verified:
        """Eager at sizes, then each distinct slice plan on N CPU devices, then one padded bucket."""
        options, clock = conversion.options, conversion.clock
        lowered = conversion.program.entry_points[DEFAULT_ENTRY_POINT]
        captured = conversion.captured[DEFAULT_ENTRY_POINT]
        quantized = (conversion.quantized or {}).get(DEFAULT_ENTRY_POINT)
        forward = _with_reference(captured, quantized, conversion.weight_only, lowered)
        requested = verify_stage.resolve_requested_sizes(captured.signature, options.verify_sizes)
        with clock.stage("verify", lambda: describe_verification(report)):
            report = verify_forward(forward, options, requested, conversion.run_memory)
        if not report.passed:
            raise verification_failure(report, options.out, forward.captured.reference, lambda: captured.example_inputs)
        buckets, plans = conversion.buckets[DEFAULT_ENTRY_POINT], conversion.plans.get(DEFAULT_ENTRY_POINT, {})
        sharded = []
        for plan, names in _distinct_plans(plans):
            with clock.stage(f"verify sharded {plan.mesh_text}", lambda: sharded[-1].describe()):
                sharded.append(verify_stage.verify_sharded(lowered, plan, names, report, forward.captured.reference,
                                                           captured.example_inputs, buckets))
            if not sharded[-1].passed:
                failed = {**report.to_json(), "sharded": [result.to_json() for result in sharded]}
                raise VerificationError(report, write_failed_report(options.out, failed), sharded[-1].failure_summary())
        # A server pads requests to the next bucket: run one padded bucket against eager on the real rows.
        with clock.stage("verify padding", lambda: padding.describe() if padding else "no bucket is padded"):
            padding = verify_stage.verify_padding(lowered, forward.captured.reference, captured.example_inputs, buckets, report.tolerances,
                                                  conversion.run_memory)
        policy = verify_stage.padding_policy(lowered.signature, None if padding is None else padding.passed)
        return Verified(report, tuple(sharded), {DEFAULT_ENTRY_POINT: policy}, self._writers(conversion, forward, report, padding))

    def replay_golden(self, artifact, tolerances) -> verify_stage.VerificationReport:
        """Every stored size run TPU-faithfully and in plain f32 against the stored eager outputs."""
        labels = [case["label"] for case in artifact.manifest["verification"]["cases"] if case["golden"]]
        runs = verify_stage.ProgramRuns(artifact.program)
        cases = []
        for label, (sizes, inputs, expected) in zip(labels, artifact.golden_cases()):
            case = compare_case(runs, inputs, expected, verify_stage.PlannedCase(label, sizes, "stored", 0.0), tolerances)
            cases.append(dataclasses.replace(case, golden=case.error is None))
        return verify_stage.VerificationReport(artifact.records.precision, artifact.records.matmul_precision, tolerances, tuple(cases), {},
                                               "stored eager outputs")

    def describe_golden(self, report) -> str:
        return f"{len(report.cases)} stored size(s) match ({'; '.join(case.describe_sizes() for case in report.cases)})"

    def _writers(self, conversion: Conversion, forward: LoweredForward, report, padding) -> tuple:
        """The SavedModel, the quantization report of a PT2E or weight-only program, the padding check."""
        writers = ()
        if conversion.saved_model is not None:
            options = conversion.options
            writers += (serving_stage.TfServingExport(
                forward.lowered, report, conversion.buckets[DEFAULT_ENTRY_POINT], model_name(options), options.model_version, options.out,
                conversion.saved_model, conversion.scratch, buckets_compiled=conversion.compiled, on_step=conversion.clock.event),)
        if forward.quantized is not None:
            writers += (_quantization_report(forward.quantized, forward.lowered, conversion),)
        if forward.weight_only is not None:
            writers += (_weight_only_report(forward, conversion.clock),)
        if padding:
            writers += (lambda staging: {"padding": padding.to_json()},)
        return writers


def model_name(options: ConversionOptions) -> str:
    """TF Serving's model name for the artifact: --name, else the artifact directory's stem (checked)."""
    return serving_stage.check_model_name(options.model_name or serving_stage.default_model_name(options.out))


def pt2e_quantize(captured: export_stage.CapturedModel, options: ConversionOptions, clock: StageClock):
    """The PT2E quantize pass of one captured model (imported here: torchao loads only for quantized conversions)."""
    from tpuexport import quantize as quantize_stage

    with clock.stage("quantize", lambda: quantized.describe()):
        quantized = quantize_stage.quantize(captured, options.quantize, options.calibration, options.calibration_file,
                                            options.random_calibration)
    return quantized


def lower_forward(captured: export_stage.CapturedModel, options: ConversionOptions, clock: StageClock | None = None) -> LoweredForward:
    """The quantize and lower passes of a forward model held in memory, with the reference verification
    compares the program with: what the fuzz harness (benchmarks/fuzz_models.py) checks without
    compiling or writing anything.

    Raises:
      TpuExportError: bad quantize options or calibration, an unsupported operator, a failed lowering.
    """
    clock = clock or StageClock(None)
    weight_only = weight_only_scheme(options)
    quantized = pt2e_quantize(captured, options, clock) if options.pt2e else None
    captured = quantized.captured if quantized else captured
    lowered = lower_entry_point(captured, options, weight_only)
    return _with_reference(captured, quantized, weight_only, lowered)


def _with_reference(captured: export_stage.CapturedModel, quantized, weight_only, lowered: lower_stage.LoweredProgram) -> LoweredForward:
    """The LoweredForward of a lowered program: a weight-only program is compared with the float model
    whose quantized weights are rounded and dequantized as it runs (quantize/weight_only.py)."""
    float_reference = captured.reference
    if weight_only is not None:
        from tpuexport.quantize.weight_only import DequantizedReference

        captured = dataclasses.replace(captured, reference=DequantizedReference(captured.reference, lowered.quantized_state_axes, weight_only))
    return LoweredForward(captured, float_reference, quantized, weight_only, lowered)


def verify_forward(forward: LoweredForward, options: ConversionOptions, requested_sizes: tuple[dict[str, int], ...] = (),
                   memory: verify_stage.RunMemory = verify_stage.RunMemory()) -> verify_stage.VerificationReport:
    """The program's CPU runs at the planned sizes against its reference, within the tolerances of its
    precision and quantization (and the options' overrides); PT2E programs are also checked op by op.

    Args:
      forward: the program and its reference (`lower_forward`; its program has its weights).
      options: the conversion's options (matmul precision, tolerance overrides, budget).
      requested_sizes: sizes that must be verified, resolved (verify.resolve_requested_sizes).
      memory: what an optional run may hold (verify.run_memory of the conversion's memory budget).
    Returns:
      The VerificationReport, passed or not (its `tolerances` are the ones applied).
    """
    quantized = forward.quantized is not None
    tolerances = verification_tolerances(forward.lowered, options, quantized)
    report = verify_stage.verify(forward.lowered, forward.captured.reference, forward.captured.example_inputs, tolerances,
                                 options.verify_budget_flops, requested_sizes, check_op_by_op=quantized, memory=memory)
    if quantized:
        report = dataclasses.replace(report, against="the PT2E-converted model, eager PyTorch")
    if forward.weight_only is not None:
        report = dataclasses.replace(report, against="the model with its quantized weights dequantized, eager PyTorch")
    return report


def describe_verification(report: verify_stage.VerificationReport) -> str:
    worst = report.worst_errors()
    return (f"{len(report.cases)} size(s), {'passed' if report.passed else 'FAILED'}; worst relative RMS error "
            f"{worst['tpu']:.1e} as the TPU computes (matmul precision {report.matmul_precision}), {worst['cpu']:.1e} in f32")


def _distinct_plans(plans: dict) -> list[tuple]:
    """Each distinct plan once, with the targets that use it (two slices of one size share a plan)."""
    grouped: dict = {}
    for name, plan in plans.items():
        grouped.setdefault(plan, []).append(name)
    return [(plan, tuple(names)) for plan, names in grouped.items()]


def _weight_only_report(forward: LoweredForward, clock: StageClock):
    """The writer that measures a weight-only program's SQNR against the float model and puts the
    manifest's quantization section (which weights, how) in the artifact."""
    from tpuexport.verify.quantization_report import weight_only_section

    def write(staging: pathlib.Path) -> dict:
        with clock.stage("quantization report", lambda: _describe_weight_only(section)):
            section = weight_only_section(forward.lowered, forward.weight_only, forward.float_reference, forward.captured.example_inputs)
        return {"quantization": section}

    return write


def _describe_weight_only(section: dict) -> str:
    outputs = ", ".join(f"{o['name']} {o['sqnr_db']:.1f} dB" if o["sqnr_db"] is not None else f"{o['name']} exact"
                        for o in section["outputs"])
    return (f"{section['mode']}: {len(section['weights'])} weight(s) quantized; SQNR vs float: {outputs}; "
            f"weights {section['weight_bytes']['ratio']}x f32" + "".join(f"; WARNING: {warning}" for warning in section["warnings"]))


def _quantization_report(quantized, lowered: lower_stage.LoweredProgram, conversion: Conversion):
    """The writer that measures SQNR against the float model and the integer share of the first
    TPU executable's matmul FLOPs, and puts the report in the artifact."""
    from tpuexport.verify import quantization_report

    def write(staging: pathlib.Path) -> dict:
        executable = conversion.compiled()[DEFAULT_ENTRY_POINT].results[0]
        with conversion.clock.stage("quantization report", lambda: quantization_report.describe_report(report)):
            matmuls = quantization_report.CompiledMatmuls(executable.target.name, executable.bucket.name, executable.matmul_flops)
            report = quantization_report.build_report(quantized, lowered, matmuls)
        return quantization_report.report_writer(report)(staging)

    return write
