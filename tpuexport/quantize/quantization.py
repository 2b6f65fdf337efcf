"""The quantize pass: a CapturedModel becomes a quantized CapturedModel, through PT2E.

  torch.export program -> .module() -> prepare_pt2e(TpuQuantizer) -> calibrate -> convert_pt2e
  -> rewrite_integer_ops -> torch.export again, with the same named dims.

The result's `reference` (what verification compares the artifact with) is the PT2E-converted
model run eagerly; the float model is kept for the SQNR report.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import pathlib
from typing import Any, Callable, Iterable

import torch
from torch.utils import _pytree as pytree
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from tpuexport.errors import TpuExportError
from tpuexport.export import CapturedModel, describe, torch_dynamic_shapes
from tpuexport.quantize.calibration import check_samples, load_calibration_file, random_samples
from tpuexport.quantize.quantizer import MODES, QUANTIZED_OPS, TpuQuantizer
from tpuexport.quantize.rewrite import rewrite_integer_ops
from tpuexport.signature import ProgramSignature

# Calibration samples also used to measure SQNR against the float model (with the example inputs).
MAX_EVALUATION_SAMPLES = 4

RANDOM_CALIBRATION_WARNING = (
    "static int8 scales were calibrated on RANDOM inputs (--random-calibration): activation ranges do not "
    "reflect real data, so accuracy on real inputs may be much worse than reported; calibrate with real samples"
)


@dataclasses.dataclass(frozen=True)
class QuantizedLayer:
    """One op computed in int8 (or with int8 weights).

    Attributes:
      node: the op's node name in the PT2E graphs (e.g. "linear_1").
      module: the nn.Module path it came from (e.g. "layers.2"), or "" when unknown.
      op: "linear", "conv1d", "conv2d", "matmul", "bmm" or "embedding".
      integer: whether it runs as an integer dot/convolution (False: int8 weights, float compute).
    """

    node: str
    module: str
    op: str
    integer: bool


@dataclasses.dataclass(frozen=True)
class QuantizedModel:
    """The quantize pass's result.

    Attributes:
      captured: the quantized program as a CapturedModel; its reference is the PT2E-converted model.
      mode: "int8", "int8-dynamic" or "int8-weight-only".
      float_model: the float model (eager), for the output SQNR.
      float_layers: the prepared (float, batch norms folded) graph module, for per-layer SQNR.
      converted: the PT2E-converted graph module.
      layers: the quantized layers, in graph order.
      calibration_source: "file", "api", "factory", "random" or "none".
      calibration_samples: number of calibration samples used.
      evaluation_samples: input tuples the SQNR figures are measured on.
      float_weight_bytes: bytes of the float program's weights (64-bit values counted as 32-bit, as
        lowering stores them), for the size ratio.
      warnings: messages the user must see (e.g. random calibration).
    """

    captured: CapturedModel
    mode: str
    float_model: Callable[..., Any]
    float_layers: torch.fx.GraphModule
    converted: torch.fx.GraphModule
    layers: tuple[QuantizedLayer, ...]
    calibration_source: str
    calibration_samples: int
    evaluation_samples: tuple[tuple[torch.Tensor, ...], ...]
    float_weight_bytes: int
    warnings: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for the progress output."""
        integer = sum(layer.integer for layer in self.layers)
        text = (f"{self.mode}: {len(self.layers)} layer(s), {integer} integer; calibration {self.calibration_source}"
                f" ({self.calibration_samples} sample(s))")
        return text + "".join(f"; WARNING: {warning}" for warning in self.warnings)


def quantize(
    captured: CapturedModel,
    mode: str,
    calibration: Iterable | None = None,
    calibration_file: pathlib.Path | None = None,
    random_calibration: bool = False,
) -> QuantizedModel:
    """Quantizes a captured model with PT2E and tpuexport's TPU quantizer.

    Args:
      captured: the export stage's result (float).
      mode: one of MODES.
      calibration: samples given to the API (tuples of inputs), or None.
      calibration_file: a .npz / .safetensors file (see calibration.py), or None; wins over the others.
      random_calibration: calibrate static int8 on random inputs when no samples are given.
    Returns:
      The QuantizedModel.
    Raises:
      TpuExportError: unknown mode, missing or bad calibration data, or re-export failed.
    """
    if mode not in MODES:
        raise TpuExportError(f"unknown quantization {mode!r}; use one of {', '.join(MODES)}")
    samples, source = _calibration_samples(captured, mode, calibration, calibration_file, random_calibration)
    program = captured.program if mode == "int8-weight-only" else attention_as_matmuls(captured.program)
    module = program.module()
    prepared = prepare_pt2e(module, TpuQuantizer(mode))
    with torch.no_grad():
        for sample in samples or [captured.example_inputs]:  # dynamic / weight-only modes observe weights only
            prepared(*sample)
    float_layers = copy.deepcopy(prepared)
    converted = convert_pt2e(prepared)
    integer_module = copy.deepcopy(converted)
    integer_nodes = set(rewrite_integer_ops(integer_module))
    program = _reexport(integer_module, captured)
    names = tuple(spec.name for spec in captured.signature.inputs)
    signature = describe(program, captured.example_inputs, names, {spec.name: spec.placeholders for spec in captured.signature.inputs})
    _check_same_interface(captured.signature, signature)
    quantized = dataclasses.replace(captured, program=program, reference=converted, signature=signature)
    evaluation = (tuple(captured.example_inputs), *[tuple(s) for s in samples[:MAX_EVALUATION_SAMPLES]])
    warnings = (RANDOM_CALIBRATION_WARNING,) if source == "random" else ()
    return QuantizedModel(
        quantized, mode, captured.reference, float_layers, converted, _quantized_layers(converted, integer_nodes),
        source, len(samples), evaluation, _weight_bytes(captured.program), warnings,
    )


def attention_as_matmuls(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Rewrites every scaled_dot_product_attention into its math: two matmuls around a softmax.

    PT2E annotates the exported graph before decomposition, where attention is one opaque op, so
    without this Q·Kᵀ and P·V would stay float. As matmuls of two activations they are quantized
    like any other (int8 x int8 -> int32 on the TPU); masks, causality, scale and grouped-query
    heads keep torch's semantics.

    Args:
      program: the captured float program.
    Returns:
      The program with attention decomposed (other ops untouched).
    """
    return program.run_decompositions({torch.ops.aten.scaled_dot_product_attention.default: _attention_math})


def _attention_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch's scaled_dot_product_attention in eval mode (dropout is off), as matmuls and a softmax."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if enable_gqa:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], -3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], -3)
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    # A query masked from every key (a padded row) gets zeros from torch's attention, NaN from a plain softmax.
    return torch.matmul(torch.ops.aten._safe_softmax(scores, -1), value)


def _weight_bytes(program: torch.export.ExportedProgram) -> int:
    tensors = [*program.state_dict.values(), *program.constants.values()]
    return sum(t.numel() * min(t.element_size(), 4) for t in tensors if isinstance(t, torch.Tensor))


def _calibration_samples(captured, mode, calibration, calibration_file, random_calibration) -> tuple[list, str]:
    """(samples, source) for the mode; static int8 requires samples or an explicit random opt-in."""
    signature = captured.signature
    if calibration_file is not None:
        return load_calibration_file(pathlib.Path(calibration_file), signature), "file"
    if calibration is not None:
        return check_samples(calibration, signature), "api"
    if captured.calibration is not None:
        return check_samples(captured.calibration, signature), "factory"
    if mode != "int8":
        return [], "none"
    if random_calibration:
        return random_samples(signature, captured.example_inputs), "random"
    raise TpuExportError(
        "static int8 quantization needs calibration data: pass --calibration FILE (.npz/.safetensors, one array per "
        "input with samples on axis 0), calibration=[(x,), ...] in the API, or --random-calibration to accept random data"
    )


def _reexport(module: torch.fx.GraphModule, captured: CapturedModel) -> torch.export.ExportedProgram:
    """torch.export of the quantized module with the original program's example args and named dims."""
    args, _ = captured.program.example_inputs
    dynamic_shapes = pytree.tree_unflatten(torch_dynamic_shapes(captured.signature), pytree.tree_structure(args))
    try:
        with torch.no_grad():
            return torch.export.export(module, args, dynamic_shapes=dynamic_shapes)
    except Exception as error:  # torch.export raises many kinds
        message = " ".join(str(error).split())[:300]
        raise TpuExportError(f"torch.export of the quantized model failed ({type(error).__name__}: {message})") from None


def _check_same_interface(before: ProgramSignature, after: ProgramSignature) -> None:
    if (before.inputs, before.outputs, before.dims) != (after.inputs, after.outputs, after.dims):
        raise TpuExportError(
            "quantizing changed the model's signature (inputs, outputs or dims); report this with the model to tpuexport"
        )


# "linear", "conv1d", "conv2d", "matmul", "bmm", "embedding": every op the quantizer annotates.
_OP_NAMES = {operator: operator.overloadpacket.__name__ for operator in QUANTIZED_OPS}
_DEQUANTIZE_OPS = {
    torch.ops.quantized_decomposed.dequantize_per_tensor.default, torch.ops.quantized_decomposed.dequantize_per_tensor.tensor,
    torch.ops.quantized_decomposed.dequantize_per_channel.default,
}


def _quantized_layers(converted: torch.fx.GraphModule, integer_nodes: set[str]) -> tuple[QuantizedLayer, ...]:
    """The converted graph's ops that read a dequantized input, i.e. the ones PT2E quantized."""
    layers = []
    for node in converted.graph.nodes:
        if node.op != "call_function" or node.target not in _OP_NAMES:
            continue
        if not any(isinstance(a, torch.fx.Node) and a.target in _DEQUANTIZE_OPS for a in node.args):
            continue
        stack = node.meta.get("nn_module_stack") or {}
        module = list(stack.values())[-1][0] if stack else ""
        layers.append(QuantizedLayer(node.name, module, _OP_NAMES[node.target], node.name in integer_nodes))
    return tuple(layers)
