"""The states the text-generation entry points keep beside the KV cache, per slot: short convolutions'
last inputs (LFM2's conv layers, and every recurrent layer's), recurrent states (Mamba-2's,
gated DeltaNet's) and indexer keys (DeepSeek Sparse Attention's). Each has a prefill class (a
fresh prompt's state written to its slot) and a decode class (the slots' states advanced one step);
`WithStates` puts them beside the KV cache in the order GenerationSpec.cache_inputs names them.
"""

from __future__ import annotations

import torch

from tpuexport.errors import TpuExportError
from tpuexport.export.cache_specs import GenerationSpec
from tpuexport.export.functional_cache import FunctionalKVCache, GroupedKVCache, write_decode_cache, write_prefill_cache


class PrefillConvStates:
    """Prefill's short-convolution states (GenerationSpec.conv_layers): a fresh prompt has none, and
    row r's state after it is its last conv_kernel inputs to the convolution, positions
    lengths[r] - kernel .. lengths[r] - 1 (zeros before position 0), written to slot slots[r]. The
    prompt's padding, after its real tokens, never reaches the state: the convolution is causal."""

    def __init__(self, states: torch.Tensor, layers: tuple[int, ...], lengths: torch.Tensor, slots: torch.Tensor):
        self.states, self.index, self.lengths = states, {layer: index for index, layer in enumerate(layers)}, lengths
        self.slots = slots.clamp(0, states.shape[1] - 1)

    def conv_state(self, layer: int) -> torch.Tensor | None:
        return None

    def update_conv_state(self, inputs: torch.Tensor, layer: int, kernel: int | None = None) -> torch.Tensor:
        """Keeps each row's last inputs ([batch, channels, steps]) of the layer; returns them all for its convolution."""
        batch, channels, _ = inputs.shape
        kept_inputs = self.states.shape[-1]  # the kernel size, as the spec records it
        positions = self.lengths[:, None] - kept_inputs + torch.arange(kept_inputs, device=inputs.device)[None, :]
        kept = inputs.gather(2, positions.clamp(min=0)[:, None, :].expand(batch, channels, kept_inputs))
        kept = torch.where((positions >= 0)[:, None, :], kept, torch.zeros_like(kept))
        layer_index = torch.full((1,), self.index[layer], dtype=torch.long, device=inputs.device)
        self.states = self.states.index_put((layer_index, self.slots), kept.to(self.states.dtype))
        return inputs

    def written(self) -> tuple[torch.Tensor]:
        return (self.states,)


class DecodeConvStates:
    """Decode's short-convolution states: each layer reads its slots' states, and the model's one-step
    convolution (transformers' `causal_conv1d_update`) shifts the step's input into a copy of them,
    which is the layer's state after the step."""

    def __init__(self, states: torch.Tensor, layers: tuple[int, ...]):
        self.states, self.index = states, {layer: index for index, layer in enumerate(layers)}
        self.stepped: dict[int, torch.Tensor] = {}

    def conv_state(self, layer: int) -> torch.Tensor:
        index = self.index[layer]
        self.stepped[index] = self.states[index].clone()  # the model updates it in place
        return self.stepped[index]

    def update_conv_state(self, inputs: torch.Tensor, layer: int, kernel: int | None = None) -> torch.Tensor:
        raise TpuExportError("a decode step ran a short convolution over more than one token")

    def written(self) -> tuple[torch.Tensor]:
        return (torch.stack([self.stepped.get(index, self.states[index]) for index in range(self.states.shape[0])]),)


class PrefillIndexerKeys:
    """Prefill's indexer keys (GenerationSpec.indexed_layers): row r's keys for positions 0..seq-1 go to
    slot slots[r], as the KV cache's do (the padding's are overwritten by decode before any query may
    see them); the indexer scores the prompt's own keys, as attention reads them."""

    def __init__(self, keys: torch.Tensor, layers: tuple[int, ...], slots: torch.Tensor):
        self.keys, self.index, self.slots = keys, {layer: index for index, layer in enumerate(layers)}, slots

    def update_indexer(self, new: torch.Tensor, layer: int) -> torch.Tensor:
        """Writes a layer's new indexer keys ([batch, steps, width]); returns them, what the indexer scores."""
        self.keys = write_prefill_cache(self.keys, new[:, None].to(self.keys.dtype), self.index[layer], self.slots, "layer_batch_head_pos")
        return new

    def written(self) -> tuple[torch.Tensor]:
        return (self.keys,)


class DecodeIndexerKeys:
    """Decode's indexer keys: row r's new key goes to position positions[r] of slot r, after the last
    layer (as DecodeCache writes); the indexer scores the layer's keys as the step received them with
    the step's own selected in at its position (the mask keeps keys 0..positions[r])."""

    def __init__(self, keys: torch.Tensor, layers: tuple[int, ...], positions: torch.Tensor):
        self.keys, self.index, self.positions = keys, {layer: index for index, layer in enumerate(layers)}, positions
        self.pending: list[tuple[int, torch.Tensor]] = []

    def update_indexer(self, new: torch.Tensor, layer: int) -> torch.Tensor:
        """Keeps a layer's new indexer keys ([batch, 1, width]) for `written`; returns the layer's keys [batch, context, width]."""
        index, stored = self.index[layer], new[:, 0].to(self.keys.dtype)
        self.pending.append((index, stored))
        layer_keys = self.keys[index][:, 0]
        current = torch.arange(layer_keys.shape[1], device=new.device)[None, :, None] == self.positions[:, None, None]
        return torch.where(current, stored[:, None], layer_keys).to(new.dtype)

    def written(self) -> tuple[torch.Tensor]:
        keys = self.keys
        for index, stored in self.pending:
            keys = write_decode_cache(keys, stored[:, None], index, self.positions, "layer_batch_head_pos")
        return (keys,)


class PrefillRecurrentStates:
    """Prefill's recurrent states (GenerationSpec.recurrent_layers): a fresh prompt has none (the layer
    starts from zeros), and each row's state after it, the layer's final state over the left-padded
    prompt (the masked padding before it leaves a zero state at zero), goes to slot slots[r]."""

    def __init__(self, states: torch.Tensor, layers: tuple[int, ...], slots: torch.Tensor):
        self.states, self.index = states, {layer: index for index, layer in enumerate(layers)}
        self.slots = slots.clamp(0, states.shape[1] - 1)

    def recurrent_state(self, layer: int) -> torch.Tensor | None:
        return None

    def update_recurrent_state(self, state: torch.Tensor, layer: int) -> torch.Tensor:
        layer_index = torch.full((1,), self.index[layer], dtype=torch.long, device=state.device)
        self.states = self.states.index_put((layer_index, self.slots), state.to(self.states.dtype))
        return state

    def written(self) -> tuple[torch.Tensor]:
        return (self.states,)


class DecodeRecurrentStates:
    """Decode's recurrent states: each layer reads a copy of its slots' states, which the model's
    one-step update either changes in place (Mamba-2's `selective_state_update`) or replaces
    (`update_recurrent_state`: gated DeltaNet's); that is the layer's state after the step."""

    def __init__(self, states: torch.Tensor, layers: tuple[int, ...]):
        self.states, self.index = states, {layer: index for index, layer in enumerate(layers)}
        self.stepped: dict[int, torch.Tensor] = {}

    def recurrent_state(self, layer: int) -> torch.Tensor:
        index = self.index[layer]
        self.stepped[index] = self.states[index].clone()  # the model may update it in place
        return self.stepped[index]

    def update_recurrent_state(self, state: torch.Tensor, layer: int) -> torch.Tensor:
        self.stepped[self.index[layer]] = state.to(self.states.dtype)
        return state

    def written(self) -> tuple[torch.Tensor]:
        return (torch.stack([self.stepped.get(index, self.states[index]) for index in range(self.states.shape[0])]),)


def by_attention_layer(cache: "FunctionalKVCache | GroupedKVCache", spec: GenerationSpec) -> "GroupedKVCache":
    """The KV cache addressed by the model's layer index when conv layers hold no keys: one cache of
    every attention layer becomes a group of them (a grouped cache already maps its layers)."""
    return cache if isinstance(cache, GroupedKVCache) else GroupedKVCache([(cache, spec.full_layers)])


class WithStates:
    """A KV cache (FunctionalKVCache or GroupedKVCache) and the states beside it: the short-convolution
    states, the recurrent states and the indexer keys (each may be None). `written` gives the KV
    cache's tensors, then conv_state, recurrent_state, indexer_keys (GenerationSpec.cache_inputs order)."""

    def __init__(self, kv: "FunctionalKVCache | GroupedKVCache", conv: PrefillConvStates | DecodeConvStates | None = None,
                 indexer: PrefillIndexerKeys | DecodeIndexerKeys | None = None,
                 recurrent: PrefillRecurrentStates | DecodeRecurrentStates | None = None):
        self.kv, self.conv, self.indexer, self.recurrent = kv, conv, indexer, recurrent

    def update(self, new_keys: torch.Tensor, new_values: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.update(new_keys, new_values, layer)

    def conv_state(self, layer: int) -> torch.Tensor | None:
        return self.conv.conv_state(layer)

    def update_conv_state(self, inputs: torch.Tensor, layer: int, kernel: int | None = None) -> torch.Tensor:
        return self.conv.update_conv_state(inputs, layer)

    def update_indexer(self, new: torch.Tensor, layer: int) -> torch.Tensor:
        return self.indexer.update_indexer(new, layer)

    def recurrent_state(self, layer: int) -> torch.Tensor | None:
        return None if self.recurrent is None else self.recurrent.recurrent_state(layer)

    def update_recurrent_state(self, state: torch.Tensor, layer: int) -> torch.Tensor:
        if self.recurrent is None:  # a layer keeping a state the spec's probe did not see (module docstring of generation_spec)
            raise TpuExportError("--task text-generation: the model keeps a recurrent (state-space) state the entry points did not find "
                                 "when probing its layers; its full-sequence forward may convert at a fixed length "
                                 "(--task feature-extraction --dim seq=N:N)")
        return self.recurrent.update_recurrent_state(state, layer)

    def written(self) -> tuple[torch.Tensor, ...]:
        return self.kv.written() + sum((state.written() for state in (self.conv, self.recurrent, self.indexer) if state is not None), ())
