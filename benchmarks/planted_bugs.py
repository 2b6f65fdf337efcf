"""Deliberately wrong lowerings, to show that verification catches real bugs (tests and benchmarks).

Each bug is a context manager that swaps one JAX lowering (tpuexport's own, or torchax's for an
ATen op) for a subtly wrong one while a program is lowered; it applies to every use of the op.
They are mistakes a lowering can plausibly make.

int8 (FLOAT ops untouched):
  int8_scale_off_by_one_step  the rescale uses max|x|/128 where the quantizer used max|x|/127
                              (every integer matmul/conv result 0.8% too small)
  int8_missing_bias           the bias of every integer linear/convolution is dropped
  int8_wrong_zero_point       activations are quantized with zero point 1 instead of 0 (a one-step shift)

float:
  dropped_bias                addmm and convolution ignore their bias
  wrong_norm_epsilon          layer and batch norms use epsilon 0.1 (batch norm's momentum, a
                              positional mix-up) instead of the model's
  swapped_channels            output channels 0 and 1 of every addmm, mm and convolution trade places
  transposed_weight           square weights of addmm/mm are used transposed; convolution kernels
                              have their two spatial axes swapped
weight-only int4 (packing and the program's dequantization):
  int4_nibble_order_swapped   element 2i packed into the high nibble, 2i+1 into the low one
  int4_wrong_group_boundary   groups of every (size/group)-th element instead of consecutive runs
  int4_scale_of_the_wrong_group  each group scaled by its neighbour's scale
weight-only convolutions (int8 and int4: the scale per output channel that multiplies the result):
  conv_scale_of_the_wrong_channel  each output channel scaled by its neighbour's scale
  conv_scale_on_the_input_channels the scales multiply the input's channels (the wrong side of the
                              contraction) where in and out channels are as many, without groups
A bug whose op the program does not use (no biases, no norms) leaves it unchanged: the benchmark
reports such rows as exact.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import torch

from tpuexport.lower.op_support import lowering_for
from tpuexport.lower.registry import OWN_LOWERINGS
from tpuexport.quantize import ops

_tx = torch.ops.tpuexport
_qd = torch.ops.quantized_decomposed
_aten = torch.ops.aten


@contextlib.contextmanager
def _swapped(replacements: dict):
    saved = {operator: OWN_LOWERINGS.get(operator) for operator in replacements}
    OWN_LOWERINGS.update(replacements)
    try:
        yield
    finally:
        for operator, lowering in saved.items():
            if lowering is None:
                del OWN_LOWERINGS[operator]
            else:
                OWN_LOWERINGS[operator] = lowering


def _correct(operator):
    """The lowering tpuexport uses for `operator` (its own or torchax's), as a function."""
    lowering = lowering_for(operator)
    return getattr(lowering, "func", lowering)


def _scaled(lowering, factor: float):
    def wrong(*args, **kwargs):
        return lowering(*args, **kwargs) * factor

    return wrong


def _without_bias(lowering, bias_index: int):
    def wrong(*args, **kwargs):
        args = list(args)
        args[bias_index] = None
        return lowering(*args, **kwargs)

    return wrong


def _shifted_quantize(x, scale, zero_point, quant_min, quant_max, dtype):
    return ops._quantize(x, 1.0 / ops._scalar(scale), 1, quant_min, quant_max, dtype)


def int8_scale_off_by_one_step():
    """Integer results rescaled by 127/128 (bias added before the error, so it is all scaled)."""
    return _swapped({
        _tx.int8_linear.default: _scaled(ops.JAX_LOWERINGS[_tx.int8_linear.default], 127 / 128),
        _tx.int8_conv.default: _scaled(ops.JAX_LOWERINGS[_tx.int8_conv.default], 127 / 128),
        _tx.int8_matmul.default: _scaled(ops.JAX_LOWERINGS[_tx.int8_matmul.default], 127 / 128),
    })


def int8_missing_bias():
    return _swapped({
        _tx.int8_linear.default: _without_bias(ops.JAX_LOWERINGS[_tx.int8_linear.default], 4),
        _tx.int8_conv.default: _without_bias(ops.JAX_LOWERINGS[_tx.int8_conv.default], 4),
    })


def int8_wrong_zero_point():
    static = ops.JAX_LOWERINGS[_qd.quantize_per_tensor.default]

    def shifted_static(x, scale, zero_point, quant_min, quant_max, dtype):
        return static(x, scale, 1, quant_min, quant_max, dtype)

    return _swapped({_qd.quantize_per_tensor.default: shifted_static, _qd.quantize_per_tensor.tensor: _shifted_quantize})


def dropped_bias():
    addmm, convolution = _correct(_aten.addmm.default), _correct(_aten.convolution.default)

    def addmm_without_bias(bias, mat1, mat2, *, beta=1, alpha=1):
        return addmm(jnp.zeros_like(bias), mat1, mat2, beta=beta, alpha=alpha)

    def convolution_without_bias(x, weight, bias, *options):
        return convolution(x, weight, None, *options)

    return _swapped({_aten.addmm.default: addmm_without_bias, _aten.convolution.default: convolution_without_bias})


BATCH_NORM_MOMENTUM = 0.1


def wrong_norm_epsilon():
    layer_norm = _correct(_aten.native_layer_norm.default)
    batch_norm = _correct(_aten._native_batch_norm_legit_no_training.default)

    def layer_norm_wrong_epsilon(x, normalized_shape, weight, bias, eps):
        return layer_norm(x, normalized_shape, weight, bias, BATCH_NORM_MOMENTUM)

    def batch_norm_wrong_epsilon(x, weight, bias, mean, var, momentum, eps):
        return batch_norm(x, weight, bias, mean, var, momentum, momentum)

    return _swapped({_aten.native_layer_norm.default: layer_norm_wrong_epsilon,
                     _aten._native_batch_norm_legit_no_training.default: batch_norm_wrong_epsilon})


def _swap_first_two(values, axis: int):
    if values.shape[axis] < 2:
        return values
    order = jnp.arange(values.shape[axis]).at[0].set(1).at[1].set(0)
    return jnp.take(values, order, axis=axis)


def swapped_channels():
    addmm, mm, convolution = _correct(_aten.addmm.default), _correct(_aten.mm.default), _correct(_aten.convolution.default)
    return _swapped({
        _aten.addmm.default: lambda *args, **kwargs: _swap_first_two(addmm(*args, **kwargs), -1),
        _aten.mm.default: lambda *args, **kwargs: _swap_first_two(mm(*args, **kwargs), -1),
        _aten.convolution.default: lambda *args, **kwargs: _swap_first_two(convolution(*args, **kwargs), 1),
    })


def _transposed_if_square(matrix):
    return matrix.T if matrix.shape[0] == matrix.shape[1] else matrix


def transposed_weight():
    addmm, mm, convolution = _correct(_aten.addmm.default), _correct(_aten.mm.default), _correct(_aten.convolution.default)

    def addmm_transposed(bias, mat1, mat2, **kwargs):
        return addmm(bias, mat1, _transposed_if_square(mat2), **kwargs)

    def mm_transposed(mat1, mat2):
        return mm(mat1, _transposed_if_square(mat2))

    def convolution_transposed(x, weight, *options):
        return convolution(x, jnp.swapaxes(weight, -1, -2) if weight.ndim == 4 else weight, *options)

    return _swapped({_aten.addmm.default: addmm_transposed, _aten.mm.default: mm_transposed,
                     _aten.convolution.default: convolution_transposed})


FLOAT_BUGS = {
    "dropped_bias": dropped_bias,
    "wrong_norm_epsilon": wrong_norm_epsilon,
    "swapped_channels": swapped_channels,
    "transposed_weight": transposed_weight,
}


INT8_BUGS = {
    "int8_scale_off_by_one_step": int8_scale_off_by_one_step,
    "int8_missing_bias": int8_missing_bias,
    "int8_wrong_zero_point": int8_wrong_zero_point,
}


# Weight-only int4 (quantize/weight_only.py packs, lower/quantized_weights.py converts): bugs in
# the packing and in the program's dequantization, planted while a program is lowered.
@contextlib.contextmanager
def _patched(owner, name: str, replacement):
    saved = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def _nibble_order_swapped():
    """Packing puts element 2i in the high nibble (the program reads it from the low one)."""
    from tpuexport.quantize import weight_only

    def swapped(integers):
        nibbles = integers.contiguous().view(torch.uint8) & 0x0F
        return (nibbles[..., 0::2] << 4) | nibbles[..., 1::2]

    return _patched(weight_only, "pack_int4", swapped)


def _dequantized_with(regroup):
    """QuantizedArray.scaled_groups of int4 weights (what their products and dequantized copies
    use) with `regroup(integers, scale, position)` -> (grouped integers, scale broadcast to them) in
    place of the correct grouping."""
    from tpuexport.lower.quantized_weights import QuantizedArray

    correct = QuantizedArray.scaled_groups

    def scaled_groups(self, integers, scale, position):
        if self.bits != 4:
            return correct(self, integers, scale, position)
        grouped, scale = regroup(integers, scale, position)
        return (grouped.astype(self.dtype) * scale.astype(self.dtype)).reshape(integers.shape)

    return _patched(QuantizedArray, "scaled_groups", scaled_groups)


def _wrong_group_boundary():
    """Groups taken as every (size/group)-th element instead of consecutive runs of `group`."""
    def regroup(integers, scale, position):
        shape = integers.shape
        groups = scale.shape[position]
        grouped = integers.reshape(shape[:position] + (shape[position] // groups, groups) + shape[position + 1:])
        return grouped, jnp.expand_dims(scale, position)

    return _dequantized_with(regroup)


def _scale_of_the_wrong_group():
    """Each group multiplied by its neighbour's scale (the scales rolled by one group)."""
    def regroup(integers, scale, position):
        shape = integers.shape
        groups = scale.shape[position]
        grouped = integers.reshape(shape[:position] + (groups, shape[position] // groups) + shape[position + 1:])
        return grouped, jnp.expand_dims(jnp.roll(scale, 1, axis=position), position + 1)

    return _dequantized_with(regroup)


WEIGHT_ONLY_BUGS = {
    "int4_nibble_order_swapped": _nibble_order_swapped,
    "int4_wrong_group_boundary": _wrong_group_boundary,
    "int4_scale_of_the_wrong_group": _scale_of_the_wrong_group,
}


def _convolution_scaled_with(scaled):
    """quantized_convolution with `scaled(x, integers, scale, options)` -> the result in place of the correct one."""
    from tpuexport.lower import quantized_weights

    def quantized_convolution(x, weight, bias, *options):
        integers = weight.integers().reshape(weight.shape).astype(weight.dtype)
        scale = weight.scale.reshape(-1).astype(jnp.promote_types(weight.scale.dtype, weight.dtype))
        result = scaled(x, integers, scale, options, len(weight.kernel) - 2)
        if bias is not None:
            result = result + bias.reshape(bias.shape + (1,) * (len(weight.kernel) - 2)).astype(result.dtype)
        return result.astype(weight.dtype)

    return _patched(quantized_weights, "quantized_convolution", quantized_convolution)


def _convolution(x, integers, options):
    from tpuexport.lower.aten_lowerings import torchax_lowering

    return torchax_lowering(torch.ops.aten.convolution.default)(x, integers, None, *options)


def _conv_scale_of_the_wrong_channel():
    return _convolution_scaled_with(lambda x, integers, scale, options, spatial:
                                    _convolution(x, integers, options) * jnp.roll(scale, 1).reshape((-1,) + (1,) * spatial))


def _conv_scale_on_the_input_channels():
    def scaled(x, integers, scale, options, spatial):
        per_channel = scale.reshape((-1,) + (1,) * spatial)
        if integers.shape[0] == integers.shape[1] and options[-1] == 1:
            return _convolution(x * per_channel.astype(x.dtype), integers, options)
        return _convolution(x, integers, options) * per_channel

    return _convolution_scaled_with(scaled)


WEIGHT_ONLY_CONVOLUTION_BUGS = {
    "conv_scale_of_the_wrong_channel": _conv_scale_of_the_wrong_channel,
    "conv_scale_on_the_input_channels": _conv_scale_on_the_input_channels,
}
