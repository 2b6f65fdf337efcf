"""Lowerings of the Python operations on sizes that a graph holds (`x.shape[0] > 4`,
`float(h) * 4.0`) where JAX's symbolic dims cannot express the result.

JAX dim expressions are integers, and comparing two of them raises unless the dims' ranges decide
it. Such results become arrays instead, computed from the actual sizes when the program runs.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import torch

from tpuexport.lower.registry import register_lowering


def _decided_at_run_time(compare):
    """A comparison of sizes (a torch.cond predicate on a shape, say) that the dims' ranges decide
    is a Python bool, as in torch; one they leave open is a boolean array."""

    def lowered(left, right):
        try:
            return compare(left, right)
        except jax.errors.InconclusiveDimensionOperation:
            return compare(jnp.asarray(left), jnp.asarray(right))

    return lowered


for _comparison in (operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge):
    register_lowering(_comparison)(_decided_at_run_time(_comparison))


@register_lowering(torch.sym_float)
def sym_float(size):
    """A size as a float (`F.interpolate(scale_factor=...)` on a symbolic image side computes its
    sampling step so): a float32 scalar array for a symbolic dim."""
    return jnp.asarray(size, jnp.float32) if jax.export.is_symbolic_dim(size) else float(size)


# JAX's min and max of dim expressions (private to JAX, what jnp's shape functions use): a symbolic
# size stays a size (a slice bound), decided by the dims' ranges where they decide it.
from jax._src.core import max_dim, min_dim  # noqa: E402


@register_lowering(torch.sym_min)
def sym_min(left, right):
    """`min(start + block, seq_len)` of a block loop (MiniMax's lightning attention): a size."""
    return min_dim(left, right)


@register_lowering(torch.sym_max)
def sym_max(left, right):
    """`max(...)` of sizes: a size."""
    return max_dim(left, right)
