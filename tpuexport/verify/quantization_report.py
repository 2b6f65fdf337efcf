"""The quantization report: SQNR of the quantized model against the float model, per output and
per quantized layer, written into the artifact as quantization/report.json and a PNG bar chart.

SQNR (dB) = 10 * log10(sum(float^2) / sum((float - quantized)^2)) over all elements of all
evaluation samples (the example inputs and up to 4 calibration samples); higher is better, null
when the two are identical. A layer's SQNR compares its output in the float model (batch norms
folded, as PT2E sees it) with its output in the PT2E-converted model, so it includes the error
accumulated by the layers before it.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pathlib
from typing import Callable

import numpy as np
import torch
from torch.utils import _pytree as pytree

from tpuexport.lower import LoweredProgram
from tpuexport.quantize.quantization import QuantizedModel
from tpuexport.verify.compare import sqnr_db
from tpuexport.verify.verification import eager_outputs, to_numpy

REPORT = "quantization/report.json"
CHART = "quantization/layer_sqnr.png"
INTEGER_TYPES = "s8xs8->s32"
# An output whose SQNR against the float model is below this (dB) is warned about, verified or not:
# quantization visibly changed what the model computes (about 18% RMS error at 15 dB).
LOW_SQNR_DB = 15.0
PT2E_FLOAT_FIX = ("PT2E quantizes every supported layer (no option keeps some float): use --quantize int8-weight-only with "
                  "--keep-float REGEX for the layers it depends on, or convert without --quantize")
INT8_KV_FIX = "keep the KV cache in the model's dtype (convert without --kv-cache-dtype int8)"
# Operators that multiply matrices; those the quantizer left float are listed in the report.
_MATMUL_LIKE = {"linear", "addmm", "mm", "bmm", "matmul", "baddbmm", "einsum", "conv1d", "conv2d", "conv3d",
                "conv_transpose1d", "conv_transpose2d", "convolution"}


@dataclasses.dataclass(frozen=True)
class CompiledMatmuls:
    """What one compiled TPU executable multiplies, as the compile stage read it from its HLO.

    Attributes:
      target: the TPU target name.
      bucket: the bucket name (its dim sizes).
      flops_by_types: matmul/convolution FLOPs per "<lhs>x<rhs>-><result>" element types.
    """

    target: str
    bucket: str
    flops_by_types: dict[str, int]

    def integer_fraction(self) -> float | None:
        total = sum(self.flops_by_types.values())
        return self.flops_by_types.get(INTEGER_TYPES, 0) / total if total else None


def build_report(quantized: QuantizedModel, lowered: LoweredProgram, compiled: CompiledMatmuls) -> dict:
    """The report.json content.

    Args:
      quantized: the quantize pass's result.
      lowered: the lowered quantized program (its CPU run is the artifact's output).
      compiled: the matmul FLOPs of one compiled TPU executable of it.
    Returns:
      A JSON-ready dict.
    """
    samples = quantized.evaluation_samples
    nodes = [layer.node for layer in quantized.layers]
    float_values, _ = _run_recording(quantized.float_layers, samples, nodes)
    quantized_values, pt2e_outputs = _run_recording(quantized.converted, samples, nodes)
    float_outputs = [eager_outputs(quantized.float_model, sample) for sample in samples]
    artifact_outputs = [lowered.run([to_numpy(t) for t in sample]) for sample in samples]
    outputs = []
    for index, spec in enumerate(lowered.signature.outputs):
        if not np.issubdtype(float_outputs[0][index].dtype, np.floating):
            continue
        reference = [outs[index] for outs in float_outputs]
        outputs.append({
            "name": spec.name,
            "sqnr_db": sqnr_db(reference, [outs[index] for outs in artifact_outputs]),
            "pt2e_sqnr_db": sqnr_db(reference, [outs[index] for outs in pt2e_outputs]),
        })
    weight_bytes, float_weight_bytes = int(sum(w.nbytes for w in lowered.weights)), quantized.float_weight_bytes
    return {
        "mode": quantized.mode,
        "scheme": _SCHEMES[quantized.mode],
        "calibration": {"source": quantized.calibration_source, "samples": quantized.calibration_samples},
        "warnings": [*quantized.warnings, *low_sqnr_warnings(outputs, PT2E_FLOAT_FIX)],
        "evaluation_samples": len(samples),
        "sqnr_rule": sqnr_rule("all evaluation samples"),
        "outputs": outputs,
        "layers": [
            {"node": layer.node, "module": layer.module, "op": layer.op, "integer": layer.integer,
             "sqnr_db": sqnr_db(float_values[layer.node], quantized_values[layer.node])}
            for layer in quantized.layers
        ],
        "weight_bytes": {"quantized": weight_bytes, "float": float_weight_bytes,
                         "ratio": round(weight_bytes / float_weight_bytes, 4) if float_weight_bytes else None},
        "integer_flops": {
            "rule": "share of the compiled TPU executable's dot/convolution FLOPs whose operands are s8 x s8 with s32 results",
            "target": compiled.target,
            "bucket": compiled.bucket,
            "fraction": None if compiled.integer_fraction() is None else round(compiled.integer_fraction(), 4),
            "flops_by_types": compiled.flops_by_types,
            "float_ops": [
                {"node": layer.node, "module": layer.module, "op": layer.op, "why": "int8 weights, float compute"}
                for layer in quantized.layers if not layer.integer
            ] + _unquantized_matmuls(quantized.converted),
        },
    }


def generation_report(quantized: dict[str, QuantizedModel], program, compiled: dict[str, CompiledMatmuls], float_comparison: dict) -> dict:
    """The report.json content of an int8 text-generation artifact: one forward-style report per
    entry point (on its calibration/evaluation samples: prefill over prompts, decode over filled
    caches), and at the top the teacher-forced logits over the verified tokens against the float
    model (verify/quantized_generation.py), which is what `outputs` holds.

    Args:
      quantized: {entry point: QuantizedModel}.
      program: the lowered GenerationProgram (its entry points share one set of weights).
      compiled: {entry point: the matmul FLOPs of one of its compiled TPU executables}.
      float_comparison: QuantizedGenerationReport.float_comparison.
    Returns:
      A JSON-ready dict with the keys of `build_report` (decode's or the step's layers, weights and
      integer FLOPs at the top) plus "entry_points" and "first_divergence".
    """
    entry_points = {name: build_report(quantized[name], program.entry_points[name], compiled[name]) for name in quantized}
    last = list(quantized)[-1]  # decode (prefill's weights are the same), or a paged program's step
    main = entry_points[last]
    # A paged step measures the TPU-faithful run's logits only (verify/paged_generation.py).
    outputs = [{"name": "logits", **float_comparison["logits"]}]
    return {
        **main,
        # The entry points' own warnings (calibration) and the verified logits', not the entry points' per-sample outputs'.
        "warnings": [*quantized[last].warnings, *low_sqnr_warnings(outputs, PT2E_FLOAT_FIX)],
        "evaluation_samples": "teacher-forced logits of every verified generation step (verification's cases)",
        "sqnr_rule": float_comparison["rule"],
        "outputs": outputs,
        "first_divergence": float_comparison["first_divergence"],
        "integer_flops": {**main["integer_flops"], "by_entry_point": {name: report["integer_flops"]["fraction"]
                                                                         for name, report in entry_points.items()}},
        "entry_points": entry_points,
    }


def _unquantized_matmuls(converted: torch.fx.GraphModule) -> list[dict]:
    """Matrix-multiplying ops of the converted graph that read no dequantized input (left float)."""
    found = []
    for node in converted.graph.nodes:
        if node.op != "call_function" or not hasattr(node.target, "overloadpacket"):
            continue
        op = node.target.overloadpacket.__name__
        if op not in _MATMUL_LIKE or any(_is_dequantize(a) for a in node.args):
            continue
        stack = node.meta.get("nn_module_stack") or {}
        found.append({"node": node.name, "module": list(stack.values())[-1][0] if stack else "", "op": op,
                      "why": "not quantized (an operator or operand pattern the quantizer does not annotate)"})
    return found


def _is_dequantize(argument) -> bool:
    return isinstance(argument, torch.fx.Node) and "dequantize" in str(argument.target)


_SCHEMES = {
    "int8": "int8 symmetric per-output-channel weights, int8 symmetric per-tensor activations with calibrated "
            "scales; int8 x int8 -> int32 dot/convolution, rescaled to float",
    "int8-dynamic": "int8 symmetric per-output-channel weights, int8 symmetric per-tensor activations with scales "
                    "computed from each call's values; int8 x int8 -> int32 dot/convolution, rescaled to float",
    "int8-weight-only": "int8 symmetric per-output-channel weights dequantized on the fly; float compute",
}


def _run_recording(
    module: torch.fx.GraphModule, samples, names: list[str],
) -> tuple[dict[str, list[np.ndarray]], list[list[np.ndarray]]]:
    """Runs `module` on every sample, recording the named nodes' outputs on the way.

    Returns:
      ({node name: its output per sample}, the module's flat outputs per sample as verify's
      eager_outputs gives them).
    """
    recorded: dict[str, list[np.ndarray]] = {name: [] for name in names}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            result = super().run_node(node)
            if node.name in recorded:
                recorded[node.name].append(result.detach().float().numpy())
            return result

    with torch.no_grad():
        outputs = [[to_numpy(t) for t in pytree.tree_leaves(Recorder(module).run(*sample))] for sample in samples]
    return recorded, outputs


def describe_report(report: dict) -> str:
    """One line for the progress output: output SQNRs, the worst layer, the weight size ratio."""
    outputs = ", ".join(f"{o['name']} {_db(o['sqnr_db'])}" for o in report["outputs"])
    layers = [layer["sqnr_db"] for layer in report["layers"] if layer["sqnr_db"] is not None]
    worst = f"; worst layer {min(layers):.1f} dB" if layers else ""
    integer = report["integer_flops"]["fraction"]
    share = f"; {integer:.0%} of TPU matmul FLOPs in int8" if integer is not None else ""
    text = f"SQNR vs float: {outputs}{worst}; weights {report['weight_bytes']['ratio']}x float{share}"
    return text + "".join(f"; WARNING: {warning}" for warning in report["warnings"])


def _db(value: float | None) -> str:
    return "exact" if value is None else f"{value:.1f} dB"


def chart_png(report: dict) -> bytes:
    """A horizontal bar chart of per-layer SQNR (dB), as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render to a buffer
    from matplotlib import pyplot

    layers = report["layers"]
    labels = [f"{layer['module'] or layer['node']} ({layer['op']})" for layer in layers]
    values = [layer["sqnr_db"] if layer["sqnr_db"] is not None else 0.0 for layer in layers]
    figure, axes = pyplot.subplots(figsize=(8, 1.2 + 0.35 * max(len(layers), 1)))
    axes.barh(range(len(layers)), values, color=["tab:blue" if layer["integer"] else "tab:orange" for layer in layers])
    axes.set_yticks(range(len(layers)), labels, fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel("SQNR vs float (dB, higher is better)")
    axes.set_title(f"{report['mode']}: per-layer SQNR (blue: integer op, orange: int8 weights, float compute)", fontsize=9)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    pyplot.close(figure)
    return buffer.getvalue()


def report_writer(report: dict) -> Callable[[pathlib.Path], dict]:
    """An `extra_writers` entry for write_artifact: writes the report and chart, returns the manifest section."""

    def write(staging: pathlib.Path) -> dict:
        (staging / REPORT).parent.mkdir(parents=True, exist_ok=True)
        (staging / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        (staging / CHART).write_bytes(chart_png(report))
        return {"quantization": {
            "mode": report["mode"], "report": REPORT, "chart": CHART, "warnings": report["warnings"],
            "outputs": report["outputs"], "integer_flops_fraction": report["integer_flops"]["fraction"],
        }}

    return write


def weight_only_section(lowered: LoweredProgram, scheme, float_reference=None, example_inputs=(), measured_outputs=(),
                        fix: str | None = None) -> dict:
    """The manifest's `quantization` section of a weight-only program (no PT2E, no report file).

    Args:
      lowered: the lowered weight-only program (with its weights).
      scheme: its quantize.weight_only.WeightOnlyScheme.
      float_reference: the float model, run eagerly; None for no SQNR (outputs empty).
      example_inputs: the inputs SQNR is measured on.
      measured_outputs: outputs' SQNR measured already, [{"name", "sqnr_db"}] (a generation program's
        logits against the float model's generate(), from verification).
      fix: what a low-SQNR warning advises (None: weight_only_fix; a generation program with an int8
        KV cache too names both, generation_fix).
    Returns:
      {"mode", "scheme", "group_size", "packing", "weights": {name: entry}, "outputs": [{"name",
      "sqnr_db"}], "weight_bytes": {"quantized", "f32", "ratio"}, "warnings"}; SQNR of the artifact's
      CPU run against the float model (report rule as for PT2E).
    """
    outputs = list(measured_outputs)
    if float_reference is not None:
        artifact_outputs = lowered.run([to_numpy(t) for t in example_inputs])
        float_outputs = eager_outputs(float_reference, example_inputs)
        outputs = [{"name": spec.name, "sqnr_db": sqnr_db([expected], [actual])}
                   for spec, expected, actual in zip(lowered.signature.outputs, float_outputs, artifact_outputs)
                   if np.issubdtype(expected.dtype, np.floating)]
    f32_bytes = 0
    scales = {entry["scale"] for entry in lowered.quantized.values()}
    for name, spec in zip(lowered.weight_names, lowered.weight_specs):
        if name in scales:
            continue
        shape = list(spec.shape)
        if name in lowered.quantized and lowered.quantized[name]["bits"] == 4:
            shape[-1] *= 2
        floating = name in lowered.quantized or np.issubdtype(np.dtype(spec.dtype), np.floating)
        f32_bytes += int(np.prod(shape)) * (4 if floating else np.dtype(spec.dtype).itemsize)
    return {
        "mode": scheme.mode,
        "scheme": scheme.describe(),
        "group_size": scheme.group_size if scheme.bits == 4 else None,
        "weights": dict(lowered.quantized),
        "sqnr_rule": sqnr_rule("the example inputs"),
        "outputs": outputs,
        "weight_bytes": {"quantized": lowered.weight_bytes, "f32": f32_bytes,
                         "ratio": round(lowered.weight_bytes / f32_bytes, 4) if f32_bytes else None},
        "warnings": low_sqnr_warnings(outputs, fix or weight_only_fix(scheme.bits)),
    }


def int8_kv_section(measured_outputs: list[dict]) -> dict:
    """The manifest's `quantization` section of a generation program whose only quantization is its int8
    KV cache: the logits' SQNR against the float model's generate() (from verification) and a warning
    if it is low."""
    return {"mode": "int8-kv-cache", "sqnr_rule": sqnr_rule("the verified logits"), "outputs": list(measured_outputs),
            "warnings": low_sqnr_warnings(measured_outputs, INT8_KV_FIX)}


def generation_fix(weight_only_bits: int | None, int8_kv: bool) -> str:
    """How generation logits far from the float model's get closer: undo what made them so."""
    return " or ".join(([weight_only_fix(weight_only_bits)] if weight_only_bits else []) + ([INT8_KV_FIX] if int8_kv else []))


def weight_only_fix(bits: int) -> str:
    """How a weight-only output far from float gets closer to it."""
    return ("keep the weights of the layers it depends on float with --keep-float REGEX (their state_dict names)"
            + (" or use int8-weight-only" if bits == 4 else ""))


def sqnr_rule(over: str) -> str:
    """How a section's SQNR is computed, over `over` (the report records it beside the figures)."""
    return f"10*log10(sum(float^2) / sum((float - quantized)^2)) over {over}; null if identical"


def low_sqnr_warnings(outputs: list[dict], fix: str) -> list[str]:
    """A warning per output whose SQNR against the float model is below LOW_SQNR_DB, naming the output and `fix`."""
    return [f"output {output['name']} is {output['sqnr_db']:.1f} dB from the float model (below {LOW_SQNR_DB:g} dB): {fix}"
            for output in outputs if output["sqnr_db"] is not None and output["sqnr_db"] < LOW_SQNR_DB]
