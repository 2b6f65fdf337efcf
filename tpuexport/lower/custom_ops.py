"""Custom operators that libraries register (`torch.library.custom_op`), lowered through what
defines them.

torch.export keeps such an operator as one opaque call. torch's decompositions already inline
those with a CompositeImplicitAutograd kernel; each of the others lowers through, in order:

1. a lowering of tpuexport's own (lower/registry.py), for library operators whose Python
   implementation cannot be traced but whose meaning is documented (below);
2. a decomposition registered with torch (`torch._decomp.register_decomposition`);
3. the operator's Python implementation (the function given to `torch.library.custom_op`), traced
   like the model's own code. One that cannot be traced (it reads tensor values with `.tolist()`,
   say) fails the conversion with one line naming the operator (see lowering.decompose).

Operators with none of these stay in the graph and are reported as unsupported.
"""

from __future__ import annotations

import torch
import torch._decomp
from torch._library.custom_ops import OPDEFS

from tpuexport.lower.aten_lowerings import grouped_mm
from tpuexport.lower.registry import own_lowering, register_lowering

# Operators that torch and torchax handle themselves, and tpuexport's own: not libraries' custom operators.
_BUILTIN_NAMESPACES = frozenset({"aten", "prims", "higher_order", "quantized_decomposed", "tpuexport"})

# transformers' mixture-of-experts kernel (Mixtral, Qwen-MoE, ...), which it calls while exporting
# float32 models: its Python implementation loops over `offs.tolist()`, and transformers documents
# it as the stand-in for torch._grouped_mm with the same arguments and result.
register_lowering("transformers::grouped_mm_fallback")(grouped_mm)


def custom_operators(program: torch.export.ExportedProgram) -> list[torch._ops.OpOverload]:
    """The library custom operators the program (and its subgraphs) calls, in graph order."""
    found = {}
    for module in program.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                target = node.target
                if isinstance(target, torch._ops.OpOverload) and target.namespace not in _BUILTIN_NAMESPACES:
                    found.setdefault(target, None)
    return list(found)


def custom_operator_decompositions(program: torch.export.ExportedProgram) -> dict:
    """Decompositions for the program's library custom operators that tpuexport does not lower itself.

    Args:
      program: the exported program.
    Returns:
      {operator: decomposition}: a registered decomposition, else the Python implementation.
    """
    decompositions = {}
    registered = torch._decomp.global_decomposition_table["post_autograd"]
    for operator in custom_operators(program):
        if own_lowering(operator) is not None:
            continue
        if operator in registered:
            decompositions[operator] = registered[operator]
        elif operator._name in OPDEFS:
            decompositions[operator] = OPDEFS[operator._name]._init_fn
    return decompositions

