"""tpuexport's own lowerings, consulted before torchax's op library.

Maps an operator (an OpOverload) to a function on JAX arrays with the operator's signature.
Lowerings of torch's own operators (lower/aten_lowerings.py and its neighbours) are imported by the
lowering stage. A library's operator, which exists only once that library is imported, is registered
by its qualified name ("transformers::grouped_mm_fallback") and found for its overload ".default".
The operators of quantized programs (tpuexport's int8 ops, PT2E's quantized_decomposed ops) are
lowered by the quantize stage's table (quantize/ops.py), read only when such an operator appears,
so torchao loads only for quantized programs.
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
    # Imported here, not at the top: the runtime imports modules that register lowerings (sampling.py)
    # without importing torch, which mixed_precision.py needs.
    from tpuexport.lower.mixed_precision import is_quantization_op

    if is_quantization_op(target):
        from tpuexport.quantize.ops import JAX_LOWERINGS  # torchao loads only for quantized programs

        return JAX_LOWERINGS.get(target)
    return None
