"""Weights stored in the layout the TPU's op reading them wants, rather than the one torch keeps.

transformers keeps a mixture-of-experts layer's weights [experts, out, in] and multiplies rows by
them with `grouped_mm(x, weight.transpose(-2, -1), offsets)`: a grouped matmul
(`jax.lax.ragged_dot`) over [experts, in, out]. XLA's TPU compiler copies the whole weight into that
layout at every call: on v5e, Mixtral-8x7B's gate/up experts (8 x 4096 -> 14336, bf16) need 896 MiB
of temporaries and 2692 MiB of HBM traffic for 64 tokens, against 0.1 MiB and 898 MiB for a weight
stored [experts, in, out] (benchmarks/studies/grouped_matmul.py). Dimension numbers that contract the stored
layout in place (`ragged_dot_general`, rhs contracting dim 2) get the same copy, measured alike. So
the program stores such a weight with its last two axes swapped, and the transpose the model applies
reads the stored array as it is (`TransposedWeight`): no transpose is left in the program.

A weight is stored transposed when it is a 3-D float weight whose every use is a transpose of its
last two axes whose every use is a grouped matmul's right-hand side (`transposed_weights`). The
layout is a permutation of the state_dict tensor's axes (of one block's, for a scanned run's stack,
whose leading stack axis stays first), recorded per weight in LoweredProgram.weight_layouts and the
manifest; every path that produces the stored arrays applies it: collect_weights' arrays and a
plan's shapes (lowering.py, before scanned blocks are stacked), a checkpoint's tensors as they
stream (pipeline), weight-only quantization (in the stored layout, so the scales share it), and
--shard rules (given in the state_dict layout, permuted by compile/sharding.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpuexport.lower.aten_lowerings import grouped_mm
from tpuexport.lower.registry import own_lowering

_aten = torch.ops.aten
_TRANSPOSES = (_aten.permute.default, _aten.transpose.int)
# A 3-D weight with its last two axes swapped: the layout of a grouped matmul's right-hand side.
SWAPPED = (0, 2, 1)


def transposed_weights(program: torch.export.ExportedProgram, tied: dict[str, str]) -> frozenset[str]:
    """The weights to store with their last two axes swapped (see the module docstring).

    Args:
      program: the decomposed program.
      tied: the tied weights (lowering.tied_weights); they keep torch's layout.
    Returns:
      Their state_dict names.
    """
    names = {spec.arg.name: spec.target for spec in program.graph_signature.input_specs
             if spec.kind != torch.export.graph_signature.InputKind.USER_INPUT}
    chosen = set()
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in names or names[node.name] in tied or names[node.name] in tied.values():
            continue
        value = node.meta.get("val")
        if not (isinstance(value, torch.Tensor) and value.dim() == 3 and value.dtype.is_floating_point and node.users):
            continue
        if all(swaps_last_two(user.target, user.args, 3) and user.args[0] is node and _read_by_grouped_matmuls(user)
               for user in node.users):
            chosen.add(names[node.name])
    return frozenset(chosen)


def _read_by_grouped_matmuls(node: torch.fx.Node) -> bool:
    """Whether every use of `node` is a grouped matmul's right-hand side (its argument 1)."""
    return bool(node.users) and all(own_lowering(user.target) is grouped_mm and len(user.args) > 1 and user.args[1] is node
                                    and node not in (user.args[0], *user.args[2:]) for user in node.users)


def swaps_last_two(target, args, rank: int) -> bool:
    """Whether an op (`target` called with `args`) transposes the last two axes of a rank-`rank`
    operand and keeps the others in place."""
    if target is _aten.permute.default:
        return [axis % rank for axis in args[1]] == [*range(rank - 2), rank - 1, rank - 2]
    if target is _aten.transpose.int:
        return rank >= 2 and sorted(axis % rank for axis in args[1:3]) == [rank - 2, rank - 1]
    return False


def in_stored_layout(value, layout: tuple[int, ...] | None):
    """A weight (torch tensor, numpy array or jax.ShapeDtypeStruct) in its stored layout: its axes
    in `layout`'s order, counted from the end (a scanned run's stack keeps its leading axis first);
    unchanged for None."""
    if layout is None:
        return value
    lead = len(value.shape) - len(layout)
    order = (*range(lead), *(lead + axis for axis in layout))
    if isinstance(value, torch.Tensor):
        return value.permute(order)
    if isinstance(value, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(tuple(value.shape[axis] for axis in order), value.dtype)
    return np.ascontiguousarray(np.transpose(value, order))


def in_state_layout(value: np.ndarray, layout: tuple[int, ...] | None) -> np.ndarray:
    """A stored weight's array back in its state_dict tensor's layout (the inverse of `in_stored_layout`)."""
    if layout is None:
        return value
    lead = value.ndim - len(layout)
    return np.transpose(value, (*range(lead), *(lead + axis for axis in np.argsort(layout))))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TransposedWeight:
    """A weight stored with its last two axes swapped, while tracing (a JAX pytree: scans index
    its stacked array like any weight's).

    Attributes:
      stored: the array as the program stores it (the layout the grouped matmul reads).
    """

    stored: jax.Array

    def as_torch_keeps_it(self) -> jax.Array:
        """The weight in the state_dict tensor's layout, for an op other than the transpose."""
        return jnp.swapaxes(self.stored, -1, -2)


def call_with_transposed(target, args: tuple) -> tuple[bool, object]:
    """The transpose a TransposedWeight was stored for, done by reading the stored array.

    Returns:
      (True, the stored array) when `target` swaps the weight's last two axes; (False, args with
      every TransposedWeight in torch's layout) for any other op.
    """
    weight = args[0] if args and isinstance(args[0], TransposedWeight) else None
    if weight is not None and target in _TRANSPOSES and swaps_last_two(target, args, weight.stored.ndim):
        return True, weight.stored
    return False, tuple(arg.as_torch_keeps_it() if isinstance(arg, TransposedWeight) else arg for arg in args)
