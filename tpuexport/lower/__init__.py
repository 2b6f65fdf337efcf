"""Lowering stage: ExportedProgram -> jax.export.Exported (StableHLO with symbolic dims)."""

from tpuexport.lower.cost import flops_at
from tpuexport.lower.lowering import PRECISIONS, LoweredProgram, lower
from tpuexport.lower.mixed_precision import DEFAULT_PRECISION
from tpuexport.lower.matmul_precision import MATMUL_PRECISIONS
from tpuexport.lower.op_support import UnsupportedOperator, find_unsupported

__all__ = ["DEFAULT_PRECISION", "MATMUL_PRECISIONS", "PRECISIONS", "LoweredProgram", "UnsupportedOperator", "find_unsupported", "flops_at", "lower"]
