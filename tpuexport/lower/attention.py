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

import jax
import jax.numpy as jnp
import torch

from tpuexport.lower.registry import register_lowering

aten = torch.ops.aten


@register_lowering(aten.scaled_dot_product_attention.default)
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *,
                                 enable_gqa=False):
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
    Returns:
      [..., heads, q, value_dim] in the query's dtype.
    """
    del enable_gqa  # the shapes say it: kv_heads < heads
    if dropout_p != 0.0:
        raise NotImplementedError("scaled_dot_product_attention with dropout lowers only for inference (dropout_p=0)")
    if query.ndim == 2:  # [q, dim]: one head
        return scaled_dot_product_attention(query[None], key[None], value[None], attn_mask, dropout_p, is_causal, scale)[0]
    dtype = jnp.result_type(query, key, value)
    query, key, value = (operand.astype(dtype) for operand in (query, key, value))
    heads, kv_heads = query.shape[-3], key.shape[-3]
    groups = heads // kv_heads
    lead = query.shape[:-3]
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
