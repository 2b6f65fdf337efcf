"""Integer operators for quantized programs: torch.library ops in the "tpuexport" namespace, each
with a JAX lowering in this module's JAX_LOWERINGS, which the lowering stage reads when it meets an
operator of a quantized program (lower/registry.py; quantize sits below lower and does not import it).

In torch (eager and fake tensors) every op dequantizes and runs the float op, which is exactly what
the PT2E-converted model computes. The JAX lowerings instead multiply int8 by int8 with int32
accumulation (`preferred_element_type=jnp.int32`), so the TPU runs the dot or convolution on its
integer units, and rescale the int32 result once by (activation scale x weight scale).

The same module lowers the `quantized_decomposed` ops that PT2E's convert step leaves in the graph
(activation quantize/dequantize, weight dequantize, run-time scales of dynamic quantization), so
every quantized program lowers.

All scales here are symmetric: zero points are 0 (the rewrite pass only matches such patterns).
"""

from __future__ import annotations

import math
from typing import Callable

import jax.numpy as jnp
import torch
import torch.nn.functional as F
from jax import lax
from torch.utils.flop_counter import register_flop_formula

# Importing this module registers the quantized_decomposed ops with torch.
import torch.ao.quantization.fx._decomposed  # noqa: F401  isort: skip

# operator (OpOverload) -> a function on JAX arrays with the operator's signature.
JAX_LOWERINGS: dict[object, Callable] = {}


def register_lowering(operator):
    """Decorator: records a JAX function as `operator`'s lowering in JAX_LOWERINGS."""

    def register(function: Callable) -> Callable:
        JAX_LOWERINGS[operator] = function
        return function

    return register


def _dequantize(values: torch.Tensor, scale: torch.Tensor, channel_axis: int | None = None) -> torch.Tensor:
    """values * scale in float32; `scale` is per tensor, or per channel along `channel_axis`."""
    if channel_axis is None:
        return values.to(torch.float32) * scale.to(torch.float32).reshape(())
    shape = [1] * values.dim()
    shape[channel_axis] = -1
    return values.to(torch.float32) * scale.to(torch.float32).reshape(shape)


def _int8_linear_reference(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear of int8 activations (per-tensor scale) and int8 weights [out, in] (per-row scales)."""
    return F.linear(_dequantize(x_q, x_scale), _dequantize(w_q, w_scale, 0), bias)


def _int8_conv_reference(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
    stride: list[int], padding: list[int], dilation: list[int], groups: int,
) -> torch.Tensor:
    """conv1d/conv2d (by the weight's rank) of int8 activations and int8 weights [out, in/groups, *kernel]."""
    convolve = F.conv1d if w_q.dim() == 3 else F.conv2d
    return convolve(_dequantize(x_q, x_scale), _dequantize(w_q, w_scale, 0), bias, stride, padding, dilation, groups)


def _int8_matmul_reference(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """torch.matmul of two int8 activations, each with a per-tensor scale."""
    return torch.matmul(_dequantize(a_q, a_scale), _dequantize(b_q, b_scale))


def _int8_embedding_reference(w_q: torch.Tensor, w_scale: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Embedding lookup in an int8 table [rows, width] with per-row scales."""
    return F.embedding(indices, _dequantize(w_q, w_scale, 0))


def _define(name: str, reference):
    """Defines tpuexport::<name> with `reference` as its CPU and its fake (meta) implementation."""
    operator = torch.library.custom_op(f"tpuexport::{name}", reference, mutates_args=())
    operator.register_fake(reference)  # the float math also runs on fake tensors, giving the shapes
    return operator


int8_linear = _define("int8_linear", _int8_linear_reference)
int8_conv = _define("int8_conv", _int8_conv_reference)
int8_matmul = _define("int8_matmul", _int8_matmul_reference)
int8_embedding = _define("int8_embedding", _int8_embedding_reference)


# FLOPs of the integer ops, for verification's cost estimates (tpuexport/lower/cost.py): two per
# multiply-add, from the output's size and the contracted (or kernel) size.
@register_flop_formula(torch.ops.tpuexport.int8_linear)
def _int8_linear_flops(x_shape, x_scale_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * math.prod(out_shape) * w_shape[1]


@register_flop_formula(torch.ops.tpuexport.int8_conv)
def _int8_conv_flops(x_shape, x_scale_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * math.prod(out_shape) * math.prod(w_shape[1:])


@register_flop_formula(torch.ops.tpuexport.int8_matmul)
def _int8_matmul_flops(a_shape, a_scale_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * math.prod(out_shape) * a_shape[-1]


def _scalar(scale):
    """A per-tensor scale (python float, 0-d or [1] array) as a float32 scalar."""
    return jnp.asarray(scale, jnp.float32).reshape(())


def _channel_scale(scale, rank: int, axis: int):
    """Per-channel scales shaped to broadcast along `axis` of a rank-`rank` array."""
    shape = [1] * rank
    shape[axis] = -1
    return jnp.asarray(scale, jnp.float32).reshape(shape)


@register_lowering(torch.ops.tpuexport.int8_linear.default)
def _int8_linear_jax(x_q, x_scale, w_q, w_scale, bias):
    accumulated = lax.dot_general(
        x_q, w_q, (((x_q.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.int32,
    )
    out = accumulated.astype(jnp.float32) * (_scalar(x_scale) * _channel_scale(w_scale, accumulated.ndim, -1))
    return out if bias is None else out + bias


@register_lowering(torch.ops.tpuexport.int8_conv.default)
def _int8_conv_jax(x_q, x_scale, w_q, w_scale, bias, stride, padding, dilation, groups):
    spatial = "HW"[: w_q.ndim - 2]
    accumulated = lax.conv_general_dilated(
        x_q, w_q, window_strides=tuple(stride), padding=[(p, p) for p in padding], rhs_dilation=tuple(dilation),
        dimension_numbers=(f"NC{spatial}", f"OI{spatial}", f"NC{spatial}"), feature_group_count=groups,
        preferred_element_type=jnp.int32,
    )
    out = accumulated.astype(jnp.float32) * (_scalar(x_scale) * _channel_scale(w_scale, accumulated.ndim, 1))
    return out if bias is None else out + _channel_scale(bias, accumulated.ndim, 1)


@register_lowering(torch.ops.tpuexport.int8_matmul.default)
def _int8_matmul_jax(a_q, a_scale, b_q, b_scale):
    # Both operands are computed activations (attention's Q·Kᵀ and P·V). libtpu 0.0.42.1 overflows
    # its stack costing a convolution fusion that also holds their producers (seen on every
    # Llama-style decoder: rotary embedding -> quantize -> Q·Kᵀ); the barrier keeps the int8
    # operands out of that fusion, at the cost of writing them to HBM once.
    a_q, b_q = lax.optimization_barrier((a_q, b_q))
    accumulated = jnp.matmul(a_q, b_q, preferred_element_type=jnp.int32)
    return accumulated.astype(jnp.float32) * (_scalar(a_scale) * _scalar(b_scale))


@register_lowering(torch.ops.tpuexport.int8_embedding.default)
def _int8_embedding_jax(w_q, w_scale, indices):
    # Gather the int8 rows first, then dequantize only them (the table stays int8 in HBM).
    rows = jnp.take(w_q, indices, axis=0)
    return rows.astype(jnp.float32) * jnp.take(jnp.asarray(w_scale, jnp.float32), indices, axis=0)[..., None]


def _quantize(x, inverse_scale, zero_point, quant_min, quant_max, dtype):
    # torch's formula: clamp(round(x * (1 / scale)) + zero_point), rounding half to even.
    rounded = jnp.round(x.astype(jnp.float32) * inverse_scale) + zero_point
    return jnp.clip(rounded, quant_min, quant_max).astype(_jax_dtype(dtype))


def _jax_dtype(dtype: torch.dtype):
    return {torch.int8: jnp.int8, torch.uint8: jnp.uint8, torch.int16: jnp.int16, torch.int32: jnp.int32}[dtype]


@register_lowering(torch.ops.quantized_decomposed.quantize_per_tensor.default)
def _quantize_per_tensor_jax(x, scale, zero_point, quant_min, quant_max, dtype):
    return _quantize(x, jnp.float32(1.0 / scale), zero_point, quant_min, quant_max, dtype)


@register_lowering(torch.ops.quantized_decomposed.quantize_per_tensor.tensor)
def _quantize_per_tensor_tensor_jax(x, scale, zero_point, quant_min, quant_max, dtype):
    return _quantize(x, 1.0 / _scalar(scale), _scalar(zero_point), quant_min, quant_max, dtype)


@register_lowering(torch.ops.quantized_decomposed.dequantize_per_tensor.default)
def _dequantize_per_tensor_jax(x_q, scale, zero_point, quant_min, quant_max, dtype, *, out_dtype=None):
    return (x_q.astype(jnp.float32) - zero_point) * jnp.float32(scale)


@register_lowering(torch.ops.quantized_decomposed.dequantize_per_tensor.tensor)
def _dequantize_per_tensor_tensor_jax(x_q, scale, zero_point, quant_min, quant_max, dtype, *, out_dtype=None):
    return (x_q.astype(jnp.float32) - _scalar(zero_point)) * _scalar(scale)


@register_lowering(torch.ops.quantized_decomposed.dequantize_per_channel.default)
def _dequantize_per_channel_jax(x_q, scales, zero_points, axis, quant_min, quant_max, dtype, *, out_dtype=None):
    centred = x_q.astype(jnp.float32)
    if zero_points is not None:
        centred = centred - _channel_scale(zero_points, x_q.ndim, axis)
    return centred * _channel_scale(scales, x_q.ndim, axis)


@register_lowering(torch.ops.quantized_decomposed.choose_qparams_symmetric.tensor)
def _choose_qparams_symmetric_jax(x, quant_min, quant_max, eps, dtype):
    # torch's determine_qparams for per_tensor_symmetric: max(|min|, |max|) / ((qmax - qmin) / 2), at least eps.
    largest = jnp.maximum(-jnp.minimum(jnp.min(x), 0.0), jnp.maximum(jnp.max(x), 0.0)).astype(jnp.float32)
    scale = jnp.maximum(largest / ((quant_max - quant_min) / 2), jnp.float32(eps))
    return scale.reshape(1), jnp.zeros((1,), jnp.int32)
