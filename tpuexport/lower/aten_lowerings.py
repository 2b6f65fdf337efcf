"""tpuexport's own lowerings of ATen operators whose torchax lowering fails on patterns real models use.

Each is registered in lower/registry.py and so runs instead of torchax's; where only some
arguments need it, the rest go to torchax's lowering unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpuexport.lower.registry import register_lowering
from tpuexport.lower.torchax_import import import_torchax

aten = torch.ops.aten


def torchax_lowering(operator):
    """torchax's JAX function for `operator`: registered for the overload, or for all overloads of
    the operator at once (its OpOverloadPacket, as torchax registers `avg_pool2d`), looked up in that
    order as torchax's own interpreter does."""
    registry = import_torchax().ops.ops_registry.all_aten_ops
    return (registry.get(operator) or registry[operator.overloadpacket]).func


def _is_integer(value) -> bool:
    """A Python int or a JAX symbolic dim (an integer expression such as `seq + 2`)."""
    return isinstance(value, (int, np.integer)) or jax.export.is_symbolic_dim(value)


@register_lowering(aten.nonzero_static.default)
def nonzero_static(inputs, *, size, fill_value=-1):
    """The positions of the first `size` nonzero values (torchax's finds them all first, which JAX
    cannot size unless the values are known while tracing)."""
    return jnp.argwhere(inputs, size=size, fill_value=fill_value)


@register_lowering(aten.arange.default)
@register_lowering(aten.arange.start)
@register_lowering(aten.arange.start_step)
def arange(start, end=None, step=1, *, dtype=None, layout=None, device=None, pin_memory=None):
    """`torch.arange` whose bounds may be symbolic dims (position ids `arange(seq)`, BART's
    `arange(past, past + seq)`, relative-position buckets).

    jnp.arange needs concrete bounds; with integer bounds the length is the integer expression
    ceil((end - start) / step), which a symbolic dim can express, and the values are an iota.
    """
    if end is None:
        start, end = 0, start
    if not all(_is_integer(value) for value in (start, end, step)):
        return torchax_lowering(aten.arange.start_step)(start, end, step, dtype=dtype)
    if step > 0:
        length = (end - start + step - 1) // step
    else:
        length = (start - end - step - 1) // -step
    jax_dtype = jax.dtypes.canonicalize_dtype(import_torchax().ops.mappings.t2j_dtype(dtype or torch.int64))
    return jax.lax.iota(jax_dtype, length) * jnp.asarray(step, jax_dtype) + jnp.asarray(start, jax_dtype)


@register_lowering(aten.avg_pool1d.default)
@register_lowering(aten.avg_pool2d.default)
@register_lowering(aten.avg_pool3d.default)
def avg_pool(inputs, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    """Average pooling where `ceil_mode` adds a partial last window and padding counts in the mean
    (EfficientNet's pooler: `AvgPool2d(kernel, ceil_mode=True)`).

    torchax corrects the divisor of such windows element by element, looping over every output
    index, which fails on a symbolic batch dim. Here the divisor is itself a window sum, of ones over
    the input and its declared padding; the extra padding that ceil_mode adds counts as zero, as in
    torch. Other cases, and spatial dims that are symbolic, go to torchax's lowering.
    """
    spatial = inputs.shape[inputs.ndim - len(kernel_size):]
    if not (ceil_mode and count_include_pad and divisor_override is None and all(isinstance(s, int) for s in spatial)):
        # torchax registers one function for 1-, 2- and 3-d pooling.
        return torchax_lowering(aten.avg_pool2d.default)(inputs, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    dims = len(kernel_size)
    stride = list(stride) or list(kernel_size)
    padding = [padding] if isinstance(padding, int) else list(padding)
    padding = padding * dims if len(padding) == 1 else padding
    kernel, extra = zip(*(_ceil_mode_window(*args) for args in zip(spatial, kernel_size, stride, padding)))
    leading = inputs.ndim - dims
    sums = jax.lax.reduce_window(inputs, jnp.array(0, inputs.dtype), jax.lax.add, (1,) * leading + kernel,
                                 (1,) * leading + tuple(stride), [(0, 0)] * leading + [(p, p + e) for p, e in zip(padding, extra)])
    counted = jnp.pad(jnp.ones(spatial, inputs.dtype), [(p, p) for p in padding], constant_values=1)
    counts = jax.lax.reduce_window(counted, jnp.array(0, inputs.dtype), jax.lax.add, kernel, tuple(stride), [(0, e) for e in extra])
    return (sums / counts).astype(inputs.dtype)


def _ceil_mode_window(size: int, kernel: int, stride: int, padding: int) -> tuple[int, int]:
    """The window and the padding past the right edge for one spatial dim of a ceil_mode pooling.

    torch's ceil_mode output size needs that extra padding, as its last window may reach past the
    padded input (it must only start inside the input or its left padding). A single window larger
    than the padded input is clipped to it: the rest would only sum padding zeros, and XLA:CPU's
    reduce_window returns wrong sums when padding exceeds a size-1 input at larger batches
    (EfficientNet's pooler `AvgPool2d(hidden_dim, ceil_mode=True)` over a 1x1 map, seen from batch 15).

    Returns:
      (window, extra right padding).
    """
    windows = -(-(size + 2 * padding - kernel) // stride) + 1
    if (windows - 1) * stride >= size + padding:
        windows -= 1
    if windows == 1:
        return min(kernel, size + 2 * padding), 0
    return kernel, max((windows - 1) * stride + kernel - (size + 2 * padding), 0)


@register_lowering(aten._upsample_bilinear2d_aa.default)
def upsample_bilinear_antialiased(inputs, output_size, align_corners, scales_h=None, scales_w=None):
    """`F.interpolate(..., mode="bilinear", antialias=True)`: TIPSv2's and Siglip2's position embeddings."""
    return _resample_antialiased(aten._upsample_bilinear2d_aa.default, "linear", inputs, output_size, align_corners, scales_h, scales_w)


@register_lowering(aten._upsample_bicubic2d_aa.default)
def upsample_bicubic_antialiased(inputs, output_size, align_corners, scales_h=None, scales_w=None):
    """`F.interpolate(..., mode="bicubic", antialias=True)`: DINOv2-with-registers' position embeddings."""
    return _resample_antialiased(aten._upsample_bicubic2d_aa.default, "cubic", inputs, output_size, align_corners, scales_h, scales_w)


def _resample_antialiased(operator, method: str, inputs, output_size, align_corners, scales_h, scales_w):
    """torch's antialiased resampling of the last two dims, by jax.image.scale_and_translate.

    torchax's lowering calls a copy of JAX's resampling that predates JAX's kernel table holding
    (kernel, radius) pairs, and fails with "'tuple' object is not callable". jax.image's own
    function is torch's antialiased resampling: a triangle (bilinear) or Keys cubic with a = -0.5
    (bicubic) filter, widened by the scale when downsampling, sampled at pixel centres and
    normalized over the input. align_corners and symbolic sizes go to torchax's lowering.
    """
    spatial = inputs.shape[-2:]
    if align_corners or not all(isinstance(size, int) for size in (*spatial, *output_size)):
        return torchax_lowering(operator)(inputs, output_size, align_corners, None, scales_h, scales_w)
    # torch's scale is output over input unless the call gave its own (scale_factor without recompute).
    scale = [given if given else out / size for given, out, size in zip((scales_h, scales_w), output_size, spatial)]
    return jax.image.scale_and_translate(inputs, (*inputs.shape[:-2], *output_size), (inputs.ndim - 2, inputs.ndim - 1),
                                         jnp.asarray(scale, jnp.float32), jnp.zeros(2, jnp.float32), method,
                                         antialias=True, precision=jax.lax.Precision.HIGHEST)


@register_lowering(aten._grouped_mm.default)
def grouped_mm(inputs, weights, offsets=None, bias=None, out_dtype=None):
    """`torch._grouped_mm` as mixture-of-experts layers call it: rows of `inputs` (M, K), sorted by
    expert, times their expert's matrix of `weights` (G, K, N); `offsets` (G,) holds where each
    expert's rows end. That is `jax.lax.ragged_dot`, with group sizes the offsets' differences.
    """
    if not (inputs.ndim == 2 and weights.ndim == 3 and offsets is not None and bias is None):
        raise NotImplementedError("only the mixture-of-experts form of grouped_mm lowers: "
                                  "(M, K) rows by (G, K, N) weights, with offsets and no bias")
    result = jax.lax.ragged_dot(inputs, weights, group_sizes_of(offsets))
    return result.astype(import_torchax().ops.mappings.t2j_dtype(out_dtype) if out_dtype is not None else inputs.dtype)


def group_sizes_of(offsets):
    """ragged_dot's group sizes from grouped_mm's offsets (where each group's rows end)."""
    return jnp.diff(offsets, prepend=jnp.zeros((1,), offsets.dtype)).astype(jnp.int32)


@register_lowering(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """An embedding lookup as one gather whose out-of-range ids read the nearest row.

    torchax's `jnp.take` fills rows of out-of-range ids with NaN, which is a select over the whole
    [batch, seq, hidden] result (Llama-3.2-1B at 8 x 2048: 0.27 GB written and read again on TPU);
    eager PyTorch refuses such ids instead. `padding_idx`, `scale_grad_by_freq` and `sparse` only
    change gradients.
    """
    return jnp.take(weight, indices, axis=0, mode="clip")


@register_lowering(aten._embedding_bag_forward_only.default)
@register_lowering(aten._embedding_bag.default)
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False, per_sample_weights=None,
                  include_last_offset=False, padding_idx=-1):
    """`F.embedding_bag` (sum, mean or max of each bag's rows, bags starting at `offsets`) as one gather
    and a segment reduction. torchax's reads the offsets' values on the host, which fails when they are
    an input of the program (Kimi K2.5's vision tower interpolates its position table so, its offsets
    a constant computed from the image grid). Returns torch's four outputs: the bags, each index's bag,
    each bag's size, and (for max) each bag's row of the maximum, else zeros."""
    bags = offsets.shape[0] - (1 if include_last_offset else 0)
    bag_of_index = jnp.searchsorted(offsets, jnp.arange(indices.shape[0]), side="right") - 1
    kept = (indices != padding_idx) if padding_idx >= 0 else jnp.ones(indices.shape, bool)
    rows = jnp.take(weight, indices, axis=0, mode="clip")
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None].astype(rows.dtype)
    sizes = jax.ops.segment_sum(kept.astype(jnp.int32), bag_of_index, num_segments=bags)
    if mode == 2:
        reduced = jax.ops.segment_max(jnp.where(kept[:, None], rows, -jnp.inf), bag_of_index, num_segments=bags)
        reduced = jnp.where(sizes[:, None] > 0, reduced, 0).astype(weight.dtype)
    else:
        reduced = jax.ops.segment_sum(jnp.where(kept[:, None], rows, 0), bag_of_index, num_segments=bags)
        if mode == 1:
            reduced = reduced / jnp.maximum(sizes, 1)[:, None].astype(reduced.dtype)
    return reduced, bag_of_index.astype(indices.dtype), sizes.astype(indices.dtype), jnp.zeros((bags,), indices.dtype)


@register_lowering(aten.full.default)
def full(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    """`torch.full` without a dtype takes its fill value's: int64 for an int, bool for a bool.

    torchax gives every such fill the default float dtype, so position ids started as
    `torch.full(size, fill_value=0)` and indexing an embedding (Idefics3's vision embeddings) became
    floats the gather refuses.
    """
    if dtype is None and isinstance(fill_value, (bool, np.bool_)):
        dtype = torch.bool
    elif dtype is None and _is_integer(fill_value):
        dtype = torch.int64
    return torchax_lowering(aten.full.default)(size, fill_value, dtype=dtype)


@register_lowering(aten.max_pool2d_with_indices.default)
@register_lowering(aten.max_pool3d_with_indices.default)
def max_pool_with_indices(inputs, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    """Max pooling with `ceil_mode` over symbolic spatial sizes (max_pool1d(..., ceil_mode=True) over a
    sequence, which torch exports as a 2-d pool over [batch, channels, 1, seq]).

    torchax computes ceil_mode's right padding from the input size and compares symbolic dims, which
    is inconclusive. No comparison is needed: torch's ceil_mode output size,
    ceil((L + 2p - d(k-1) - 1) / s) + 1, less one when that last window would start in the right
    padding, is min(ceil((L + 2p - d(k-1) - 1) / s) + 1, ceil((L + p) / s)), and floor is monotonic,
    so it is the window count of the input padded by p on the left and by the static
    min(p + s - 1, d(k-1)) on the right, for every L. Padding is the lowest value, so windows reaching
    past the input take the max of what they cover, as torch's do. Indices are the flat spatial
    positions of each window's first maximum (torch's CPU kernel keeps the first). Other cases go to
    torchax's lowering.

    Returns:
      (values, indices) as torch's operator.
    """
    dims = len(kernel_size)
    spatial = inputs.shape[inputs.ndim - dims:]
    if not (ceil_mode and not all(isinstance(size, int) for size in spatial)):
        return torchax_lowering(aten.max_pool2d_with_indices.default)(inputs, kernel_size, stride, padding, dilation, ceil_mode)
    stride = tuple(stride) or tuple(kernel_size)
    padding, dilation = (_per_dim(value, dims) for value in (padding, dilation))
    pads = [(p, min(p + s - 1, d * (k - 1))) for k, s, p, d in zip(kernel_size, stride, padding, dilation)]
    leading = inputs.ndim - dims
    window = (1,) * leading + tuple(kernel_size)
    strides = (1,) * leading + stride
    window_dilation = (1,) * leading + dilation
    all_pads = [(0, 0)] * leading + pads
    lowest = jnp.array(-jnp.inf if jnp.issubdtype(inputs.dtype, jnp.floating) else jnp.iinfo(inputs.dtype).min, inputs.dtype)
    values = jax.lax.reduce_window(inputs, lowest, jax.lax.max, window, strides, all_pads, window_dilation=window_dilation)
    index_dtype = jax.dtypes.canonicalize_dtype(jnp.int64)  # int32 unless JAX runs with 64-bit types
    positions = jnp.broadcast_to(jax.lax.iota(index_dtype, _product(spatial)).reshape(spatial), inputs.shape)

    def first_maximum(left, right):
        (left_value, left_index), (right_value, right_index) = left, right
        take_right = (right_value > left_value) | ((right_value == left_value) & (right_index < left_index))
        return jnp.where(take_right, right_value, left_value), jnp.where(take_right, right_index, left_index)

    _, indices = jax.lax.reduce_window((inputs, positions), (lowest, jnp.array(0, positions.dtype)), first_maximum, window, strides,
                                       all_pads, window_dilation=window_dilation)
    return values, indices


def _per_dim(value, dims: int) -> tuple:
    """A pooling argument given once or per spatial dim, per spatial dim."""
    value = [value] if isinstance(value, int) else list(value)
    return tuple(value * dims if len(value) == 1 else value)


def _product(sizes):
    """The product of sizes, symbolic ones included."""
    total = 1
    for size in sizes:
        total = total * size
    return total
