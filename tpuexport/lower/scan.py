"""Repeated blocks lowered as one `jax.lax.scan`: a deep model's layers compile once, not once each.

A *run* is consecutive children `P.i, P.i+1, ...` of one container at module path P (an
nn.ModuleList or nn.Sequential: BERT's, Llama's, ViT's layers), found in the decomposed program
through its nodes' `nn_module_stack` metadata, where

  - every block has the same module class and the same ops in the same order, each op reading
    the corresponding values: its own block's ops, its own weights (same shapes and dtypes), the
    previous block's outputs (the scan's carry; the first block reads the run's inputs there), or
    values computed outside the run that are the same for every block (an attention mask, rotary
    embeddings, a weight every block shares, symbolic sizes): the scan body closes over those;
  - nothing outside the run reads a block's values except the last block's carried outputs, read
    after the run.

The blocks' weights are stacked along a new leading axis, one array per weight of the first
block, named `P.<first>-<last>.<name within the block>` (`model.layers.0-31.mlp.up_proj.weight`),
and `ScannedRun.to_json` maps each back to the state_dict names it holds. Blocks that differ end a
run (a new one may start at them); a run with anything that does not fit stays unrolled, and so do
runs whose blocks hold convolutions (XLA:CPU runs them at half speed in a loop) or grouped matmuls
(a mixture-of-experts layer's experts: XLA:TPU copies each scan step's slice of the stacked experts
before its grouped-matmul kernel reads it, where unrolled it reads each layer's experts in place).

The torch graph itself is not changed: op-by-op checks, FLOPs and verification read it as before.
Only the tracing interpreter (lowering.py) skips the run's ops one by one and computes them at the
run's last op with `run_scan`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpuexport.lower.aten_lowerings import grouped_mm
from tpuexport.lower.mixed_precision import is_quantization_op
from tpuexport.lower.registry import own_lowering

_CHILD = re.compile(r"^(?P<container>.+)\.(?P<index>\d+)$")
# Values the interpreter computes outside the scan even inside a block: symbolic sizes, plain scalars.
_SCALAR_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


@dataclasses.dataclass(frozen=True)
class StackedWeight:
    """One weight of the template block, stacked over the run's blocks.

    Attributes:
      name: the stacked array's name among the program's weights.
      template: the first block's placeholder for it (what the scan body reads).
      originals: the state_dict names it holds, one per block, in block order.
    """

    name: str
    template: torch.fx.Node
    originals: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ScannedRun:
    """Consecutive identical blocks lowered as one scan.

    Attributes:
      module: the container's module path (e.g. "model.layers").
      module_type: the blocks' class (nn_module_stack's qualified name).
      first: the first block's index in the container.
      count: how many blocks the run holds.
      template: the first block's ops in graph order: the scan body.
      carries: (template op whose value the next block reads, the node the first block reads
        instead), one per carried value.
      outputs: the last block's ops giving the final carries, parallel with `carries`.
      weights: the stacked weights.
      ops: every op of every block of the run (none runs one by one).
      last_op: the run's last op in graph order, where the scan runs.
    """

    module: str
    module_type: str
    first: int
    count: int
    template: tuple[torch.fx.Node, ...]
    carries: tuple[tuple[torch.fx.Node, torch.fx.Node], ...]
    outputs: tuple[torch.fx.Node, ...]
    weights: tuple[StackedWeight, ...]
    ops: frozenset[torch.fx.Node]
    last_op: torch.fx.Node

    def to_json(self, before_scan: int = 0) -> dict:
        """The manifest's entry: where the run is and which state_dict names each stacked weight holds.

        Args:
          before_scan: how many of its first blocks run on their own before the scan (run_scan).
        """
        return {
            "module": self.module,
            "module_type": self.module_type,
            "first": self.first,
            "count": self.count,
            "blocks_before_scan": before_scan,
            "weights": {weight.name: list(weight.originals) for weight in self.weights},
        }


@dataclasses.dataclass(eq=False)
class _Block:
    """One child of a container: its ops (graph order) and the weights no other op reads."""

    index: int
    module_type: str
    ops: list[torch.fx.Node]
    weights: set[torch.fx.Node] = dataclasses.field(default_factory=set)


def find_runs(program: torch.export.ExportedProgram) -> tuple[ScannedRun, ...]:
    """Finds the runs of identical blocks to lower as scans.

    Containers are searched outermost first; a block inside a run found already is not searched
    again (its ops are part of the scan body). Runs of blocks with convolutions or grouped matmuls
    (mixture-of-experts layers) stay unrolled.

    Args:
      program: the decomposed program (not changed).
    Returns:
      The runs, in graph order; empty when there are none.
    """
    weight_names = {spec.arg.name: spec.target for spec in program.graph_signature.input_specs
                    if spec.kind != torch.export.graph_signature.InputKind.USER_INPUT}
    order = {node: position for position, node in enumerate(program.graph.nodes)}
    containers = _blocks_by_container(program.graph, weight_names)
    runs, taken = [], set()
    for container in sorted(containers, key=lambda path: (path.count("."), path)):
        children = [block for _, block in sorted(containers[container].items()) if taken.isdisjoint(block.ops)]
        for run in _runs_of(container, children, weight_names, order):
            if any(op.target is torch.ops.aten.convolution.default for op in run.template):
                # Measured on ResNet-50 (benchmarks/studies/conversion_speed.py): XLA:CPU runs convolutions
                # inside a while loop at half speed (verify 37.5 s scanned vs 16.5 s unrolled), and
                # a CNN's short stages (3-6 blocks) gain little compile time; they stay unrolled.
                continue
            if any(own_lowering(op.target) is grouped_mm for op in run.template):
                # Measured on a Mixtral-8x7B-shaped model (benchmarks/studies/experts_layout.py, v5e): XLA
                # copies each scan step's slice of the stacked experts before its grouped-matmul
                # kernel reads it (1795 MiB of temporaries at 64 tokens, 3.3 MiB unrolled, where each
                # layer's experts are an argument read in place); they stay unrolled, at the price of a
                # longer compile (32 layers on v5e-8: 16.1 s vs 2.8 s per bucket).
                continue
            runs.append(run)
            taken.update(run.ops)
    return tuple(sorted(runs, key=lambda run: order[run.last_op]))


def _is_scalar(node: torch.fx.Node) -> bool:
    """Symbolic sizes and plain scalars: the interpreter computes them outside the scan."""
    return isinstance(node.meta.get("val"), _SCALAR_TYPES)


def _blocks_by_container(graph: torch.fx.Graph, weight_names: Mapping[str, str]) -> dict[str, dict[int, _Block]]:
    """Every numbered child of every container that has ops: {container path: {index: block}}."""
    containers: dict[str, dict[int, _Block]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or _is_scalar(node):
            continue
        for path, module_type in (node.meta.get("nn_module_stack") or {}).values():
            child = _CHILD.match(path)
            if child:
                index = int(child["index"])
                block = containers.setdefault(child["container"], {}).setdefault(index, _Block(index, str(module_type), []))
                block.ops.append(node)
    order = {node: position for position, node in enumerate(graph.nodes)}
    for children in containers.values():
        _adopt_quantization_ops(graph, children)
        for block in children.values():
            block.ops.sort(key=order.__getitem__)
            ops = set(block.ops)
            block.weights = {argument for op in block.ops for argument in op.all_input_nodes
                             if argument.op == "placeholder" and argument.name in weight_names and set(argument.users) <= ops}
    return containers


def _adopt_quantization_ops(graph: torch.fx.Graph, children: dict[int, _Block]) -> None:
    """Adds to a block the quantization ops that only it reads, and the module-less ops (scale
    constants, getitems of computed scales) that feed them and only that block: PT2E inserts them
    with the root module alone in `nn_module_stack`, as it is for the root's own ops, which must
    stay outside the blocks."""
    block_of = {op: block for block in children.values() for op in block.ops}
    adopted = set()
    for node in reversed(graph.nodes):
        if node.op != "call_function" or _is_scalar(node) or node in block_of or not node.users:
            continue
        module_less = not {path for path, _ in (node.meta.get("nn_module_stack") or {}).values()} - {""}
        if not (module_less and (is_quantization_op(node.target) or not adopted.isdisjoint(node.users))):
            continue
        readers = {block_of.get(user) for user in node.users}
        if len(readers) == 1 and None not in readers:
            block = readers.pop()
            block.ops.append(node)
            block_of[node] = block
            adopted.add(node)


def _runs_of(container: str, children: list[_Block], weight_names: Mapping[str, str],
             order: Mapping[torch.fx.Node, int]) -> list[ScannedRun]:
    """The runs among one container's children: each starts at a block (the template) and takes the
    following blocks while they match it; a run that does not check out is shortened, else its
    first block stays unrolled and the search goes on from the next one."""
    runs = []
    start = 0
    while start + 1 < len(children):
        template = children[start]
        weight_maps = [{weight: weight for weight in template.weights}]
        initial: dict[int, torch.fx.Node] = {}
        end = start + 1
        while end < len(children) and children[end].index == children[end - 1].index + 1:
            matched = _match(template, children[end], children[end - 1], initial, discover=end == start + 1)
            if matched is None:
                break
            weight_maps.append(matched)
            end += 1
        run = None
        for stop in range(end, start + 1, -1):
            run = _checked_run(container, children[start:stop], weight_maps[:stop - start], initial, weight_names, order)
            if run is not None:
                break
        if run is None:
            start += 1
        else:
            runs.append(run)
            start += run.count
    return runs


def _tensor_type(node: torch.fx.Node) -> str:
    """Shapes (symbolic sizes as expressions) and dtypes of a node's value, as text."""
    def describe(value):
        if isinstance(value, torch.Tensor):
            return f"{value.dtype}{tuple(value.shape)}"
        if isinstance(value, (list, tuple)):
            return "(" + ",".join(describe(item) for item in value) + ")"
        return f"{type(value).__name__}:{value}" if isinstance(value, _SCALAR_TYPES) else type(value).__name__

    return describe(node.meta.get("val"))


def _match(template: _Block, block: _Block, previous: _Block, initial: dict[int, torch.fx.Node],
           discover: bool) -> dict[torch.fx.Node, torch.fx.Node] | None:
    """Whether `block` computes what `template` does, reading `previous`'s outputs where the template
    reads the run's inputs.

    Args:
      template: the run's first block.
      block: the block to compare.
      previous: the block before it.
      initial: {position of a previous block's op that the next block reads: the node the template
        reads there}; filled in when `discover` (the block right after the template), else only read.
      discover: whether new carried positions may be added to `initial`.
    Returns:
      {template weight placeholder: block weight placeholder}, or None when the blocks differ.
    """
    if block.module_type != template.module_type or len(block.ops) != len(template.ops) or len(block.weights) != len(template.weights):
        return None
    template_position = {op: position for position, op in enumerate(template.ops)}
    block_position = {op: position for position, op in enumerate(block.ops)}
    previous_position = {op: position for position, op in enumerate(previous.ops)}
    carried = {node: position for position, node in initial.items()}
    weights: dict[torch.fx.Node, torch.fx.Node] = {}

    def same_node(expected: torch.fx.Node, actual: torch.fx.Node) -> bool:
        if expected in template_position:
            return block_position.get(actual) == template_position[expected]
        if expected in template.weights:
            return (actual in block.weights and weights.setdefault(expected, actual) is actual
                    and _tensor_type(expected) == _tensor_type(actual))
        if actual in previous_position:
            position = previous_position[actual]
            if position not in initial and discover and expected not in carried and not _is_scalar(expected):
                initial[position], carried[expected] = expected, position
            return initial.get(position) is expected
        if expected in carried:
            return False
        # Read from outside the run: the same value for every block.
        return actual is expected or (_is_scalar(expected) and _is_scalar(actual) and str(expected.meta["val"]) == str(actual.meta["val"]))

    def same(expected, actual) -> bool:
        if isinstance(expected, torch.fx.Node) or isinstance(actual, torch.fx.Node):
            return isinstance(expected, torch.fx.Node) and isinstance(actual, torch.fx.Node) and same_node(expected, actual)
        if isinstance(expected, (list, tuple)):
            return type(expected) is type(actual) and len(expected) == len(actual) and all(map(same, expected, actual))
        if isinstance(expected, dict):
            return isinstance(actual, dict) and expected.keys() == actual.keys() and all(same(expected[k], actual[k]) for k in expected)
        return type(expected) is type(actual) and expected == actual

    for expected, actual in zip(template.ops, block.ops):
        if (expected.target != actual.target or _tensor_type(expected) != _tensor_type(actual)
                or not same((expected.args, expected.kwargs), (actual.args, actual.kwargs))):
            return None
    if len(set(weights.values())) != len(block.weights):
        return None
    return weights


def _checked_run(container: str, blocks: list[_Block], weight_maps: list[dict], initial: Mapping[int, torch.fx.Node],
                 weight_names: Mapping[str, str], order: Mapping[torch.fx.Node, int]) -> ScannedRun | None:
    """The ScannedRun of matched blocks, or None when the scan would not compute what they do:
    fewer than two blocks, nothing carried, a carry whose type changes, or a block value read
    anywhere but in its own block, by the next block where carried, or after the run."""
    if len(blocks) < 2 or not initial:
        return None
    template, last = blocks[0], blocks[-1]
    ops = [set(block.ops) for block in blocks]
    every_op = frozenset().union(*ops)
    last_op = max(every_op, key=order.__getitem__)
    for position, node in initial.items():
        if not isinstance(node.meta.get("val"), torch.Tensor) or _tensor_type(template.ops[position]) != _tensor_type(node):
            return None
    for number, block in enumerate(blocks):
        for position, op in enumerate(block.ops):
            for user in op.users:
                if user in ops[number]:
                    continue
                if position not in initial:
                    return None
                read_next = number + 1 < len(blocks) and user in ops[number + 1]
                read_after = number + 1 == len(blocks) and order[user] > order[last_op]
                if not (read_next or read_after):
                    return None
    positions = sorted(initial)
    first, final = blocks[0].index, last.index
    weights = []
    for placeholder in sorted(template.weights, key=order.__getitem__):
        originals = tuple(weight_names[weights_of[placeholder].name] for weights_of in weight_maps)
        weights.append(StackedWeight(_stacked_name(container, first, final, originals[0]), placeholder, originals))
    return ScannedRun(
        module=container, module_type=template.module_type, first=first, count=len(blocks), template=tuple(template.ops),
        carries=tuple((template.ops[position], initial[position]) for position in positions),
        outputs=tuple(last.ops[position] for position in positions), weights=tuple(weights), ops=every_op, last_op=last_op,
    )


def _stacked_name(container: str, first: int, last: int, original: str) -> str:
    """`model.layers.0-31.mlp.up_proj.weight` for `model.layers.0.mlp.up_proj.weight` stacked over blocks 0..31."""
    prefix = f"{container}.{first}."
    within = original[len(prefix):] if original.startswith(prefix) else original
    return f"{container}.{first}-{last}.{within}"


def stack_weights(names: tuple[str, ...], arrays: tuple,
                  runs: tuple[ScannedRun, ...]) -> tuple[tuple[str, ...], tuple[np.ndarray, ...]]:
    """The program's weights with each run's blocks' weights stacked.

    Args:
      names: state_dict names of the weights, in placeholder order.
      arrays: the weights (or, for a plan, their jax.ShapeDtypeStructs), in the same order.
      runs: the runs (find_runs).
    Returns:
      (names, arrays): unstacked weights in their order; a run's stacked weights where its first
      weight was.
    """
    by_name = dict(zip(names, arrays))
    run_of = {original: run for run in runs for weight in run.weights for original in weight.originals}
    stacked_names, stacked_arrays, placed = [], [], set()
    for name, array in zip(names, arrays):
        run = run_of.get(name)
        if run is None:
            stacked_names.append(name)
            stacked_arrays.append(array)
        elif id(run) not in placed:
            placed.add(id(run))
            for weight in run.weights:
                stacked_names.append(weight.name)
                stacked_arrays.append(_stacked([by_name[original] for original in weight.originals]))
    return tuple(stacked_names), tuple(stacked_arrays)


def _stacked(blocks: list):
    """The blocks' arrays stacked on a new leading axis; for a plan's shapes and dtypes, that shape."""
    if isinstance(blocks[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(blocks), *blocks[0].shape), blocks[0].dtype)
    return np.stack(blocks)


def run_scan(run: ScannedRun, value_of: Callable[[torch.fx.Node], object], call: Callable,
             stacked: Mapping[str, jax.Array]) -> tuple[dict[torch.fx.Node, jax.Array], int]:
    """Computes a run as `jax.lax.scan` over its blocks (while tracing).

    A scan's carry keeps its type. Where a block changes the carried values' dtypes (under
    --precision bf16 a layer norm gives f32 for bf16 inputs), the first blocks run on their own,
    as the unrolled program runs them, until the types settle; the rest are scanned.

    Args:
      run: the run.
      value_of: the value of a node computed outside the run (the interpreter's environment).
      call: runs one op as the interpreter does: call(node, args, kwargs) -> value.
      stacked: the program's weights by name, stacked ones among them (arrays, or pytrees of
        arrays such as a weight-only QuantizedArray, each leaf stacked).
    Returns:
      ({last block's op: value} for the ops the run's carried values come from, how many blocks
      ran before the scan).
    """
    slot = {node: position for position, (_, node) in enumerate(run.carries)}
    weight_name = {weight.template: weight.name for weight in run.weights}

    def block(carry, weights):
        values = {}

        def read(node):
            if node in values:
                return values[node]
            if node in slot:
                return carry[slot[node]]
            if node in weight_name:
                return weights[weight_name[node]]
            return value_of(node)

        for node in run.template:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), read)
            values[node] = call(node, args, kwargs)
        return tuple(values[op] for op, _ in run.carries)

    def types(values):
        return [(value.shape, value.dtype) for value in values]

    carry = tuple(value_of(node) for _, node in run.carries)
    blocks = {weight.name: stacked[weight.name] for weight in run.weights}
    before_scan = 0
    while before_scan < run.count:
        weights = {name: jax.tree.map(lambda leaf: leaf[before_scan], array) for name, array in blocks.items()}
        if types(jax.eval_shape(block, carry, weights)) == types(carry):
            break
        carry = block(carry, weights)
        before_scan += 1
    if before_scan < run.count:
        # Each step indexes the stacked weights in place: scanning over `array[before_scan:]`
        # would copy every stacked weight (XLA materializes a slice that feeds a loop).
        def step(values, index):
            def indexed(leaf):
                return jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False)

            return block(values, {name: jax.tree.map(indexed, array) for name, array in blocks.items()}), None

        carry, _ = jax.lax.scan(step, carry, jnp.arange(before_scan, run.count, dtype=jnp.int32))
    return dict(zip(run.outputs, carry)), before_scan
