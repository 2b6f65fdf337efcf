"""Shape polymorphism: the signature's named dims as JAX symbolic dims, all in one scope.

torchax's own `extract_avals` makes one symbolic scope per dim, which JAX rejects as soon as a
program has two dims ("Invalid mixing of symbolic scopes"). Here every dim is created by a single
`jax.export.symbolic_shape` call carrying all range constraints, and derived dims ("2*seq") are
parsed in that same scope. jax.export turns the constraints into shape assertions in the module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpuexport.signature import ProgramSignature


def dim_constraints(signature: ProgramSignature) -> tuple[str, ...]:
    """The signature's ranges as jax.export constraints (dims are >= 1 without saying so)."""
    constraints = []
    for dim in signature.dims:
        if dim.min > 1:
            constraints.append(f"{dim.name} >= {dim.min}")
        if dim.max is not None:
            constraints.append(f"{dim.name} <= {dim.max}")
    return tuple(constraints)


def symbolic_input_avals(signature: ProgramSignature, dtype_override=None) -> list[jax.ShapeDtypeStruct]:
    """Abstract values for the inputs, with symbolic dims sharing one scope.

    Args:
      signature: the program's signature.
      dtype_override: optional function (TensorSpec -> dtype) replacing an input's dtype.
    Returns:
      One ShapeDtypeStruct per input, in signature order.
    """
    if signature.dims:
        names = [dim.name for dim in signature.dims]
        symbols = jax.export.symbolic_shape(", ".join(names), constraints=dim_constraints(signature))
        scope = symbols[0].scope
        by_name = dict(zip(names, symbols))
    avals = []
    for spec in signature.inputs:
        shape = []
        for size in spec.shape:
            if isinstance(size, int):
                shape.append(size)
            elif size in by_name:
                shape.append(by_name[size])
            else:
                shape.append(jax.export.symbolic_shape(size, scope=scope)[0])
        dtype = dtype_override(spec) if dtype_override else jnp.dtype(spec.dtype)
        avals.append(jax.ShapeDtypeStruct(tuple(shape), dtype))
    return avals
