"""The true positions for model code that numbers positions from the cache's length.

The entry points give a model explicit position_ids and a cache whose `get_seq_length` is 0 (rows
of one step sit at different positions, which one length cannot say). Code that numbers positions
from that length instead of reading position_ids therefore sees positions 0..seq-1 at every step.
`positions_known` gives such code the step's positions [batch, seq] (and its keys' positions) for as
long as it is open; every other model is left as it is.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn


@contextlib.contextmanager
def positions_known(model: nn.Module, positions: torch.Tensor, keys: torch.Tensor):
    """While open, the model's position-numbering code (module docstring) uses `positions` [batch, seq]
    and the positions `keys` [k] of the keys attention reads:
    - a decoder whose forward takes no position_ids embeds them with its learned position embedding
      with an offset (`_offset_position_embedding`);
    - Llama 4's layers without rotary embeddings scale their queries by their temperature at them
      (`_temperature_tuned_attention`);
    - an ALiBi model biases each key by its position (`_alibi_builders`)."""
    with contextlib.ExitStack() as stack:
        for module, name in _alibi_builders(model):
            stack.enter_context(_alibi_over(module, name, keys))
        embed = None if "position_ids" in inspect.signature(model.forward).parameters else _offset_position_embedding(model)
        if embed is not None:
            stack.enter_context(_forward_replaced(embed, lambda *args, **kwargs: nn.functional.embedding(positions + embed.offset, embed.weight)))
        for attention in _temperature_tuned_attention(model):
            stack.enter_context(_forward_replaced(attention.q_proj, _tempered_queries(attention, positions)))
        yield


def _offset_position_embedding(model: nn.Module) -> nn.Embedding | None:
    """The decoder's learned position embedding with an int `offset` (positions p at rows p + offset:
    TrOCR's, and the ForCausalLM decoders of BART, mBART, PLBart), or None. Such a decoder numbers its
    positions from the cache's length: every decode step embedded position 0 (TrOCR's decode logits
    failed verification). A model embedding none (ALiBi) is left as it is; one with another position
    embedding (Marian's and Pegasus's sinusoidal, Blenderbot's without an offset) still fails
    verification."""
    embed = getattr(model.get_decoder(), "embed_positions", None) if hasattr(model, "get_decoder") else None
    return embed if isinstance(embed, nn.Embedding) and isinstance(getattr(embed, "offset", None), int) else None


def _temperature_tuned_attention(model: nn.Module) -> list[nn.Module]:
    """Attention modules scaling their queries by position (Llama 4's layers without rotary embeddings,
    `attn_temperature_tuning`): query * (log1p(floor((p + 1) / floor_scale)) * attn_scale + 1), with p
    counted from `get_seq_length`."""
    return [module for module in model.modules()
            if getattr(module, "attn_temperature_tuning", False) is True and getattr(module, "use_rope", True) in (False, 0)
            and isinstance(getattr(module, "q_proj", None), nn.Module)]


def _temperature(positions: torch.Tensor, attention: nn.Module) -> torch.Tensor:
    return torch.log1p(torch.floor((positions.float() + 1.0) / attention.floor_scale)) * attention.attn_scale + 1.0


def _tempered_queries(attention: nn.Module, positions: torch.Tensor):
    """q_proj's forward giving its queries the temperature at `positions` over the one the module then
    applies at 0..seq-1 (its own count), so that their product is the temperature at `positions`. The
    module applies the temperature to q_proj's output unchanged (no rotary, no norm between), so the
    correction can sit there."""
    project = attention.q_proj.forward

    def forward(hidden_states):
        counted = torch.arange(hidden_states.shape[1], device=hidden_states.device)[None, :]
        correction = _temperature(positions, attention) / _temperature(counted, attention)
        return (project(hidden_states) * correction[..., None]).to(hidden_states.dtype)

    return forward


def _alibi_builders(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, method) of each module building an ALiBi bias (ALIBI_OVER_KEYS' methods), whose bias
    assumes that the keys are the positions 0..k-1 of a prompt run at once: BLOOM's counts them over
    a 2D padding mask where the entry points give a prepared 4D mask over the cache's keys; MPT's
    is built at max_seq_len and sliced to the keys' count, which torch.export fixes at the example's."""
    return [(module, name) for module in model.modules() for name in ALIBI_OVER_KEYS if callable(getattr(type(module), name, None))]


def _slopes(pair: torch.Tensor) -> torch.Tensor:
    """Each head's slope, from a builder's biases of two consecutive keys [heads, 2]."""
    return pair[:, 1] - pair[:, 0]


def _bloom_alibi(build, module: nn.Module, keys: torch.Tensor):
    """BLOOM's `build_alibi_tensor(attention_mask, num_heads, dtype)` -> [batch * heads, 1, k], the
    batch read off the prepared mask [batch, 1, q, k]."""
    def over_keys(attention_mask, num_heads, dtype):
        slopes = _slopes(build(module, torch.ones((1, 2), dtype=torch.long, device=keys.device), num_heads, torch.float32)[:, 0])
        alibi = slopes[None, :, None] * keys[None, None, :].float()
        return alibi.expand(attention_mask.shape[0], -1, -1).reshape(-1, 1, keys.shape[0]).to(dtype)
    return over_keys


def _mpt_alibi(build, module: nn.Module, keys: torch.Tensor):
    """MPT's `build_mpt_alibi_tensor(num_heads, sequence_length, alibi_bias_max, device)` -> [heads, 1, k]:
    as many keys as attention reads, so its slice to their count takes them all."""
    def over_keys(num_heads, sequence_length, alibi_bias_max=8, device=None):
        slopes = _slopes(build(module, num_heads, 2, alibi_bias_max, device)[:, 0])
        return slopes[:, None, None] * keys[None, None, :].float()
    return over_keys


# The ALiBi builders biasing keys at the entry points' key positions. Each head's slope is the model's
# own builder's, read off two consecutive keys. Only a per-query constant sets these biases apart from
# the model's own (its keys counted from another start), and softmax ignores it.
ALIBI_OVER_KEYS = {"build_alibi_tensor": _bloom_alibi, "build_mpt_alibi_tensor": _mpt_alibi}


@contextlib.contextmanager
def _alibi_over(module: nn.Module, name: str, keys: torch.Tensor):
    """While open, `module`'s ALiBi builder `name` biases keys at positions `keys` [k]."""
    setattr(module, name, ALIBI_OVER_KEYS[name](getattr(type(module), name), module, keys))
    try:
        yield
    finally:
        delattr(module, name)


@contextlib.contextmanager
def _forward_replaced(module: nn.Module, forward):
    """While open, `module`'s forward is `forward` (an instance attribute over its class's)."""
    own = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own
