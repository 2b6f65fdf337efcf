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


@register_lowering(torch.ops.higher_order.scan)
def scan(combine, init, xs, additional_inputs):
    """`torch._higher_order_ops.scan` (its operator form: over dim 0, forward; a reverse scan is
    flipped around it) as `jax.lax.scan`, whose length may be a symbolic size.

    Args:
      combine: the step, a function of (*carry, *one slice of each xs, *additional_inputs)
        returning (*next carry, *outputs of the step).
      init: the initial carry, a list of arrays.
      xs: the scanned arrays, a list, each over its first dim.
      additional_inputs: arrays every step reads (the weights the step uses).
    Returns:
      (*final carry, *each output stacked over the steps).
    """
    carries = len(init)

    def step(carry, slices):
        results = combine(*carry, *slices, *additional_inputs)
        # The carry keeps its dtype from step to step, whatever precision the step computed in.
        return tuple(jnp.asarray(value).astype(start.dtype) for value, start in zip(results[:carries], carry)), tuple(results[carries:])

    carry, outputs = jax.lax.scan(step, tuple(jnp.asarray(value) for value in init), tuple(xs))
    return (*carry, *outputs)
