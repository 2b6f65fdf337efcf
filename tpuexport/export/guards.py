"""Dim ranges that torch.export narrowed without saying so.

torch.export raises when the model's code narrows a declared dim ("Constraints violated"), but
not when a size computed from the dims is fixed: a sequence of 2*k sliced twice with step 2 has
length 1 at the example k=2, torch fixes that length at 1 where an op needs it (linear reshapes by
it), and the program keeps only a guard on its inputs, `((1 + ((1 + x.size()[1]) // 2)) // 2) == 1`
(`ExportedProgram._guards_code`, which `program.module()` checks on each call). Lowering such a
program fails on a shape. Other guards only pick torch's faster path (a view rather than a copy)
and hold a program that computes the same at every size; those are no reason to refuse, so the
guards only explain a lowering that failed.
"""

from __future__ import annotations

import torch

from tpuexport.signature import ProgramSignature


def narrowed_range(program: torch.export.ExportedProgram, signature: ProgramSignature) -> str | None:
    """Checks the program's guards at sizes across every declared range.

    Args:
      program: an exported program (decomposed or not: decomposing keeps the guards).
      signature: its signature (dims with ranges and example sizes).
    Returns:
      "G fails at k=3 (declared k 2..6)" for the first guard G that fails inside the ranges, or
      None (no guard fails, or they cannot be checked here: the explanation must not fail itself).
    """
    if not getattr(program, "_guards_code", None) or not signature.dims:
        return None
    example = signature.example_sizes()
    try:
        guards = getattr(program.module(), "_guards_fn", None)
        if guards is None or _guard_failure(guards, signature, example) is not None:
            return None
        failures = ((sizes, _guard_failure(guards, signature, sizes)) for sizes in _sizes_across_ranges(signature))
        sizes, failure = next(((sizes, failure) for sizes, failure in failures if failure is not None), (None, None))
    except Exception:  # it only explains another error: a program torch cannot unlift, or guards on more than sizes
        return None
    if failure is None:
        return None
    changed = [dim for dim in signature.dims if sizes[dim.name] != example[dim.name]]
    return (f"{failure.removeprefix('Guard failed: ')} fails at {', '.join(f'{dim.name}={sizes[dim.name]}' for dim in changed)} "
            f"(declared {', '.join(f'{dim.name} {dim.range_text}' for dim in changed)})")


def _sizes_across_ranges(signature: ProgramSignature) -> list[dict[str, int]]:
    """Each dim alone at its ends, next to them and near its middle (the others at the example),
    then every dim at its minimum and at its maximum; an unbounded dim's maximum counts as 4x its
    example (as verification's sizes do)."""
    example = signature.example_sizes()
    ceiling = {dim.name: dim.max if dim.max is not None else max(4 * dim.example, dim.min) for dim in signature.dims}
    points = []
    for dim in signature.dims:
        low, high = dim.min, ceiling[dim.name]
        middle = (low + high) // 2
        for size in sorted({low, low + 1, middle, middle + 1, high - 1, high}):
            if low <= size <= high:
                points.append({**example, dim.name: size})
    points += [{dim.name: dim.min for dim in signature.dims}, dict(ceiling)]
    unique = []
    for sizes in points:
        if sizes != example and sizes not in unique:
            unique.append(sizes)
    return unique


def _guard_failure(guards, signature: ProgramSignature, sizes: dict[str, int]) -> str | None:
    """The failing guard's message at these sizes (inputs on the meta device: no memory), or None."""
    inputs = [torch.empty(spec.concrete_shape(sizes), dtype=getattr(torch, spec.torch_dtype), device="meta") for spec in signature.inputs]
    try:
        guards(*inputs)
    except AssertionError as error:
        return " ".join(str(error).split())
    return None
