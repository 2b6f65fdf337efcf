"""Runtime assertions on values fixed at export: checked once at conversion, then dropped.

A check written as `torch._check` of a tensor (transformers' torch_compilable_check: D-FINE's,
RT-DETRv2's and DEIMv2's that their feature maps' sizes add up to the encoder's sequence) reads its
truth as a number, `_local_scalar_dense(_is_all_true(...))`, which symbolic ops test rather than an
assertion: computed from constants alone (here also tensors made from numbers on the meta device of
weights streamed from a checkpoint), it is that number.

torch.distributions checks its parameters when one is built (`Normal(0, 1)`: loc is real, scale
is positive); under torch.export each check becomes `aten._assert_async(aten._is_all_true(...))`,
which have no TPU lowering. Gemma 3n's MLP builds `Normal(0, 1)` in its forward for a Gaussian
top-k, and was refused for those two operators. When every value an assertion reads comes from the
program's constants (tensors the forward made from Python numbers), the assertion says the same
for every input: it is evaluated here, and dropped with the ops only it used when it holds. One that
fails never gets here (torch.export evaluates constants while tracing and raises the assertion's
message); it, and an assertion on inputs or weights, is left in place (reported as an operator
without a lowering).
"""

from __future__ import annotations

import copy

import torch
from torch.export.graph_signature import InputKind

from tpuexport.export.constant_folding import deterministic

aten = torch.ops.aten
_ASSERTIONS = (aten._assert_async.msg, aten._assert_async.default)
# Only consumers of the asserted value: torch.export checks its dtype, which says nothing once it is gone.
_METADATA_CHECKS = (aten._assert_tensor_metadata.default,)


def fold_constant_assertions(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Evaluates the assertions whose values are the program's constants and drops those that hold; a
    check's truth read as a number from constants becomes that number.

    Args:
      program: the decomposed program (not changed).
    Returns:
      `program` itself when no assertion reads constants only and holds, else a copy without those.
    """
    constants = {spec.arg.name: program.constants[spec.target] for spec in program.graph_signature.input_specs
                 if spec.kind is InputKind.CONSTANT_TENSOR and spec.target in program.constants}
    order = {node: index for index, node in enumerate(program.graph.nodes)}
    values: dict[torch.fx.Node, object] = {}
    folded = [node for node in program.graph.nodes
              if node.target in _ASSERTIONS and _holds(_constant_value(node.args[0], constants, order, values))]
    # A check as `torch._check` writes it (transformers' torch_compilable_check of a tensor: its truth read as a
    # number, `_local_scalar_dense(_is_all_true(...))`, which symbolic ops test): the number, when constants give it.
    numbers = {node.name: value.item() for node in program.graph.nodes if node.target is aten._local_scalar_dense.default
               and isinstance(value := _constant_value(node.args[0], constants, order, values), torch.Tensor)}
    if not folded and not numbers:
        return program
    graph_module = copy.deepcopy(program.graph_module)
    by_name = {node.name: node for node in graph_module.graph.nodes}
    evaluated = {node.name for node in values} | set(numbers)
    for node in folded:
        graph_module.graph.erase_node(by_name[node.name])
    for name, number in numbers.items():
        for user in list(by_name[name].users):
            user.args, user.kwargs = torch.fx.node.map_arg((user.args, user.kwargs),
                                                           lambda arg, name=name, number=number: number if arg.name == name else arg)
    for node in reversed(list(graph_module.graph.nodes)):
        checks_folded = node.target in _METADATA_CHECKS and node.args[0].name in evaluated
        if checks_folded or (node.name in evaluated and node.op == "call_function" and not node.users):
            graph_module.graph.erase_node(node)
    graph_module.recompile()
    return program._update(graph_module, program.graph_signature)


def _constant_value(node: torch.fx.Node, constants: dict, order: dict, values: dict):
    """`node`'s tensor when it is computed from `constants` alone by deterministic ops (evaluated with
    torch and kept in `values`), else None."""
    cone: list[torch.fx.Node] = []
    pending, seen = [node], set()
    while pending:
        current = pending.pop()
        if current in seen or current in values:
            continue
        seen.add(current)
        if current.op == "placeholder":
            if current.name not in constants:
                return None
        elif current.op != "call_function" or not _pure(current.target):
            return None
        cone.append(current)
        pending.extend(current.all_input_nodes)
    try:
        with torch.no_grad():
            for current in sorted(cone, key=order.__getitem__):
                if current.op == "placeholder":
                    values[current] = constants[current.name]
                    continue
                args, kwargs = torch.fx.node.map_arg((current.args, current.kwargs), values.__getitem__)
                if isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type == "meta":
                    # Made from numbers on the device of weights streamed from a checkpoint (D-FINE's feature map sizes):
                    # the same numbers on the CPU.
                    kwargs = {**kwargs, "device": torch.device("cpu")}
                values[current] = current.target(*args, **kwargs)
    except Exception:  # a constant on the meta device (a plan) or an op torch cannot run here: left to lowering
        return None
    result = values[node]
    return None if isinstance(result, torch.Tensor) and result.is_meta else result


def _holds(value) -> bool:
    """Whether an evaluated assertion's value is true (None: not evaluated)."""
    return value is not None and bool(value)


def _pure(target) -> bool:
    """An op whose result depends on its arguments only (constant_folding.deterministic), and no assertion."""
    return target not in _ASSERTIONS and target not in _METADATA_CHECKS and deterministic(target)
