"""Weight-only int8/int4 weights inside the traced program: the matrix products read them as
integers and convert them where they multiply, so the TPU keeps them s8/s4 in HBM.

A quantized weight reaches the interpreter as a `QuantizedArray` (its integer argument, its scale
argument, how to combine them). The ops that read it in a weight-only program (quantize/weight_only.py
chose the weights whose every use is one of them) take it as it is:

  t / permute / transpose   a lazy transpose (the weight is not moved)
  expand / view             to its own shape with leading dims: the weight broadcast over a batch,
                            which the product below does without a copy
  mm / bmm / addmm          x @ (convert(w) * scale), converted inside the dot. An int4 weight
                            stays as its s4 pairs [.., m, 2] (the two nibbles of a byte), the
                            pair dim contracted with x's pairs (or kept as output features):
                            reshaping the pairs into the packed dim first makes v5e's compiler
                            (libtpu 0.0.50.1) write the whole dequantized bf16 weight to HBM
                            (Llama-3-8B's MLP at 8 tokens: 58 MB of temporaries, none in pairs).
                            Per output chunk (CHUNK_ELEMENTS), which bounds the float copy the
                            compiler makes at prefill sizes, where the weight is read by many rows
  embedding                 the looked-up rows only, converted after the gather
  convolution               a weight stored as its [out, in/groups x kernel] matrix with one scale
                            per output channel: the integers reshaped to the kernel and converted
                            go to the convolution, the scales multiply its result (they commute
                            with the contraction); on v5e the convolution reads the s8 (or s4)
                            weight inside its fusion, no float copy of it exists (a per-group
                            int4 scale would need one: benchmarks/studies/weight_only_convolutions.py)
  grouped matmul            an int8 [experts, k, n] weight (per output channel) as ragged_dot's
                            s8 right-hand side, f32 accumulation, each row's product times its
                            expert's scales after the dot (the scale commutes with the
                            contraction), reaching the rows by a one-hot product that fuses into
                            the multiply: on v5e no converted copy of the weight exists (Mixtral's
                            gate/up at 64 rows: 458 MiB accessed, against 2245 MiB when
                            dequantized first; at 4096 rows, a 2048-token top-2 prefill, 1041 MiB
                            as for bf16 weights; benchmarks/studies/grouped_matmul.py)

Any other op gets the dequantized weight (correct, but it materializes: the selection avoids it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import torch

from tpuexport.lower.aten_lowerings import group_sizes_of, grouped_mm, torchax_lowering
from tpuexport.lower.registry import own_lowering
from tpuexport.lower.torchax_import import import_torchax

# Largest number of weight elements one dot converts: at 2048 tokens v5e copies a dequantized chunk to
# HBM, so this bounds the copy (benchmarks/studies/weight_only_fusion.py --tokens 2048).
CHUNK_ELEMENTS = 2 ** 25

_aten = torch.ops.aten


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A weight-only weight while tracing (a JAX pytree: scans index its leaves together).

    Attributes:
      values: int8 integers, or int4 packed two per byte in uint8 (last dim halved), in the
        stored weight's layout (leading dims of a stack).
      scale: the scales: the stored shape with `axis` divided by the group size.
      bits: 8 or 4.
      axis: the stored weight's contraction axis, -1 or -2 (counted from the end: stacks add dims in front).
      dtype: the float dtype the weight computes in.
      transposed: whether the op reading it sees the stored weight's last two axes swapped.
      kernel: a convolution weight's shape (one block's: [out, in/groups, *kernel]), stored as
        its [out, in/groups x kernel] matrix with axis -1 and one scale per output channel; None
        for other weights.
    """

    values: jax.Array
    scale: jax.Array
    bits: int = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))
    dtype: jnp.dtype = dataclasses.field(metadata=dict(static=True))
    transposed: bool = dataclasses.field(default=False, metadata=dict(static=True))
    kernel: tuple[int, ...] | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def stored_shape(self) -> tuple[int, ...]:
        shape = tuple(self.values.shape)
        return shape[:-1] + (shape[-1] * 2,) if self.bits == 4 else shape

    @property
    def shape(self) -> tuple[int, ...]:
        shape = self.stored_shape
        if self.kernel is not None:
            return shape[:-2] + self.kernel
        return shape[:-2] + (shape[-1], shape[-2]) if self.transposed else shape

    def astype(self, dtype) -> "QuantizedArray":
        """The same weight computing in another float dtype (precision casts of matmul operands)."""
        return dataclasses.replace(self, dtype=jnp.dtype(dtype))

    def dequantized(self) -> jax.Array:
        """convert(values) * scale per group, multiplied in the wider of the scale's dtype and
        `dtype`, rounded once to `dtype`; as the op reading it sees it."""
        integers = self.integers()
        weight = self.scaled_groups(integers, self.scale, integers.ndim + self.axis)
        if self.kernel is not None:
            return weight.reshape(self.shape)
        return jnp.swapaxes(weight, -1, -2) if self.transposed else weight

    def scaled_pairs(self) -> jax.Array:
        """An int4 weight converted and scaled as s4 pairs [..., a, b / 2, 2] of its stored shape
        [..., a, b] (pair p of column c is element 2c + p), in `dtype`; static shapes only."""
        pairs = jax.lax.bitcast_convert_type(self.values, jnp.int4)
        if self.axis == -1:  # groups along the columns: one scale for both elements of a pair
            return self.scaled_groups(pairs, self.scale[..., None], pairs.ndim - 2)
        return self.scaled_groups(pairs, self.scale.reshape(self.scale.shape[:-1] + pairs.shape[-2:]), pairs.ndim - 3)

    def scaled_groups(self, integers: jax.Array, scale: jax.Array, position: int) -> jax.Array:
        """`integers` converted and times `scale` per group along axis `position` (consecutive
        runs; `scale` has integers' shape, or 1 where it broadcasts, with that axis divided by
        the group size), multiplied in the wider of the scale's dtype and `dtype`, in `dtype`."""
        shape = integers.shape
        groups = scale.shape[position]
        product = jnp.promote_types(scale.dtype, self.dtype)
        grouped = integers.reshape(shape[:position] + (groups, shape[position] // groups) + shape[position + 1:])
        return (grouped.astype(product) * jnp.expand_dims(scale.astype(product), position + 1)).reshape(shape).astype(self.dtype)

    def integers(self) -> jax.Array:
        """The integers (int4 unpacked) in the stored shape, not converted."""
        integers = self.values
        if self.bits == 4 and any(not isinstance(size, int) for size in self.values.shape):
            # Looked-up rows have symbolic shapes, which XLA's bitcast does not take: unpack by arithmetic.
            nibbles = jnp.stack([integers & 0x0F, integers >> 4], axis=-1).astype(jnp.int8)
            integers = jnp.where(nibbles > 7, nibbles - 16, nibbles).reshape(self.stored_shape)
        elif self.bits == 4:
            # u8[..., m] -> s4[..., m, 2]: the low nibble is element 0 (quantize/weight_only.py packs so).
            integers = jax.lax.bitcast_convert_type(integers, jnp.int4).reshape(self.stored_shape)
        return integers

    def rows(self, start: int, stop: int) -> "QuantizedArray":
        """Rows start:stop of a weight stored (out, in) (axis -1), with their scales."""
        return dataclasses.replace(self, values=self.values[..., start:stop, :], scale=self.scale[..., start:stop, :])


def dequantize_all(value):
    """`value` with every QuantizedArray in it (lists, tuples) replaced by its dequantized weight."""
    if isinstance(value, QuantizedArray):
        return value.dequantized()
    if isinstance(value, (list, tuple)):
        return type(value)(dequantize_all(item) for item in value)
    return value


def holds_quantized(args, kwargs) -> bool:
    return any(isinstance(value, QuantizedArray) for value in (*args, *kwargs.values()))


def call_with_quantized(target, args: tuple, kwargs: dict):
    """Runs an op one of whose arguments is a QuantizedArray.

    Returns:
      The op's value: a QuantizedArray for a transpose, expand or view of one; the product or
      the looked-up rows for mm/bmm/addmm and embedding; else the op on the dequantized weight
      (None is returned for that case so the caller runs the op normally).
    """
    weight = args[0] if args and isinstance(args[0], QuantizedArray) else None
    if weight is not None and target in (_aten.t.default, _aten.permute.default, _aten.transpose.int):
        return dataclasses.replace(weight, transposed=not weight.transposed)
    if weight is not None and target in (_aten.expand.default, _aten.view.default):
        size = tuple(args[1])
        if tuple(size[-2:]) == weight.shape[-2:]:
            return weight  # broadcast over leading dims: the product below broadcasts it
    if target in (_aten.mm.default, _aten.bmm.default) and isinstance(args[1], QuantizedArray) and not kwargs:
        return quantized_matmul(args[0], args[1])
    if target is _aten.addmm.default and isinstance(args[2], QuantizedArray) and kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1:
        product = quantized_matmul(args[1], args[2])
        return product + args[0].astype(product.dtype)
    if target is _aten.embedding.default and weight is not None and not weight.transposed:
        return _embedding(weight, args[1])
    if own_lowering(target) is grouped_mm and _reads_per_channel_int8(args, kwargs):
        return quantized_grouped_matmul(args[0], args[1], args[2], kwargs.get("out_dtype"))
    if (target is _aten.convolution.default and len(args) == 9 and not kwargs and isinstance(args[1], QuantizedArray)
            and args[1].kernel is not None and not args[6] and not holds_quantized((args[0], args[2]), {})):
        return quantized_convolution(*args)
    return None


def quantized_convolution(x: jax.Array, weight: QuantizedArray, bias, *options) -> jax.Array:
    """aten.convolution (not transposed) of `x` with a convolution weight: over its integers
    converted to weight.dtype, then times the scale of each output channel (in the wider of the
    scale's dtype and weight.dtype), plus the bias; in weight.dtype.

    Args:
      x: the input, [batch, channels, *spatial] or unbatched.
      weight: the QuantizedArray (one scale per output channel, `kernel` set).
      bias: the bias or None.
      options: stride, padding, dilation, transposed (False), output_padding, groups.
    """
    integers = weight.integers().reshape(weight.shape).astype(weight.dtype)
    result = torchax_lowering(_aten.convolution.default)(x, integers, None, *options)
    spatial = len(weight.kernel) - 2
    product = jnp.promote_types(weight.scale.dtype, weight.dtype)
    scale = weight.scale.reshape(weight.scale.shape[:-2] + (-1,) + (1,) * spatial).astype(product)
    result = result.astype(product) * scale
    if bias is not None:
        result = result + bias.reshape(bias.shape + (1,) * spatial).astype(product)
    return result.astype(weight.dtype)


def _reads_per_channel_int8(args: tuple, kwargs: dict) -> bool:
    """Whether a grouped matmul's only quantized argument is its [experts, k, n] right-hand side,
    int8 with one scale per output channel, and it has offsets and no bias."""
    weight = args[1] if len(args) > 2 and isinstance(args[1], QuantizedArray) else None
    return (weight is not None and weight.bits == 8 and not weight.transposed and weight.axis == -2 and weight.scale.shape[-2] == 1
            and not isinstance(args[0], QuantizedArray) and kwargs.get("bias") is None and len(args) == 3)


def quantized_grouped_matmul(rows: jax.Array, weight: QuantizedArray, offsets: jax.Array, out_dtype=None) -> jax.Array:
    """`rows` (sorted by expert; `offsets` where each expert's end) times their expert's int8
    matrix: ragged_dot over the integers, then each row's result times its expert's scales."""
    group_sizes = group_sizes_of(offsets)
    product = jax.lax.ragged_dot(rows, weight.values, group_sizes, preferred_element_type=jnp.float32)
    # Each row's scales as a one-hot [rows, experts] matrix (the row's expert; no expert for rows past the
    # last end, whose product is zeros) times the [experts, n] scales: XLA fuses this small exact product into
    # the multiply. Gathering the scales per row (jnp.take) instead materializes a [rows, n] table and pushes the
    # f32 product out of VMEM: v5e, Mixtral gate/up at 4096 rows, 2290 MiB accessed against 1041
    # (benchmarks/studies/grouped_matmul.py).
    row = jnp.arange(rows.shape[0], dtype=offsets.dtype)[:, None]
    starts = jnp.concatenate([jnp.zeros((1,), offsets.dtype), offsets[:-1]])
    membership = ((row >= starts[None, :]) & (row < offsets[None, :])).astype(jnp.float32)
    row_scales = jnp.dot(membership, weight.scale[..., 0, :].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return (product * row_scales).astype(rows.dtype if out_dtype is None else import_torchax().ops.mappings.t2j_dtype(out_dtype))


def quantized_matmul(x: jax.Array, weight: QuantizedArray) -> jax.Array:
    """x @ weight, weight the (k, n) right-hand side (its leading dims, if any, broadcast over
    x's), in weight.dtype, the weight converted inside each dot over chunks of output features."""
    k, n = weight.shape[-2:]
    if weight.transposed and k * n > CHUNK_ELEMENTS:
        # Output features are the stored weight's rows: chunk them (a divisor of n, so each dot is alike).
        rows = max((size for size in range(1, n + 1) if n % size == 0 and size * k <= CHUNK_ELEMENTS), default=n)
        return jnp.concatenate([_matmul(x, weight.rows(start, start + rows)) for start in range(0, n, rows)], axis=-1)
    return _matmul(x, weight)


def _matmul(x: jax.Array, weight: QuantizedArray) -> jax.Array:
    """x @ weight, an int4 weight read as its s4 pairs (QuantizedArray.scaled_pairs)."""
    contracts_stored_last = weight.transposed
    if weight.bits != 4 or weight.kernel is not None or weight.axis != (-1 if contracts_stored_last else -2):
        return jnp.matmul(x, weight.dequantized())
    pairs = weight.scaled_pairs()
    if contracts_stored_last:  # stored (n, k): x's features in pairs meet the weight's pairs
        paired = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
        return jnp.einsum("...tcp,...ncp->...tn", paired, pairs)
    # stored (k, n): the pairs are output features, n / 2 of them times 2
    product = jnp.einsum("...tk,...kcp->...tcp", x, pairs)
    return product.reshape(*product.shape[:-2], weight.shape[-1])


def _embedding(weight: QuantizedArray, indices: jax.Array) -> jax.Array:
    """The rows of a quantized table at `indices`, gathered as integers and converted after."""
    rows = dataclasses.replace(weight, values=jnp.take(weight.values, indices, axis=0), scale=jnp.take(weight.scale, indices, axis=0))
    return rows.dequantized()
