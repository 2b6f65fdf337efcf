"""Rewrites of the exported graph that put patterns real models use into a form that lowers.

Each pass takes an ExportedProgram and returns one; `lower()` runs them in its pass list. A pass
never changes the program it is given when that program may be the user's (a copy is rewritten).
"""

from __future__ import annotations

import copy

import torch

aten = torch.ops.aten


def graph_modules(program: torch.export.ExportedProgram) -> list[torch.fx.GraphModule]:
    """The program's graph module and the subgraphs it calls (e.g. torch.cond's branches)."""
    return [module for module in program.graph_module.modules() if isinstance(module, torch.fx.GraphModule)]


def attention_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The graph's scaled_dot_product_attention ops, listed first so that a pass may rewrite around them."""
    return [node for node in graph.nodes if node.target is aten.scaled_dot_product_attention.default]


def _mutated(node: torch.fx.Node) -> bool:
    """Whether an operator that writes into its arguments uses `node`."""
    return any(isinstance(user.target, torch._ops.OpOverload) and user.target._schema.is_mutable for user in node.users)


def reshape_views(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Rewrites `aten.view` into `aten.reshape` where nothing writes through the view.

    torch.export drops a `.contiguous()` that is a no-op on the example's strides, and torch's
    decompositions (scaled_dot_product_attention's, for one) give some tensors other strides than
    eager does, so a later `view` fails inside `run_decompositions` ("Cannot view a tensor with shape
    [s43, s53, 64] and strides (64, 64*s43, 1)"): GPT-2's attention output before its projection,
    in library code the user cannot change. `reshape` is the same view wherever `view` succeeds and
    a copy elsewhere, which only differs when something writes through the view or its base: those
    views are kept.

    Args:
      program: the exported program (not changed).
    Returns:
      `program` itself when it has no such view, else a copy with the views rewritten.
    """
    def rewritable(node):
        return node.target is aten.view.default and not _mutated(node) and not _mutated(node.args[0])

    if not any(rewritable(node) for module in graph_modules(program) for node in module.graph.nodes):
        return program
    graph_module = copy.deepcopy(program.graph_module)
    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if rewritable(node):
                node.target = aten.reshape.default
        module.recompile()
    return program._update(graph_module, program.graph_signature)


# Positions of aten.convolution's per-spatial-dim lists: stride, padding, dilation, output_padding.
_PER_SPATIAL_DIM_ARGUMENTS = (3, 4, 5, 7)


def expand_convolution_arguments(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Gives every `aten.convolution` one stride, padding, dilation and output padding per spatial dim.

    torch accepts a single value for all spatial dims, and decomposing `conv2d(padding="valid")`
    (EfficientNet's strided depthwise convolutions) leaves `padding=[0]`; torchax's lowering
    expands such a list in place, which fails on the graph's immutable argument lists.

    Args:
      program: a decomposed program that the lowering stage owns (rewritten in place).
    Returns:
      `program`.
    """
    for module in graph_modules(program):
        for node in module.graph.nodes:
            if node.target is not aten.convolution.default:
                continue
            spatial_dims = len(node.args[1].meta["val"].shape) - 2
            arguments = list(node.args)
            for position in _PER_SPATIAL_DIM_ARGUMENTS:
                values = list(arguments[position])
                if len(values) == 1 and spatial_dims > 1:
                    arguments[position] = values * spatial_dims
            node.args = tuple(arguments)
        module.recompile()
    return program


_MASK_WRITES = (aten.index_put.default, aten.index_put_.default)


def index_masks_at_known_counts(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Gives a boolean mask that reads rows of a tensor (`x[mask]`), and the writes through the same mask
    (`x[mask] = rows`), the positions it selects, `aten.nonzero_static(mask, size=count)`, where
    torch.export knows how many rows the read selects (Qwen3-VL's deepstack adds its image features at
    the placeholder tokens, a count the program fixes). JAX indexes with a boolean mask only when its
    values are known while tracing. A write alone is left as it is: its rows may broadcast, so they do
    not say the count.

    Args:
      program: a decomposed program that the lowering stage owns (rewritten in place).
    Returns:
      `program`.
    """
    for module in graph_modules(program):
        graph = module.graph
        counts = {}  # {mask: rows a read through it selects}
        for node in graph.nodes:
            if node.target is aten.index.Tensor and (mask := _one_mask(node)) is not None:
                count = _known_size(node.meta["val"].shape[0])
                if count is not None:
                    counts[mask] = count
        positions = {}  # {mask: the columns of its positions}
        for node in list(graph.nodes):
            mask = _one_mask(node) if node.target is aten.index.Tensor or node.target in _MASK_WRITES else None
            if mask not in counts:
                continue
            if mask not in positions:
                with graph.inserting_after(mask):
                    found = graph.call_function(aten.nonzero_static.default, (mask,), {"size": counts[mask]})
                found.meta["val"] = mask.meta["val"].new_empty((counts[mask], mask.meta["val"].dim()), dtype=torch.long)
                positions[mask] = []
                for dim in range(mask.meta["val"].dim()):
                    with graph.inserting_after(positions[mask][-1] if positions[mask] else found):
                        positions[mask].append(graph.call_function(aten.select.int, (found, 1, dim)))
                    positions[mask][-1].meta["val"] = found.meta["val"][:, dim]
            node.args = (node.args[0], positions[mask], *node.args[2:])
        module.recompile()
    return program


def _one_mask(node: torch.fx.Node) -> torch.fx.Node | None:
    """The boolean mask an index or index_put indexes with, when it is its one index, else None."""
    indices = node.args[1]
    if len(indices) != 1 or not isinstance(indices[0], torch.fx.Node):
        return None
    return indices[0] if indices[0].meta["val"].dtype == torch.bool else None


def _known_size(size) -> int | None:
    """A size's one value: an int, or a symbol torch.export bounded to one value (a count of mask
    positions it found equal to another tensor's rows), else None."""
    if isinstance(size, int):
        return size
    bounds = size.node.shape_env.bound_sympy(size.node.expr)
    return int(bounds.lower) if bounds.lower == bounds.upper else None


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def unmerge_batched_matmuls(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Turns `bmm` over merged leading dims back into one matmul over those dims.

    torch's decompositions compute a matmul of rank-4 tensors (attention's q @ k^T and p @ v, shaped
    (batch, heads, seq, dim)) as `view(a, [batch*heads, m, k])`, `bmm`, `view([batch, heads, m, n])`.
    The merged dim hides batch and heads from XLA's sharding propagation: with the batch split over
    one mesh axis and the heads over another, the partitioner gathers every head on every device
    instead of keeping each device's heads. `aten.matmul` of the rank-4 tensors is the same
    computation (a dot_general with two batch dims) and keeps them apart. Only a bmm whose operands
    are views of tensors with the same leading dims, and whose every user views it back to them, is
    rewritten.

    Args:
      program: a decomposed program that the lowering stage owns (rewritten in place).
    Returns:
      `program`.
    """
    for module in graph_modules(program):
        graph = module.graph
        for node in list(graph.nodes):
            if node.target is not aten.bmm.default or not all(arg.target in _VIEWS for arg in node.args):
                continue
            left, right = (view.args[0] for view in node.args)
            left_shape, right_shape = (tuple(map(str, source.meta["val"].shape)) for source in (left, right))
            leading = left_shape[:-2]
            result_shape = (*leading, left_shape[-2], right_shape[-1])
            users = list(node.users)
            if (len(leading) < 2 or right_shape[:-2] != leading or not users
                    or not all(user.target in _VIEWS and tuple(map(str, user.meta["val"].shape)) == result_shape for user in users)):
                continue
            with graph.inserting_before(node):
                matmul = graph.call_function(aten.matmul.default, (left, right))
            matmul.meta = dict(users[0].meta)
            for user in users:
                user.replace_all_uses_with(matmul)
        graph.eliminate_dead_code()
        module.recompile()
    return program


# The matrix operand of each 2D matmul op: mm(matrix, weight), addmm(bias, matrix, weight).
_MATRIX_OPERAND = {aten.mm.default: 0, aten.addmm.default: 1}


def merged_matmul_operand(node: torch.fx.Node) -> tuple[int, torch.fx.Node] | None:
    """Where a 2D matmul (a linear layer) reads a view merging the leading dims of a higher-rank
    tensor, and either its result is split into attention heads or its input joins them.

    torch's decompositions compute `linear` of a [batch, seq, in] tensor as `view([batch * seq, in])`,
    `addmm` (or `mm`) and a view back. When the result is then split into heads (attention's q, k and
    v), XLA:TPU lays the merged [batch * seq, out] result out and copies it twice into the layout
    attention reads (benchmarks/native_jax.py, BERT-base 8 x 128), and the output projection's input
    (the heads joined) is copied once more. Over the unmerged tensor (a dot_general contracting its
    last dim) q, k and v are copied once and the output projection's input not at all, so the lowering computes it that
    way (lowering._TracingInterpreter) and merges the result's leading dims after the dot, where XLA
    folds the two reshapes away. Other linear layers keep the merged form: for BERT's feed-forward
    layers the unmerged dot made XLA write the GELU's erf masks out (more bytes, not fewer). The graph
    itself is not changed.

    Args:
      node: any op of the decomposed graph.
    Returns:
      (the matrix operand's position in `node.args`, the unmerged tensor's node) when `node` is an mm
      or addmm whose matrix operand is such a view (rank >= 3, the contracted last dim kept), and
      whose result is only viewed back and split into heads (a view of rank >= 4) or whose unmerged
      tensor is a view of a rank >= 4 one; else None.
    """
    position = _MATRIX_OPERAND.get(node.target)
    if position is None or len(node.args) <= position:
        return None
    view = node.args[position]
    if not (isinstance(view, torch.fx.Node) and view.target in _VIEWS and isinstance(view.args[0], torch.fx.Node)):
        return None
    if not (_split_into_heads(node) or _joins_heads(view.args[0])):
        return None
    source = view.args[0].meta.get("val")
    merged = view.meta.get("val")
    if not (isinstance(source, torch.Tensor) and isinstance(merged, torch.Tensor) and source.dim() >= 3 and merged.dim() == 2
            and str(source.shape[-1]) == str(merged.shape[-1])):
        return None
    return position, view.args[0]


def _rank(node) -> int:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value.dim() if isinstance(value, torch.Tensor) else 0


def _split_into_heads(node: torch.fx.Node) -> bool:
    """Whether a 2D matmul's every reader is a view whose every reader is a view of rank >= 4
    ([batch, seq, heads, dim])."""
    views = list(node.users)
    return bool(views) and all(view.target in _VIEWS and view.users and all(
        user.target in _VIEWS and _rank(user) >= 4 for user in view.users) for view in views)


def _joins_heads(node: torch.fx.Node) -> bool:
    """Whether a value is a view of a rank >= 4 tensor ([batch, seq, heads, dim] -> [batch, seq, hidden])."""
    return node.target in _VIEWS and _rank(node.args[0]) >= 4


def reads_heads_last(node: torch.fx.Node) -> bool:
    """Whether every reader of a [..., heads, q, dim] value (an attention's result) swaps its heads
    and q dims (`transpose(1, 2)`, a permute after decomposition), as models do before the output
    projection; attention.scaled_dot_product_attention then computes it in that order."""
    value = node.meta.get("val")
    if not (isinstance(value, torch.Tensor) and value.dim() >= 3 and node.users):
        return False
    rank = value.dim()
    swapped = [*range(rank - 3), rank - 2, rank - 3, rank - 1]
    return all(user.target is aten.permute.default and [dim % rank for dim in user.args[1]] == swapped for user in node.users)


# Elementwise ops that build attention masks from per-query and per-key values (positions,
# padding, document ids): comparisons, boolean logic, selects, broadcasts.
_MASK_OPS = frozenset({
    aten.expand.default, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_not.default,
    aten.logical_and.default, aten.logical_or.default, aten.logical_not.default, aten.where.self,
    aten.eq.Tensor, aten.ne.Tensor, aten.le.Tensor, aten.lt.Tensor, aten.ge.Tensor, aten.gt.Tensor,
    aten.eq.Scalar, aten.ne.Scalar, aten.le.Scalar, aten.lt.Scalar, aten.ge.Scalar, aten.gt.Scalar,
})


def _query_by_key(node) -> bool:
    """Whether a node's value is a [..., q, k] tensor (neither of its last two dims is 1)."""
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and all(str(size) != "1" for size in value.shape[-2:])


def sink_attention_masks(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Recomputes each attention's mask next to it, from its per-query and per-key parts.

    Models build one [batch, 1, q, k] mask before their layers (transformers: causal from position
    ids, padding from the attention mask, packed documents from cumulative sums) as comparisons and
    boolean logic of [.., q, 1] and [.., 1, k] values, and every layer reads it. Read from memory,
    the mask is one more [q, k] operand of the scores' fusion, which XLA:TPU then stops fusing
    with the softmax: the f32 scores are written out and read back (about 2.4x the attention's HBM
    bytes at Llama-1B's shape). Computed from the small parts inside the layer, it fuses for free.
    The mask's [q, k]-shaped elementwise ops are copied before each scaled_dot_product_attention
    (as part of its layer, so scanned layers compute their own); the parts stay where they are.

    Args:
      program: a decomposed program that the lowering stage owns (rewritten in place).
    Returns:
      `program`.
    """
    for module in graph_modules(program):
        graph = module.graph
        for attention in attention_nodes(graph):
            mask = attention.args[3] if len(attention.args) > 3 else attention.kwargs.get("attn_mask")
            if not (isinstance(mask, torch.fx.Node) and mask.target in _MASK_OPS and _query_by_key(mask)):
                continue
            copies: dict[torch.fx.Node, torch.fx.Node] = {}

            def copy(node):
                if not (isinstance(node, torch.fx.Node) and node.target in _MASK_OPS and _query_by_key(node)):
                    return node
                if node not in copies:
                    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), copy)
                    with graph.inserting_before(attention):
                        copies[node] = graph.call_function(node.target, args, kwargs)
                    copies[node].meta = {**node.meta, "nn_module_stack": attention.meta.get("nn_module_stack"),
                                         "stack_trace": attention.meta.get("stack_trace")}
                return copies[node]

            sunk = copy(mask)
            if len(attention.args) > 3:
                attention.args = (*attention.args[:3], sunk, *attention.args[4:])
            else:
                attention.kwargs = {**attention.kwargs, "attn_mask": sunk}
        graph.eliminate_dead_code()
        module.recompile()
    return program


_RESHAPES = frozenset({aten.reshape.default, aten.view.default, aten._unsafe_view.default})


def _repeated_heads_source(node) -> torch.fx.Node | None:
    """The [batch, kv_heads, k, dim] tensor that `node` repeats along its heads as transformers'
    `repeat_kv` does (`x[:, :, None].expand(b, kv_heads, n, k, dim).reshape(b, kv_heads * n, k, dim)`),
    or None when `node` is not such a repeat."""
    if not (isinstance(node, torch.fx.Node) and node.target in _RESHAPES and len(node.users) == 1):
        return None
    expanded = node.args[0]
    if isinstance(expanded, torch.fx.Node) and expanded.target is aten.clone.default and len(expanded.users) == 1:
        expanded = expanded.args[0]  # torch's decomposition of reshape copies the expanded view first
    if not (isinstance(expanded, torch.fx.Node) and expanded.target is aten.expand.default and len(expanded.users) == 1):
        return None
    inserted = expanded.args[0]
    if not (isinstance(inserted, torch.fx.Node) and inserted.target is aten.unsqueeze.default and inserted.args[1] == 2
            and len(inserted.users) == 1):
        return None
    source = inserted.args[0]
    source_value, repeated_value = source.meta.get("val"), node.meta.get("val")
    if not (isinstance(source_value, torch.Tensor) and isinstance(repeated_value, torch.Tensor) and source_value.dim() == 4
            and repeated_value.dim() == 4):
        return None
    groups = expanded.meta["val"].shape[2]
    same = [str(a) == str(b) for a, b in zip(source_value.shape, repeated_value.shape)]
    if not (same[0] and same[2] and same[3] and str(repeated_value.shape[1]) == str(source_value.shape[1] * groups)):
        return None
    return source


def group_repeated_kv(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Gives each scaled_dot_product_attention the key and value heads its model repeated for it.

    transformers repeats a grouped-query model's key/value heads up to the query heads before
    `scaled_dot_product_attention` whenever it passes a mask (`repeat_kv`). The attention lowering
    groups the query heads over the key/value heads instead (lower/attention.py); fed repeated
    heads, XLA:TPU materializes the repeat, in f32 for a decode step's single query (a one-layer
    Llama-3.2-1B-shaped decode step, 8 x 4096 on v5e: 2.42 GiB accessed and 0.25 GiB of
    temporaries, 1.75 GiB and 1 MiB without the repeat). The attention is then called with the
    unrepeated heads and `enable_gqa=True`, which is torch's meaning of the same attention.

    Args:
      program: a decomposed program that the lowering stage owns (rewritten in place).
    Returns:
      `program`.
    """
    for module in graph_modules(program):
        graph = module.graph
        for attention in attention_nodes(graph):
            key, value = attention.args[1], attention.args[2]
            sources = _repeated_heads_source(key), _repeated_heads_source(value)
            if None in sources or str(sources[0].meta["val"].shape[1]) != str(sources[1].meta["val"].shape[1]):
                continue
            attention.args = (attention.args[0], *sources, *attention.args[3:])
            attention.kwargs = {**attention.kwargs, "enable_gqa": True}
        graph.eliminate_dead_code()
        module.recompile()
    return program
