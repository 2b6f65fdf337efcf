"""Dots as XLA:CPU computes them without copying their weights.

Transposed operands.

torch's `linear` is `x @ weight.T`, so every lowered linear layer is a transpose of its weight feeding
a dot. A TPU's layout assignment folds the transpose into the dot; XLA:CPU (JAX 0.12) writes the
transposed weight out first, and for bfloat16 writes it in f32, the width its float normalization
computes bfloat16 dots in: a Llama-3.2-1B head ([128256, 2048]) costs a 1 GiB temporary per run
(benchmarks/results/conversion_memory/). A dot_general names its contracting and batch dims on each
operand, so it can read the untransposed operand directly: the same products, summed over the same
dims, with no copy.

Single-row products. XLA:CPU (JAX 0.12) computes a bfloat16 dot whose left side has one row (a
vector times a matrix: a batch-1 prefill's head, every matmul of a batch-1 decode step) by
converting the whole right side to f32 first: the 1B head's 1 GiB temporary again, and 7.5x the time
of the same product with two rows, which its bfloat16 matmul library takes as it is (786 vs 104 ms
for [1, 2048] x [2048, 128256], measured here). Such a dot gets a row of zeros appended and drops
that row of the result: the same products for the real row, equal bit for bit to that row of a
many-row product.
"""

from __future__ import annotations

import numpy as np
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo

from tpuexport.lower.stablehlo_rewrite import ops_named, producer


def fold_transposes_into_dots(module: ir.Module) -> int:
    """Makes every dot_general whose operand is a transpose read the transpose's own operand, where
    the dot's result keeps its dim order (the operand's free dims stay in order; a 2-d weight's one
    free dim always does). Returns how many operands were folded; unused transposes are left to XLA."""
    folded = 0
    for dot in ops_named(module, ("stablehlo.dot_general",)):
        numbers = stablehlo.DotDimensionNumbers(dot.attributes["dot_dimension_numbers"])
        dims = {"lhs": (list(numbers.lhs_batching_dimensions), list(numbers.lhs_contracting_dimensions)),
                "rhs": (list(numbers.rhs_batching_dimensions), list(numbers.rhs_contracting_dimensions))}
        for position, side in enumerate(("lhs", "rhs")):
            transpose = _transpose_producing(dot.operands[position])
            if transpose is None:
                continue
            permutation = list(ir.DenseI64ArrayAttr(transpose.attributes["permutation"]))
            batching, contracting = dims[side]
            free = [d for d in range(len(permutation)) if d not in batching and d not in contracting]
            if [permutation[d] for d in free] != sorted(permutation[d] for d in free):
                continue  # the dot's result would list the free dims in another order
            dims[side] = ([permutation[d] for d in batching], [permutation[d] for d in contracting])
            dot.operands[position] = transpose.operands[0]
            folded += 1
        dot.attributes["dot_dimension_numbers"] = stablehlo.DotDimensionNumbers.get(
            lhs_batching_dimensions=dims["lhs"][0], rhs_batching_dimensions=dims["rhs"][0],
            lhs_contracting_dimensions=dims["lhs"][1], rhs_contracting_dimensions=dims["rhs"][1])
    return folded


def _transpose_producing(value: ir.Value) -> ir.Operation | None:
    op = producer(value)
    return op if op is not None and op.name == "stablehlo.transpose" else None


def pad_single_row_dots(module: ir.Module) -> int:
    """Appends a zero row to the left side of every bfloat16 dot_general that may have a single row
    (module docstring) and slices it off the result. A dot qualifies when it has no batch dims and
    its left side has a free dim whose product with the others may be 1, every dim but that one
    being static (the row appended is then a constant). Returns how many dots were padded."""
    padded = 0
    for dot in ops_named(module, ("stablehlo.dot_general",)):
        lhs_type = ir.RankedTensorType(dot.operands[0].type)
        numbers = stablehlo.DotDimensionNumbers(dot.attributes["dot_dimension_numbers"])
        if not isinstance(lhs_type.element_type, ir.BF16Type) or list(numbers.lhs_batching_dimensions):
            continue
        free = [d for d in range(lhs_type.rank) if d not in list(numbers.lhs_contracting_dimensions)]
        row = _single_row_dim(lhs_type, free)
        if row is None:
            continue
        with ir.InsertionPoint(dot):
            zeros_type = ir.RankedTensorType.get([1 if d == row else lhs_type.shape[d] for d in range(lhs_type.rank)], lhs_type.element_type)
            zeros = stablehlo.constant(ir.DenseElementsAttr.get_splat(zeros_type, ir.FloatAttr.get(lhs_type.element_type, 0.0)))
            lhs = stablehlo.concatenate([dot.operands[0], zeros], row)
            result_type = ir.RankedTensorType(dot.result.type)
            result_row = free.index(row)  # no batch dims: the left side's free dims lead the result's
            shape = list(result_type.shape)
            shape[result_row] = ir.RankedTensorType(lhs.type).shape[row]
            wide = stablehlo.DotGeneralOp(ir.RankedTensorType.get(shape, result_type.element_type), lhs, dot.operands[1],
                                          dot.attributes["dot_dimension_numbers"], precision_config=_attribute(dot, "precision_config"),
                                          algorithm=_attribute(dot, "algorithm")).result
            sliced = _first_rows(wide, result_type, result_row, dot.operands[0], row)
        dot.result.replace_all_uses_with(sliced)
        dot.erase()
        padded += 1
    return padded


def _single_row_dim(lhs_type: ir.RankedTensorType, free: list[int]) -> int | None:
    """The free dim to append a row along: one whose product with the other free dims may be 1 (it
    is dynamic, or every free dim is 1), every other dim being static; None when there is none."""
    dynamic = [d for d in range(lhs_type.rank) if lhs_type.is_dynamic_dim(d)]
    if len(dynamic) > 1 or (dynamic and dynamic[0] not in free):
        return None
    if dynamic:
        others = [lhs_type.shape[d] for d in free if d != dynamic[0]]
        return dynamic[0] if int(np.prod(others)) == 1 else None
    return free[0] if free and int(np.prod([lhs_type.shape[d] for d in free])) == 1 else None


def _first_rows(wide: ir.Value, result_type: ir.RankedTensorType, dim: int, lhs: ir.Value, lhs_dim: int) -> ir.Value:
    """`wide` without its last row along `dim`: as many rows as the left side's `lhs_dim` has."""
    ranks = range(result_type.rank)
    if not result_type.is_dynamic_dim(dim):
        return stablehlo.slice(wide, [0] * result_type.rank, list(result_type.shape), [1] * result_type.rank)
    index = ir.RankedTensorType.get([1], ir.IntegerType.get_signless(32))
    rows = stablehlo.reshape(index, stablehlo.get_dimension_size(lhs, lhs_dim))
    limits = [rows if d == dim else _i32s([result_type.shape[d]]) for d in ranks]
    limit = stablehlo.concatenate(limits, 0)
    return stablehlo.real_dynamic_slice(result_type, wide, _i32s([0] * result_type.rank), limit, _i32s([1] * result_type.rank))


def _i32s(values: list[int]) -> ir.Value:
    return stablehlo.constant(ir.DenseElementsAttr.get(np.asarray(values, np.int32)))


def _attribute(op: ir.Operation, name: str):
    return op.attributes[name] if name in op.attributes else None
