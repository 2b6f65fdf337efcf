"""The caches of the text-generation entry points (static, paged, encoder-decoder) as the artifact
records them and the runtime reads them: shapes, dtypes and limits. Apart from the torch modules that
build the entry points (generation.py, paged.py, seq2seq.py) because the runtime uses these without
importing torch."""

from __future__ import annotations

import dataclasses
import math

from tpuexport.safetensors_files import numpy_dtype

# Cache layouts, each cache tensor's axes:
#   "layer_batch_head_pos"  [layers, batch, kv_heads, context, head_dim]: a layer's slice is what
#                           attention reads ([batch, heads, keys, head_dim]) without a transpose
#   "layer_batch_pos_head"  [layers, batch, context, kv_heads, head_dim]: one decode write per row
#                           is one contiguous [kv_heads, head_dim] block
CACHE_LAYOUTS = ("layer_batch_head_pos", "layer_batch_pos_head")
DEFAULT_CACHE_LAYOUT = "layer_batch_head_pos"
# The KV cache: an input and an output (same name) of every entry point, donated when compiled.
CACHE_INPUTS = ("cache_k", "cache_v")
# An int8 cache's scales, inputs and outputs like the cache (donated too), after it in every signature.
CACHE_SCALE_INPUTS = ("cache_k_scale", "cache_v_scale")
# A model mixing full and sliding layers: the sliding layers' rings (GenerationSpec.window_layers), after the rest.
WINDOW_CACHE_INPUTS = ("window_cache_k", "window_cache_v")
# A model with short-convolution layers (LFM2's "conv" layers): each such layer's last inputs to its
# causal convolution, per slot, in the model's dtype (GenerationSpec.conv_layers), after the rest.
CONV_STATE_INPUTS = ("conv_state",)
# A model with recurrent layers (state-space or linear attention: Mamba-2's, gated DeltaNet's): each such
# layer's recurrent state per slot (GenerationSpec.recurrent_layers), in the dtype the layer keeps it,
# after conv_state (their short convolutions' states).
RECURRENT_STATE_INPUTS = ("recurrent_state",)
# A model with indexed attention (DeepSeek Sparse Attention's "indexed_attention" layers): each such
# layer's indexer keys, which choose the keys its attention reads, per slot and position, in the
# model's dtype (GenerationSpec.indexed_layers), after the rest.
INDEXER_KEYS_INPUTS = ("indexer_keys",)
# --kv-cache-dtype: "model" stores keys and values in the model's dtype; "int8" stores them as
# symmetric int8 per (layer, slot, kv-head, position), scale = absmax over head_dim / 127 (as
# MaxText's kv_quant and vLLM store an int8 cache), the scales in the model's dtype.
#
# Scales in the model's dtype, not always float32, measured (benchmarks/studies/kv_int8.py scales,
# results/studies/kv_int8.txt; a tiny Llama's cached keys and values, quantized and dequantized): in a bf16
# model, bf16 scales 46.20 dB reconstruction SQNR vs 45.78 with f32 scales (attention reads bf16, so
# an f32 scale is rounded at dequantization but was not when quantizing), and 3% fewer cache bytes
# (2 vs 4 bytes per 64 int8 values; the TPU pads neither: v5e decode step of 2 Llama-1B layers at
# 8 x 4096, arguments 0.780 vs 0.782 GiB); in an f32 model, f32 scales 46.63 vs 46.51 dB.
KV_CACHE_DTYPES = ("model", "int8")
# --sliding-window-cache: "bounded" gives a model whose every layer attends within one sliding window
# W < max_context (Mistral, Mixtral, Phi-3) a ring cache of W positions per slot (its keys at
# 32k context: W / 32768 of the bytes); "full" keeps max_context positions, the windows in the masks.
SLIDING_WINDOW_CACHES = ("bounded", "full")
# Scales are [layers, batch, kv_heads, context] whatever the cache's layout: positions, the long
# axis, minor (the TPU tiles the two minor axes by 8 x 128; measured unpadded with the default
# layout, results/studies/kv_int8.txt), and one scale layout for the write ops of both cache layouts.
SCALE_LAYOUT = "layer_batch_head_pos"


@dataclasses.dataclass(frozen=True)
class GenerationSpec:
    """What a text-generation artifact's entry points share: the cache and its limits.

    Attributes:
      max_batch: cache slots (decode's batch; prefill's largest batch).
      max_context: positions per slot (longest prompt + generated tokens).
      layers, kv_heads, head_dim: the cache's model-given sizes: the heads and the larger of the
        widths of what the attention layers cache as keys and as values (`cached_shapes`; with
        multi-head latent attention the two differ, and the narrower is stored zero-padded).
      vocab: logits per row.
      dtype: the cache's dtype (the model's, torch name, e.g. "float32", "bfloat16").
      layout: one of CACHE_LAYOUTS.
      prefill_buckets: the prompt lengths (`seq` sizes) prefill is compiled for.
      kv_cache_dtype: one of KV_CACHE_DTYPES: "model" (keys and values in `dtype`) or "int8"
        (int8 keys and values with scales in `dtype`, see `quantize_kv`).
      cache_window: None, or the sliding window W < max_context within which every layer attends:
        each slot then keeps W positions, a ring (position p at index p mod W), since no query
        reads a key W or more positions behind it. None: max_context positions, p at index p.
      window_layers: with cache_window, the sliding layers when the model mixes them with full
        attention layers (Gemma 2/3, Qwen2's `layer_types`): those keep the ring in
        window_cache_k/window_cache_v, the others max_context positions in cache_k/cache_v (each
        group's layers in model order). Empty: every layer keeps the ring in cache_k/cache_v.
      window_kv_heads, window_head_dim: with window_layers, the sliding layers' kv heads and cached width
        where they differ from the full layers' (MiMo-V2-Flash's sliding layers have twice as many heads,
        dots3's a wider latent); 0, 0: kv_heads, head_dim.
      conv_layers: the layers that are causal short convolutions, not attention (LFM2's "conv"
        layers): they keep no keys and values, but each slot's last `conv_kernel` inputs to the
        convolution ([conv_channels, conv_kernel] per slot) in conv_state, a recurrent state that a
        prefill replaces and every decode step shifts by one. Empty: every layer attends.
      conv_channels, conv_kernel: a conv layer's state per slot (its channels, and the inputs it keeps).
      indexed_layers: the layers whose attention reads only the keys their indexer chooses (DeepSeek
        Sparse Attention's "indexed_attention" layers): besides their keys and values in cache_k/cache_v,
        they keep the indexer's own key per position ([max_context, indexer_dim] per slot) in
        indexer_keys, laid out as one head of a "layer_batch_head_pos" cache whatever `layout` is
        (the cache's write ops then write it). Empty: no layer has an indexer.
      indexer_dim: an indexer key's width.
      recurrent_layers: the layers that keep a recurrent state instead of keys and values (Mamba-2's
        state-space mixers, gated DeltaNet's linear attention): `recurrent_state` per slot (its shape
        per slot, in `recurrent_dtype`) in recurrent_state, which a prefill replaces and every decode
        step advances; their short convolutions' inputs are conv_layers' states. Such a model's
        prefill aligns each prompt to the end of its bucket (`left_padded`). Empty: none.
      recurrent_state, recurrent_dtype: a recurrent layer's state per slot: its shape and torch dtype name.
      attending_recurrent_layers: the recurrent layers that also attend (an attention and a state-space
        mixer side by side: Falcon-H1's and Zamba2's "hybrid" layers): they keep keys and values in
        cache_k/cache_v besides their states. Empty: no recurrent layer keeps keys.
    """

    max_batch: int
    max_context: int
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype: str
    layout: str
    prefill_buckets: tuple[int, ...]
    kv_cache_dtype: str = "model"
    cache_window: int | None = None
    window_layers: tuple[int, ...] = ()
    window_kv_heads: int = 0
    window_head_dim: int = 0
    conv_layers: tuple[int, ...] = ()
    conv_channels: int = 0
    conv_kernel: int = 0
    indexed_layers: tuple[int, ...] = ()
    indexer_dim: int = 0
    recurrent_layers: tuple[int, ...] = ()
    recurrent_state: tuple[int, ...] = ()
    recurrent_dtype: str = ""
    attending_recurrent_layers: tuple[int, ...] = ()

    @property
    def cache_positions(self) -> int:
        """Positions each slot of cache_k/cache_v holds: the window's W when every layer keeps the ring, else max_context."""
        return self.max_context if self.window_layers else self.cache_window or self.max_context

    @property
    def full_layers(self) -> tuple[int, ...]:
        """The layers whose keys are in cache_k/cache_v."""
        kept_apart = {*self.window_layers, *self.conv_layers, *self.recurrent_layers} - {*self.attending_recurrent_layers}
        return tuple(layer for layer in range(self.layers) if layer not in kept_apart)

    @property
    def left_padded(self) -> bool:
        """Whether prefill runs each prompt aligned to the end of its bucket, after the padding: a
        recurrent state folds in every input it sees, so the padding must come before a prompt (where
        the masked inputs leave the state at zero), not after it."""
        return bool(self.recurrent_layers)

    @property
    def static_prompt(self) -> bool:
        """Whether prefill's prompt length is static, its one bucket: a left-padded (recurrent) prefill's,
        or an indexed model's whose indexer's top-k, its shortest bucket, is the whole context."""
        return self.left_padded or bool(self.indexed_layers) and self.prefill_buckets[0] == self.max_context

    def _cache_tensor_shape(self, layers: int, positions: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        if self.layout == "layer_batch_head_pos":
            return (layers, self.max_batch, kv_heads, positions, head_dim)
        return (layers, self.max_batch, positions, kv_heads, head_dim)

    @property
    def window_cache_shape(self) -> tuple[int, ...]:
        """window_cache_k/window_cache_v's shape (models mixing full and sliding layers): the sliding layers' rings."""
        return self._cache_tensor_shape(len(self.window_layers), self.cache_window or 0, self.window_kv_heads or self.kv_heads,
                                        self.window_head_dim or self.head_dim)

    @property
    def quantized(self) -> bool:
        """Whether the cache holds int8 keys and values with scales."""
        return self.kv_cache_dtype == "int8"

    @property
    def cache_inputs(self) -> tuple[str, ...]:
        """The cache's tensors, in the entry points' input (and output) order."""
        return (CACHE_INPUTS + (CACHE_SCALE_INPUTS if self.quantized else ()) + (WINDOW_CACHE_INPUTS if self.window_layers else ())
                + (CONV_STATE_INPUTS if self.conv_layers else ()) + (RECURRENT_STATE_INPUTS if self.recurrent_layers else ())
                + (INDEXER_KEYS_INPUTS if self.indexed_layers else ()))

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """An int8 cache's scales: [layers, max_batch, kv_heads, cache positions] (SCALE_LAYOUT)."""
        return (len(self.full_layers), self.max_batch, self.kv_heads, self.cache_positions)

    @property
    def scale_dtype(self) -> str:
        """An int8 cache's scales' dtype: the model's (see KV_CACHE_DTYPES)."""
        return self.dtype

    def cache_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """{cache input name: (shape, torch dtype name)} in cache_inputs order."""
        stored = "int8" if self.quantized else self.dtype
        tensors = {name: (self.cache_shape, stored) for name in CACHE_INPUTS}
        if self.quantized:
            tensors.update({name: (self.scale_shape, self.scale_dtype) for name in CACHE_SCALE_INPUTS})
        if self.window_layers:
            tensors.update({name: (self.window_cache_shape, stored) for name in WINDOW_CACHE_INPUTS})
        if self.conv_layers:
            tensors[CONV_STATE_INPUTS[0]] = (self.conv_state_shape, self.dtype)
        if self.recurrent_layers:
            tensors[RECURRENT_STATE_INPUTS[0]] = (self.recurrent_state_shape, self.recurrent_dtype)
        if self.indexed_layers:
            tensors[INDEXER_KEYS_INPUTS[0]] = (self.indexer_keys_shape, self.dtype)
        return tensors

    @property
    def conv_state_shape(self) -> tuple[int, ...]:
        """conv_state's shape: [conv layers, max_batch, conv_channels, conv_kernel]."""
        return (len(self.conv_layers), self.max_batch, self.conv_channels, self.conv_kernel)

    @property
    def indexer_keys_shape(self) -> tuple[int, ...]:
        """indexer_keys' shape: [indexed layers, max_batch, 1, max_context, indexer_dim] (one head)."""
        return (len(self.indexed_layers), self.max_batch, 1, self.max_context, self.indexer_dim)

    @property
    def recurrent_state_shape(self) -> tuple[int, ...]:
        """recurrent_state's shape: [recurrent layers, max_batch, *recurrent_state]."""
        return (len(self.recurrent_layers), self.max_batch, *self.recurrent_state)

    def describe_states(self) -> str:
        """' + conv state [shape] (layers i,j)', ' + recurrent state [shape] dtype (layers i,j)' and
        ' + indexer keys [shape] (layers i,j)' for the export stage's line and `inspect`; '' for a model
        with none of them."""
        def layers(indexes):
            return ",".join(map(str, indexes))

        return ((f" + conv state {list(self.conv_state_shape)} (layers {layers(self.conv_layers)})" if self.conv_layers else "")
                + (f" + recurrent state {list(self.recurrent_state_shape)} {self.recurrent_dtype} (layers {layers(self.recurrent_layers)})"
                   if self.recurrent_layers else "")
                + (f" + indexer keys {list(self.indexer_keys_shape)} (layers {layers(self.indexed_layers)})" if self.indexed_layers else ""))

    @property
    def cache_shape(self) -> tuple[int, ...]:
        """cache_k/cache_v's shape (in `layout`)."""
        return self._cache_tensor_shape(len(self.full_layers), self.cache_positions, self.kv_heads, self.head_dim)

    @property
    def cache_bytes(self) -> int:
        """Bytes of the keys and values together (and of their scales, for an int8 cache)."""
        return sum(math.prod(shape) * numpy_dtype(dtype).itemsize for shape, dtype in self.cache_tensors().values())

    def to_json(self) -> dict:
        data = {**dataclasses.asdict(self), "prefill_buckets": list(self.prefill_buckets), "cache_shape": list(self.cache_shape)}
        if self.cache_window is None:  # a cache of max_context positions: the manifest is as it was before rings
            del data["cache_window"]
        if self.window_layers:
            data.update(window_layers=list(self.window_layers), window_cache_shape=list(self.window_cache_shape))
        else:
            del data["window_layers"]
        for name in ("window_kv_heads", "window_head_dim"):
            if not data[name]:  # sliding layers caching what the full layers do: the manifest is as it was before the fields
                del data[name]
        if self.conv_layers:
            data.update(conv_layers=list(self.conv_layers), conv_state_shape=list(self.conv_state_shape))
        else:  # a model without conv layers: the manifest is as it was before them
            for name in ("conv_layers", "conv_channels", "conv_kernel"):
                del data[name]
        if self.recurrent_layers:
            data.update(recurrent_layers=list(self.recurrent_layers), recurrent_state=list(self.recurrent_state),
                        recurrent_state_shape=list(self.recurrent_state_shape))
        else:  # a model without recurrent layers: the manifest is as it was before them
            for name in ("recurrent_layers", "recurrent_state", "recurrent_dtype"):
                del data[name]
        if self.attending_recurrent_layers:
            data["attending_recurrent_layers"] = list(self.attending_recurrent_layers)
        else:  # the manifest is as it was before such layers
            del data["attending_recurrent_layers"]
        if self.indexed_layers:
            data.update(indexed_layers=list(self.indexed_layers), indexer_keys_shape=list(self.indexer_keys_shape))
        else:  # a model without indexed layers: the manifest is as it was before them
            for name in ("indexed_layers", "indexer_dim"):
                del data[name]
        if not self.quantized:  # a model-dtype cache's manifest is as it was before the option
            del data["kv_cache_dtype"]
            return data
        return {**data, "scale_shape": list(self.scale_shape), "scale_dtype": self.scale_dtype, "scale_layout": SCALE_LAYOUT}

    @classmethod
    def from_json(cls, data: dict) -> "GenerationSpec":
        fields = {field.name for field in dataclasses.fields(cls)}
        values = {key: value for key, value in data.items() if key in fields}
        return cls(**{**values, "prefill_buckets": tuple(values["prefill_buckets"]), "window_layers": tuple(values.get("window_layers", ())),
                      "conv_layers": tuple(values.get("conv_layers", ())), "indexed_layers": tuple(values.get("indexed_layers", ())),
                      "recurrent_layers": tuple(values.get("recurrent_layers", ())), "recurrent_state": tuple(values.get("recurrent_state", ())),
                      "attending_recurrent_layers": tuple(values.get("attending_recurrent_layers", ()))})


# Paged caches (paged.py)
# The pages, then (--kv-cache-dtype int8) their scales: inputs and outputs of the step, donated.
PAGED_CACHE_INPUTS = ("cache_kv", "cache_kv_scale")
# vLLM's default block size; JAX's tuned kernel table starts at 16 too.
DEFAULT_PAGE_SIZE = 16
# The cache's page count is a dim of the exported step ("pages"): the portable program runs at any count
# (verification at a small one), and each target's executables are compiled at that target's count.
PAGES_DIM = "pages"


def max_pages(page_size: int) -> int:
    """The most pages a cache may have: its slots (and the one past the end a padding token writes to,
    lower/paged.py) are int32 on the device."""
    return (2**31 - 1) // page_size - 1


@dataclasses.dataclass(frozen=True)
class PagedSpec:
    """What a paged text-generation artifact's step shares with its runtime: the pages and their limits.

    Attributes:
      max_batch: rows a step can hold (page_indices' largest row count).
      max_context: positions a row can reach.
      layers, kv_heads, head_dim, vocab: the model's sizes (head_dim: the cached width).
      dtype: the cache's dtype (the model's, torch name).
      page_size: positions per page.
      num_pages: pages in the cache (shared by all rows): the portable program's, which verification and
        CPU targets run at; a TPU target's executables may take another count (its step buckets' "pages").
      token_buckets: the step's token budgets (T) compiled.
      row_buckets: the step's row counts compiled (max_batch among them).
      kv_cache_dtype: "model" (pages in `dtype`) or "int8" (int8 pages and a scale per position, kv head,
        keys and values, in `dtype`: export/functional_cache.py's quantize_kv, as the static cache's).
    """

    max_batch: int
    max_context: int
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype: str
    page_size: int
    num_pages: int
    token_buckets: tuple[int, ...]
    row_buckets: tuple[int, ...]
    kv_cache_dtype: str = "model"

    @property
    def quantized(self) -> bool:
        """Whether the pages hold int8 keys and values with scales."""
        return self.kv_cache_dtype == "int8"

    @property
    def cache_inputs(self) -> tuple[str, ...]:
        """The cache's tensors, in the step's input (and output) order."""
        return PAGED_CACHE_INPUTS if self.quantized else PAGED_CACHE_INPUTS[:1]

    @property
    def pages_per_row(self) -> int:
        """Page-table entries per row: the pages max_context positions take."""
        return math.ceil(self.max_context / self.page_size)

    @property
    def cache_shape(self) -> tuple[int, ...]:
        return (self.layers, self.num_pages, self.page_size, 2 * self.kv_heads * self.head_dim)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """An int8 cache's scales: per position, per kv head, its keys' scale then its values'."""
        return (self.layers, self.num_pages, self.page_size, 2 * self.kv_heads)

    def cache_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        if not self.quantized:
            return {PAGED_CACHE_INPUTS[0]: (self.cache_shape, self.dtype)}
        return {PAGED_CACHE_INPUTS[0]: (self.cache_shape, "int8"), PAGED_CACHE_INPUTS[1]: (self.scale_shape, self.dtype)}

    @property
    def cache_bytes(self) -> int:
        """Bytes of the pages (and of their scales, for an int8 cache)."""
        return sum(math.prod(shape) * numpy_dtype(dtype).itemsize for shape, dtype in self.cache_tensors().values())

    @property
    def capacity_tokens(self) -> int:
        """Positions the cache holds over all rows."""
        return self.num_pages * self.page_size

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "kind": "paged", "token_buckets": list(self.token_buckets), "row_buckets": list(self.row_buckets),
                "cache_shape": list(self.cache_shape), "pages_per_row": self.pages_per_row, "capacity_tokens": self.capacity_tokens,
                "cache_layout": "layer_page_offset_head_kv (per position, per kv head: its keys [head_dim], then its values)",
                **({"scale_shape": list(self.scale_shape), "scale_layout": "layer_page_offset_head_kv (per position, per kv head: its keys' "
                                                                           "scale, then its values')"} if self.quantized else {})}

    @classmethod
    def from_json(cls, data: dict) -> "PagedSpec":
        fields = {field.name for field in dataclasses.fields(cls)}
        values = {key: value for key, value in data.items() if key in fields}
        return cls(**{**values, "token_buckets": tuple(values["token_buckets"]), "row_buckets": tuple(values["row_buckets"])})


# Encoder-decoder caches (seq2seq.py)
SEQ2SEQ_LAYOUT = "layer_batch_head_pos"
# The state: inputs returned as the output of the same name, donated when compiled (token sources;
# audio features have no source lengths).
SEQ2SEQ_STATE_INPUTS = ("cache_k", "cache_v", "cross_k", "cross_v", "source_lengths")


@dataclasses.dataclass(frozen=True)
class Seq2SeqSpec:
    """What an encoder-decoder artifact's entry points share: the caches and their limits.

    Attributes:
      max_batch: cache slots (decode's batch; encode's largest batch).
      max_context: decoder positions per slot (generated tokens, the start token included).
      max_source: source positions per slot (the longest source bucket).
      layers, heads, head_dim: the decoder's sizes (both caches).
      vocab: logits per row.
      dtype: the caches' dtype (the model's, torch name).
      source_buckets: the source lengths encode is compiled for.
      decoder_start_token_id: the first token decode is fed.
      source: what encode reads: "tokens" (source[batch, seq] ids with lengths, padded to a source
        bucket) or "features" (input_features[batch, mel_bins, frames], every source filling all
        max_source positions: no source lengths, decode's cross attention sees every position).
      features: (mel bins, frames) of an audio source (frames static), else ().
    """

    max_batch: int
    max_context: int
    max_source: int
    layers: int
    heads: int
    head_dim: int
    vocab: int
    dtype: str
    source_buckets: tuple[int, ...]
    decoder_start_token_id: int
    source: str = "tokens"
    features: tuple[int, ...] = ()
    kind: str = "encoder-decoder"
    layout: str = SEQ2SEQ_LAYOUT

    @property
    def masks_sources(self) -> bool:
        """Whether sources have lengths (decode masks cross keys at and after them): token sources."""
        return self.source == "tokens"

    @property
    def state_inputs(self) -> tuple[str, ...]:
        """The state tensors, in the entry points' order (source_lengths only where sources have lengths)."""
        return SEQ2SEQ_STATE_INPUTS if self.masks_sources else SEQ2SEQ_STATE_INPUTS[:-1]

    @property
    def cache_shape(self) -> tuple[int, ...]:
        """The decoder self-attention cache (cache_k, cache_v)."""
        return (self.layers, self.max_batch, self.heads, self.max_context, self.head_dim)

    @property
    def cross_shape(self) -> tuple[int, ...]:
        """The cross-attention cache (cross_k, cross_v)."""
        return (self.layers, self.max_batch, self.heads, self.max_source, self.head_dim)

    @property
    def cache_bytes(self) -> int:
        """Bytes of both caches, keys and values (the source lengths are negligible)."""
        size = numpy_dtype(self.dtype).itemsize
        count = sum(math.prod(shape) for shape in (self.cache_shape, self.cross_shape))
        return 2 * count * size

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "source_buckets": list(self.source_buckets), "features": list(self.features),
                "cache_shape": list(self.cache_shape), "cross_shape": list(self.cross_shape)}

    @classmethod
    def from_json(cls, data: dict) -> "Seq2SeqSpec":
        fields = {field.name for field in dataclasses.fields(cls)}
        values = {key: value for key, value in data.items() if key in fields}
        return cls(**{**values, "source_buckets": tuple(values["source_buckets"]), "features": tuple(values.get("features", ()))})
