"""Lowerings of torch's control-flow operators to JAX's.

The lowering stage hands these a subgraph (a branch) as a function of JAX arrays that runs it
through the same interpreter, so both branches are traced in the program's one symbolic scope.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from tpuexport.lower.registry import register_lowering


@register_lowering(torch.ops.higher_order.cond)
def cond(predicate, true_branch, false_branch, operands):
    """`torch.cond(pred, true_fn, false_fn, operands)` as `jax.lax.cond`: on the TPU only the taken
    branch runs.

    Args:
      predicate: a boolean scalar (an array with one element).
      true_branch, false_branch: the branches, functions of the operands returning a tuple.
      operands: the branches' inputs (the user's operands and the weights the branches read).
    Returns:
      The taken branch's outputs, a tuple.
    """
    return jax.lax.cond(
        jnp.reshape(predicate, ()),
        lambda values: tuple(true_branch(*values)),
        lambda values: tuple(false_branch(*values)),
        tuple(operands),
    )

