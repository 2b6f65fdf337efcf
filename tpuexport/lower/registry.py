"""tpuexport's own lowerings, consulted before torchax's op library.

Maps an operator (an OpOverload, e.g. a torch.library op defined by the quantization stage) to a
function on JAX arrays with the operator's signature. Operators tpuexport defines are registered by
the modules that define them, which the lowering stage does not import; lowerings of torch's own
operators (lower/aten_lowerings.py and its neighbours) are imported by the lowering stage.
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
