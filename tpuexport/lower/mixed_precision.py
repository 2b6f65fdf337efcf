"""Where a program computes in bfloat16, per --precision.

  auto        (the default) the model's own dtypes, tensor by tensor: every weight and input as
              the model holds it (bf16 parameters stay bf16, f32 buffers and parameters stay
              f32), every op in the dtypes the exported graph gives it, as eager PyTorch runs it
  f32         weights and floating inputs in f32 (bfloat16/float16 ones widened); ops as the
              graph casts them (the TPU's matmul arithmetic is --matmul-precision's)
  bf16        weights, inputs and every op in bfloat16, except the f32 state the model keeps in
              f32 on purpose: non-persistent f32 buffers (a rotary `inv_freq`) and the weights of
              modules named in a Hugging Face model's `_keep_in_fp32_modules`. What is computed
              from that state alone (rotary angles, their cos/sin) stays f32 and is rounded to
              bfloat16 where it meets bfloat16 values, as Hugging Face's bf16 models do.
              Outputs in the model's dtypes
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

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

PRECISIONS = ("auto", "f32", "bf16", "bf16-mixed")
DEFAULT_PRECISION = "auto"
# What a program computes in, for its tolerances (resolve_precision): 16-bit float types in its StableHLO.
_HALF_TYPES = {"bf16": re.compile(r"[<x]bf16>"), "f16": re.compile(r"[<x]f16>")}

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


def stored_weight(array: np.ndarray, precision: str, kept: bool) -> np.ndarray:
    """A weight in the dtype the program stores it in.

    Args:
      array: the weight as exported (64-bit already narrowed).
      precision: one of PRECISIONS.
      kept: whether it is kept as it is (a quantization op reads it: int8 weights, scales; or the
        model keeps it in f32 on purpose, see the module docstring).
    Returns:
      The array, in the dtype the precision stores it in.
    """
    dtype = stored_dtype(array.dtype, array.ndim, precision, kept)
    return array if dtype == array.dtype else array.astype(dtype)


def is_float(dtype) -> bool:
    """Whether a numpy dtype is floating point, bfloat16 included (numpy does not count it)."""
    dtype = np.dtype(dtype)
    return np.issubdtype(dtype, np.floating) or dtype == ml_dtypes.bfloat16


def stored_dtype(dtype: np.dtype, ndim: int, precision: str, kept: bool) -> np.dtype:
    """The dtype the program stores a weight in, from its exported dtype and rank alone (plans
    without weights need it without an array).

    Args:
      dtype: the weight's dtype as exported (64-bit already narrowed).
      ndim: its rank.
      precision: one of PRECISIONS.
      kept: whether it is kept as it is (see stored_weight).
    Returns:
      bfloat16 or float32 where the precision stores the weight so, else `dtype`.
    """
    dtype = np.dtype(dtype)
    if kept or not is_float(dtype):
        return dtype
    if precision == "bf16" or (precision == "bf16-mixed" and ndim >= 2):
        return np.dtype(ml_dtypes.bfloat16)
    if precision == "f32":
        return np.dtype(np.float32)
    return dtype


def input_compute_dtype(precision: str):
    """The dtype the program casts its floating inputs to on entry (None: as the model declares them)."""
    return {"bf16": jnp.bfloat16, "f32": jnp.float32}.get(precision)


def resolve_precision(precision: str, exported: jax.export.Exported | None, input_dtypes) -> str:
    """What a program computes in, for its verification tolerances and the manifest.

    Args:
      precision: the requested one (PRECISIONS).
      exported: the lowered program, or None when `input_dtypes` already names every dtype it
        computes in.
      input_dtypes: the dtype names of the model's inputs and outputs (what eager PyTorch computes
        with; a bfloat16 model is compared in bfloat16 even where the program widens it).
    Returns:
      "bf16" or "bf16-mixed" as requested; for "auto" and "f32": "bf16" (or "f16") when the program
      or the model's interface holds 16-bit floats, else "f32".
    """
    if precision in ("bf16", "bf16-mixed"):
        return precision
    text = exported.mlir_module() if exported is not None else ""
    names = set(input_dtypes)
    for name, pattern in _HALF_TYPES.items():
        if ({"bf16": "bfloat16", "f16": "float16"}[name] in names) or pattern.search(text):
            return name
    return "f32"


def _cast(values, source, destination):
    def cast(value):
        if hasattr(value, "dtype") and value.dtype == source:
            return value.astype(destination)
        if isinstance(value, (list, tuple)):
            return type(value)(cast(item) for item in value)
        return value

    return [cast(value) for value in values]


def kept_f32_meetings(graph: torch.fx.Graph, kept: frozenset[str]) -> frozenset[torch.fx.Node]:
    """The ops where values computed from kept f32 state alone meet other floating values: there
    bf16 rounds the kept values to bfloat16 (module docstring).

    Args:
      graph: the decomposed program's graph.
      kept: names of the placeholders the program keeps in f32.
    Returns:
      The nodes whose floating operands come from kept state (with integers: positions) and from
      other floating values (weights, inputs) alike.
    """
    sources: dict[torch.fx.Node, frozenset[str]] = {}
    meetings = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            value = node.meta.get("val")
            floating = isinstance(value, torch.Tensor) and value.dtype.is_floating_point
            sources[node] = frozenset({"kept" if node.name in kept else "other"}) if floating else frozenset()
            continue
        inputs = [sources.get(argument, frozenset()) for argument in node.all_input_nodes]
        sources[node] = frozenset().union(*inputs)
        if any(found == {"kept"} for found in inputs) and "other" in sources[node]:
            meetings.add(node)
    return frozenset(meetings)


def cast_arguments(precision: str, target, args: tuple, kwargs: dict, kept_meets_bf16: bool = False) -> tuple[tuple, dict]:
    """The arguments of one op in the dtypes the precision computes it in.

    Under bf16 a few lowerings give f32 from bfloat16 operands (SegFormer's bilinear upsampling
    feeds a convolution); a convolution, which unlike a dot does not promote mixed operands, then
    gets them in bfloat16; so do the f32 values computed from kept f32 state where they meet
    bfloat16 ones (`kept_meets_bf16`, see kept_f32_meetings). bf16-mixed casts the operands of
    every matmul and convolution."""
    if precision == "bf16" and (kept_meets_bf16 or target == _aten.convolution.default):
        return tuple(_cast(args, jnp.float32, jnp.bfloat16)), dict(zip(kwargs, _cast(kwargs.values(), jnp.float32, jnp.bfloat16)))
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
    if precision in ("bf16", "bf16-mixed") and _dequantizes(target) and getattr(value, "dtype", None) == jnp.float32:
        return value.astype(jnp.bfloat16)
    return value
