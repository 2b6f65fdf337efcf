"""Reading the compiled TPU HLO text: which matmuls and convolutions the chip runs, on what types,
and which collectives a sharded program exchanges between chips.

XLA's TPU compiler rewrites the program (fusions, layouts, dots turned into convolutions), so what
the TPU really computes is only visible in the compiled module's text (`compiled.as_text()`):

    %conv.1 = s32[2,16,16,16]{...} convolution(%fusion.17, %fusion.9), window={size=7x7 ...}, dim_labels=bf01_oi01->bf01
    %fusion.17 = s8[2,3,32,32]{...} fusion(...), kind=kLoop, calls=...

Instruction names are unique within a module, so an operand's type is read from its definition
wherever that is (another computation, a fusion parameter).
"""

from __future__ import annotations

import dataclasses
import math
import re

_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\]", re.MULTILINE)
_MATMUL = re.compile(
    r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(\w+)\[([\d,]*)\]\S*\s+(dot|convolution)\((%[\w.\-]+),\s*(%[\w.\-]+)\)(.*)$",
    re.MULTILINE,
)
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=\w+_(\w+)->")


@dataclasses.dataclass(frozen=True)
class MatmulOp:
    """One dot or convolution of the compiled program.

    Attributes:
      kind: "dot" or "convolution".
      types: "<lhs>x<rhs>-><result>" element types, e.g. "s8xs8->s32" or "f32xf32->f32".
      flops: 2 x multiply-adds, from the result shape and the contracted (or kernel) sizes.
    """

    kind: str
    types: str
    flops: int


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def matmul_ops(hlo_text: str) -> list[MatmulOp]:
    """Every dot and convolution in a compiled HLO module, with operand types and FLOPs.

    Args:
      hlo_text: `compiled.as_text()` of an XLA executable.
    Returns:
      One MatmulOp per instruction, in text order.
    """
    shapes = {name: (element, _dims(dims)) for name, element, dims in _DEFINITION.findall(hlo_text)}
    ops = []
    for result_type, result_dims, kind, lhs, rhs, attributes in _MATMUL.findall(hlo_text):
        (lhs_type, lhs_dims), (rhs_type, rhs_dims) = shapes.get(lhs, ("?", [])), shapes.get(rhs, ("?", []))
        outputs = math.prod(_dims(result_dims))
        if kind == "dot":
            contracting = _CONTRACTING.search(attributes)
            reduced = math.prod(lhs_dims[int(i)] for i in _dims(contracting.group(1))) if contracting and lhs_dims else 0
        else:
            # Kernel labels such as "oi01": every kernel dim but the output features is reduced over
            # (the input-feature dim already counts input features per group).
            labels = _DIM_LABELS.search(attributes)
            out_axis = labels.group(1).find("o") if labels else -1
            reduced = math.prod(size for axis, size in enumerate(rhs_dims) if axis != out_axis) if rhs_dims and out_axis >= 0 else 0
        ops.append(MatmulOp(kind, f"{lhs_type}x{rhs_type}->{result_type}", 2 * outputs * reduced))
    return ops


def matmul_flops_by_types(hlo_text: str) -> dict[str, int]:
    """Matmul and convolution FLOPs of a compiled module, summed per "<lhs>x<rhs>-><result>" types.

    Returns:
      e.g. {"s8xs8->s32": 1048576, "f32xf32->f32": 65536}, largest first.
    """
    totals: dict[str, int] = {}
    for op in matmul_ops(hlo_text):
        totals[op.types] = totals.get(op.types, 0) + op.flops
    return dict(sorted(totals.items(), key=lambda item: -item[1]))



COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# `%name = <result type> <opcode>(<operands>)`, the result an array type or a tuple of them; async
# collectives appear as `<kind>-start` (counted) and `<kind>-done` (not counted).
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(\(.*?\)|\w+\[[\d,]*\]\S*)\s+("
    + "|".join(COLLECTIVE_KINDS) + r")(-start)?\(([^)]*)\)",
    re.MULTILINE,
)
_ARRAY_TYPE = re.compile(r"(\w+)\[([\d,]*)\]")


def element_bytes(element_type: str) -> float:
    """Bytes per element of an HLO element type ("f32" 4, "bf16" 2, "s8" 1, "pred" 1, "s4" 0.5)."""
    if element_type == "pred":
        return 1.0
    bits = re.match(r"[a-z]+(\d+)", element_type)
    return int(bits.group(1)) / 8 if bits else 0.0


def _array_bytes(element_type: str, dims: str) -> int:
    return int(element_bytes(element_type) * math.prod(_dims(dims)))


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """The collectives of a compiled (sharded) HLO module, per kind.

    Each all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute instruction
    counts once (an async `-start`/`-done` pair once); XLA may split one logical exchange into
    several instructions, and an instruction inside a loop body runs once per iteration. Bytes
    are per device: the larger of what the instruction takes and what it returns (the gathered
    result of an all-gather, the unscattered operand of a reduce-scatter).

    Args:
      hlo_text: `compiled.as_text()` of an XLA executable.
    Returns:
      {kind: {"count": instructions, "bytes": bytes per device}} for every kind present, in
      COLLECTIVE_KINDS order.
    """
    shapes = {name: _array_bytes(element, dims) for name, element, dims in _DEFINITION.findall(hlo_text)}
    totals: dict[str, dict[str, int]] = {}
    for result_type, kind, is_async, operands in _COLLECTIVE.findall(hlo_text):
        results = [_array_bytes(element, dims) for element, dims in _ARRAY_TYPE.findall(result_type)]
        # An async start returns (operands..., results...) in one tuple: the largest element is the payload.
        returned = max(results, default=0) if is_async else sum(results)
        taken = sum(shapes.get(operand.strip(), 0) for operand in operands.split(",") if operand.strip())
        entry = totals.setdefault(kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += max(returned, taken)
    return {kind: totals[kind] for kind in COLLECTIVE_KINDS if kind in totals}
