"""tpuexport's own lowerings, consulted before torchax's op library.

Maps an operator (an OpOverload, e.g. a torch.library op defined by the quantization stage) to a
function on JAX arrays with the operator's signature. Operators tpuexport defines are registered by
the modules that define them, which the lowering stage does not import; lowerings of torch's own
operators (lower/aten_lowerings.py and its neighbours) are imported by the lowering stage. A
library's operator, which exists only once that library is imported, is registered by its
qualified name ("transformers::grouped_mm_fallback") and found for its overload ".default".
"""

from __future__ import annotations

from typing import Callable

OWN_LOWERINGS: dict[object, Callable] = {}


def register_lowering(operator):
    """Decorator: `@register_lowering(torch.ops.tpuexport.some_op.default)` (or a library operator's
    qualified name, "namespace::name") over a JAX function."""

    def register(function: Callable) -> Callable:
        OWN_LOWERINGS[operator] = function
        return function

    return register


def own_lowering(target) -> Callable | None:
    """tpuexport's lowering of a graph node's target, or None."""
    if target in OWN_LOWERINGS:
        return OWN_LOWERINGS[target]
    name = getattr(target, "_name", None)  # an OpOverload's qualified name, "namespace::name"
    if getattr(target, "_overloadname", None) == "default" and name in OWN_LOWERINGS:
        return OWN_LOWERINGS[name]
    return None
