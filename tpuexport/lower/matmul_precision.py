"""The matmul precision every dot and convolution of an artifact carries.

On TPU, an f32 dot or convolution runs as ONE bfloat16 pass with f32 accumulation unless its
precision says otherwise, while XLA:CPU computes true f32; a program that leaves the choice to the
platform computes different numbers on the chip that serves it than on the machine that verified
it. So the artifact pins the precision on every floating-point dot_general and convolution:

  setting   StableHLO precision_config   TPU arithmetic (= dot algorithm)
  default   [DEFAULT, DEFAULT]           1 bf16 pass, f32 accumulation   (BF16_BF16_F32)
  high      [HIGH, HIGH]                 3 bf16 passes (bf16x3)          (BF16_BF16_F32_X3)
  highest   [HIGHEST, HIGHEST]           6 bf16 passes, f32 accuracy     (BF16_BF16_F32_X6)

The precision enum, not the dot `algorithm` attribute: convolutions have no algorithm attribute,
and XLA:CPU refuses algorithms on the small dots it emits elementwise ("Algorithm not supported by
the ElementalIrEmitter"), so an artifact carrying them could not be verified or run on CPU. The
compiled TPU HLO shows the enum as `operand_precision` (DEFAULT is StableHLO's default value, which
serialization leaves out; the module's `tpuexport.matmul_precision` attribute names the setting).
Integer dots (int8 x int8 -> int32) have no precision and are left alone.

Matmuls that feed a discrete decision are pinned to HIGHEST whatever the setting: every matmul
whose result reaches a top-k, sort, argmax/argmin or max/min-with-indices (a mixture of experts'
router, a scoring head), or a threshold that masks (a comparison whose boolean selects between
values not computed from what it compares: Mask2Former's `sigmoid(mask_logits) < 0.5` attention
mask), directly or through other ops and matmuls. One bf16 pass anywhere in that
cone moves the decision's inputs by ~1e-3, and near-ties flip (a token routed to another expert
changes that expert's whole output), so the TPU would not compute what the model does. Pinning the
routers alone is not enough: a Mixtral-shaped model (f32, batch 64 x seq 128) still routed tokens
of 33 of 8.19M logits differently with its routers pinned, 2 with its layers' attention pinned too,
none with the whole cone (benchmarks/studies/routing.py). For bf16 operands HIGHEST costs nothing (one
pass computes their products exactly); for f32 ones it is six passes instead of one, on nearly
every matmul of an f32 mixture of experts (all but the last layer's experts and the head):
`--precision bf16` is the fast path there. The lowering traces the cone's ops under a named scope
(DECISION_SCOPE + node name) that the StableHLO's op locations keep; the manifest lists the ops
whose dots were pinned.
"""

from __future__ import annotations

import dataclasses
import re

import jax
from jax.extend.mlir import ir

import torch

from tpuexport.lower.stablehlo_rewrite import operand_element_types, rewrite_matmuls

# The setting, recorded on the module itself: serialization drops precision_config attributes that
# hold StableHLO's default value (DEFAULT), so for "default" this attribute is what says it was chosen.
MODULE_ATTRIBUTE = "tpuexport.matmul_precision"
# The named scope a decision's matmuls are traced under (found again in the ops' locations).
DECISION_SCOPE = "tpuexport_decision."
# The graph node an op was traced for, in its location: ".../tpuexport_decision.mm_4/dot_general".
_DECISION_OWNER = re.compile(re.escape(DECISION_SCOPE) + r"([^/\"]+)")

_aten = torch.ops.aten
DECISIONS = frozenset({_aten.topk.default, _aten.sort.default, _aten.sort.stable, _aten.argmax.default, _aten.argmin.default,
                       _aten.max.dim, _aten.min.dim})
# Comparisons that decide when their boolean selects between values not computed from what they compare (_is_threshold_mask).
THRESHOLDS = frozenset(getattr(getattr(_aten, name), overload) for name in ("lt", "le", "gt", "ge") for overload in ("Scalar", "Tensor"))


@dataclasses.dataclass(frozen=True)
class MatmulPrecision:
    """One --matmul-precision setting.

    Attributes:
      name: "default", "high" or "highest".
      enum: the StableHLO precision enum for convolutions ("DEFAULT", "HIGH", "HIGHEST").
      bf16_passes: bfloat16 products per f32 product on the TPU's matrix units (1, 3, 6).
      description: the arithmetic, for reports.
    """

    name: str
    enum: str
    bf16_passes: int
    description: str

    def precision_config(self) -> ir.Attribute:
        return ir.Attribute.parse(f"[#stablehlo<precision {self.enum}>, #stablehlo<precision {self.enum}>]")


MATMUL_PRECISIONS = {
    p.name: p
    for p in (
        MatmulPrecision("default", "DEFAULT", 1, "one bfloat16 pass per f32 product, f32 accumulation"),
        MatmulPrecision("high", "HIGH", 3, "three bfloat16 passes per f32 product (bf16x3), f32 accumulation"),
        MatmulPrecision("highest", "HIGHEST", 6, "six bfloat16 passes per f32 product (f32 accuracy), f32 accumulation"),
    )
}


def decision_matmuls(graph: torch.fx.Graph) -> dict[torch.fx.Node, str]:
    """The ops whose matmuls feed a discrete decision: every op the decision's inputs are computed
    by (its ancestors; their dots are pinned, the rest of their ops unaffected).

    Args:
      graph: the decomposed program's graph.
    Returns:
      {node: the name of the first decision op it feeds, e.g. "aten.topk.default"}.
    """
    found: dict[torch.fx.Node, str] = {}
    for decision in graph.nodes:
        if decision.op != "call_function" or not (decision.target in DECISIONS or _is_threshold_mask(decision)):
            continue
        pending = list(decision.all_input_nodes)
        while pending:
            node = pending.pop()
            if node in found or node.op != "call_function":
                continue
            found[node] = str(decision.target)
            pending.extend(node.all_input_nodes)
    return found


def _is_threshold_mask(comparison: torch.fx.Node) -> bool:
    """Whether a comparison of computed floats is a discrete decision: its boolean (through boolean
    ops) chooses, in a `where`, between values neither of which is computed from the compared floats
    (Mask2Former's attention mask `sigmoid(mask_logits) < 0.5` selects -inf or 0 for each pixel: one
    bf16 pass in its cone flipped pixels near 0.5 and moved whole queries' outputs). Activations that
    compare (softplus, mish, PReLU, CELU, threshold: `where(x > t, x, f(x))`) select values of the
    compared tensor itself and are continuous across the threshold: not decisions, or every matmul
    before a softplus would be pinned."""
    if comparison.target not in THRESHOLDS or not _is_float(comparison.args[0]):
        return False
    compared = {arg for arg in comparison.args[:2] if isinstance(arg, torch.fx.Node)}
    pending, seen = [comparison], set()
    while pending:
        node = pending.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if user.target == _aten.where.self and user.args[0] is node:
                if not any(_computed_from(branch, compared, comparison) for branch in user.args[1:]):
                    return True
            elif getattr(user.meta.get("val"), "dtype", None) == torch.bool:
                pending.append(user)
    return False


def _is_float(node) -> bool:
    return isinstance(node, torch.fx.Node) and getattr(node.meta.get("val"), "is_floating_point", lambda: False)()


def _computed_from(value, sources: set, comparison: torch.fx.Node) -> bool:
    """Whether a graph value is computed from any of `sources` other than through `comparison`."""
    pending, seen = [value], set()
    while pending:
        node = pending.pop()
        if not isinstance(node, torch.fx.Node) or node in seen or node is comparison:
            continue
        if node in sources:
            return True
        seen.add(node)
        pending.extend(node.all_input_nodes)
    return False


def is_decision_matmul(op: ir.Operation) -> bool:
    """Whether an op was traced for a matmul that feeds a decision (its location names DECISION_SCOPE)."""
    return DECISION_SCOPE in str(op.location)


def pin_matmul_precision(exported: jax.export.Exported, precision: MatmulPrecision,
                         pinned_ops: set[str] | None = None) -> jax.export.Exported:
    """Writes `precision` on every floating-point dot_general and convolution of the program, and
    HIGHEST on those that feed a decision (module docstring).

    Args:
      exported: the lowered program.
      precision: the setting to pin.
      pinned_ops: a set that receives the graph node names whose dots were pinned for a decision, or None.
    Returns:
      The same program with the setting's precision on every floating-point dot and
      convolution (replacing whatever precision or algorithm the op had); integer ops unchanged.
    """
    highest = MATMUL_PRECISIONS["highest"]

    def pin(op: ir.Operation) -> None:
        if not all(isinstance(t, ir.FloatType) for t in operand_element_types(op)):
            return
        decision = is_decision_matmul(op)
        if decision and pinned_ops is not None:
            pinned_ops.update(_DECISION_OWNER.findall(str(op.location)))
        op.attributes["precision_config"] = (highest if decision else precision).precision_config()
        if "algorithm" in op.attributes:
            del op.attributes["algorithm"]

    return rewrite_matmuls(exported, pin, {MODULE_ATTRIBUTE: precision.name})
