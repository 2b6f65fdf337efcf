"""`scaled_dot_product_attention` lowered as a JAX engineer writes attention.

The lowering stage keeps `aten.scaled_dot_product_attention` whole through torch's decompositions
(lowering.decompose) and lowers it here instead of tracing torch's math decomposition, which on TPU
costs twice the HBM traffic of the same attention written in JAX (benchmarks/native_jax.py; a
Llama-3.2-1B shape at 8 x 2048 in bfloat16: 2.0x the bytes and the temporaries). Three things
differ from that decomposition:

  fully masked rows  torch gives a query row whose every score is -inf zeros (`_safe_softmax`),
                     found by an -inf compare and an any() over the whole [batch, heads, q, k]
                     score tensor. That extra consumer of the scores stops XLA fusing them into
                     the softmax, and so does any use of the softmax's row max or sum besides the
                     softmax itself (measured on v5e at Llama-1B's shape: 1.45x the attention's
                     bytes). Here the mask alone says which rows see no key (any() over the mask,
                     whose parts are per-query and per-key values: graph_passes.sink_attention_masks),
                     and their outputs, NaN from the plain softmax, are replaced by zeros.
  operand dtypes     torch's CPU math path converts bfloat16 q, k, v to f32 before both dots. Here
                     the dots take the operands in their own dtype and accumulate in f32
                     (`preferred_element_type`); the softmax is computed in f32 and its
                     probabilities enter the second dot in the operands' dtype, as in a JAX model.
                     f32 models compute as before (the TPU's arithmetic of every dot is the pinned
                     matmul precision either way).
  masks              a boolean mask selects scores (no f32 additive copy of it per layer), a float
                     mask is added in f32, `is_causal` is an iota compare inside the fusion, and
                     grouped-query attention reshapes the query heads into groups instead of
                     repeating the key and value heads.

A row whose scores are all -inf without a mask saying so (infinite activations) gives NaN here,
zeros in torch.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
import torch

from tpuexport.lower.registry import register_lowering

aten = torch.ops.aten


@register_lowering(aten.scaled_dot_product_attention.default)
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *,
                                 enable_gqa=False, read_heads_last=False):
    """torch.nn.functional.scaled_dot_product_attention, inference only.

    Args:
      query: [..., heads, q, dim]; key: [..., kv_heads, k, dim]; value: [..., kv_heads, k, value_dim]
        (kv_heads divides heads; equal unless the model repeats them itself or enable_gqa).
      attn_mask: None, a boolean mask (True = attend) or a float mask added to the scores,
        broadcastable to [..., heads, q, k].
      dropout_p: must be 0 (inference).
      is_causal: mask the upper triangle (query i sees keys 0..i).
      scale: the scores' factor; None for 1 / sqrt(dim).
      enable_gqa: torch's flag for kv_heads < heads (the grouping is read from the shapes).
      read_heads_last: the result's every reader swaps its heads and q dims back (the lowering's
        interpreter says so from the graph: graph_passes.reads_heads_last).
    Returns:
      [..., heads, q, value_dim] in the query's dtype.
    """
    del enable_gqa  # the shapes say it: kv_heads < heads
    if dropout_p != 0.0:
        raise NotImplementedError("scaled_dot_product_attention with dropout lowers only for inference (dropout_p=0)")
    if query.ndim == 2:  # [q, dim]: one head
        return scaled_dot_product_attention(query[None], key[None], value[None], attn_mask, dropout_p, is_causal, scale)[0]
    dtype = jnp.result_type(query, key, value)
    # torch broadcasts the batch dims (Granite Speech's Q-Former: one row of queries over every window's keys).
    lead = jnp.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
    query, key, value = (jnp.broadcast_to(operand, (*lead, *operand.shape[-3:])).astype(dtype) for operand in (query, key, value))
    heads, kv_heads = query.shape[-3], key.shape[-3]
    groups = heads // kv_heads
    q_len, k_len, dim = query.shape[-2], key.shape[-2], query.shape[-1]
    # [..., kv_heads, groups, q, dim]: each key/value head serves its group of query heads.
    grouped = query.reshape(*lead, kv_heads, groups, q_len, dim)
    scores = jnp.einsum("...hgqd,...hkd->...hgqk", grouped, key, preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(dim ** -0.5 if scale is None else scale)
    dead_rows = None  # [..., q, 1]: query rows that see no key (torch gives them zeros)
    if is_causal:
        scores = jnp.where(jax.lax.iota(jnp.int32, q_len)[:, None] >= jax.lax.iota(jnp.int32, k_len)[None, :], scores, -jnp.inf)
    if attn_mask is not None:
        mask = _grouped_mask(attn_mask, len(lead), kv_heads, groups)
        if mask.dtype == jnp.bool_:
            scores = jnp.where(mask, scores, -jnp.inf)
            dead_rows = ~jnp.any(mask, axis=-1, keepdims=True)
        else:
            scores = scores + mask.astype(jnp.float32)
            dead_rows = jnp.all(mask == -jnp.inf, axis=-1, keepdims=True)
    # The softmax exactly as XLA fuses it with the scores' dot (any other use of the row max or the
    # sum would make XLA write the f32 scores out and read them again). A dead row's max is -inf and
    # its probabilities NaN; its output is replaced below, from the mask alone.
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    exponentials = jnp.exp(scores - row_max)
    probabilities = (exponentials / jnp.sum(exponentials, axis=-1, keepdims=True)).astype(dtype)
    if read_heads_last and dtype == jnp.float32:
        # (f32 only: XLA:CPU has no dot for bf16 operands with an f32 result in this order, "DotThunk:
        # Unsupported element type BF16 x BF16 = F32", so verification could not run a bf16 program.)
        # Computed in the order its readers want ([..., q, heads, dim]: `transpose(1, 2)` before the
        # output projection) and transposed back, which XLA cancels with theirs. Computed as [...,
        # heads, q, dim], the values and the result are copied into other layouts (BERT-base on v5e:
        # three more copies per layer, 12 % of the attention block's bytes; measured in
        # benchmarks/native_jax.py). For a reader that does not transpose, this order costs more.
        attended = jnp.einsum("...hgqk,...hkd->...qhgd", probabilities, value, preferred_element_type=jnp.float32)
        attended = jnp.moveaxis(attended, -4, -2)
    else:
        attended = jnp.einsum("...hgqk,...hkd->...hgqd", probabilities, value, preferred_element_type=jnp.float32)
    if dead_rows is not None:
        attended = jnp.where(dead_rows, 0.0, attended)
    return attended.astype(query.dtype).reshape(*lead, heads, q_len, value.shape[-1])


def _grouped_mask(mask, batch_dims: int, kv_heads: int, groups: int):
    """A mask broadcastable to [..., heads, q, k] as one broadcastable to [..., kv_heads, groups, q, k]
    (no copy: a reshape, or a new axis when the mask has one head)."""
    rank = batch_dims + 3
    mask = mask.reshape((1,) * (rank - mask.ndim) + tuple(mask.shape))
    mask_heads = mask.shape[-3]
    if mask_heads == 1:
        return mask[..., None, :, :]
    return mask.reshape(*mask.shape[:-3], kv_heads, groups, *mask.shape[-2:])


# TPU executables of a bucket may compute attention with JAX's Pallas flash-attention kernel
# (lower/kernels.py re-traces the bucket with `tpuexport::attention_kernel` in place of each
# scaled_dot_product_attention whose mask it can express). The kernel keeps the [q, k] scores in
# VMEM, block by block. Measured on v5e (benchmarks/studies/kernels.py sizes, results/studies/kernels.txt: 8 x seq,
# 32 query / 8 key-value heads of 64, causal, bf16), the portable lowering vs the kernel, bytes
# accessed / temporaries:
#   seq  128:   64 MB / 0 MiB    vs   82 MB / 0 MiB   (the kernel reads 1.27x)
#   seq  256:  198 MB / 0 MiB    vs  164 MB / 0 MiB   (0.83x)
#   seq  512:  664 MB / 256 MiB  vs  327 MB / 32 MiB
#   seq 2048: 9374 MB / 4096 MiB vs 1309 MB / 512 MiB
# so the kernel is used from KERNEL_MIN_KEYS keys on, where it reads fewer bytes.
KERNEL_MIN_KEYS = 256
# Block sizes tried, largest first: the sequence must be a multiple of one (the kernel's lanes are 128 wide).
FLASH_BLOCKS = (512, 256, 128)
FLASH_ATTENTION = "flash_attention"  # the kernel's name in the manifest: jax.experimental.pallas.ops.tpu.flash_attention


@dataclasses.dataclass(frozen=True)
class KernelUse:
    """One attention op of a bucket's program at static shapes, and whether the kernel computes it.

    Attributes:
      batch, heads, kv_heads, q_len, k_len, head_dim: the op's static shapes.
      dtype: the operands' dtype name.
      causal: the mask's causal part (query i sees keys 0..i).
      scale: the scores' factor.
      key_mask: whether a per-key mask (padding) applies, given to the kernel as segment ids.
      query_mask: whether a per-query mask applies (its masked rows become zeros).
      block_sizes: {"block_q", "block_k_major", "block_k", "block_b"} when the kernel is used, else None.
      reason: why the kernel is not used (None when it is).
    """

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int
    dtype: str
    causal: bool
    scale: float
    key_mask: bool
    query_mask: bool
    block_sizes: dict | None = None
    reason: str | None = None

    @property
    def kernel(self) -> str | None:
        return FLASH_ATTENTION if self.block_sizes is not None else None

    def to_json(self) -> dict:
        entry = {"op": "scaled_dot_product_attention", "kernel": self.kernel,
                 "shape": {"batch": self.batch, "heads": self.heads, "kv_heads": self.kv_heads, "q": self.q_len, "k": self.k_len,
                           "head_dim": self.head_dim}, "dtype": self.dtype, "causal": self.causal, "scale": self.scale,
                 "key_mask": self.key_mask, "query_mask": self.query_mask}
        return entry | ({"block_sizes": self.block_sizes} if self.kernel else {"reason": self.reason})


# The kernel uses of the trace in progress (lower/kernels.py collects them), None outside one.
_KERNEL_USES: contextvars.ContextVar[list | None] = contextvars.ContextVar("kernel_uses", default=None)


@contextlib.contextmanager
def recording_kernel_uses():
    """Collects the KernelUse of every attention_kernel op traced inside (a scanned layer's once)."""
    uses: list[KernelUse] = []
    token = _KERNEL_USES.set(uses)
    try:
        yield uses
    finally:
        _KERNEL_USES.reset(token)


def plan_kernel(query_shape, key_shape, value_shape, dtype, causal: bool, scale: float, key_mask: bool,
                query_mask: bool) -> KernelUse:
    """Whether the flash kernel computes an attention of these static shapes, and with which blocks.

    Args:
      query_shape: [batch, heads, q, dim]; key_shape, value_shape: [batch, kv_heads, k, dim].
      dtype: the operands' dtype; causal, scale, key_mask, query_mask: the op's mask form.
    Returns:
      The KernelUse, with block sizes or the reason the kernel is not used.
    """
    batch, heads, q_len, dim = query_shape
    kv_heads, k_len = key_shape[1], key_shape[2]
    use = functools.partial(KernelUse, batch, heads, kv_heads, q_len, k_len, dim, jnp.dtype(dtype).name, causal, float(scale),
                            key_mask, query_mask)
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return use(reason=f"operands in {jnp.dtype(dtype).name}: the kernel takes bfloat16 or float32")
    if value_shape[-1] != dim:
        return use(reason=f"value head dim {value_shape[-1]} differs from the query's {dim}: the kernel needs them equal")
    if k_len < KERNEL_MIN_KEYS:
        return use(reason=f"{k_len} keys: below {KERNEL_MIN_KEYS} XLA's fused attention reads fewer bytes than the kernel")
    blocks = [size for size in FLASH_BLOCKS if q_len % size == 0 and k_len % size == 0]
    if not blocks:
        return use(reason=f"sequence {q_len} x {k_len} is not a multiple of {FLASH_BLOCKS[-1]}: no block size divides it")
    block = blocks[0]
    return use(block_sizes={"block_q": block, "block_k_major": block, "block_k": block, "block_b": 1})


def flash_call(query, key, value, key_valid, query_valid, causal: bool, scale: float, block_sizes: dict):
    """Attention by the Pallas flash kernel, with torch's semantics for rows that see no key.

    Args:
      query: [batch, heads, q, dim]; key, value: [batch, kv_heads, k, dim] (kv_heads divides heads:
        each key/value head is repeated for its group, as the kernel needs equal head counts).
      key_valid: None or a boolean [batch or 1, 1, 1, k]: keys every query may see (padding),
        passed as segment ids (query rows all 1, a key 1 if valid, 0 if not).
      query_valid: None or a boolean [batch or 1, 1, q, 1]: query rows that see anything.
      causal, scale: the kernel's flags.
      block_sizes: BlockSizes fields (plan_kernel).
    Returns:
      [batch, heads, q, dim] in the query's dtype; a row that sees no key is zeros (torch's safe softmax).
    """
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash  # Pallas loads for kernel traces only

    batch, heads, q_len, _ = query.shape
    k_len = key.shape[2]
    if key.shape[1] != heads:
        key, value = (jnp.repeat(operand, heads // operand.shape[1], axis=1) for operand in (key, value))
    segment_ids = None
    if key_valid is not None:
        keys = jnp.broadcast_to(key_valid, (batch, 1, 1, k_len)).reshape(batch, k_len)
        segment_ids = pallas_flash.SegmentIds(q=jnp.ones((batch, q_len), jnp.int32), kv=keys.astype(jnp.int32))
    attended = pallas_flash.flash_attention(query, key, value, segment_ids=segment_ids, causal=causal, sm_scale=scale,
                                            block_sizes=pallas_flash.BlockSizes(**block_sizes))
    dead_rows = None  # [batch, 1, q, 1]: the kernel gives such rows an average of the values, torch zeros
    if key_valid is not None:
        keys = jnp.broadcast_to(key_valid, (batch, 1, 1, k_len))
        if causal:  # row i sees keys 0..i: dead if none of them is valid
            seen = jnp.cumsum(keys.astype(jnp.int32), axis=-1)[..., jnp.minimum(jnp.arange(q_len), k_len - 1)]
            dead_rows = (seen == 0).reshape(batch, 1, q_len, 1)
        else:
            dead_rows = ~jnp.any(keys, axis=-1, keepdims=True)
    if query_valid is not None:
        dead_rows = ~query_valid if dead_rows is None else dead_rows | ~query_valid
    if dead_rows is not None:
        attended = jnp.where(dead_rows, jnp.zeros((), attended.dtype), attended)
    return attended


@register_lowering("tpuexport::attention_kernel")
def attention_kernel(query, key, value, key_valid=None, query_valid=None, causal=False, scale=None):
    """`tpuexport::attention_kernel` (lower/kernels.py): scaled_dot_product_attention whose mask is
    causal and/or per-key and per-query parts, by the flash kernel where plan_kernel allows it,
    else by scaled_dot_product_attention above with the mask rebuilt from its parts."""
    dtype = jnp.result_type(query, key, value)
    query, key, value = (operand.astype(dtype) for operand in (query, key, value))
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    use = plan_kernel(query.shape, key.shape, value.shape, dtype, causal, scale, key_valid is not None, query_valid is not None)
    uses = _KERNEL_USES.get()
    if uses is not None:
        uses.append(use)
    if use.kernel is None:
        mask = parts_mask(key_valid, query_valid, causal, query.shape[-2], key.shape[-2])
        return scaled_dot_product_attention(query, key, value, mask, 0.0, causal and mask is None, scale)
    return flash_call(query, key, value, key_valid, query_valid, causal, scale, use.block_sizes)


def parts_mask(key_valid, query_valid, causal: bool, q_len: int, k_len: int):
    """The boolean mask (broadcastable to [batch, heads, q, k]) of a per-key and a per-query part and,
    with either, the causal triangle (an iota compare, so that the rows the three leave without a key
    are found from the mask); None without parts (causal alone is scaled_dot_product_attention's flag)."""
    parts = [part for part in (key_valid, query_valid) if part is not None]
    if not parts:
        return None
    mask = parts[0] if len(parts) == 1 else parts[0] & parts[1]
    if causal:
        mask = mask & (jax.lax.iota(jnp.int32, q_len)[:, None] >= jax.lax.iota(jnp.int32, k_len)[None, :])
    return mask
