"""The true positions for model code that numbers positions from the cache's length.

The entry points give a model explicit position_ids and a cache whose `get_seq_length` is 0 (rows
of one step sit at different positions, which one length cannot say). Code that numbers positions
from that length instead of reading position_ids therefore sees positions 0..seq-1 at every step.
`positions_known` gives such code the step's positions [batch, seq] for as long as it is open;
every other model is left as it is.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn


@contextlib.contextmanager
def positions_known(model: nn.Module, positions: torch.Tensor):
    """While open, the model's position-numbering code (module docstring) uses `positions` [batch, seq]:
    - a decoder whose forward takes no position_ids embeds them with its learned position embedding
      with an offset (`_offset_position_embedding`);
    - Llama 4's layers without rotary embeddings scale their queries by their temperature at them
      (`_temperature_tuned_attention`)."""
    with contextlib.ExitStack() as stack:
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
