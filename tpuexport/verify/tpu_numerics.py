"""The TPU's matmul arithmetic, emulated on CPU, so that verification checks what the TPU returns.

XLA:CPU ignores the precision an artifact pins on its dots and convolutions (lower/matmul_precision.py)
and computes them in true f32. The TPU's matrix units instead multiply bfloat16 operands and
accumulate in f32: an f32 operand x is rounded to hi = bf16(x) (round to nearest even), and for
more passes its remainder lo = bf16(x - hi) is multiplied too. This module rewrites the artifact's
own StableHLO so that XLA:CPU computes exactly those products:

  default  (1 pass)   op(hi_a, hi_b)
  high     (3 passes) op(hi_a, hi_b) + op(hi_a, lo_b) + op(lo_a, hi_b)
  highest  (6 passes) f32 as it is (six passes reach f32's accuracy; the remaining difference is
                      below f32 accumulation-order noise)

Products of two bfloat16 values are exact in f32, so on CPU the rewritten op differs from the TPU
only in the order of f32 accumulation. A dot of an f32 operand and an integer one (a weight-only
int8 grouped matmul: f32 rows times s8 experts) rounds the f32 operand alone: int8 values are exact
in bfloat16, so its passes are op(hi, q) and, for high, op(lo, q). bfloat16 programs (--precision bf16) need nothing: their
operands already are bfloat16 on both platforms. Elementwise transcendental functions (exp, tanh,
...) use slightly different f32 approximations on TPU (about 1e-6 relative); they are not emulated.
XLA may compute a dot whose contraction is tiny (size 1) as elementwise f32 multiplies on the TPU;
the emulation then rounds where the TPU does not, overstating the error, never understating it.
"""

from __future__ import annotations

import jax
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo

from tpuexport.lower.matmul_precision import MatmulPrecision, is_decision_matmul
from tpuexport.lower.stablehlo_rewrite import operand_element_types, rewrite_matmuls


def tpu_faithful(exported: jax.export.Exported, precision: MatmulPrecision) -> jax.export.Exported:
    """The program with every f32 dot and convolution computed as the TPU computes it (see above).

    Args:
      exported: the lowered program (its precision pinned).
      precision: the pinned setting.
    Returns:
      A program to run on CPU; `exported` itself when nothing differs (highest, or no f32 matmuls).
    """
    if precision.bf16_passes >= 6:
        return exported
    emulated: list[str] = []

    def emulate(op: ir.Operation) -> None:
        # Matmuls feeding a decision are pinned to HIGHEST (lower/matmul_precision.py): f32 as it is.
        types = operand_element_types(op)
        if is_decision_matmul(op) or not any(isinstance(t, ir.F32Type) for t in types):
            return
        if not all(isinstance(t, (ir.F32Type, ir.IntegerType)) for t in types):
            return
        if any(isinstance(t, ir.IntegerType) for t in types):
            emulated.append(op.name)
            _emulate_mixed(op, types, precision)
            return
        emulated.append(op.name)
        lhs, rhs = list(op.operands)[:2]
        lhs_hi, rhs_hi = _through_bf16(lhs), _through_bf16(rhs)
        if precision.bf16_passes == 1:
            op.operands[0], op.operands[1] = lhs_hi, rhs_hi
            return
        lhs_lo = _through_bf16(stablehlo.SubtractOp(lhs, lhs_hi).result)
        rhs_lo = _through_bf16(stablehlo.SubtractOp(rhs, rhs_hi).result)
        terms = []
        for lhs, rhs in ((lhs_hi, rhs_hi), (lhs_hi, rhs_lo), (lhs_lo, rhs_hi)):
            term = op.clone(ir.InsertionPoint(op))
            term.operands[0], term.operands[1] = lhs, rhs
            terms.append(term.result)
        total = stablehlo.AddOp(stablehlo.AddOp(terms[0], terms[1]).result, terms[2]).result
        op.result.replace_all_uses_with(total)
        op.erase()

    faithful = rewrite_matmuls(exported, emulate)
    # Nothing rewritten (bf16 or integer matmuls, or none): the same program, so verification runs
    # and compiles it once per size, not twice.
    return faithful if emulated else exported


def _emulate_mixed(op: ir.Operation, types: list[ir.Type], precision: MatmulPrecision) -> None:
    """A dot of one f32 operand and one integer operand, with the f32 operand's bfloat16 passes."""
    position = 0 if isinstance(types[0], ir.F32Type) else 1
    value = op.operands[position]
    hi = _through_bf16(value)
    if precision.bf16_passes == 1:
        op.operands[position] = hi
        return
    terms = []
    for part in (hi, _through_bf16(stablehlo.SubtractOp(value, hi).result)):
        term = op.clone(ir.InsertionPoint(op))
        term.operands[position] = part
        terms.append(term.result)
    op.result.replace_all_uses_with(stablehlo.AddOp(terms[0], terms[1]).result)
    op.erase()


def _through_bf16(value: ir.Value) -> ir.Value:
    """An f32 value rounded to bfloat16 (to nearest even) and widened back to f32.

    The bfloat16 value passes an optimization barrier: XLA:CPU, which may keep excess precision
    (xla_allow_excess_precision, on by default), otherwise removes the f32 -> bf16 -> f32 pair in
    some compilations and not in others: the coverage Mixtral's TPU-faithful run came out exactly
    the plain f32 run at batch 64 x seq 128, and rounded at 2 x 16 and 33 x 65.
    """
    f32_type = ir.RankedTensorType(value.type)
    bf16_type = ir.RankedTensorType.get(f32_type.shape, ir.BF16Type.get(), f32_type.encoding)
    rounded = stablehlo.OptimizationBarrierOp([stablehlo.ConvertOp(bf16_type, value).result]).results[0]
    return stablehlo.ConvertOp(f32_type, rounded).result
