"""Capture of a decoder LM for text generation: a prefill and a decode entry point over one
explicit, fixed-shape KV cache.

Two small modules wrap the SAME Hugging Face model instance (so their weights have the same
state_dict names and values; the artifact stores them once):

  prefill(tokens[batch, seq], lengths[batch], slots[batch], cache_k, cache_v)
      -> {logits[batch, vocab] of each row's last real token, cache_k, cache_v}
      Prompts are right-padded to the bucket's `seq`; row r's keys and values for positions
      0..seq-1 are written into cache slot slots[r]. Attention is causal within the prompt, so a
      real token never sees padding; the padding's cache entries (positions >= lengths[r]) are
      overwritten by decode before any query may attend to them.
  decode(tokens[max_batch], positions[max_batch], cache_k, cache_v)
      -> {logits[max_batch, vocab], cache_k, cache_v}
      One step for every slot of the cache, each row at its own position: the new key and value
      are written at `positions[r]`, and the row attends to keys 0..positions[r].

How the cache is read and written is export/functional_cache.py; the states some models keep beside
it (short convolutions', recurrent layers', indexers' keys) are export/cache_states.py.

The KV cache is a `transformers.cache_utils.Cache` whose `update` writes functionally; the model
gets a prepared 4D additive mask (transformers' mask functions return a 4D mask as it is) and
explicit position ids, so no code of the model's depends on a cache length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Collection

import torch
from torch import nn

from tpuexport.errors import TpuExportError
from tpuexport.export.cache_specs import CACHE_LAYOUTS, DEFAULT_CACHE_LAYOUT, KV_CACHE_DTYPES, SLIDING_WINDOW_CACHES, GenerationSpec
from tpuexport.export.cache_states import (DecodeConvStates, DecodeIndexerKeys, DecodeRecurrentStates, PrefillConvStates, PrefillIndexerKeys,
                                           PrefillRecurrentStates, WithStates, by_attention_layer)
from tpuexport.export.checkpoints import meta_copy
from tpuexport.export.functional_cache import DecodeCache, FunctionalKVCache, GroupedKVCache, PrefillCache
from tpuexport.export.model_positions import positions_known

def base_model(model: nn.Module) -> nn.Module:
    """The base model a causal LM's forward calls for its hidden states: transformers' `base_model`,
    unless that is the LM itself, as it is when `base_model_prefix` names no attribute of the LM
    (MllamaForCausalLM's and Llama4ForCausalLM's "language_model", while they hold their text model as
    `model`: calling the LM there returns logits, not `last_hidden_state`); then the LM's one child that
    is a Hugging Face model."""
    from transformers import PreTrainedModel

    base = model.base_model
    if base is not model:
        return base
    children = [child for child in model.children() if isinstance(child, PreTrainedModel)]
    return children[0] if len(children) == 1 else base


def _cache_argument(model: nn.Module, functional) -> dict:
    """{the base model's cache argument: the transformers Cache over `functional`}: `past_key_values`,
    or `cache` for a model that names it so (Mamba-2's; it would take past_key_values into **kwargs
    and run without a cache)."""
    parameters = inspect.signature(base_model(model).forward).parameters
    name = "cache" if "cache" in parameters and "past_key_values" not in parameters else "past_key_values"
    return {name: _transformers_cache(functional)}


def _transformers_cache(functional: "FunctionalKVCache | GroupedKVCache | WithStates"):
    """A transformers Cache whose update is `functional.update` (what the attention layers call)."""
    from transformers.cache_utils import Cache

    class KVCache(Cache):
        def __init__(self):
            super().__init__(layers=[])

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return functional.update(key_states, value_states, layer_idx)

        # What a short-convolution layer calls (LFM2's): its state before the step, and its inputs to keep.
        def get_conv_state(self, layer_idx, state_idx=0):
            return functional.conv_state(layer_idx)

        def update_conv_state(self, conv_states, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
            return functional.update_conv_state(conv_states, layer_idx, kernel=conv_kernel_size)

        def is_recording_past(self, layer_idx):
            return False

        # What an indexed attention layer's indexer calls (DeepSeek Sparse Attention's): its keys to keep, and all it scores.
        def update_indexer(self, indexer_key_states, layer_idx):
            return functional.update_indexer(indexer_key_states, layer_idx)

        # What a recurrent layer calls (Mamba-2's, gated DeltaNet's): its state before the step (None: a fresh prompt), and after it.
        def get_recurrent_state(self, layer_idx, state_idx=0):
            return functional.recurrent_state(layer_idx)

        def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
            return functional.update_recurrent_state(recurrent_states, layer_idx)

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 0

    return KVCache()


class _Cached(Exception):
    """Raised by the probe's cache at the first write: what the first attention layer caches."""

    def __init__(self, keys: torch.Size, values: torch.Size):
        super().__init__()
        self.keys, self.values = keys, values


class _ProbeCache:
    def update(self, new_keys, new_values, layer):
        raise _Cached(new_keys.shape, new_values.shape)

    def conv_state(self, layer):
        return None

    def update_conv_state(self, inputs, layer, kernel=None):
        return inputs

    def recurrent_state(self, layer):
        return None

    def update_recurrent_state(self, state, layer):
        return state


class _ConvCached(Exception):
    """Raised by the conv probe's cache at the first short convolution: its channels and the inputs it keeps."""

    def __init__(self, channels: int, kernel: int | None):
        super().__init__()
        self.channels, self.kernel = channels, kernel


class _PassingProbeCache(_ProbeCache):
    """Keys, values and indexer keys pass through: a probe stopping at a later call."""

    def update(self, new_keys, new_values, layer):
        return new_keys, new_values

    def update_indexer(self, new, layer):
        return new


class _StateRecorder(_PassingProbeCache):
    """Passes every call through (a fresh prompt) and records what each layer keeps besides keys:
    {layer: (channels, kernel)} of short convolutions, {layer: (state shape per row, dtype)} of recurrent states."""

    def __init__(self):
        self.convs: dict[int, tuple[int, int | None]] = {}
        self.recurrent: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        self.keys: set[int] = set()

    def update(self, new_keys, new_values, layer):
        self.keys.add(layer)
        return new_keys, new_values

    def update_conv_state(self, inputs, layer, kernel=None):
        self.convs[layer] = (int(inputs.shape[1]), kernel)
        return inputs

    def update_recurrent_state(self, state, layer):
        self.recurrent[layer] = (tuple(int(size) for size in state.shape[1:]), state.dtype)
        return state


class _LayerProbeCache(_PassingProbeCache):
    """Raises _Cached at one layer's write, the earlier layers' passing through."""

    def __init__(self, layer: int):
        self.layer = layer

    def update(self, new_keys, new_values, layer):
        if layer == self.layer:
            raise _Cached(new_keys.shape, new_values.shape)
        return new_keys, new_values


class _ConvProbeCache(_PassingProbeCache):
    def update_conv_state(self, inputs, layer, kernel=None):
        raise _ConvCached(int(inputs.shape[1]), kernel)


class _IndexerCached(Exception):
    """Raised by the indexer probe's cache at the first indexer key write: the key's width."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width


class _IndexerProbeCache(_PassingProbeCache):
    def update_indexer(self, new, layer):
        raise _IndexerCached(int(new.shape[-1]))


@contextlib.contextmanager
def buffers_kept(model: nn.Module):
    """Within it a forward may rebind the model's buffers; on exit each module has the buffers it had.

    Some forwards move a buffer to their input's device and keep the copy (CTRL's
    `self.pos_encoding = self.pos_encoding.to(device)`): run on the meta device to probe shapes,
    they replace a buffer the model computed when it was built (and no checkpoint holds) by a
    meta tensor with no values."""
    kept = {module: dict(module._buffers) for module in model.modules()}
    try:
        yield
    finally:
        for module, buffers in kept.items():
            module._buffers.clear()
            module._buffers.update(buffers)


def decoder_layers(model: nn.Module) -> int:
    """The decoder's layer count (its cache's first axis), from its text config's num_hidden_layers.

    Raises:
      TpuExportError: a config without one (e.g. BLT's byte-level local and global transformers):
        not one stack of decoder layers the KV-cache entry points can cache.
    """
    layers = getattr(_text_config(model.config), "num_hidden_layers", None)
    if not isinstance(layers, int):
        raise TpuExportError(f"--task text-generation: {type(model).__name__} ({model.config.model_type}) has no num_hidden_layers in its "
                             "config: its layers are not one decoder stack the KV-cache entry points support; convert its forward "
                             "with --task feature-extraction, or write a file.py:factory for it")
    return layers


def cached_shapes(model: nn.Module, layer: int | None = None) -> tuple[int, int]:
    """(kv heads, head_dim) of what a decoder's attention layers write to their cache, as the first
    layer (or `layer`) writes it for a 2-token prompt (on the model's device, the meta device too;
    the forward stops there): a model's own (Llama's num_key_value_heads x head_dim, DeepSeek's heads x
    qk_nope + qk_rope for keys and heads x v_head_dim for values, MiniCPM3's one latent "head").

    Raises:
      TpuExportError: keys and values with different head counts.
    """
    try:
        _probe_forward(model, _ProbeCache() if layer is None else _LayerProbeCache(layer))
    except _Cached as cached:
        keys, values = cached.keys, cached.values
    except Exception:  # the forward fails before any layer writes (so will its export, which says why): the config's sizes
        text = _text_config(model.config)
        heads = text.num_attention_heads
        return getattr(text, "num_key_value_heads", None) or heads, getattr(text, "head_dim", None) or text.hidden_size // heads
    else:
        raise TpuExportError(f"--task text-generation: {type(model).__name__}'s layers write no KV cache; it is not a decoder the "
                             "prefill/decode entry points can run")
    if keys[1] != values[1]:
        raise TpuExportError(f"--task text-generation: {type(model).__name__} caches keys of {keys[1]} heads and values of {values[1]}, "
                             "which the KV cache (one head count) does not hold yet")
    return int(keys[1]), int(max(keys[-1], values[-1]))


def _probe_forward(model: nn.Module, cache) -> None:
    """The base model's forward over a 2-token prompt with `cache` as its cache (on the model's
    device, the meta device too), as the entry points call it (Prefill.hidden_states)."""
    parameter = next(model.parameters())
    positions = torch.arange(2, device=parameter.device)
    # The probe does not know yet whether layers of a type no mask names attend: it gives them a mask, to see what they keep.
    windows = _windows_with_hybrid_layers(model, _unmasked_layer_types(model), attending=True)
    mask = _causal_masks(windows, positions[None, :], positions, parameter.dtype, attention_chunks(model))
    if getattr(model, "_is_stateful", False):  # recurrent layers get no padding mask: a 2-token prompt has no padding
        mask = _with_recurrent_layers(model, mask, windows, _unmasked_layer_types(model), None)
    else:
        mask = _with_conv_layers(mask, bool(conv_layers(model)))
    with torch.no_grad(), buffers_kept(model):
        base_model(model)(input_ids=torch.zeros((1, 2), dtype=torch.long, device=parameter.device), attention_mask=mask,
                          position_ids=positions[None, :], use_cache=True, **_cache_argument(model, cache))


# The key transformers' hybrid models read their recurrent layers' 2D padding mask under, in a prepared
# mask mapping ({"full_attention": ..., "linear_attention": ...}), whatever their layer types say.
_RECURRENT_MASK_KEY = "linear_attention"


def _unmasked_layer_types(model: nn.Module) -> set[str]:
    """The config's layer types no causal mask is for (not attention), and transformers' recurrent mask key."""
    return (set(getattr(_text_config(model.config), "layer_types", None) or ()) - set(_MASKED_LAYER_TYPES)) | {_RECURRENT_MASK_KEY}


def _takes_mask_mapping(model: nn.Module) -> bool:
    """Whether the base model takes a prepared mask per layer type (transformers' models mixing layer
    types test `isinstance(causal_mask_mapping := attention_mask, dict)`); a model of one kind of layer
    (Mamba-2's) takes one mask, which for recurrent layers is the 2D padding mask."""
    return "causal_mask_mapping" in inspect.getsource(type(base_model(model)).forward)


def _with_recurrent_layers(model: nn.Module, mask, windows: dict, unmasked: set[str], padding: torch.Tensor | None):
    """The mask a model with recurrent layers takes: {attention layer type: its causal mask, recurrent
    or other unmasked layer type: `padding`} (a left-padded prefill's [batch, seq] mask of real tokens,
    or None in decode: a step's token is never padding), or `padding` alone for a model taking one mask."""
    if not _takes_mask_mapping(model):
        return padding
    return {**(mask if isinstance(mask, dict) else dict.fromkeys(windows, mask)), **dict.fromkeys(unmasked, padding)}


def _with_conv_layers(mask, conv: bool):
    """A prepared mask per layer type ({layer type: mask}) with the short-convolution layers' None when
    the model has them (`conv`): they mask nothing, as no padding reaches a causal convolution's kept
    inputs. One mask for every attention layer is left as it is: the model gives its conv layers None."""
    return {**mask, _CONV_LAYER_TYPE: None} if conv and isinstance(mask, dict) else mask


def conv_layers(model: nn.Module) -> tuple[int, ...]:
    """The decoder's short-convolution layers (LFM2's "conv" layer type), by index; () for none."""
    return tuple(index for index, layer_type in enumerate(getattr(_text_config(model.config), "layer_types", None) or ())
                 if layer_type == _CONV_LAYER_TYPE)


def indexed_layers(model: nn.Module) -> tuple[int, ...]:
    """The decoder's indexed attention layers (DeepSeek Sparse Attention's "indexed_attention"), by index; () for none."""
    return tuple(index for index, layer_type in enumerate(getattr(_text_config(model.config), "layer_types", None) or ())
                 if layer_type == _INDEXED_LAYER_TYPE)


def indexer_width(model: nn.Module) -> int:
    """The width of an indexer key, as the first indexed layer's indexer keeps it for a 2-token prompt
    (the forward stops there).

    Raises:
      TpuExportError: the model's indexed layers keep no indexer keys through the cache.
    """
    try:
        _probe_forward(model, _IndexerProbeCache())
    except _IndexerCached as cached:
        return cached.width
    except Exception as error:  # the forward fails before its first indexer: its export would too
        raise TpuExportError(f"--task text-generation: {type(model).__name__}'s forward fails before its first indexer "
                             f"({type(error).__name__}: {' '.join(str(error).split())[:200]}); its full-sequence forward may convert "
                             "(--task feature-extraction)") from None
    raise TpuExportError(f"--task text-generation: {type(model).__name__}'s indexed_attention layers keep no indexer keys in the cache "
                         "(update_indexer); its full-sequence forward may convert (--task feature-extraction)")


def conv_state_shape(model: nn.Module) -> tuple[int, int]:
    """(channels, kernel) of what a short-convolution layer keeps per slot, as the first one keeps it
    for a 2-token prompt (the forward stops there).

    Raises:
      TpuExportError: the model's conv layers keep no state through the cache.
    """
    try:
        _probe_forward(model, _ConvProbeCache())
    except _ConvCached as cached:
        if cached.kernel:
            return cached.channels, int(cached.kernel)
    except Exception as error:  # the forward fails before its first convolution: its export would too
        raise TpuExportError(f"--task text-generation: {type(model).__name__}'s forward fails before its first short convolution "
                             f"({type(error).__name__}: {' '.join(str(error).split())[:200]}); its full-sequence forward may convert "
                             "(--task feature-extraction)") from None
    raise TpuExportError(f"--task text-generation: {type(model).__name__}'s conv layers keep no state in the cache the way the "
                         "entry points hold it (a kernel size per layer); its full-sequence forward may convert (--task feature-extraction)")


def cached_shapes_per_layer_type(model: nn.Module) -> tuple[tuple[int, int], tuple[int, int]]:
    """((kv heads, head_dim) of the full layers, of the sliding layers) of a decoder mixing the two, as the
    first layer of each type writes them (cached_shapes): MiMo-V2-Flash's sliding layers cache twice as
    many heads, dots3's a wider latent (its sliding layers' kv_lora_rank, 1024, against 512)."""
    layer_types = list(_text_config(model.config).layer_types)
    first_full = next(index for index, layer_type in enumerate(layer_types)
                      if layer_type in _MASKED_LAYER_TYPES and layer_type != "sliding_attention")
    return cached_shapes(model, first_full), cached_shapes(model, layer_types.index("sliding_attention"))


def _masked_value(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).min


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


# Attention layer types whose keys a plain (optionally windowed or chunked) causal mask describes.
_MASKED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "indexed_attention")
# Layers attending within fixed chunks of positions (Llama 4's): a query at q sees the keys k <= q of its
# own chunk, k // C == q // C (transformers' `chunked_overlay`, with no left padding).
_CHUNKED_LAYER_TYPE = "chunked_attention"
# Layers whose indexer chooses the keys their attention reads (DeepSeek Sparse Attention's): causal
# masks as a full layer's, and the indexer's keys in the cache beside theirs (indexer_keys).
_INDEXED_LAYER_TYPE = "indexed_attention"
# Layers that are causal short convolutions (LFM2's), whose state the cache holds beside the keys (conv_state).
_CONV_LAYER_TYPE = "conv"


def attention_windows(model: nn.Module, state_layer_types: Collection[str] = ()) -> dict[str, int | None]:
    """The attention each layer type of a Hugging Face decoder does: {layer type: sliding window}.

    A query at position q attends to keys k with q - window < k <= q (transformers'
    `sliding_window_overlay`); window None is full causal attention. A config with `layer_types`
    (Qwen2, Gemma 2/3) gives its "sliding_attention" layers `sliding_window`; one without it
    (Mistral, Mixtral, Phi-3) applies `sliding_window`, when set, to every layer.

    `state_layer_types`: the types of the layers that keep a recurrent state instead of keys (the
    spec's recurrent layers'); like LFM2's "conv" layers they attend to nothing and are left out.

    Raises:
      TpuExportError: a layer type no causal mask describes and no state holds (linear attention
        without a recurrent state through the cache, ...).
    """
    config = _text_config(model.config)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return {"full_attention": window}
    not_attention = {_CONV_LAYER_TYPE, *state_layer_types}  # no mask: no keys
    layer_types = [layer_type for layer_type in layer_types if layer_type not in not_attention]
    unknown = sorted(set(layer_types) - set(_MASKED_LAYER_TYPES))
    if unknown:
        raise TpuExportError(f"--task text-generation: {type(model).__name__} has {unknown[0]} layers, which the KV-cache entry points "
                             f"do not support yet (only {' and '.join(_MASKED_LAYER_TYPES)}); its full-sequence forward may convert "
                             "(--task feature-extraction)")
    return {layer_type: window if layer_type == "sliding_attention" else None for layer_type in sorted(set(layer_types))}


def _windows_with_hybrid_layers(model: nn.Module, state_layer_types: Collection[str], attending: bool) -> dict[str, int | None]:
    """`attention_windows`, and where it finds no attention layer type but recurrent layers attend
    (`attending`: Falcon-H1's and Zamba2's "hybrid" layers, an attention beside a state-space mixer),
    full causal attention for them."""
    return attention_windows(model, state_layer_types) or ({"full_attention": None} if attending else {})


def attention_chunks(model: nn.Module) -> dict[str, int]:
    """{layer type: chunk size C} of the layers attending within chunks of C positions (Llama 4's
    "chunked_attention" layers, C = attention_chunk_size); {} for a model without them. Their keys
    are kept for every position, as a full layer's: the chunk lives in the masks
    (`_causal_masks`), so the cache is the one the entry points already hold."""
    config = _text_config(model.config)
    if _CHUNKED_LAYER_TYPE not in (getattr(config, "layer_types", None) or ()):
        return {}
    chunk = getattr(config, "attention_chunk_size", None)
    if not isinstance(chunk, int) or chunk < 1:
        raise TpuExportError(f"--task text-generation: {type(model).__name__} has chunked_attention layers but its config gives no "
                             "attention_chunk_size; set it in config.json")
    return {_CHUNKED_LAYER_TYPE: chunk}


def keys_seen(queries: torch.Tensor, keys: torch.Tensor, window: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """Which keys each query sees (bool, broadcast of `queries` [..., 1] against `keys` [...]): the
    causal k <= q, within a sliding window (q - window < k) or a chunk (k // chunk == q // chunk)."""
    visible = keys <= queries
    if window is not None:
        visible = visible & (keys > queries - window)
    if chunk is not None:
        visible = visible & (keys // chunk == queries // chunk)
    return visible


def check_decoder(model: nn.Module) -> None:
    """Refuses, in one line, a causal LM whose state between steps no cache can hold (recurrent
    states are `_recurrent_states`' to judge).

    Raises:
      TpuExportError: a model whose forward takes no cache, or one that attends bidirectionally.
    """
    name = type(model).__name__
    # The LM's forward, not its base model's: a base model may be a wrapper passing on *args, **kwargs (TrOCR's).
    if not {"past_key_values", "cache"} & set(inspect.signature(model.forward).parameters):
        if getattr(model, "_is_stateful", False):  # RWKV's and xLSTM's states: arguments of their own
            raise _state_outside_cache(name)
        # OpenAI GPT's base model swallows the cache in **kwargs and reads the entry points' 4D mask as
        # a 2D one (torch.export then failed in its merge_heads: "permute a tensor of rank 6").
        raise TpuExportError(f"--task text-generation: {name} ({model.config.model_type}) takes no KV cache (its forward has no "
                             "past_key_values): its generate() recomputes the whole sequence at every step, which the "
                             "prefill/decode entry points do not; its full-sequence forward may convert (--task feature-extraction)")
    if _attends_bidirectionally(model):
        # BERT-style decoders say so with is_decoder; PaliGemma's Gemma with use_bidirectional_attention (its prompt, a prefix).
        field, value = ("use_bidirectional_attention", "true") if getattr(model.config, "use_bidirectional_attention", False) \
            else ("is_decoder", "false")
        fix = {"true": "false", "false": "true"}[value]
        raise TpuExportError(f"--task text-generation: {name} attends bidirectionally (its config's {field} is {value}), "
                             f"so earlier tokens' keys change as tokens are added and no KV cache can hold them; set {field} {fix} "
                             "in config.json if it was trained as a causal decoder, or convert --task feature-extraction")


def _attends_bidirectionally(model: nn.Module) -> bool:
    """Whether every attention module of a transformers model that says whether it is causal says
    it is not (a BERT-style decoder built with is_decoder false): its generate() recomputes the
    whole sequence at every step."""
    causal = [module.is_causal for module in model.modules() if isinstance(getattr(module, "is_causal", None), bool)]
    return bool(causal) and not any(causal)


def ring_prefill_positions(lengths: torch.Tensor, window: int) -> torch.Tensor:
    """Which prompt position a ring cache of `window` (W) indexes keeps at each index after
    prefill: [batch, W].

    Row r keeps its last W real positions, max(0, L - W)..L - 1 (L = lengths[r]), position p at
    index p mod W. A row shorter than W has indexes L..W-1 left over: they get position L - 1
    again (a copy of a real key, never a padding token's), and decode writes each of them, at
    position i, before any query may see index i (`ring_mask`)."""
    start = (lengths - window).clamp(min=0)[:, None]
    index = torch.arange(window, device=lengths.device)[None, :]
    positions = start + (index - start) % window
    return torch.minimum(positions, (lengths - 1)[:, None])


def ring_mask(positions: torch.Tensor, window: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [batch, 1, 1, W] of decode queries at absolute `positions` [batch] over a
    ring cache of W indexes, the step's own key written at index q mod W.

    Index i holds the latest position p <= q with p = i mod W once the row has been written up
    to q: p = q - ((q - i) mod W), which is within the window (q - W < p <= q) by construction and
    a real position (p >= 0) exactly when i <= q. So the mask shows index i iff i <= q: every key
    the windowed causal query sees, and nothing else (an index above q before the ring first
    fills holds an earlier occupant's key or a prefill filler)."""
    index = torch.arange(window, device=positions.device)
    visible = index[None, :] <= positions[:, None]
    return torch.where(visible, 0.0, _masked_value(dtype)).to(dtype)[:, None, None]


def _causal_masks(windows: dict[str, int | None], queries: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype,
                  chunks: dict[str, int] | None = None):
    """The additive masks [batch, 1, queries, keys] of queries at positions `queries` [batch, q] over
    cache positions `keys` [k], each layer type within its window and chunk (`attention_chunks`): one
    tensor when every layer attends alike, else {layer type: mask} (what transformers' models with
    mixed layer types take as a prepared mask)."""
    masks = {}
    for layer_type, window in windows.items():
        visible = keys_seen(queries[:, :, None], keys[None, None, :], window, (chunks or {}).get(layer_type))
        masks[layer_type] = torch.where(visible, 0.0, _masked_value(dtype)).to(dtype)[:, None]
    return next(iter(masks.values())) if len(masks) == 1 else masks


def bias_mask_windows(model: nn.Module) -> dict[nn.Module, int | None]:
    """Attention modules that mask with a causal `bias` buffer of their own: {module: its window}.

    GPT-Neo (and ImageGPT, Bark) build, once, a bool [1, 1, P, P] lower triangle at P =
    max_position_embeddings (banded for local attention: keys q - W < k <= q) and take
    `bias[:, :, k - q : k, :k]` for q queries over k keys, i.e. they assume the keys are positions
    0..k-1 and the queries the last q of them. Over the entry points' caches that is not so (decode
    reads max_context keys for a query at any position), and slicing the fixed P x P buffer to a
    symbolic prompt length makes torch.export specialize it to P (a contiguity guard). The entry
    points therefore give each such module, for the step, a `bias` holding its own mask over the
    keys it reads (`masks_as_bias`); the window comes from the buffer itself (None: plain causal,
    or a band at least P wide). A buffer of another form, or on the meta device, is left alone.
    """
    found = {}
    for module in model.modules():
        bias = module._buffers.get("bias")
        if (bias is None or bias.dtype != torch.bool or bias.dim() != 4 or tuple(bias.shape[:2]) != (1, 1)
                or bias.shape[2] != bias.shape[3] or bias.is_meta):
            continue
        size = bias.shape[-1]
        window = int(bias[0, 0, -1].sum())
        causal = torch.ones((size, size), dtype=torch.bool, device=bias.device).tril()
        if torch.equal(bias[0, 0], causal & ~causal.tril(-window)):
            found[module] = None if window >= size else window
    return found


@contextlib.contextmanager
def masks_as_bias(windows: dict[nn.Module, int | None], queries: torch.Tensor, keys: torch.Tensor):
    """Within it each module of `bias_mask_windows` reads as `bias` its mask for queries at
    positions `queries` [batch, q] over keys at positions `keys` [k], laid out as the module slices
    it (`bias[:, :, k - q : k, :k]`: the last q of k rows; the rows above, never read, repeat the
    first). The module's buffer itself is untouched (an instance attribute shadows it while the
    context is open). Such models set no config window (`attention_windows`), so their cache is
    never a ring: key index k is position k."""
    for module, window in windows.items():
        visible = keys[None, None, :] <= queries[:, :, None]
        if window is not None:
            visible = visible & (keys[None, None, :] > queries[:, :, None] - window)
        visible = visible[:, None]
        above = visible.shape[-1] - visible.shape[-2]
        object.__setattr__(module, "bias", torch.cat([visible[:, :, :1].expand(-1, -1, above, -1), visible], dim=2))
    try:
        yield
    finally:
        for module in windows:
            module.__dict__.pop("bias", None)


class _EntryPoint(nn.Module):
    """Holds the model (registered once, as `model`, so every entry point names its weights alike)."""

    def __init__(self, model: nn.Module, spec: GenerationSpec):
        super().__init__()
        self.model = model
        self.spec = spec
        # A model with recurrent layers: the layer types no causal mask is for (its recurrent layers',
        # transformers' "linear_attention", and layers keeping nothing: Nemotron-H's "mlp" and "moe").
        self.unmasked_types = _unmasked_layer_types(model) if getattr(spec, "recurrent_layers", ()) else set()  # a PagedSpec has none
        self.windows = _windows_with_hybrid_layers(model, self.unmasked_types, bool(getattr(spec, "attending_recurrent_layers", ())))
        self.chunks = attention_chunks(model)
        self.bias_windows = bias_mask_windows(model)
        # The dtype the model computes in (an int8 cache's is not): the masks' and attention's.
        self.model_dtype = getattr(torch, spec.dtype)

    def hidden_states(self, tokens, mask, positions, cache, keys, padding: torch.Tensor | None = None) -> torch.Tensor:
        """The model's last hidden states; `keys`: the positions of the keys attention reads [k], for
        the modules that mask with a buffer of their own (`masks_as_bias`); `padding`: a left-padded
        prefill's [batch, seq] mask of real tokens (1) and padding (0), which the recurrent layers take
        to zero the padding's inputs (decode has none: a step's token is never padding)."""
        if self.unmasked_types:
            mask = _with_recurrent_layers(self.model, mask, self.windows, self.unmasked_types, padding)
        else:
            mask = _with_conv_layers(mask, bool(self.spec.conv_layers))
        with masks_as_bias(self.bias_windows, positions, keys), positions_known(self.model, positions, keys):
            output = base_model(self.model)(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                                            **_cache_argument(self.model, cache))
        return output.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The causal LM's logits of the rows wanted (`hidden` [rows, width]), computed by the LM's
        own forward with its base model answering `hidden`: whatever that forward does after the
        base model is done as it does it (a prediction head's dense layer and norm before the output
        projection, as ModernBERT's decoder and BERT-style LM heads have; Cohere's logit_scale,
        Granite's logits_scaling, Gemma's soft-capping)."""
        options = {"use_cache": False}
        if "output_router_logits" in inspect.signature(self.model.forward).parameters:
            options["output_router_logits"] = False  # no load-balancing loss: it would read every token's router logits
        # The base model, or the part of it the LM's forward calls (OPT's calls its decoder, not OPTModel).
        base = base_model(self.model)
        answered = []
        with _answering([base, *base.children()], _BaseOutput(hidden[:, None]), answered):
            logits = self.model(inputs_embeds=hidden[:, None], **options).logits
        if not answered:
            raise TpuExportError(f"{type(self.model).__name__}'s forward computes its hidden states without calling its base model "
                                 f"({type(base).__name__}) or a part of it, so its logits cannot be taken from chosen rows; convert "
                                 "it from a file.py:factory whose model returns logits from hidden states")
        return logits[:, -1].float()


class _BaseOutput:
    """What the base model answers its LM's forward in `_EntryPoint.logits`: `last_hidden_state`
    (also as item 0); every other output an LM's forward may pass on (attentions, router logits,
    cross-attentions, the cache) None, as a base model gives them when they are not asked for."""

    def __init__(self, last_hidden_state: torch.Tensor):
        self.last_hidden_state = last_hidden_state

    def __getitem__(self, index):
        if index in (0, "last_hidden_state"):
            return self.last_hidden_state
        raise KeyError(index)

    def __getattr__(self, name: str):
        return None


@contextlib.contextmanager
def _answering(modules: list[nn.Module], output, answered: list):
    """Within it, calling any of `modules` returns `output` whatever it is given, and appends the module
    to `answered`. A `forward` an instance held already (an accelerate hook's, say) is put back after,
    not deleted."""
    own = [module.__dict__.get("forward") for module in modules]
    for module in modules:
        module.forward = lambda *args, module=module, **kwargs: answered.append(module) or output
    try:
        yield
    finally:
        for module, forward in zip(modules, own):
            if forward is None:
                del module.forward
            else:
                module.forward = forward


class Prefill(_EntryPoint):
    cache_type = PrefillCache
    conv_type = PrefillConvStates
    indexer_type = PrefillIndexerKeys
    recurrent_type = PrefillRecurrentStates

    def forward(self, tokens, lengths, slots, cache_k, cache_v, cache_k_scale=None, cache_v_scale=None):
        return self.prefill(tokens, lengths, slots, cache_k, cache_v, cache_k_scale, cache_v_scale)

    def prefill(self, tokens, lengths, slots, cache_k, cache_v, cache_k_scale=None, cache_v_scale=None, window_cache_k=None,
                window_cache_v=None, conv_state=None, indexer_keys=None):
        batch, steps = tokens.shape
        # One batch dim for the three inputs (torch.export may otherwise give each its own symbol).
        torch._check(lengths.shape[0] == batch)
        torch._check(slots.shape[0] == batch)
        dtype = self.model_dtype
        positions = torch.arange(steps, device=tokens.device)
        mask = _causal_masks(self.windows, positions[None, :].expand(batch, steps), positions, dtype, self.chunks)
        window = self.spec.cache_window
        ring_positions = None if window is None else ring_prefill_positions(lengths, window)
        if not self.spec.window_layers:
            cache = self.cache_type(cache_k, cache_v, self.spec.layout, slots, cache_k_scale, cache_v_scale, kept_columns=ring_positions)
        else:  # the full layers write every position, the sliding layers their rings
            cache = GroupedKVCache([(self.cache_type(cache_k, cache_v, self.spec.layout, slots), self.spec.full_layers),
                                    (self.cache_type(window_cache_k, window_cache_v, self.spec.layout, slots, kept_columns=ring_positions),
                                     self.spec.window_layers)])
        if self.spec.conv_layers or self.spec.indexed_layers:  # states beside the attention layers' keys
            cache = WithStates(by_attention_layer(cache, self.spec),
                               self.conv_type(conv_state, self.spec.conv_layers, lengths, slots) if self.spec.conv_layers else None,
                               self.indexer_type(indexer_keys, self.spec.indexed_layers, slots) if self.spec.indexed_layers else None)
        hidden = self.hidden_states(tokens, mask, positions[None, :].expand(batch, steps), cache, positions)
        last = hidden[torch.arange(batch, device=tokens.device), lengths - 1]
        return {"logits": self.logits(last), **dict(zip(self.spec.cache_inputs, cache.written()))}


    def prefill_left_padded(self, tokens, lengths, slots, cache_k, cache_v, conv_state, recurrent_state):
        """Prefill of a model with recurrent layers (GenerationSpec.left_padded): same inputs and
        outputs as `prefill` (right-padded prompts), but each row runs aligned to the end of the
        bucket, its padding first. A recurrent layer folds every input into its state; the padding
        before a prompt is masked to zero inputs (the model's own `apply_mask_to_padding_states`,
        given `padding`), which leave the initial zero state at zero, so each row's final state is
        its prompt's alone. Attention masks the padding's keys; the KV cache keeps position p of
        row r from column p + padding[r]; the short convolutions keep the bucket's last inputs."""
        batch, steps = tokens.shape
        torch._check(lengths.shape[0] == batch)
        torch._check(slots.shape[0] == batch)
        spec, dtype = self.spec, self.model_dtype
        columns = torch.arange(steps, device=tokens.device)
        padding = steps - lengths
        positions = columns[None, :] - padding[:, None]  # each column's position in its prompt; negative on padding
        real = positions >= 0
        aligned = torch.where(real, tokens.gather(1, positions.clamp(min=0)), torch.zeros_like(tokens))
        masks = {}
        for layer_type, window in self.windows.items():
            visible = keys_seen(positions[:, :, None], positions[:, None, :], window, self.chunks.get(layer_type)) & real[:, None, :]
            masks[layer_type] = torch.where(visible, 0.0, _masked_value(dtype)).to(dtype)[:, None]
        kept_columns = (columns[None, :] + padding[:, None]).clamp(max=steps - 1)  # past a prompt: decode's to overwrite
        cache = WithStates(by_attention_layer(self.cache_type(cache_k, cache_v, spec.layout, slots, kept_columns=kept_columns), spec),
                           self.conv_type(conv_state, spec.conv_layers, torch.full_like(lengths, steps), slots),
                           recurrent=self.recurrent_type(recurrent_state, spec.recurrent_layers, slots))
        hidden = self.hidden_states(aligned, masks, positions.clamp(min=0), cache, columns, padding=real.to(dtype))
        return {"logits": self.logits(hidden[:, -1]), **dict(zip(spec.cache_inputs, cache.written()))}


class RecurrentPrefill(Prefill):
    """Prefill of a model with recurrent layers (GenerationSpec.recurrent_layers), left-padded."""

    def forward(self, tokens, lengths, slots, cache_k, cache_v, conv_state, recurrent_state):
        return self.prefill_left_padded(tokens, lengths, slots, cache_k, cache_v, conv_state, recurrent_state)


class ConvPrefill(Prefill):
    """Prefill of a model with short-convolution layers (GenerationSpec.conv_layers)."""

    def forward(self, tokens, lengths, slots, cache_k, cache_v, conv_state):
        return self.prefill(tokens, lengths, slots, cache_k, cache_v, conv_state=conv_state)


class IndexedPrefill(Prefill):
    """Prefill of a model with indexed attention layers (GenerationSpec.indexed_layers)."""

    def forward(self, tokens, lengths, slots, cache_k, cache_v, indexer_keys):
        return self.prefill(tokens, lengths, slots, cache_k, cache_v, indexer_keys=indexer_keys)


class MixedPrefill(Prefill):
    """Prefill of a model whose sliding layers keep their rings apart (GenerationSpec.window_layers)."""

    def forward(self, tokens, lengths, slots, cache_k, cache_v, window_cache_k, window_cache_v):
        return self.prefill(tokens, lengths, slots, cache_k, cache_v, window_cache_k=window_cache_k, window_cache_v=window_cache_v)


class Decode(_EntryPoint):
    cache_type = DecodeCache
    conv_type = DecodeConvStates
    indexer_type = DecodeIndexerKeys
    recurrent_type = DecodeRecurrentStates

    def ring_indexes(self, positions: torch.Tensor) -> torch.Tensor:
        """Where a ring cache keeps the keys of absolute `positions`: p mod W."""
        return positions % self.spec.cache_window

    def forward(self, tokens, positions, cache_k, cache_v, cache_k_scale=None, cache_v_scale=None):
        return self.decode(tokens, positions, cache_k, cache_v, cache_k_scale, cache_v_scale)

    def decode(self, tokens, positions, cache_k, cache_v, cache_k_scale=None, cache_v_scale=None, window_cache_k=None,
               window_cache_v=None, conv_state=None, indexer_keys=None, recurrent_state=None):
        window, layout = self.spec.cache_window, self.spec.layout
        keys = torch.arange(self.spec.max_context, device=tokens.device)
        if window is None:
            mask = _causal_masks(self.windows, positions[:, None], keys, self.model_dtype, self.chunks)
            cache = self.cache_type(cache_k, cache_v, layout, positions, cache_k_scale, cache_v_scale)
        elif not self.spec.window_layers:  # a ring: the model's mask over its W indexes, the key written at index q mod W
            mask = ring_mask(positions, window, self.model_dtype)
            cache = self.cache_type(cache_k, cache_v, layout, self.ring_indexes(positions), cache_k_scale, cache_v_scale)
        else:  # full layers over max_context positions, sliding layers over their rings
            mask = {layer_type: _causal_masks({layer_type: None}, positions[:, None], keys, self.model_dtype, self.chunks)
                    for layer_type in self.windows if layer_type != "sliding_attention"}
            mask["sliding_attention"] = ring_mask(positions, window, self.model_dtype)
            cache = GroupedKVCache([(self.cache_type(cache_k, cache_v, layout, positions), self.spec.full_layers),
                                    (self.cache_type(window_cache_k, window_cache_v, layout, self.ring_indexes(positions)),
                                     self.spec.window_layers)])
        if self.spec.conv_layers or self.spec.indexed_layers or self.spec.recurrent_layers:  # states beside the attention layers' keys
            cache = WithStates(by_attention_layer(cache, self.spec),
                               self.conv_type(conv_state, self.spec.conv_layers) if self.spec.conv_layers else None,
                               self.indexer_type(indexer_keys, self.spec.indexed_layers, positions) if self.spec.indexed_layers else None,
                               self.recurrent_type(recurrent_state, self.spec.recurrent_layers) if self.spec.recurrent_layers else None)
        hidden = self.hidden_states(tokens[:, None], mask, positions[:, None], cache, keys)
        return {"logits": self.logits(hidden[:, 0]), **dict(zip(self.spec.cache_inputs, cache.written()))}


class ConvDecode(Decode):
    """Decode of a model with short-convolution layers (GenerationSpec.conv_layers)."""

    def forward(self, tokens, positions, cache_k, cache_v, conv_state):
        return self.decode(tokens, positions, cache_k, cache_v, conv_state=conv_state)


class RecurrentDecode(Decode):
    """Decode of a model with recurrent layers (GenerationSpec.recurrent_layers)."""

    def forward(self, tokens, positions, cache_k, cache_v, conv_state, recurrent_state):
        return self.decode(tokens, positions, cache_k, cache_v, conv_state=conv_state, recurrent_state=recurrent_state)


class IndexedDecode(Decode):
    """Decode of a model with indexed attention layers (GenerationSpec.indexed_layers)."""

    def forward(self, tokens, positions, cache_k, cache_v, indexer_keys):
        return self.decode(tokens, positions, cache_k, cache_v, indexer_keys=indexer_keys)


class MixedDecode(Decode):
    """Decode of a model whose sliding layers keep their rings apart (GenerationSpec.window_layers)."""

    def forward(self, tokens, positions, cache_k, cache_v, window_cache_k, window_cache_v):
        return self.decode(tokens, positions, cache_k, cache_v, window_cache_k=window_cache_k, window_cache_v=window_cache_v)


class MixedConvPrefill(Prefill):
    """Prefill of a model with sliding layers keeping their rings apart and short-convolution layers (LFM3's)."""

    def forward(self, tokens, lengths, slots, cache_k, cache_v, window_cache_k, window_cache_v, conv_state):
        return self.prefill(tokens, lengths, slots, cache_k, cache_v, window_cache_k=window_cache_k, window_cache_v=window_cache_v,
                            conv_state=conv_state)


class MixedConvDecode(Decode):
    """Decode of a model with sliding layers keeping their rings apart and short-convolution layers (LFM3's)."""

    def forward(self, tokens, positions, cache_k, cache_v, window_cache_k, window_cache_v, conv_state):
        return self.decode(tokens, positions, cache_k, cache_v, window_cache_k=window_cache_k, window_cache_v=window_cache_v,
                           conv_state=conv_state)


class MixedIndexedPrefill(Prefill):
    """Prefill of a model with sliding layers keeping their rings apart and indexed attention layers (dots3's)."""

    def forward(self, tokens, lengths, slots, cache_k, cache_v, window_cache_k, window_cache_v, indexer_keys):
        return self.prefill(tokens, lengths, slots, cache_k, cache_v, window_cache_k=window_cache_k, window_cache_v=window_cache_v,
                            indexer_keys=indexer_keys)


class MixedIndexedDecode(Decode):
    """Decode of a model with sliding layers keeping their rings apart and indexed attention layers (dots3's)."""

    def forward(self, tokens, positions, cache_k, cache_v, window_cache_k, window_cache_v, indexer_keys):
        return self.decode(tokens, positions, cache_k, cache_v, window_cache_k=window_cache_k, window_cache_v=window_cache_v,
                           indexer_keys=indexer_keys)


def generation_spec(model: nn.Module, max_batch: int, max_context: int, layout: str = DEFAULT_CACHE_LAYOUT,
                    prefill_buckets: tuple[int, ...] | None = None, kv_cache_dtype: str = "model",
                    sliding_window_cache: str = "bounded") -> GenerationSpec:
    """The cache a Hugging Face decoder LM needs at these limits.

    Args:
      model: a transformers causal LM (`PreTrainedModel` with a decoder config).
      max_batch: cache slots; max_context: positions per slot.
      layout: one of CACHE_LAYOUTS.
      prefill_buckets: prompt lengths prefill is compiled for; None for the default (128, 512,
        2048 below max_context, and max_context).
      kv_cache_dtype: one of KV_CACHE_DTYPES.
      sliding_window_cache: one of SLIDING_WINDOW_CACHES: "bounded" keeps W positions per slot (a
        ring, `GenerationSpec.cache_window`) when every layer attends within one window W <
        max_context; "full" keeps max_context positions whatever the windows.
    Returns:
      The GenerationSpec.
    Raises:
      TpuExportError: not a Hugging Face causal LM, or limits out of range.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "base_model") or model.get_output_embeddings() is None:
        raise TpuExportError("--task text-generation needs a Hugging Face causal LM (e.g. LlamaForCausalLM, GPT2LMHeadModel); "
                             f"got {type(model).__name__}")
    if getattr(config, "is_encoder_decoder", False):
        raise TpuExportError(f"--task text-generation supports decoder-only LMs; {type(model).__name__} is an encoder-decoder")
    check_kv_cache_dtype(kv_cache_dtype)
    check_sliding_window_cache(sliding_window_cache)
    if layout not in CACHE_LAYOUTS:
        raise TpuExportError(f"unknown cache layout {layout!r}; use one of {', '.join(CACHE_LAYOUTS)}")
    if max_batch < 1 or max_context < 2:
        raise TpuExportError(f"--max-batch {max_batch} / --max-context {max_context} out of range; give max batch >= 1 and max context >= 2")
    check_decoder(model)
    text = _text_config(config)
    layers = decoder_layers(model)
    recurrent = _recurrent_states(model)
    windows = set(attention_windows(model, _unmasked_layer_types(model) if recurrent else ()).values())  # refuses a type no mask describes
    # Every layer recurrent (Mamba-2's): no layer writes keys, and cache_k/cache_v hold none (0 layers). Full
    # layers beside sliding ones: each type's first layer probed, the sliding layers' shape kept for their rings.
    sliding = None
    if recurrent and len(recurrent.layers) == layers and not recurrent.attending:
        kv_heads, head_dim = 1, 1
    elif len(windows) > 1 and not recurrent:
        (kv_heads, head_dim), sliding = cached_shapes_per_layer_type(model)
    else:
        kv_heads, head_dim = cached_shapes(model)
    positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    if positions is not None and max_context > positions:
        raise TpuExportError(f"--max-context {max_context} exceeds the model's {positions} positions (max_position_embeddings); "
                             f"give --max-context <= {positions}")
    shortest = _shortest_prefill(model, max_context)
    if recurrent:  # one static prompt length (`_recurrent_states`): by default the longest default bucket's
        prefill_buckets = (min(max_context, _LONGEST_DEFAULT_BUCKET),) if prefill_buckets is None else prefill_buckets
        if len(set(prefill_buckets)) > 1:
            raise TpuExportError(f"--task text-generation: {type(model).__name__}'s recurrent layers take one prefill bucket "
                                 f"(their chunked scans export at a static prompt length), not {sorted(set(prefill_buckets))}; "
                                 "give one --bucket seq=N")
    if prefill_buckets is None:
        # An indexed model's shortest (its index_topk) is a bucket too: the prompts shorter than the next one are padded to it.
        candidates = (128, 512, _LONGEST_DEFAULT_BUCKET) + ((shortest,) if shortest > 2 else ())
        prefill_buckets = tuple(size for size in candidates if shortest <= size < max_context) + (max_context,)
    for size in prefill_buckets:
        if not shortest <= size <= max_context:
            raise TpuExportError(f"prefill bucket seq={size} is out of range: prompt lengths are 2..{max_context} (--max-context)"
                                 + (f", and a bucket holds at least the indexer's top {shortest} keys (index_topk)" if shortest > 2 else ""))
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    window = max((size for size in windows if size is not None), default=None)
    bounded = sliding_window_cache == "bounded" and window is not None and window < max_context
    window_layers = ()
    if bounded and len(windows) > 1:  # full layers beside sliding ones: the sliding layers' rings apart
        window_layers = tuple(index for index, layer_type in enumerate(text.layer_types) if layer_type == "sliding_attention")
        if kv_cache_dtype == "int8":
            raise TpuExportError(f"--kv-cache-dtype int8 with the window-bounded cache of {type(model).__name__} (full and sliding layers) "
                                 "is not supported yet; add --sliding-window-cache full")
    window_kv_heads = window_head_dim = 0
    if sliding is not None and sliding != (kv_heads, head_dim):
        if not window_layers:
            raise TpuExportError(f"--task text-generation: {type(model).__name__}'s sliding layers cache {sliding[0]} kv heads x "
                                 f"{sliding[1]} and its full layers {kv_heads} x {head_dim}, which one cache cannot hold: keep the sliding "
                                 f"layers' rings apart (--sliding-window-cache bounded, the default, with --max-context above the window {window})")
        window_kv_heads, window_head_dim = sliding
    convs, conv_channels, conv_kernel = conv_layers(model), 0, 0
    if recurrent:
        if kv_cache_dtype == "int8" or window_layers or bounded:
            raise TpuExportError(f"--task text-generation: {type(model).__name__}'s recurrent layers with "
                                 f"{'--kv-cache-dtype int8' if kv_cache_dtype == 'int8' else 'a sliding-window cache'} are not supported "
                                 "yet; convert it with the model-dtype cache" + ("" if kv_cache_dtype == "int8" else " and --sliding-window-cache full"))
        convs, conv_channels, conv_kernel = recurrent.layers, recurrent.conv_channels, recurrent.conv_kernel
    elif convs:
        if kv_cache_dtype == "int8":
            raise TpuExportError(f"--task text-generation: {type(model).__name__}'s short-convolution layers with --kv-cache-dtype int8 "
                                 "are not supported yet; convert it with the model-dtype cache")
        conv_channels, conv_kernel = conv_state_shape(model)
    indexed, indexer_dim = indexed_layers(model), 0
    if indexed:
        if kv_cache_dtype == "int8" or convs or recurrent or (bounded and not window_layers):
            raise TpuExportError(f"--task text-generation: {type(model).__name__}'s indexed attention layers with "
                                 f"{'--kv-cache-dtype int8' if kv_cache_dtype == 'int8' else 'conv, recurrent or ring-cached layers'} are "
                                 "not supported yet; convert it with the model-dtype cache")
        indexer_dim = indexer_width(model)
    return GenerationSpec(max_batch, max_context, layers, kv_heads, head_dim, model.get_output_embeddings().weight.shape[0], dtype,
                          layout, tuple(sorted(set(prefill_buckets))), kv_cache_dtype, window if bounded else None, window_layers,
                          window_kv_heads, window_head_dim, convs, conv_channels, conv_kernel, indexed, indexer_dim, recurrent.layers if recurrent else (),
                          recurrent.state if recurrent else (), str(recurrent.dtype).removeprefix("torch.") if recurrent else "",
                          recurrent.attending if recurrent else ())


@dataclasses.dataclass(frozen=True)
class RecurrentStates:
    """What a model's recurrent layers keep per slot, as a 2-token prompt's forward writes it through
    the cache (`_recurrent_states`).

    Attributes:
      layers: the layers keeping a recurrent state (each also a short convolution's inputs).
      state, dtype: a layer's recurrent state per slot: shape and dtype.
      conv_channels, conv_kernel: a layer's short-convolution state per slot.
      attending: those of the layers that also write keys (an attention beside the state-space mixer).
    """

    layers: tuple[int, ...]
    state: tuple[int, ...]
    dtype: torch.dtype
    conv_channels: int
    conv_kernel: int
    attending: tuple[int, ...] = ()


def _recurrent_states(model: nn.Module) -> RecurrentStates | None:
    """The recurrent states a decoder keeps through transformers' cache (`update_recurrent_state`:
    Mamba-2's state-space mixers, gated DeltaNet's linear attention, ...), or None for a model
    keeping none. Their chunked scans loop over chunks or pad to whole chunks, which torch.export
    cannot keep over a symbolic prompt length: prefill is exported at one static length.

    Raises:
      TpuExportError: a model whose recurrent state the cache does not hold (transformers'
        `_is_stateful` without `update_recurrent_state`: Mamba, RWKV, xLSTM, ...), one without attention
        layers, or recurrent layers the entry points cannot hold alike (no short convolution, or
        states of different shapes).
    """
    name = type(model).__name__
    if not getattr(model, "_is_stateful", False):  # transformers marks every model keeping such a state: no probe for the rest
        return None
    recorder = _StateRecorder()
    if any(parameter.is_meta for parameter in model.parameters()):
        # Its buffers too: a state-space mixer computing with a buffer its init made (Zaya's, Falcon-H1's)
        # met the meta weights as a CPU tensor, and the probe failed.
        model = meta_copy(model)
    try:
        _probe_forward(model, recorder)
    except Exception as error:  # the forward fails at 2 tokens: its export would too
        raise TpuExportError(f"--task text-generation: {name}'s forward fails on a 2-token prompt ({type(error).__name__}: "
                             f"{' '.join(str(error).split())[:200]}); its full-sequence forward may convert (--task feature-extraction)") from None
    if not recorder.recurrent:
        raise _state_outside_cache(name)
    layers = tuple(sorted(recorder.recurrent))
    states, convs = {recorder.recurrent[layer] for layer in layers}, {recorder.convs.get(layer) for layer in layers}
    if None in convs or len(convs) > 1 or len(states) > 1:
        problem = "has recurrent layers whose states differ in shape or keep no short convolution, which one state tensor cannot hold yet"
    else:
        (state, dtype), ((channels, kernel),) = next(iter(states)), convs
        if kernel:
            return RecurrentStates(layers, state, dtype, channels, int(kernel), tuple(sorted(recorder.keys & set(layers))))
        problem = "has recurrent layers whose short convolutions keep no kernel size in the cache"
    raise TpuExportError(f"--task text-generation: {name} {problem}; its full-sequence forward may convert at a fixed length "
                         "(--task feature-extraction --dim seq=N:N)")


def _state_outside_cache(name: str) -> TpuExportError:
    return TpuExportError(f"--task text-generation: {name} keeps a recurrent state (state-space or linear-attention layers) besides or "
                          "instead of a KV cache outside transformers' cache, which the prefill/decode entry points cannot hold; its "
                          "full-sequence forward may convert at a fixed length (--task feature-extraction --dim seq=N:N)")


# The longest prefill bucket below max context by default; a recurrent model's one bucket at most (its
# prefill's chunked scans unroll into the program: a bucket of max context, a million positions for
# Kimi Linear's config, would not compile).
_LONGEST_DEFAULT_BUCKET = 2048


def _shortest_prefill(model: nn.Module, max_context: int) -> int:
    """The shortest prefill bucket: 2, or an indexed model's index_topk k when k < max_context.

    An indexer picks its top min(k, keys) keys, and in prefill the keys are the bucket's seq: over a
    seq dim spanning k, torch.export must guard min(k, seq) and fixes seq. From a bucket of k up,
    min(k, seq) is k; shorter prompts are padded to it (the padding comes after a prompt's tokens,
    which a causal query never sees)."""
    topk = getattr(_text_config(model.config), "index_topk", None) if indexed_layers(model) else None
    return topk if isinstance(topk, int) and 2 < topk < max_context else 2


def check_sliding_window_cache(sliding_window_cache: str) -> None:
    """Raises TpuExportError (one line) for a --sliding-window-cache not in SLIDING_WINDOW_CACHES."""
    if sliding_window_cache not in SLIDING_WINDOW_CACHES:
        raise TpuExportError(f"unknown --sliding-window-cache {sliding_window_cache!r}; use one of {', '.join(SLIDING_WINDOW_CACHES)} "
                             "(bounded: W positions per slot when every layer attends within a window W < max context)")


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """Raises TpuExportError (one line) for a --kv-cache-dtype not in KV_CACHE_DTYPES."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise TpuExportError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}; use one of {', '.join(KV_CACHE_DTYPES)} "
                             "(model: the model's dtype)")


def entry_point_modules(model: nn.Module, spec: GenerationSpec, prefill: type[Prefill] = Prefill,
                        decode: type[Decode] = Decode) -> dict[str, nn.Module]:
    """The entry points as modules over the one model: {"prefill": ..., "decode": ...} (their
    variants whose inputs name the sliding layers' rings and the conv layers' states, for a spec with
    window_layers, conv_layers or both)."""
    caches = (bool(spec.window_layers), bool(spec.conv_layers), bool(spec.indexed_layers), bool(spec.recurrent_layers))
    if prefill is Prefill:  # the variant whose inputs name the spec's caches (generation_spec refuses other mixes)
        prefill = {(True, True, False, False): MixedConvPrefill, (True, False, False, False): MixedPrefill,
                   (True, False, True, False): MixedIndexedPrefill,
                   (False, True, False, False): ConvPrefill, (False, False, True, False): IndexedPrefill,
                   (False, True, False, True): RecurrentPrefill}.get(caches, Prefill)
    if decode is Decode:
        decode = {(True, True, False, False): MixedConvDecode, (True, False, False, False): MixedDecode,
                  (True, False, True, False): MixedIndexedDecode,
                  (False, True, False, False): ConvDecode, (False, False, True, False): IndexedDecode,
                  (False, True, False, True): RecurrentDecode}.get(caches, Decode)
    return {"prefill": prefill(model.eval(), spec), "decode": decode(model.eval(), spec)}


def example_arguments(spec: GenerationSpec, device: str = "cpu") -> dict[str, tuple[tuple, dict | None]]:
    """Each entry point's example inputs and torch.export dynamic_shapes.

    Prefill's batch (1..max_batch) and prompt length (2..max_context) are dims, compiled at its
    buckets; decode runs at max_batch, with static shapes.

    Args:
      spec: the generation spec.
      device: where the example KV cache is made; "meta" for a plan, whose cache at max batch x
        max context can be larger than the build machine's memory (8 GiB for Llama-3-8B at
        32 x 2048) and is only needed for its shape.
    Returns:
      {entry point name: (example args, dynamic_shapes)}.
    """
    cache = tuple(torch.zeros(shape, dtype=getattr(torch, dtype), device=device) for shape, dtype in spec.cache_tensors().values())
    example_seq = max(2, min(spec.prefill_buckets[0], spec.max_context))
    # An indexed model's shortest bucket is its indexer's top-k (`_shortest_prefill`): seq starts there.
    shortest = spec.prefill_buckets[0] if spec.indexed_layers else 2
    # A model with recurrent layers prefills at its one bucket, a static length (`_recurrent_states`); so
    # does an indexed one whose top-k is its whole context (GenerationSpec.static_prompt).
    seq_shape = {} if spec.static_prompt else {1: torch.export.Dim("seq", min=shortest, max=spec.max_context)}
    prefill_args = (torch.ones((spec.max_batch, example_seq), dtype=torch.long),
                    torch.full((spec.max_batch,), example_seq, dtype=torch.long),
                    torch.arange(spec.max_batch, dtype=torch.long), *cache)
    if spec.max_batch == 1:  # one slot: prefill's batch is the static 1
        prefill_shapes = (seq_shape or None, None, None, *[None] * len(cache))
    else:
        batch = torch.export.Dim("batch", min=1, max=spec.max_batch)
        prefill_shapes = ({0: batch, **seq_shape}, {0: batch}, {0: batch}, *[None] * len(cache))
    decode_args = (torch.ones((spec.max_batch,), dtype=torch.long), torch.zeros((spec.max_batch,), dtype=torch.long), *cache)
    return {"prefill": (prefill_args, prefill_shapes), "decode": (decode_args, None)}
