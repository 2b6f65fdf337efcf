"""tpuexport's own lowerings, consulted before torchax's op library.

Maps an operator (an OpOverload, e.g. a torch.library op defined by the quantization stage) to a
function on JAX arrays with the operator's signature. Registered by the modules that define the
operators; the lowering stage imports nothing from them.
"""

from __future__ import annotations

from typing import Callable

OWN_LOWERINGS: dict[object, Callable] = {}


def register_lowering(operator):
    """Decorator: `@register_lowering(torch.ops.tpuexport.some_op.default)` over a JAX function."""

    def register(function: Callable) -> Callable:
        OWN_LOWERINGS[operator] = function
        return function

    return register
