"""Capture of an encoder-decoder (BART, T5, Whisper) for text generation: an encode and a decode entry
point over one set of weights, a decoder self-attention cache and a cross-attention cache.

  encode(source[batch, src], lengths[batch], slots[batch], cross_k, cross_v, source_lengths)
      -> {cross_k, cross_v, source_lengths}
      Sources are right-padded to the bucket's `src`; the encoder attends to each row's first
      lengths[r] tokens (a padding mask). Every decoder layer's cross-attention keys and values of
      row r are written at positions 0..src-1 of slot slots[r], and source_lengths[slots[r]] =
      lengths[r] (decode masks the cross keys at and after it: padding, or an older, longer source).
  decode(tokens[max_batch], positions[max_batch], cache_k, cache_v, cross_k, cross_v, source_lengths)
      -> {logits[max_batch, vocab], cache_k, cache_v, cross_k, cross_v, source_lengths}
      One decoder step of every slot, each row at its own position, as generation.py's decode: the
      self-attention key is written at positions[r] after the last layer, attention reads the cache
      as received with the new key selected in; cross attention reads the slot's cross keys below
      source_lengths[r]. The cross cache and lengths pass through unchanged (every executable donates
      its inputs, so they must come back out to be reused; XLA aliases them, no copy).

An audio encoder-decoder (Whisper; the spec's `source` is "features") takes audio features instead:

  encode(input_features[batch, mel_bins, frames], slots[batch], cross_k, cross_v) -> {cross_k, cross_v}
      frames is static (the encoder's own requirement: 2 x max_source_positions, no padding mask), so
      every source fills all max_source cross positions: there are no source lengths to keep, and
      decode's cross attention sees every position of the slot (Whisper's decoder masks nothing there).
  decode(tokens, positions, cache_k, cache_v, cross_k, cross_v) -> {logits, cache_k, cache_v, cross_k, cross_v}

No decoder prefill: generation starts from the model's decoder_start_token_id at position 0, fed
to decode like any later token (a decoder prompt would be fed the same way, one step per token).

The caches are explicit inputs and outputs, [layers, max_batch, heads, positions, head_dim]
(generation.py's default layout), self-attention over `max_context` decoder positions, cross
attention over `max_source` source positions. Encode computes the cross keys with the model's own
layers: it runs the decoder for one start token over the encoder's output with a cache whose cross
half writes what the layers give it (the rest of that decoder step is dead code XLA removes).
Decode hands the layers a transformers `EncoderDecoderCache` whose cross half is marked filled, so
they read the cross cache as they do in generate().

Each row's decoder position is its own; the models compute positions from one cache length, so a
family adapter (`_row_positions`) replaces the position code for the step: BART's learned position
embedding, T5's relative position bias of its first self-attention layer, Whisper's learned position
embedding (no offset).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tpuexport.errors import TpuExportError
from tpuexport.export.cache_specs import SEQ2SEQ_LAYOUT, Seq2SeqSpec
from tpuexport.export.functional_cache import DecodeCache, FunctionalKVCache, write_prefill_cache
from tpuexport.export.generation import _causal_masks, _masked_value, _transformers_cache

ENTRY_POINTS = ("encode", "decode")
class CrossWrite(FunctionalKVCache):
    """Encode: row r's cross keys (all src positions) go to slot slots[r]; attention reads them as given."""

    def __init__(self, keys, values, slots: torch.Tensor):
        super().__init__(keys, values, SEQ2SEQ_LAYOUT)
        self.slots = slots

    def write(self, cache, new, layer):
        return write_prefill_cache(cache, new.to(cache.dtype), layer, self.slots, self.layout)

    def read(self, cache, new, layer):
        return new


class _SelfAttentionUnused(FunctionalKVCache):
    """Encode's decoder step: its self-attention keys are not kept (decode writes position 0 itself)."""

    def __init__(self):
        super().__init__(None, None, SEQ2SEQ_LAYOUT)

    def update(self, new_keys, new_values, layer):
        return new_keys, new_values


class _FilledLayer:
    """A cross-attention layer whose keys are in the cache: what transformers' attention reads."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys = keys
        self.values = values


def _encoder_decoder_cache(self_attention: FunctionalKVCache, cross: FunctionalKVCache | None, filled: tuple | None, layers: int):
    """A transformers EncoderDecoderCache over the functional caches: its self-attention half is
    `self_attention`; its cross half writes through `cross` (encode) or holds `filled` (keys,
    values) [layers, batch, heads, source, head_dim] marked filled, which the layers read (decode)."""
    from transformers.cache_utils import Cache, EncoderDecoderCache

    class CrossCache(Cache):
        def __init__(self):
            super().__init__(layers=[])
            if filled is not None:
                self.layers = [_FilledLayer(filled[0][layer], filled[1][layer]) for layer in range(layers)]

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return cross.update(key_states, value_states, layer_idx)

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 0

    cache = EncoderDecoderCache(_transformers_cache(self_attention), CrossCache())
    cache.is_updated = {layer: filled is not None for layer in range(layers)}
    return cache


def _family(model: nn.Module) -> str:
    """"bart" (a learned position embedding with an offset), "t5" (relative position bias) or
    "whisper" (a learned position embedding indexed by position)."""
    from transformers.models.whisper.modeling_whisper import WhisperPositionalEmbedding

    decoder = model.get_decoder()
    embed = getattr(decoder, "embed_positions", None)
    if embed is not None and isinstance(getattr(embed, "offset", None), int) and isinstance(embed, nn.Embedding):
        return "bart"
    if isinstance(embed, WhisperPositionalEmbedding):
        return "whisper"
    block = getattr(decoder, "block", None)
    # T5 and mT5: the first layer computes the bias every layer adds (UMT5's layers each have their own).
    biased = [getattr(layer.layer[0], "SelfAttention", None) is not None and layer.layer[0].SelfAttention.has_relative_attention_bias
              for layer in block or ()]
    if biased and biased[0] and not any(biased[1:]):
        return "t5"
    raise TpuExportError(f"--task text-generation: the {type(model).__name__} encoder-decoder's decoder positions are not supported yet "
                         "(supported: BART-style learned positions, T5 relative position bias, Whisper's learned positions)")


@contextlib.contextmanager
def _row_positions(model: nn.Module, positions: torch.Tensor):
    """While open, the decoder computes each row's positions from `positions` [batch] (one query per row)."""
    decoder = model.get_decoder()
    family = _family(model)
    if family == "bart":
        embed = decoder.embed_positions
        patched, name = embed, "forward"
        replacement = lambda *args, **kwargs: nn.functional.embedding(positions[:, None] + embed.offset, embed.weight)  # noqa: E731
    elif family == "whisper":  # WhisperPositionalEmbedding's own indexing, each row at its position
        embed = decoder.embed_positions
        patched, name = embed, "forward"
        replacement = lambda *args, **kwargs: embed.weight[positions[:, None]]  # noqa: E731
    else:
        attention = decoder.block[0].layer[0].SelfAttention

        def replacement(query_length, key_length, device=None, past_seen_tokens=0):
            # T5Attention.compute_bias with one query position per row: [batch, heads, 1, keys].
            relative = torch.arange(key_length, device=positions.device)[None, :] - positions[:, None]
            buckets = attention._relative_position_bucket(relative, bidirectional=False, num_buckets=attention.relative_attention_num_buckets,
                                                          max_distance=attention.relative_attention_max_distance)
            return attention.relative_attention_bias(buckets).permute(0, 2, 1)[:, :, None, :]

        patched, name = attention, "compute_bias"
    setattr(patched, name, replacement)
    try:
        yield
    finally:
        delattr(patched, name)


def _source_mask(lengths: torch.Tensor, keys: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive padding mask [batch, 1, 1, keys] of sources of `lengths` tokens."""
    visible = torch.arange(keys, device=lengths.device)[None, :] < lengths[:, None]
    return torch.where(visible, 0.0, _masked_value(dtype)).to(dtype)[:, None, None, :]


class _EntryPoint(nn.Module):
    """Holds the model (registered once, as `model`, so both entry points name its weights alike)."""

    def __init__(self, model: nn.Module, spec: Seq2SeqSpec):
        super().__init__()
        self.model = model
        self.spec = spec


class Encode(_EntryPoint):
    """Encode of token sources (see the module docstring)."""

    cross_type = CrossWrite

    def forward(self, source, lengths, slots, cross_k, cross_v, source_lengths):
        batch, steps = source.shape
        torch._check(lengths.shape[0] == batch)
        torch._check(slots.shape[0] == batch)
        mask = _source_mask(lengths, steps, cross_k.dtype)
        hidden = self.model.get_encoder()(input_ids=source, attention_mask=mask).last_hidden_state
        cross_k, cross_v = self._write_cross(hidden, mask, slots, cross_k, cross_v)
        clamped = slots.clamp(0, self.spec.max_batch - 1)
        return {"cross_k": cross_k, "cross_v": cross_v, "source_lengths": source_lengths.index_put((clamped,), lengths)}

    def _write_cross(self, hidden, mask, slots, cross_k, cross_v) -> tuple[torch.Tensor, torch.Tensor]:
        """The cross caches with every decoder layer's keys and values of the encoder's output
        `hidden` written into the rows' slots (one decoder step from the start token; `mask`: the
        sources' padding mask, None where sources have no padding)."""
        batch = hidden.shape[0]
        cross = self.cross_type(cross_k, cross_v, slots)
        start = torch.full((batch, 1), self.spec.decoder_start_token_id, dtype=torch.long, device=hidden.device)
        # Whisper's decoder takes no encoder mask (its sources are never padded).
        source_mask = {} if mask is None else {"encoder_attention_mask": mask}
        self.model.get_decoder()(input_ids=start, attention_mask=torch.zeros((batch, 1, 1, 1), dtype=cross_k.dtype, device=hidden.device),
                                 encoder_hidden_states=hidden, use_cache=True,
                                 past_key_values=_encoder_decoder_cache(_SelfAttentionUnused(), cross, None, self.spec.layers), **source_mask)
        return cross.written()


class FeaturesEncode(Encode):
    """Encode of audio features (Whisper): every source fills all max_source positions, no lengths."""

    def forward(self, input_features, slots, cross_k, cross_v):
        torch._check(slots.shape[0] == input_features.shape[0])
        hidden = self.model.get_encoder()(input_features=input_features).last_hidden_state
        cross_k, cross_v = self._write_cross(hidden, None, slots, cross_k, cross_v)
        return {"cross_k": cross_k, "cross_v": cross_v}


class Decode(_EntryPoint):
    """Decode over token sources: cross attention masks each slot's keys at and after its source length."""

    cache_type = DecodeCache
    # The family's position adapter (a context manager over the model and each row's position).
    row_positions = staticmethod(_row_positions)

    def forward(self, tokens, positions, cache_k, cache_v, cross_k, cross_v, source_lengths):
        cross_mask = _source_mask(source_lengths, self.spec.max_source, cache_k.dtype)
        return {**self._step(tokens, positions, cache_k, cache_v, cross_k, cross_v, cross_mask), "source_lengths": source_lengths}

    def _step(self, tokens, positions, cache_k, cache_v, cross_k, cross_v, cross_mask) -> dict[str, torch.Tensor]:
        """One decoder step of every slot: logits, the written self-attention cache and the cross
        cache passed through (`cross_mask`: additive [batch, 1, 1, max_source], or None: all visible)."""
        dtype = cache_k.dtype
        keys = torch.arange(self.spec.max_context, device=tokens.device)
        mask = _causal_masks({"full_attention": None}, positions[:, None], keys, dtype)
        cache = self.cache_type(cache_k, cache_v, SEQ2SEQ_LAYOUT, positions)
        # The layers read the cross cache, never these states; they only tell them to attend across.
        encoder_states = torch.zeros((tokens.shape[0], 1, self.model.config.d_model), dtype=dtype, device=tokens.device)
        past = _encoder_decoder_cache(cache, None, (cross_k, cross_v), self.spec.layers)
        with self.row_positions(self.model, positions):
            output = self.model(encoder_outputs=(encoder_states,), attention_mask=cross_mask, decoder_input_ids=tokens[:, None],
                                decoder_attention_mask=mask, past_key_values=past, use_cache=True)
        cache_k, cache_v = cache.written()
        return {"logits": output.logits[:, 0].float(), "cache_k": cache_k, "cache_v": cache_v, "cross_k": cross_k, "cross_v": cross_v}


class FeaturesDecode(Decode):
    """Decode over audio sources: every slot's cross keys are all its source's (no lengths, no mask)."""

    def forward(self, tokens, positions, cache_k, cache_v, cross_k, cross_v):
        return self._step(tokens, positions, cache_k, cache_v, cross_k, cross_v, None)


# Each source kind's entry-point modules (encode, decode).
ENTRY_POINT_TYPES = {"tokens": (Encode, Decode), "features": (FeaturesEncode, FeaturesDecode)}


def is_encoder_decoder(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def seq2seq_spec(model: nn.Module, max_batch: int, max_context: int, source_buckets: tuple[int, ...] | None = None) -> Seq2SeqSpec:
    """The caches a Hugging Face encoder-decoder needs at these limits.

    Args:
      model: a transformers encoder-decoder LM (BartForConditionalGeneration, T5ForConditionalGeneration,
        WhisperForConditionalGeneration).
      max_batch: cache slots; max_context: decoder positions per slot.
      source_buckets: source lengths encode is compiled for (the longest is the cross cache's
        positions); None for 128, 512 below max_context, and max_context. An audio model's sources
        are its encoder's max_source_positions long, always: None (or exactly that).
    Returns:
      The Seq2SeqSpec.
    Raises:
      TpuExportError: not a supported encoder-decoder LM, or limits out of range.
    """
    config = model.config
    if model.get_output_embeddings() is None or not hasattr(model, "get_encoder"):
        raise TpuExportError("--task text-generation needs an encoder-decoder LM with a language-model head (e.g. "
                             f"BartForConditionalGeneration, T5ForConditionalGeneration, WhisperForConditionalGeneration); "
                             f"got {type(model).__name__}")
    _family(model)
    if max_batch < 1 or max_context < 2:
        raise TpuExportError(f"--max-batch {max_batch} / --max-context {max_context} out of range; give max batch >= 1 and max context >= 2")
    field = next((name for name in ("max_target_positions", "max_position_embeddings") if getattr(config, name, None) is not None), None)
    positions = getattr(config, field) if field else None
    if positions is not None and max_context > positions:
        raise TpuExportError(f"--max-context {max_context} exceeds the model's {positions} positions ({field}); "
                             f"give --max-context <= {positions}")
    source, features = "tokens", ()
    if getattr(model, "main_input_name", None) == "input_features":
        # The encoder takes exactly 2 x max_source_positions frames (its two convolutions' strides).
        encoder = model.get_encoder()
        source, features = "features", (config.num_mel_bins, config.max_source_positions * encoder.conv1.stride[0] * encoder.conv2.stride[0])
        if source_buckets is not None and tuple(source_buckets) != (config.max_source_positions,):
            raise TpuExportError(f"--bucket seq= does not apply to {type(model).__name__}: its sources are audio features of {features[1]} "
                                 f"frames, always {config.max_source_positions} source positions; drop --bucket seq")
        source_buckets = (config.max_source_positions,)
    if source_buckets is None:
        source_buckets = tuple(size for size in (128, 512) if size < max_context) + (max_context,)
    # An audio encoder's positions are its own (Whisper: max_source_positions 1500, more than the decoder's 448).
    limit = max(source_buckets) if source == "features" else positions or max(source_buckets)
    for size in source_buckets:
        if not 2 <= size <= limit:
            raise TpuExportError(f"source bucket seq={size} is out of range: source lengths are 2..{limit}")
    start = getattr(config, "decoder_start_token_id", None)
    if start is None:
        raise TpuExportError(f"{type(model).__name__}'s config has no decoder_start_token_id; set it (generation starts from it)")
    layers = getattr(config, "decoder_layers", None) or getattr(config, "num_decoder_layers", None) or config.num_layers
    heads = getattr(config, "decoder_attention_heads", None) or config.num_heads
    head_dim = getattr(config, "d_kv", None) or config.d_model // heads
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return Seq2SeqSpec(max_batch, max_context, max(source_buckets), layers, heads, head_dim, model.get_output_embeddings().weight.shape[0],
                       dtype, tuple(sorted(set(source_buckets))), int(start), source, features)


def entry_point_modules(model: nn.Module, spec: Seq2SeqSpec, encode: type[Encode] | None = None,
                        decode: type[Decode] | None = None) -> dict[str, nn.Module]:
    """The entry points as modules over the one model: {"encode": ..., "decode": ...} (None: the
    spec's source kind's, ENTRY_POINT_TYPES)."""
    default_encode, default_decode = ENTRY_POINT_TYPES[spec.source]
    return {"encode": (encode or default_encode)(model.eval(), spec), "decode": (decode or default_decode)(model.eval(), spec)}


def example_arguments(spec: Seq2SeqSpec, device: str = "cpu") -> dict[str, tuple[tuple, dict | None]]:
    """Each entry point's example inputs and torch.export dynamic_shapes: encode's batch
    (1..max_batch) and source length (2..max_source; audio features: static frames) are dims,
    decode is static at max_batch."""
    dtype = getattr(torch, spec.dtype)
    cache = tuple(torch.zeros(spec.cache_shape, dtype=dtype, device=device) for _ in range(2))
    cross = tuple(torch.zeros(spec.cross_shape, dtype=dtype, device=device) for _ in range(2))
    decode_tokens = (torch.ones((spec.max_batch,), dtype=torch.long), torch.zeros((spec.max_batch,), dtype=torch.long))
    batch = torch.export.Dim("batch", min=1, max=spec.max_batch) if spec.max_batch > 1 else None
    if spec.source == "features":
        encode_args = (torch.zeros((spec.max_batch, *spec.features), dtype=dtype), torch.arange(spec.max_batch, dtype=torch.long), *cross)
        encode_shapes = None if batch is None else ({0: batch}, {0: batch}, None, None)
        return {"encode": (encode_args, encode_shapes), "decode": ((*decode_tokens, *cache, *cross), None)}
    source_lengths = torch.ones((spec.max_batch,), dtype=torch.long)
    example_seq = max(2, spec.source_buckets[0])
    seq = torch.export.Dim("seq", min=2, max=spec.max_source)
    encode_args = (torch.ones((spec.max_batch, example_seq), dtype=torch.long), torch.full((spec.max_batch,), example_seq, dtype=torch.long),
                   torch.arange(spec.max_batch, dtype=torch.long), *cross, source_lengths)
    if batch is None:
        encode_shapes = ({1: seq}, None, None, None, None, None)
    else:
        encode_shapes = ({0: batch, 1: seq}, {0: batch}, {0: batch}, None, None, None)
    return {"encode": (encode_args, encode_shapes), "decode": ((*decode_tokens, *cache, *cross, source_lengths), None)}
