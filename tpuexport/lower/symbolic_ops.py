"""Lowerings of the Python operations on sizes that a graph holds (`x.shape[0] > 4`) where JAX's
symbolic dims cannot express the result.

JAX dim expressions are integers, and comparing two of them raises unless the dims' ranges decide
it. Such results become arrays instead, computed from the actual sizes when the program runs.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp

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

