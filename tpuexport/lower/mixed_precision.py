"""Where a program computes in bfloat16, per --precision.

  f32         everything in f32 (the TPU's matmul arithmetic is --matmul-precision's)
  bf16        weights, inputs and every op in bfloat16; outputs in the model's dtypes
  bf16-mixed  autocast-like: matmuls and convolutions take bfloat16 operands and give bfloat16
              results; softmax, norms, reductions and exp/log/pow/sqrt/rsqrt take f32 operands;
              other elementwise ops compute in their operands' promoted dtype (bf16 only where all
              of them are); weight matrices and kernels (rank >= 2) are stored in bfloat16,
              vectors (biases, norm scales) in f32; outputs in the model's dtypes

Quantized programs: int8 weights and the f32 scales of every quantization op are stored as they
are (a bfloat16 scale would bias whole channels by up to 0.4%); an int8 dot or convolution is
rescaled in f32 and its result rounded once to bfloat16 under bf16 and bf16-mixed (so are
dequantized weights of int8-weight-only programs), so the elementwise ops after it run in bfloat16.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

PRECISIONS = ("f32", "bf16", "bf16-mixed")

_aten = torch.ops.aten
MATMULS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten.convolution.default})
F32_OPS = frozenset({
    _aten._softmax.default, _aten._log_softmax.default, _aten.native_layer_norm.default, _aten.native_group_norm.default,
    _aten._native_batch_norm_legit_no_training.default, _aten.sum.dim_IntList, _aten.sum.default, _aten.mean.dim,
    _aten.mean.default, _aten.var.correction, _aten.var_mean.correction, _aten.amax.default, _aten.amin.default,
    _aten.prod.dim_int, _aten.cumsum.default, _aten.logsumexp.default, _aten.exp.default, _aten.log.default,
    _aten.pow.Tensor_Scalar, _aten.pow.Tensor_Tensor, _aten.sqrt.default, _aten.rsqrt.default,
})
# Operators of quantized programs (defined by the quantize stage, found here by namespace).
_QUANTIZATION_NAMESPACES = ("tpuexport::", "quantized_decomposed::")


def is_quantization_op(target) -> bool:
    return str(getattr(target, "_name", "")).startswith(_QUANTIZATION_NAMESPACES)


def _dequantizes(target) -> bool:
    """int8 ops and dequantizes: their f32 results are real values (not scales, not int8)."""
    name = str(getattr(target, "_name", ""))
    return name.startswith("tpuexport::int8_") or name.startswith("quantized_decomposed::dequantize")


def stored_weight(array: np.ndarray, precision: str, quantization_input: bool) -> np.ndarray:
    """A weight in the dtype the program stores it in.

    Args:
      array: the weight as exported (64-bit already narrowed).
      precision: one of PRECISIONS.
      quantization_input: whether a quantization op reads it (int8 weights, scales: kept as they are).
    Returns:
      The array, bfloat16 where the precision stores it so.
    """
    dtype = stored_dtype(array.dtype, array.ndim, precision, quantization_input)
    return array if dtype == array.dtype else array.astype(dtype)


def stored_dtype(dtype: np.dtype, ndim: int, precision: str, quantization_input: bool) -> np.dtype:
    """The dtype the program stores a weight in, from its exported dtype and rank alone (plans
    without weights need it without an array).

    Args:
      dtype: the weight's dtype as exported (64-bit already narrowed).
      ndim: its rank.
      precision: one of PRECISIONS.
      quantization_input: whether a quantization op reads it (kept as it is).
    Returns:
      bfloat16 where the precision stores the weight so, else `dtype`.
    """
    dtype = np.dtype(dtype)
    if quantization_input or not np.issubdtype(dtype, np.floating):
        return dtype
    if precision == "bf16" or (precision == "bf16-mixed" and ndim >= 2):
        return np.dtype(ml_dtypes.bfloat16)
    return dtype


def _cast(values, source, destination):
    def cast(value):
        if hasattr(value, "dtype") and value.dtype == source:
            return value.astype(destination)
        if isinstance(value, (list, tuple)):
            return type(value)(cast(item) for item in value)
        return value

    return [cast(value) for value in values]


def cast_arguments(precision: str, target, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments of one op in the dtypes the precision computes it in.

    Under bf16 a few lowerings give f32 from bfloat16 operands (SegFormer's bilinear upsampling
    feeds a convolution); a convolution, which unlike a dot does not promote mixed operands, then
    gets them in bfloat16. bf16-mixed casts the operands of every matmul and convolution."""
    if precision == "bf16" and target == _aten.convolution.default:
        return tuple(_cast(args, jnp.float32, jnp.bfloat16)), kwargs
    if precision != "bf16-mixed":
        return args, kwargs
    if target in MATMULS:
        return tuple(_cast(args, jnp.float32, jnp.bfloat16)), dict(zip(kwargs, _cast(kwargs.values(), jnp.float32, jnp.bfloat16)))
    if target == _aten.scaled_dot_product_attention.default:  # q, k, v as a matmul's operands; a float mask stays f32
        return (*_cast(args[:3], jnp.float32, jnp.bfloat16), *args[3:]), kwargs
    if target in F32_OPS:
        return tuple(_cast(args, jnp.bfloat16, jnp.float32)), dict(zip(kwargs, _cast(kwargs.values(), jnp.bfloat16, jnp.float32)))
    return args, kwargs


def cast_result(precision: str, target, value):
    """An op's result in the dtype the precision keeps it in: the f32 results of int8 ops (rescaled
    dots, convolutions, embedding rows) and of dequantizes become bfloat16 under bf16 and bf16-mixed."""
    if precision != "f32" and _dequantizes(target) and getattr(value, "dtype", None) == jnp.float32:
        return value.astype(jnp.bfloat16)
    return value
