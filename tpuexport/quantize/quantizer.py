"""A PT2E `Quantizer` for TPUs: symmetric int8 (zero point 0) on the inputs of the compute ops.

Weights are int8 per output channel, activations int8 per tensor (static: scales from calibration;
dynamic: scales computed at run time from each call's values), or weights only. Outputs and biases
stay float: the TPU accumulates int8 x int8 in int32 and the rescaled result is float anyway, so
quantizing outputs would only add error before the next op requantizes them.
"""

from __future__ import annotations

import dataclasses

import torch
from torchao.quantization.pt2e import MinMaxObserver, PerChannelMinMaxObserver, PlaceholderObserver
from torchao.quantization.pt2e.quantizer import FixedQParamsQuantizationSpec, QuantizationAnnotation, QuantizationSpec, Quantizer

MODES = ("int8", "int8-dynamic", "int8-weight-only")

# Symmetric int8 uses [-127, 127], so the range is the same on both sides of zero and -x
# quantizes to -q(x); the scale is max|x| / 127.
INT8_MIN, INT8_MAX = -127, 127


@dataclasses.dataclass(frozen=True)
class QuantizedInputs:
    """Which arguments of an operator are quantized, and how.

    Attributes:
      activations: indices of the arguments quantized as activations (per tensor).
      weight: index of the argument quantized as a weight (per output channel), or None.
      weight_axis: the weight's output-channel axis (0 for linear/conv [out, in, ...], 1 for the
        [in, out] matrix of addmm, as in GPT-2's Conv1D).
    """

    activations: tuple[int, ...]
    weight: int | None = None
    weight_axis: int = 0


LINEAR_OPS = {torch.ops.aten.linear.default: QuantizedInputs((0,), 1)}
# addmm(bias, input, weight[in, out]): a linear layer written as a matrix product (GPT-2's Conv1D).
ADDMM_OPS = {torch.ops.aten.addmm.default: QuantizedInputs((1,), 2, weight_axis=1)}
# The .padding overloads take padding="valid"/"same" (EfficientNet's convolutions are all of them).
CONV_OPS = {conv: QuantizedInputs((0,), 1) for conv in (torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default,
                                                        torch.ops.aten.conv1d.padding, torch.ops.aten.conv2d.padding)}
CONV1D_OPS = (torch.ops.aten.conv1d.default, torch.ops.aten.conv1d.padding)
# Two activations multiplied, e.g. attention's Q·Kᵀ and P·V.
MATMUL_OPS = {torch.ops.aten.matmul.default: QuantizedInputs((0, 1)), torch.ops.aten.bmm.default: QuantizedInputs((0, 1))}
# Embedding tables: int8 weights only (the indices are integers); they dominate small language models.
EMBEDDING_OPS = {torch.ops.aten.embedding.default: QuantizedInputs((), 0)}
QUANTIZED_OPS = {**LINEAR_OPS, **ADDMM_OPS, **CONV_OPS, **MATMUL_OPS, **EMBEDDING_OPS}

_EPS = torch.finfo(torch.float32).eps
# Softmax results (attention's probabilities, the left operand of P·V) lie in [0, 1] whatever the
# inputs: a static scale of 1/127 covers that range, where a calibrated one covers only the largest
# probability calibration saw (a decode step at an early position, with few keys, has larger ones).
SOFTMAX_OPS = {torch.ops.aten._safe_softmax.default, torch.ops.aten.softmax.int, torch.ops.aten._softmax.default}
PROBABILITY_SPEC = FixedQParamsQuantizationSpec(dtype=torch.int8, scale=1.0 / INT8_MAX, zero_point=0, quant_min=INT8_MIN, quant_max=INT8_MAX,
                                                qscheme=torch.per_tensor_symmetric)


def conv_padding(node: torch.fx.Node, kernel: tuple[int, ...]) -> list[int] | None:
    """The per-spatial-dim padding (both sides alike) of an aten.conv1d/conv2d call, including the
    "valid" and "same" strings of the .padding overloads; None for "same" padding that would pad one
    side more than the other (an even kernel extent), which a symmetric padding cannot express.

    Args:
      node: the convolution call.
      kernel: its weight's spatial sizes.
    """
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    given = {"stride": 1, "padding": 0, "dilation": 1, **dict(zip(names, node.args)), **node.kwargs}
    spatial = 1 if node.target in CONV1D_OPS else 2
    per_dim = lambda value: [int(value)] * spatial if isinstance(value, int) else [int(v) for v in value]
    padding = given["padding"]
    if padding == "valid":
        return [0] * spatial
    if padding == "same":
        extents = [dilation * (size - 1) for dilation, size in zip(per_dim(given["dilation"]), kernel)]
        return None if any(extent % 2 for extent in extents) else [extent // 2 for extent in extents]
    return per_dim(padding)


def weight_spec(axis: int = 0) -> QuantizationSpec:
    """int8 symmetric per output channel (`axis`: 0 for linear and conv weights)."""
    return QuantizationSpec(
        dtype=torch.int8, quant_min=INT8_MIN, quant_max=INT8_MAX, qscheme=torch.per_channel_symmetric,
        ch_axis=axis, is_dynamic=False, observer_or_fake_quant_ctr=PerChannelMinMaxObserver.with_args(eps=_EPS),
    )


def activation_spec(dynamic: bool) -> QuantizationSpec:
    """int8 symmetric per tensor; `dynamic` computes the scale from each call's values."""
    observer = PlaceholderObserver if dynamic else MinMaxObserver
    return QuantizationSpec(
        dtype=torch.int8, quant_min=INT8_MIN, quant_max=INT8_MAX, qscheme=torch.per_tensor_symmetric,
        is_dynamic=dynamic, observer_or_fake_quant_ctr=observer.with_args(eps=_EPS),
    )


class TpuQuantizer(Quantizer):
    """Annotates linear, conv1d/2d (weights and input activations), matmul/bmm (both inputs) and
    embedding (the table).

    Args:
      mode: one of MODES.
    """

    def __init__(self, mode: str):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"unknown quantization mode {mode!r}")
        self.mode = mode

    def annotate(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """Marks each supported op's float tensor inputs with how they are quantized.

        Args:
          model: the graph module from torch.export(...).module().
        Returns:
          The same module, annotated in place.
        """
        for node in model.graph.nodes:
            if node.op != "call_function" or node.target not in QUANTIZED_OPS:
                continue
            if node.target in CONV_OPS and conv_padding(node, tuple(node.args[1].meta["val"].shape[2:])) is None:
                continue  # "same" padding that pads one side more: the int8 convolution pads both sides alike
            input_specs = self._input_specs(node)
            if input_specs:
                node.meta["quantization_annotation"] = QuantizationAnnotation(input_qspec_map=input_specs, _annotated=True)
        return model

    def _input_specs(self, node: torch.fx.Node) -> dict:
        quantized = QUANTIZED_OPS[node.target]
        activation = None if self.mode == "int8-weight-only" else activation_spec(self.mode == "int8-dynamic")
        specs = {}
        for index, argument in enumerate(node.args):
            if not _is_float_tensor(argument):
                continue
            if index == quantized.weight:
                specs[argument] = weight_spec(quantized.weight_axis)
            elif index in quantized.activations and activation is not None:
                static_probabilities = self.mode == "int8" and argument.op == "call_function" and argument.target in SOFTMAX_OPS
                specs[argument] = PROBABILITY_SPEC if static_probabilities else activation
        return specs

    def transform_for_annotation(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """In dynamic mode, gives every quantized consumer of an activation its own input edge.

        PT2E shares one run-time quantize between the consumers of an activation (BERT's hidden
        state feeds the Q, K and V linears) and torchao's convert step then refuses a dynamic
        quantize with several users ("Expecting single user"). An alias per extra consumer makes
        each quantize private; XLA merges the identical scale computations again.
        """
        if self.mode != "int8-dynamic":
            return model
        graph = model.graph
        for node in list(graph.nodes):
            consumers = [user for user in node.users if self._quantizes_activation(user, node)]
            for consumer in consumers[1:]:
                with graph.inserting_before(consumer):
                    alias = graph.call_function(torch.ops.aten.alias.default, (node,))
                alias.meta.update({key: node.meta[key] for key in ("val", "nn_module_stack", "stack_trace") if key in node.meta})
                consumer.replace_input_with(node, alias)
        graph.lint()
        model.recompile()
        return model

    def _quantizes_activation(self, consumer: torch.fx.Node, argument: torch.fx.Node) -> bool:
        """Whether `consumer` is an op this quantizer quantizes and `argument` one of its activation inputs."""
        if consumer.op != "call_function" or consumer.target not in QUANTIZED_OPS:
            return False
        activations = QUANTIZED_OPS[consumer.target].activations
        return _is_float_tensor(argument) and any(consumer.args[index] is argument for index in activations if index < len(consumer.args))

    def validate(self, model: torch.fx.GraphModule) -> None:
        """Nothing to check: every annotation made here is one the converter supports."""


def _is_float_tensor(argument) -> bool:
    value = argument.meta.get("val") if isinstance(argument, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point
