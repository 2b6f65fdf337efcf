"""Dots that read a transposed operand in place on XLA:CPU.

torch's `linear` is `x @ weight.T`, so every lowered linear layer is a transpose of its weight feeding
a dot. A TPU's layout assignment folds the transpose into the dot; XLA:CPU (JAX 0.12) writes the
transposed weight out first, and for bfloat16 writes it in f32, the width its float normalization
computes bfloat16 dots in: a Llama-3.2-1B head ([128256, 2048]) costs a 1 GiB temporary per run
(benchmarks/results/conversion_memory/). A dot_general names its contracting and batch dims on each
operand, so it can read the untransposed operand directly: the same products, summed over the same
dims, with no copy.
"""

from __future__ import annotations

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo

from tpuexport.lower.stablehlo_rewrite import ops_named


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
    owner = value.owner
    if isinstance(owner, (ir.Operation, ir.OpView)) and owner.operation.name == "stablehlo.transpose":
        return owner.operation
    return None
