"""Deliberately wrong lowerings, to show that verification catches real bugs (tests and benchmarks).

Each bug is a context manager that swaps one of tpuexport's own JAX lowerings for a subtly wrong
one while a program is lowered. They are the mistakes an integer lowering can plausibly make:

  int8_scale_off_by_one_step  the rescale uses max|x|/128 where the quantizer used max|x|/127
                              (every integer matmul/conv result 0.8% too small)
  int8_missing_bias           the bias of every integer linear/convolution is dropped
  int8_wrong_zero_point       activations are quantized with zero point 1 instead of 0 (a one-step shift)
"""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
import torch

from tpuexport.lower.registry import OWN_LOWERINGS
from tpuexport.quantize import ops

_tx = torch.ops.tpuexport
_qd = torch.ops.quantized_decomposed


@contextlib.contextmanager
def _swapped(replacements: dict):
    saved = {operator: OWN_LOWERINGS[operator] for operator in replacements}
    OWN_LOWERINGS.update(replacements)
    try:
        yield
    finally:
        OWN_LOWERINGS.update(saved)


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
        _tx.int8_linear.default: _scaled(OWN_LOWERINGS[_tx.int8_linear.default], 127 / 128),
        _tx.int8_conv.default: _scaled(OWN_LOWERINGS[_tx.int8_conv.default], 127 / 128),
        _tx.int8_matmul.default: _scaled(OWN_LOWERINGS[_tx.int8_matmul.default], 127 / 128),
    })


def int8_missing_bias():
    return _swapped({
        _tx.int8_linear.default: _without_bias(OWN_LOWERINGS[_tx.int8_linear.default], 4),
        _tx.int8_conv.default: _without_bias(OWN_LOWERINGS[_tx.int8_conv.default], 4),
    })


def int8_wrong_zero_point():
    static = OWN_LOWERINGS[_qd.quantize_per_tensor.default]

    def shifted_static(x, scale, zero_point, quant_min, quant_max, dtype):
        return static(x, scale, 1, quant_min, quant_max, dtype)

    return _swapped({_qd.quantize_per_tensor.default: shifted_static, _qd.quantize_per_tensor.tensor: _shifted_quantize})


INT8_BUGS = {
    "int8_scale_off_by_one_step": int8_scale_off_by_one_step,
    "int8_missing_bias": int8_missing_bias,
    "int8_wrong_zero_point": int8_wrong_zero_point,
}
