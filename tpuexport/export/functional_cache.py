"""How the text-generation entry points read and write the KV cache (export/generation.py).

The cache is an input and an output (functional, no buffer mutation): the compiled decode step
donates it, so the TPU updates it in place. Its layout is one of CACHE_LAYOUTS; a layer's update
is one `write_prefill_cache` or `write_decode_cache` (a dynamic_update_slice per row once lowered:
a scatter made XLA relayout the whole cache into a copy and back on TPU). Decode writes after its
last layer and each layer's attention reads the cache as the step received it, with the step's new
key selected at its position: XLA can then update the donated cache in place. A write before a
later layer's read of the same tensor made XLA copy the whole cache for each layer (XLA's analysis
of the Llama-3.2-1B decode step on v5e, batch 8 x 4096: 5.2x the bytes of the weights + cache; see
benchmarks/results/studies/generation_decode_write.md).

With --kv-cache-dtype int8 the cache holds int8 keys and values, and two more tensors, their scales
(cache_k_scale, cache_v_scale), follow cache_k and cache_v in every signature: `FunctionalKVCache`
quantizes on write and dequantizes on read, so the entry points define what the artifact computes.
"""

from __future__ import annotations

import torch
from torch import nn

from tpuexport.export.cache_specs import SCALE_LAYOUT


def quantize_kv(new: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys or values [..., head_dim] as an int8 cache stores them: symmetric per vector, scale =
    absmax over head_dim / 127 in `scale_dtype`, q = round(x / scale) with the scale as stored (0
    where the vector is 0).

    Returns:
      (q int8 [..., head_dim], scale [...]).
    """
    scale = (new.abs().amax(-1).to(torch.float32) / 127.0).to(scale_dtype)
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale).to(torch.float32)
    q = torch.round(new.to(torch.float32) / divisor[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What attention reads from an int8 cache: q * scale, computed in `dtype` (the model's, which the
    scales are stored in: one rounding. With f32 scales an f32 product cast to bf16 took 0.065 instead
    of 0.045 GiB of temporaries in the Llama-1B decode step on v5e, results/studies/kv_int8.txt)."""
    return q.to(dtype) * scale.to(dtype)[..., None]


class FunctionalKVCache:
    """How one entry point reads and writes the cache tensors; `KVCache` calls it per layer.

    Subclasses decide where a step's keys go (`write`) and what attention reads (`read`). An int8
    cache (scales given) is quantized on write and dequantized on read here, so the eager entry
    points define what the lowered ones compute.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, layout: str, key_scales: torch.Tensor | None = None,
                 value_scales: torch.Tensor | None = None):
        self.keys = keys
        self.values = values
        self.layout = layout
        self.scales = None if key_scales is None else [key_scales, value_scales]

    def stored(self, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """New keys or values as the cache stores them: (int8, scales) for an int8 cache, else (new in
        the cache's dtype, None); zero-padded to the cache's head_dim when narrower (MLA's values)."""
        if self.scales is None:
            stored, scale = new.to(self.keys.dtype), None
        else:
            stored, scale = quantize_kv(new, self.scales[0].dtype)
        width = self.keys.shape[-1]
        return (stored if stored.shape[-1] == width else nn.functional.pad(stored, (0, width - stored.shape[-1]))), scale

    def update(self, new_keys: torch.Tensor, new_values: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes a layer's new keys/values ([batch, heads, steps, head_dim]) and returns what attention reads."""
        (key_q, key_scale), (value_q, value_scale) = self.stored(self.kept(new_keys)), self.stored(self.kept(new_values))
        self.keys = self.write(self.keys, key_q, layer)
        self.values = self.write(self.values, value_q, layer)
        if self.scales is not None:
            self.scales = [self.write(self.scales[0], key_scale, layer, SCALE_LAYOUT), self.write(self.scales[1], value_scale, layer, SCALE_LAYOUT)]
        return self.read(self.keys, new_keys, layer), self.read(self.values, new_values, layer)

    def kept(self, new: torch.Tensor) -> torch.Tensor:
        """The steps of `new` ([batch, heads, steps, head_dim]) the cache keeps, in the order `write` stores them: all."""
        return new

    def written(self) -> tuple[torch.Tensor, ...]:
        """The cache tensors (keys, values[, key scales, value scales]) once every layer has been
        updated: the entry point's outputs."""
        return (self.keys, self.values) + tuple(self.scales or ())

    def write(self, cache: torch.Tensor, new: torch.Tensor, layer: int, layout: str | None = None) -> torch.Tensor:
        """`cache` with a layer's `new` entries (stored form) written; layout None: the cache's."""
        raise NotImplementedError

    def read(self, cache: torch.Tensor, new: torch.Tensor, layer: int) -> torch.Tensor:
        raise NotImplementedError


class PrefillCache(FunctionalKVCache):
    """Prefill: row r's keys for positions 0..seq-1 go to slot slots[r]; attention reads the
    prompt's own keys (a fresh prompt sees nothing older), unrounded in an int8 cache too, as
    serving engines prefill.

    `kept_columns` [batch, kept] given, index i of slot slots[r] gets the prompt's column
    kept_columns[r, i] instead: a ring cache keeps W steps per row (`ring_prefill_positions`), and a
    left-padded prompt's position p is its column p + its padding.
    """

    def __init__(self, keys, values, layout, slots: torch.Tensor, key_scales=None, value_scales=None,
                 kept_columns: torch.Tensor | None = None):
        super().__init__(keys, values, layout, key_scales, value_scales)
        self.slots = slots
        self.kept_columns = kept_columns

    def kept(self, new):
        if self.kept_columns is None:
            return new
        batch, heads, _, head_dim = new.shape
        index = self.kept_columns[:, None, :, None].expand(batch, heads, self.kept_columns.shape[1], head_dim)
        return new.gather(2, index)

    def write(self, cache, new, layer, layout=None):
        return write_prefill_cache(cache, new, layer, self.slots, layout or self.layout)

    def read(self, cache, new, layer):
        return new


class DecodeCache(FunctionalKVCache):
    """Decode: row r's new key goes to position positions[r] of slot r; attention reads the
    layer's whole cache (the mask keeps keys 0..positions[r]).

    Every write waits until the last layer has read (`written`): attention reads the cache as the
    step received it, with the new key selected in at its position (the values the write would
    store: in an int8 cache, quantized and dequantized, so this step reads what later steps will),
    so no read of the cache follows a write into it (see the module's docstring).
    """

    def __init__(self, keys, values, layout, positions: torch.Tensor, key_scales=None, value_scales=None):
        super().__init__(keys, values, layout, key_scales, value_scales)
        self.positions = positions
        # (layer, [(stored keys, their scales), (stored values, their scales)]), in call order
        self.pending: list[tuple[int, list[tuple[torch.Tensor, torch.Tensor | None]]]] = []

    def update(self, new_keys, new_values, layer):
        stored = [self.stored(new_keys[:, :, 0]), self.stored(new_values[:, :, 0])]
        self.pending.append((layer, stored))
        return (self.read(self.keys, stored[0], layer, 0, new_keys.dtype)[..., :new_keys.shape[-1]],
                self.read(self.values, stored[1], layer, 1, new_values.dtype)[..., :new_values.shape[-1]])

    def written(self):
        keys, values, scales = self.keys, self.values, list(self.scales or ())
        for layer, ((key_q, key_scale), (value_q, value_scale)) in self.pending:
            keys = self.write(keys, key_q, layer)
            values = self.write(values, value_q, layer)
            if scales:
                scales = [self.write(scales[0], key_scale, layer, SCALE_LAYOUT), self.write(scales[1], value_scale, layer, SCALE_LAYOUT)]
        return (keys, values) + tuple(scales)

    def write(self, cache, new, layer, layout=None):
        return write_decode_cache(cache, new, layer, self.positions, layout or self.layout)

    def read(self, cache, stored, layer, which, dtype):
        """Attention's keys (which 0) or values (1) of `layer`: the cache as received, the step's
        `stored` (q, scale) selected in at each row's position, in `dtype`."""
        layer_cache = cache[layer]
        if self.layout == "layer_batch_pos_head":
            layer_cache = layer_cache.transpose(1, 2)
        new, scale = stored
        if self.scales is not None:
            layer_cache = dequantize_kv(layer_cache, self.scales[which][layer], dtype)
            new = dequantize_kv(new, scale, dtype)
        keys = torch.arange(layer_cache.shape[2], device=new.device)
        current = keys[None, None, :, None] == self.positions[:, None, None, None]
        return torch.where(current, new[:, :, None].to(layer_cache.dtype), layer_cache).to(dtype)


@torch.library.custom_op("tpuexport::write_prefill_cache", mutates_args=())
def write_prefill_cache(cache: torch.Tensor, new: torch.Tensor, layer: int, slots: torch.Tensor, layout: str) -> torch.Tensor:
    """The cache with row r's new keys or values ([batch, kv_heads, steps, head_dim]) at positions
    0..steps-1 of slot slots[r] in one layer; a slot outside 0..max_batch-1 is clamped onto it.
    An int8 cache's scales ([layers, batch, kv_heads, context], new [batch, kv_heads, steps]) are
    written by the same op in layout "layer_batch_head_pos".

    One op, not `index_put`, for the reason `write_decode_cache` gives (a scatter relayouts the
    whole cache on TPU: 7.2x the cache's bytes for a batch of 8 prompts of 128 tokens into an 8 x
    4096 cache on v5e); lower/generation.py lowers it as a loop over the rows, one
    `dynamic_update_slice` each (0.2x). This is its eager meaning."""
    batch, heads, steps = new.shape[:3]  # an int8 cache's scales have no head_dim
    slots = slots.clamp(0, cache.shape[1] - 1)
    index = torch.full((1,), layer, dtype=torch.long, device=new.device)
    positions = torch.arange(steps, device=new.device)
    if layout == "layer_batch_head_pos":
        heads_index = torch.arange(heads, device=new.device)
        return cache.index_put((index, slots[:, None, None], heads_index[None, :, None], positions[None, None, :]), new)
    return cache.index_put((index, slots[:, None], positions[None, :]), new.transpose(1, 2))


@write_prefill_cache.register_fake
def _(cache, new, layer, slots, layout):
    return torch.empty_like(cache)


@torch.library.custom_op("tpuexport::write_decode_cache", mutates_args=())
def write_decode_cache(cache: torch.Tensor, new: torch.Tensor, layer: int, positions: torch.Tensor, layout: str) -> torch.Tensor:
    """The cache with row r's new key or value ([batch, kv_heads, head_dim]) at position positions[r]
    of slot r in one layer; a position outside 0..max_context-1 is clamped onto it (the write lands
    on the slot's first or last position, as dynamic_update_slice does). An int8 cache's scales
    ([layers, batch, kv_heads, context], new [batch, kv_heads]) are written by the same op in layout
    "layer_batch_head_pos".

    One op, not `index_put`, because of the TPU's layout of the cache: with head_dim (64) its minor
    dim, the TPU keeps the cache with its positions minor, and XLA's scatter wants the written
    head_dim minor, so an `index_put` scatter relayouts the whole cache into a copy and back (on v5e:
    6x the cache's bytes per step). lower/generation.py lowers this op as one
    `dynamic_update_slice` per row, which updates the donated cache in place in any layout. This is
    its eager meaning."""
    batch, heads = new.shape[:2]  # an int8 cache's scales have no head_dim
    rows = torch.arange(batch, device=new.device)
    context = cache.shape[3] if layout == "layer_batch_head_pos" else cache.shape[2]
    positions = positions.clamp(0, context - 1)
    # An op, not a Python constant: torch.export would lift torch.tensor(layer) as a constant per layer.
    index = torch.full((1,), layer, dtype=torch.long, device=new.device)
    if layout == "layer_batch_head_pos":
        heads_index = torch.arange(heads, device=new.device)
        return cache.index_put((index, rows[:, None], heads_index[None, :], positions[:, None]), new)
    return cache.index_put((index, rows, positions), new)


@write_decode_cache.register_fake
def _(cache, new, layer, positions, layout):
    return torch.empty_like(cache)


class GroupedKVCache:
    """Caches of a model mixing full and sliding layers: [(FunctionalKVCache, its layers in model
    order)]; a layer's update goes to its group's cache under its index there."""

    def __init__(self, groups: list[tuple[FunctionalKVCache, tuple[int, ...]]]):
        self.groups = [cache for cache, _ in groups]
        self.where = {layer: (cache, index) for cache, layers in groups for index, layer in enumerate(layers)}

    def update(self, new_keys: torch.Tensor, new_values: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache, index = self.where[layer]
        return cache.update(new_keys, new_values, index)

    def written(self) -> tuple[torch.Tensor, ...]:
        """Every group's cache tensors, groups in order (GenerationSpec.cache_inputs)."""
        return tuple(tensor for cache in self.groups for tensor in cache.written())
