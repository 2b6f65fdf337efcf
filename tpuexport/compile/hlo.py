"""Reading the compiled TPU HLO text: which matmuls and convolutions the chip runs, on what types.

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

