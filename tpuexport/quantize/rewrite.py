"""FX pass over a PT2E-converted graph: dequantize -> linear/conv/matmul/embedding patterns become
the integer ops of `tpuexport.quantize.ops`, so lowering emits int8 dot_general / convolution.

A converted graph computes, for instance,
    x_q = quantize_per_tensor(x, s_x, 0, -127, 127, int8)
    linear(dequantize_per_tensor(x_q, s_x, ...), dequantize_per_channel(w_q, s_w, 0, axis 0, ...), bias)
which becomes int8_linear(x_q, s_x, w_q, s_w, bias). The quantize of the activation stays (it is
what produces the int8 operand); the dequantizes go. Patterns with a non-zero zero point, or a
weight dequantized along another axis, are left as they are (they still lower, in float).
"""

from __future__ import annotations

import operator

import torch

from tpuexport.quantize import ops  # noqa: F401  (defines the torch.ops.tpuexport operators)
from tpuexport.quantize.quantizer import ADDMM_OPS, CONV1D_OPS, CONV_OPS, EMBEDDING_OPS, LINEAR_OPS, MATMUL_OPS, conv_padding

_qd = torch.ops.quantized_decomposed
_DEQUANTIZE_PER_TENSOR = (_qd.dequantize_per_tensor.default, _qd.dequantize_per_tensor.tensor)
# Integer ops with a stored weight: index of the int8 weight argument (its scale follows it).
_INTEGER_WEIGHT_ARGUMENTS = {
    torch.ops.tpuexport.int8_linear.default: 2, torch.ops.tpuexport.int8_conv.default: 2, torch.ops.tpuexport.int8_embedding.default: 0,
}


def rewrite_integer_ops(module: torch.fx.GraphModule) -> list[str]:
    """Rewrites every matched pattern in place and drops the state nothing uses any more.

    Args:
      module: the graph module returned by convert_pt2e.
    Returns:
      The names of the nodes replaced by integer ops, in graph order.
    """
    graph = module.graph
    rewritten = []
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        with graph.inserting_before(node):
            replacement = _replacement(graph, node)
        if replacement is not None:
            replacement.meta.update({key: node.meta[key] for key in ("nn_module_stack", "stack_trace", "val") if key in node.meta})
            node.replace_all_uses_with(replacement)
            rewritten.append(node.name)
            graph.erase_node(node)
    _drop_zero_points(graph)
    graph.eliminate_dead_code()
    _name_weights(module)
    drop_unused_state(module)
    module.recompile()
    return rewritten


def _replacement(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node | None:
    """The integer-op node that computes `node`, or None when `node` is no quantized pattern."""
    if node.target in LINEAR_OPS or node.target in CONV_OPS:
        activation, weight = _activation(graph, node.args[0]), _weight(node.args[1])
        if activation is None or weight is None:
            return None
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if node.target in LINEAR_OPS:
            return graph.call_function(torch.ops.tpuexport.int8_linear.default, (*activation, *weight, bias))
        return graph.call_function(torch.ops.tpuexport.int8_conv.default, (*activation, *weight, bias, *_conv_options(node, weight[0])))
    if node.target in ADDMM_OPS:
        return _addmm_replacement(graph, node)
    if node.target in MATMUL_OPS:
        left, right = _activation(graph, node.args[0]), _activation(graph, node.args[1])
        if left is None or right is None:
            return None
        return graph.call_function(torch.ops.tpuexport.int8_matmul.default, (*left, *right))
    if node.target in EMBEDDING_OPS:
        weight = _weight(node.args[0])
        if weight is None:
            return None
        return graph.call_function(torch.ops.tpuexport.int8_embedding.default, (*weight, node.args[1]))
    return None


def _addmm_replacement(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node | None:
    """addmm(bias, x, W[in, out]) as int8_linear(x, Wᵀ, bias): the int8 weight is transposed in the
    graph (XLA folds the transpose into the dot's dimension numbers), its scales are per column."""
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return None
    activation, weight = _activation(graph, node.args[1]), _weight(node.args[2], axis=1)
    if activation is None or weight is None:
        return None
    transposed = graph.call_function(torch.ops.aten.permute.default, (weight[0], [1, 0]))
    return graph.call_function(torch.ops.tpuexport.int8_linear.default, (*activation, transposed, weight[1], node.args[0]))


def _drop_zero_points(graph: torch.fx.Graph) -> None:
    """Weight dequantizes left in the graph (int8-weight-only mode) get `zero_points=None` when
    those are all 0, so the artifact does not store a zero point per channel."""
    for node in graph.nodes:
        if _calls(node, (_qd.dequantize_per_channel.default,)) and node.args[2] is not None and _is_zero(node.args[2]):
            node.args = (*node.args[:2], None, *node.args[3:])


def _name_weights(module: torch.fx.GraphModule) -> None:
    """Moves PT2E's int8 weights and scales (`_frozen_param0`, `_scale_0`) next to the layer that
    uses them as `<layer>.weight_int8` / `<layer>.weight_scale`: readable names in the artifact."""
    for node in list(module.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _INTEGER_WEIGHT_ARGUMENTS:
            weight_at = _INTEGER_WEIGHT_ARGUMENTS[node.target]
            weight, scale = _through_permute(node.args[weight_at]), node.args[weight_at + 1]
        elif _calls(node, (_qd.dequantize_per_channel.default,)) and len(node.users) == 1:
            weight, scale = node.args[0], node.args[1]
            node = next(iter(node.users))
        else:
            continue
        stack = node.meta.get("nn_module_stack") or {}
        if not stack:
            continue
        layer = list(stack.values())[-1][0]
        for argument, name in ((weight, "weight_int8"), (scale, "weight_scale")):
            _move_attribute(module, argument, layer, name)


def _through_permute(node):
    """The int8 weight under the transpose an addmm rewrite puts on it."""
    if _calls(node, (torch.ops.aten.permute.default,)):
        return node.args[0]
    return node


def _move_attribute(module: torch.fx.GraphModule, node, layer: str, name: str) -> None:
    """Re-registers a root-level PT2E buffer read by get_attr `node` as buffer `name` of submodule `layer`."""
    if not (isinstance(node, torch.fx.Node) and node.op == "get_attr" and node.target.startswith("_")):
        return
    try:
        owner = module.get_submodule(layer)
    except AttributeError:  # the layer holds no state of its own in the unlifted module
        return
    if hasattr(owner, name):
        return
    owner.register_buffer(name, _attribute(module, node.target))
    delattr(module, node.target)
    node.target = f"{layer}.{name}"


def _activation(graph: torch.fx.Graph, argument) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(int8 node, scale node) when `argument` dequantizes a symmetric int8 activation, else None.

    A static scale is a float in the graph; it becomes a 0-d tensor so both kinds share one op.
    """
    if not _calls(argument, _DEQUANTIZE_PER_TENSOR):
        return None
    quantized, scale, zero_point = argument.args[:3]
    if argument.args[5] != torch.int8 or not _is_zero(zero_point):
        return None
    if not isinstance(scale, torch.fx.Node):
        scale = graph.call_function(torch.ops.aten.scalar_tensor.default, (float(scale),), {"dtype": torch.float32})
    return quantized, scale


def _weight(argument, axis: int = 0) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(int8 weight node, per-channel scale node) for a symmetric int8 weight quantized along
    `axis`, else None."""
    if not _calls(argument, (_qd.dequantize_per_channel.default,)):
        return None
    quantized, scales, zero_points, channel_axis = argument.args[:4]
    if channel_axis != axis or argument.args[6] != torch.int8 or not _is_zero(zero_points):
        return None
    return quantized, scales


def _is_zero(zero_point) -> bool:
    """Whether a zero point is 0: a literal, a stored all-zero tensor, or a symmetric run-time choice."""
    if zero_point is None or isinstance(zero_point, int):
        return not zero_point
    if zero_point.op == "get_attr":
        stored = _attribute(zero_point.graph.owning_module, zero_point.target)
        return not bool(stored.any())
    return (
        zero_point.target is operator.getitem
        and _calls(zero_point.args[0], (_qd.choose_qparams_symmetric.tensor,))
    )


def _calls(argument, targets) -> bool:
    return isinstance(argument, torch.fx.Node) and argument.op == "call_function" and argument.target in targets


def _conv_options(node: torch.fx.Node, weight: torch.fx.Node) -> tuple[list[int], list[int], list[int], int]:
    """(stride, padding, dilation, groups) of an aten.conv1d/conv2d call, as per-spatial-dim lists
    (`weight`: the stored int8 weight's get_attr node, for the kernel sizes "same" padding needs)."""
    defaults = {"stride": 1, "padding": 0, "dilation": 1, "groups": 1}
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    given = {**defaults, **dict(zip(names, node.args)), **node.kwargs}
    spatial = 1 if node.target in CONV1D_OPS else 2

    def per_dim(value) -> list[int]:
        return [int(value)] * spatial if isinstance(value, int) else [int(v) for v in value]

    return per_dim(given["stride"]), conv_padding(node, tuple(_attribute(node.graph.owning_module, weight.target).shape[2:])), per_dim(given["dilation"]), int(given["groups"])


def _attribute(module: torch.nn.Module, target: str):
    owner, _, name = target.rpartition(".")
    return getattr(module.get_submodule(owner), name)


def drop_unused_state(module: torch.fx.GraphModule) -> None:
    """Deletes parameters and buffers no get_attr node reads, so re-exporting does not keep the
    float weights that convert_pt2e replaced with int8 copies."""
    used = {node.target for node in module.graph.nodes if node.op == "get_attr"}
    state = [name for name, _ in module.named_parameters()] + [name for name, _ in module.named_buffers()]
    for name in state:
        if name not in used:
            owner, _, attribute = name.rpartition(".")
            delattr(module.get_submodule(owner), attribute)
