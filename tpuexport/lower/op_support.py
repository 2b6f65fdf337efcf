"""Finding every operator that has no lowering, before lowering starts."""

from __future__ import annotations

import dataclasses

import torch

# Every module that registers tpuexport's own lowerings, so that a lookup sees them all whichever of
# them the process imported first (the lower package imports its modules lazily, tpuexport/lazy.py).
from tpuexport.lower import (aten_lowerings, attention, control_flow, custom_ops, generation, paged, sampling,  # noqa: F401
                             symbolic_ops)
from tpuexport.lower.registry import own_lowering
from tpuexport.source_lines import user_source
from tpuexport.lower.torchax_import import import_torchax



@dataclasses.dataclass(frozen=True)
class UnsupportedOperator:
    """An operator with no JAX lowering.

    Attributes:
      name: the ATen operator, e.g. "aten.histc.default".
      source: the user's source line that produced it, "file.py:12 (code)", or what is known.
    """

    name: str
    source: str


def lowering_for(target):
    """The JAX lowering for an operator (tpuexport's own first, then torchax's), or None."""
    own = own_lowering(target)
    if own is not None:
        return own
    registry = import_torchax().ops.ops_registry.all_aten_ops
    op = registry.get(target) or registry.get(getattr(target, "overloadpacket", None))
    return op if op is not None and op.is_jax_function else None


def find_unsupported(graph_module: torch.fx.GraphModule) -> list[UnsupportedOperator]:
    """Lists every call in the (decomposed) graph and its subgraphs that nothing can lower.

    Args:
      graph_module: the decomposed program's graph module.
    Returns:
      One entry per distinct (operator, source line), in graph order; empty when all lower.
    """
    found: dict[tuple[str, str], UnsupportedOperator] = {}
    nodes = [node for module in graph_module.modules() if isinstance(module, torch.fx.GraphModule) for node in module.graph.nodes]
    for node in nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if isinstance(target, torch._ops.HigherOrderOperator):
            if own_lowering(target) is not None:
                continue
            name = f"higher-order op {target.name()}"
        elif isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and lowering_for(target) is None:
            name = str(target)
        else:
            continue
        entry = UnsupportedOperator(name, user_source(node))
        found.setdefault((entry.name, entry.source), entry)
    return list(found.values())
