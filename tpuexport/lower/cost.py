"""The program's matmul FLOPs as a polynomial in its dims, so that a cost is known at any sizes
without running anything (verification picks its sizes by it).

Every dot-like node of the decomposed graph (mm, addmm, bmm, convolution, and tpuexport's int8
ops) has a formula in torch's FLOP counter registry (scaled_dot_product_attention, which the
lowering keeps whole, its two matmuls here); applied to the node's symbolic shapes it
gives a SymInt whose expression is over torch's shape symbols, renamed here to the signature's
dim names: e.g. "2*batch*seq**2*64 + 884736*batch*seq".
"""

from __future__ import annotations

import functools
import math

import sympy
import torch
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry

from tpuexport.signature import ProgramSignature, parse_dim_expression


def matmul_flops_expression(program: torch.export.ExportedProgram, signature: ProgramSignature) -> str:
    """Sum of the FLOP formulas of every dot-like node, over the signature's dim names.

    Args:
      program: the decomposed program (nodes carry symbolic `meta["val"]`).
      signature: its signature; its dims name the symbols.
    Returns:
      A sympy-parsable expression; a symbol that no input axis names directly (a derived dim's
      own symbol) is replaced by its value at the example sizes.
    """
    total = 0
    for node in program.graph.nodes:
        if node.target is torch.ops.aten.scaled_dot_product_attention.default:
            total = total + _attention_flops(*(arg.meta["val"] for arg in node.args[:3]))
            continue
        packet = getattr(node.target, "overloadpacket", None)
        if node.op != "call_function" or packet not in flop_registry or "val" not in node.meta:
            continue
        args, kwargs = pytree.tree_map_only(torch.fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs))
        total = total + flop_registry[packet](*args, **kwargs, out_val=node.meta["val"])
    expression = total.node.expr if isinstance(total, torch.SymInt) else sympy.Integer(int(total))
    return str(sympy.expand(expression.subs(_symbol_names(program, signature))))


def _attention_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """FLOPs of attention's two matmuls: scores [..., heads, q, k] and their product with the values."""
    *lead, q_len, dim = query.shape
    positions = math.prod(lead) * q_len * key.shape[-2]
    return 2 * positions * dim + 2 * positions * value.shape[-1]


def _symbol_names(program: torch.export.ExportedProgram, signature: ProgramSignature) -> dict:
    """torch shape symbol -> the dim's name (or its example value when no axis names it alone)."""
    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    names = {}
    for spec, name in zip(signature.inputs, program.graph_signature.user_inputs):
        for declared, size in zip(spec.shape, placeholders[name].meta["val"].shape):
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol) and isinstance(declared, str):
                names.setdefault(size.node.expr, sympy.Symbol(declared))
    for symbol, value in getattr(_shape_env(placeholders.values()), "backed_var_to_val", {}).items():
        names.setdefault(symbol, sympy.Integer(int(value)))
    return names


def _shape_env(placeholders):
    for node in placeholders:
        for size in getattr(node.meta.get("val"), "shape", ()):
            if isinstance(size, torch.SymInt):
                return size.node.shape_env
    return None


@functools.lru_cache(maxsize=64)
def _polynomial(expression: str):
    parsed = parse_dim_expression(expression)
    symbols = sorted(parsed.free_symbols, key=str)
    return [str(s) for s in symbols], sympy.lambdify(symbols, parsed, "math")


def flops_at(expression: str, sizes: dict[str, int]) -> float:
    """Evaluates a FLOPs expression at concrete dim sizes."""
    names, function = _polynomial(expression)
    return float(function(*(sizes[name] for name in names)))
