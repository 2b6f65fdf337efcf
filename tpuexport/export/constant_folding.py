"""The ops of an exported program that compute from its constants alone, evaluated once at export.

A vision tower converted at one image size (export/patch_grids.py) computes its positions, windows
and attention boundaries from its grid, a constant, through ops whose output sizes come from values
(`repeat_interleave` by a tensor of counts, `.tolist()` / `aten.item`). torch.export read the
constant's values while tracing, so the program's sizes are numbers; but any later trace of the
program (torch's decompositions, the lowering) sees the constant as a tensor of unknown values and
stops at those ops. Evaluated here, they leave their results: new constants for tensors, literals
for numbers, and the program holds no op that sizes a tensor by a value.
"""

from __future__ import annotations

import copy

import torch
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument


def fold_constants(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """The program with every op computed from its constants alone evaluated (module docstring).

    Args:
      program: an exported program (not changed).
    Returns:
      `program` itself when no op computes from constants alone, else a copy with their results as
      constants (tensors) and literals (numbers); constants no op reads any more are dropped.
    """
    graph_module = copy.deepcopy(program.graph_module)
    graph = graph_module.graph
    specs = list(program.graph_signature.input_specs)
    constants = dict(program.constants)
    values, derived = _evaluated(graph, {spec.arg.name: constants[spec.target] for spec in specs
                                         if spec.kind is InputKind.CONSTANT_TENSOR and spec.target in constants})
    folded = [node for node in values if node in derived and node.op == "call_function"]
    if not folded:
        return program
    first_input = next(node for node in graph.nodes if node.op == "placeholder" and node.name == _first_user_input(specs).arg.name)
    fake_mode = torch._guards.detect_fake_mode([node.meta["val"] for node in graph.nodes if "val" in node.meta])
    for index, node in enumerate(folded):
        readers = [user for user in node.users if user not in values]
        if not readers or _written(node):  # computed as it was: a constant must not be written (SigLIP 2's `abs_()`)
            continue
        value = values[node]

        def constant(name: str, tensor: torch.Tensor) -> torch.fx.Node:
            with graph.inserting_before(first_input):
                placeholder = graph.placeholder(name)
            placeholder.meta.update(node.meta, val=fake_mode.from_tensor(tensor, static_shapes=True) if fake_mode else tensor)
            specs.insert(specs.index(_first_user_input(specs)), InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(name), name))
            constants[name] = tensor
            return placeholder

        if isinstance(value, torch.Tensor) and value.dtype == torch.bool and all(_indexes_with(reader, node) for reader in readers):
            # A mask selecting by its values: the positions it selects, whose count the lowering can read (LFM2-VL's tokens).
            positions = [constant(f"folded_constant_{index}_{axis}", axis_positions)
                         for axis, axis_positions in enumerate(value.nonzero(as_tuple=True))]
            for reader in readers:
                source, indices = reader.args[:2]
                at = indices.index(node)
                reader.args = (source, [*indices[:at], *positions, *indices[at + 1:]], *reader.args[2:])
        elif isinstance(value, torch.Tensor):
            replacement = constant(f"folded_constant_{index}", value)
            for reader in readers:
                reader.replace_input_with(node, replacement)
        elif isinstance(value, (int, float, bool)):
            for reader in readers:
                reader.args, reader.kwargs = torch.fx.node.map_arg((reader.args, reader.kwargs), lambda arg: value if arg is node else arg)
    for node in reversed([node for node in values if node.op == "call_function"]):  # what only the folded ops read too
        if not node.users:
            graph.erase_node(node)
    for spec in [spec for spec in specs if spec.kind is InputKind.CONSTANT_TENSOR]:
        placeholder = next(node for node in graph.nodes if node.op == "placeholder" and node.name == spec.arg.name)
        if not placeholder.users:
            graph.erase_node(placeholder)
            specs.remove(spec)
            constants.pop(spec.target, None)
    graph_module.recompile()
    signature = copy.copy(program.graph_signature)
    signature.input_specs = specs
    return program._update(graph_module, signature, constants=constants)


def _indexes_with(reader: torch.fx.Node, node: torch.fx.Node) -> bool:
    """Whether the op reads the node only as one of the indices of `aten.index.Tensor`."""
    return reader.target is torch.ops.aten.index.Tensor and reader.args[0] is not node and isinstance(reader.args[1], (list, tuple)) \
        and list(reader.args[1]).count(node) == 1


def _written(node: torch.fx.Node) -> bool:
    """Whether an op writes into the node's tensor in place (`abs_`, `clamp_`; not `detach_`)."""
    for user in node.users:
        target = user.target
        if not isinstance(target, torch._ops.OpOverload) or target is torch.ops.aten.detach_.default:
            continue
        for index, argument in enumerate(target._schema.arguments):
            value = user.args[index] if index < len(user.args) else user.kwargs.get(argument.name)
            if value is node and argument.alias_info is not None and argument.alias_info.is_write:
                return True
    return False


def _first_user_input(specs: list[InputSpec]) -> InputSpec:
    return next(spec for spec in specs if spec.kind is InputKind.USER_INPUT)


def _evaluated(graph: torch.fx.Graph, constants: dict[str, torch.Tensor]) -> tuple[dict[torch.fx.Node, object], set[torch.fx.Node]]:
    """({node: value} of the constant placeholders and of every deterministic op reading only them or
    nothing (`arange(3)`), in graph order; the nodes among them that read a constant)."""
    values: dict[torch.fx.Node, object] = {}
    derived: set[torch.fx.Node] = set()
    with torch.no_grad():
        for node in graph.nodes:
            if node.op == "placeholder" and node.name in constants:
                values[node] = constants[node.name]
                derived.add(node)
            elif node.op == "call_function" and all(arg in values for arg in node.all_input_nodes) and deterministic(node.target):
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
                try:
                    values[node] = node.target(*args, **kwargs)
                except Exception:  # an op torch cannot run here: left in the program
                    continue
                if any(arg in derived for arg in node.all_input_nodes):
                    derived.add(node)
    return values, derived


def deterministic(target) -> bool:
    """An op whose result depends on its arguments only: no random numbers, no writes (but `detach_`'s,
    which torch.export puts after every tensor made from numbers, and which writes no value)."""
    if target is torch.ops.aten.detach_.default:
        return True
    if isinstance(target, torch._ops.OpOverload):
        return not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags
    return callable(target)
