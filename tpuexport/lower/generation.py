"""A text-generation program: its entry points (each a LoweredProgram) over one set of weights
and one KV cache, and a session that drives them on CPU (prefill, then decode step by step).

The session is what `Artifact.generate`, `tpuexport generate` and generation verification run:
each holds the cache between calls exactly as a serving runtime would hold the TPU buffers.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Collection, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tpuexport.errors import TpuExportError
from tpuexport.export.cache_specs import GenerationSpec
from tpuexport.lower.lowered import LoweredProgram
from tpuexport.lower.program import EntryPoints
from tpuexport.lower.registry import register_lowering
from tpuexport.lower.sampling import GREEDY, Draw, SampledTokens, Sampling, draw_tokens

# How a session runs one entry point: (entry point name, inputs in its signature order) -> outputs.
Runner = Callable[[str, list[np.ndarray]], list[np.ndarray]]


@register_lowering("tpuexport::write_prefill_cache")
def write_prefill_cache(cache, new, layer: int, slots, layout: str):
    """export/functional_cache.py's `write_prefill_cache` as a loop over the rows (prefill's batch is a
    symbolic dim), one `dynamic_update_slice` of the row's [kv_heads, steps, head_dim] into its slot
    each, in place (see write_decode_cache). dynamic_update_slice clamps a slot outside the cache
    onto it, as the op's eager meaning does.

    Args:
      cache: the cache in `layout` (as for write_decode_cache); new: [batch, kv_heads, steps,
        head_dim] (an int8 cache's scales: cache [layers, batch, kv_heads, context], new [batch,
        kv_heads, steps]); layer: the layer written; slots: [batch], each row's cache slot.
    Returns:
      The cache with the rows written at positions 0..steps-1.
    """
    rows = new if layout == "layer_batch_head_pos" else jnp.swapaxes(new, 1, 2)

    def write_row(row, cache):
        update = jax.lax.dynamic_index_in_dim(rows, row, 0, keepdims=True)[None].astype(cache.dtype)
        return jax.lax.dynamic_update_slice(cache, update, (layer, slots[row]) + (0,) * (cache.ndim - 2))

    return jax.lax.fori_loop(0, rows.shape[0], write_row, cache)


@register_lowering("tpuexport::write_decode_cache")
def write_decode_cache(cache, new, layer: int, positions, layout: str):
    """export/functional_cache.py's `write_decode_cache` as one `dynamic_update_slice` per row, which XLA
    runs in place on the donated cache whatever its TPU layout (a scatter of the same rows copies
    the cache into another layout and back, and so does a read of the cache beside the update:
    benchmarks/results/studies/generation_decode_write.md). dynamic_update_slice clamps a position outside
    the context onto it, as the op's eager meaning does.

    Args:
      cache: [layers, batch, kv_heads, context, head_dim] ("layer_batch_head_pos") or [layers,
        batch, context, kv_heads, head_dim]; new: [batch, kv_heads, head_dim]; layer: the layer
        written; positions: [batch], each row's position; layout: the cache layout. An int8
        cache's scales: [layers, batch, kv_heads, context] and new [batch, kv_heads].
    Returns:
      The cache with the rows written.
    """
    heads_then_positions = layout == "layer_batch_head_pos"
    minor = (0,) * (cache.ndim - 4)  # head_dim's start; none for the scales
    for row in range(new.shape[0]):
        start = (layer, row, 0, positions[row], *minor) if heads_then_positions else (layer, row, positions[row], 0, 0)
        update = new[row][None, None, :, None] if heads_then_positions else new[row][None, None, None]
        cache = jax.lax.dynamic_update_slice(cache, update.astype(cache.dtype), start)
    return cache


@dataclasses.dataclass(frozen=True)
class GenerationProgram(EntryPoints):
    """The lowering stage's result for a decoder with `task="text-generation"`.

    Attributes:
      spec: the cache and its limits (export/generation.py).
      entry_points: {"prefill": LoweredProgram, "decode": LoweredProgram, "sample": LoweredProgram}
        (an artifact converted before sampling on the device: no "sample"); all take the same
        weights (same names, shapes and arrays: the artifact stores them once; sample reads none).
      prefill_batches: the prefill batch sizes compiled (a serving engine prefills one prompt at
        a time while other slots decode, or a full batch).
    """

    spec: GenerationSpec
    entry_points: dict[str, LoweredProgram]
    prefill_batches: tuple[int, ...]

    # The entry point that fills cache slots (a decode step advances them), and what a row is.
    fill_entry_point = "prefill"
    source_kind = "tokens"

    @property
    def weights_program(self) -> LoweredProgram:
        """Decode's: its weights stand for all the entry points' (sample takes them unused)."""
        return self.entry_points["decode"]

    @property
    def fill_batches(self) -> tuple[int, ...]:
        return self.prefill_batches

    @property
    def state_inputs(self) -> tuple[str, ...]:
        """The cache tensors every entry point takes and returns (with an int8 cache's scales)."""
        return self.spec.cache_inputs

    def manifest_section(self) -> dict:
        """The manifest's "generation" section."""
        return {**self.spec.to_json(), "prefill_batches": list(self.prefill_batches), "cache_inputs": list(self.spec.cache_inputs),
                "cache_bytes": self.spec.cache_bytes}

    @classmethod
    def from_manifest(cls, generation: dict, entry_points: dict[str, LoweredProgram]) -> "GenerationProgram":
        return cls(GenerationSpec.from_json(generation), entry_points, tuple(generation["prefill_batches"]))

    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, runner: Runner | None = None, sampling: Sampling = GREEDY,
               stop_ids: Collection[int] = ()) -> Iterator[list[int | None]]:
        """Generation in a fresh session (stream_tokens), on CPU or through `runner`."""
        return stream_tokens(GenerationSession(self, runner), prompts, max_new_tokens, sampling, stop_ids)

    def fill_buckets(self) -> list[dict[str, int]]:
        """Every compiled prefill size, {"batch": b, "seq": s}."""
        return [{"batch": batch, "seq": seq} for batch in self.prefill_batches for seq in self.spec.prefill_buckets]

    def session(self, runner: Runner | None = None) -> "GenerationSession":
        """A fresh cache and the calls that fill and advance it (on CPU, or through `runner`)."""
        return GenerationSession(self, runner)

    def check_rows(self, rows: Sequence[Sequence[int]], max_new_tokens: int, features_usage: str = "") -> None:
        """Refuses prompts the artifact cannot generate from, in one line (check_prompts)."""
        check_prompts(self.spec, rows, max_new_tokens)

    @property
    def longest_row(self) -> int:
        """The longest prompt it takes (the longest prefill bucket, within max context)."""
        return min(self.spec.max_context, self.spec.prefill_buckets[-1])

    def padding_row(self) -> list[int]:
        """What fills a fill batch's unused row (its slot is free): one token."""
        return [0]


def cpu_runner(program: GenerationProgram, programs: dict | None = None) -> Runner:
    """Runs each entry point on XLA:CPU with the weights of `program.weights_program`.

    Args:
      program: the generation program.
      programs: {entry point: jax.export.Exported} to run instead of the entry points' own (e.g.
        their TPU-faithful rewrites), or None.
    """
    shared = program.weights_program
    # Kept as they are when they hold the shared arrays already: each LoweredProgram caches its CPU executables.
    entry_points = {name: lowered if lowered.weights is shared.weights else dataclasses.replace(lowered, weights=shared.weights)
                    for name, lowered in program.entry_points.items()}

    def run(name: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
        return entry_points[name].run(inputs, program=(programs or {}).get(name))

    return run


@dataclasses.dataclass(frozen=True)
class FilledRows:
    """What filling cache slots gives each row: the token its next decode step takes and that step's
    position; `sampled` when those tokens are the model's first generated ones, drawn from the fill's
    logits (a decoder's prefill), None when they are a start token (an encoder-decoder's)."""

    tokens: list[int]
    positions: list[int]
    sampled: SampledTokens | None

    @property
    def generated(self) -> bool:
        return self.sampled is not None


class GenerationSession:
    """The KV cache and the calls that fill and advance it.

    Attributes:
      program: the generation program.
      cache: the cache's tensors (keys, values[, key scales, value scales]: GenerationSpec.cache_tensors)
        as numpy arrays (or a runtime's device arrays) in the cache layout.
    """

    def __init__(self, program: GenerationProgram, runner: Runner | None = None):
        self.program = program
        self.run = runner or cpu_runner(program)
        spec = program.spec
        # The cache's tensors follow decode's tokens and positions, in spec.cache_inputs order.
        dtypes = [tensor.dtype for tensor in program.entry_points["decode"].signature.inputs[2:]]
        self.cache = tuple(np.zeros(shape, dtype) for (shape, _), dtype in zip(spec.cache_tensors().values(), dtypes, strict=True))

    def prefill(self, prompts: Sequence[Sequence[int]], slots: Sequence[int], seq: int | None = None) -> np.ndarray:
        """Runs prefill for prompts into cache slots, right-padded to a prefill bucket.

        Args:
          prompts: token ids per row; their count must be a compiled prefill batch.
          slots: the cache slot of each row (distinct).
          seq: the prefill bucket to pad to; None for the smallest that holds the longest prompt.
        Returns:
          The next-token logits of each row [rows, vocab] (float32).
        Raises:
          TpuExportError: no bucket holds the prompts, or a bad slot.
        """
        spec = self.program.spec
        longest = max(len(prompt) for prompt in prompts)
        if seq is None:
            fitting = [size for size in spec.prefill_buckets if size >= longest]
            if not fitting:
                raise TpuExportError(f"a prompt of {longest} tokens is longer than the longest prefill bucket "
                                     f"({spec.prefill_buckets[-1]}) and max context {spec.max_context}; shorten it")
            seq = fitting[0]
        if len(prompts) not in self.program.prefill_batches:
            raise TpuExportError(f"prefill of {len(prompts)} prompts: the compiled prefill batches are {list(self.program.prefill_batches)}")
        check_slots(slots, spec.max_batch)
        if min(len(prompt) for prompt in prompts) < 1:
            raise TpuExportError("an empty prompt: give at least one token per prompt")
        tokens = right_padded(prompts, seq)
        lengths = np.array([len(prompt) for prompt in prompts], np.int64)
        logits, *cache = self.run("prefill", [tokens, lengths, np.asarray(slots, np.int64), *self.cache])
        self.cache = tuple(cache)
        return logits

    def fill(self, rows: Sequence[Sequence[int]], slots: Sequence[int], draws: Sequence[Draw | None] = (), top: bool = False) -> FilledRows:
        """Prefills rows into slots (see `prefill`): each row's first token drawn from the logits as
        `draws` say (greedy where None or missing; see `sample`), at the position after its prompt."""
        sampled = self.sample(self.prefill(rows, slots), [*draws, *[None] * (len(rows) - len(draws))], top)
        return FilledRows([int(token) for token in sampled.tokens], [len(row) for row in rows], sampled)

    def sample(self, logits, draws: Sequence[Draw | None], top: bool = False) -> SampledTokens:
        """The next token of the first len(draws) rows of `logits`, drawn by the sample entry point
        (lower/sampling.draw_tokens); with `top`, the top logprobs too."""
        return draw_tokens(self.run, self.program.entry_points, logits, draws, top)

    def decode(self, tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """One decode step of every slot.

        Args:
          tokens: the token of each slot (max_batch of them; idle slots any valid id).
          positions: the position each slot's token takes (its key is written there).
        Returns:
          The next-token logits [max_batch, vocab] (float32).
        """
        logits, *cache = self.run("decode", [np.asarray(tokens, np.int64), np.asarray(positions, np.int64), *self.cache])
        self.cache = tuple(cache)
        return logits


def check_slots(slots: Sequence[int], max_batch: int) -> None:
    """Refuses cache slots that repeat or fall outside 0..max_batch-1, in one line."""
    if len(set(slots)) != len(slots) or not all(0 <= slot < max_batch for slot in slots):
        raise TpuExportError(f"slots {list(slots)} must be distinct and within 0..{max_batch - 1} (--max-batch {max_batch})")


def right_padded(rows: Sequence[Sequence[int]], seq: int) -> np.ndarray:
    """Token rows as one int64 [rows, seq] array, each row right-padded with zeros."""
    tokens = np.zeros((len(rows), seq), np.int64)
    for index, row in enumerate(rows):
        tokens[index, :len(row)] = row
    return tokens


def check_token_rows(rows: Sequence[Sequence[int]], max_new_tokens: int, noun: str, max_batch: int, longest: int,
                     too_long: Callable[[int], str], vocab: int) -> None:
    """Refuses token rows (a decoder's prompts, an encoder-decoder's sources) an artifact cannot
    generate from, in one line.

    Args:
      rows: token ids per row; max_new_tokens: tokens asked per row.
      noun: what a row is called in messages ("prompt", "source").
      max_batch: the cache's slots; longest: the longest row accepted; too_long: the message for a
        row of that many tokens beyond it; vocab: token ids are 0..vocab-1.
    Raises:
      TpuExportError: no row, more rows than slots, an empty or too long row, a token outside the
        vocabulary, or max_new_tokens < 1.
    """
    if not rows:
        raise TpuExportError(f"no {noun} given; pass token ids, e.g. --tokens 1,2,3")
    if len(rows) > max_batch:
        raise TpuExportError(f"{len(rows)} {noun}s exceed the artifact's max batch {max_batch}; give at most {max_batch} "
                             "or convert with a larger --max-batch")
    if max_new_tokens < 1:
        raise TpuExportError(f"--max-new-tokens {max_new_tokens}: give at least 1")
    for row in rows:
        if not row:
            raise TpuExportError(f"an empty {noun}: give at least one token per {noun}")
        if len(row) > longest:
            raise TpuExportError(too_long(len(row)))
        bad = [token for token in row if not 0 <= token < vocab]
        if bad:
            raise TpuExportError(f"token id {bad[0]} is outside the vocabulary 0..{vocab - 1}")


def check_prompts(spec: GenerationSpec, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    """Refuses prompts the artifact cannot generate from, in one line (check_token_rows; a prompt
    must fit the longest prefill bucket and the context)."""
    limit = min(spec.max_context, spec.prefill_buckets[-1])
    check_token_rows(prompts, max_new_tokens, "prompt", spec.max_batch, limit,
                     lambda length: (f"a prompt of {length} tokens is longer than the artifact's max context allows (at most {limit} "
                                     f"prompt tokens, max context {spec.max_context}); shorten it or convert with a larger --max-context"),
                     spec.vocab)


def stream_tokens(session, rows: Sequence, max_new_tokens: int, sampling: Sampling = GREEDY,
                  stop_ids: Collection[int] = ()) -> Iterator[list[int | None]]:
    """Generation in a session (a decoder's or an encoder-decoder's): fill the rows' slots at the
    smallest compiled fill batch that holds them (padding rows in free slots; one at a time if none
    does, batch 1 being compiled by default), then decode steps, each row's tokens drawn as
    `sampling` says (greedy by default); yields each step's new token per row, None for a row that
    has finished: it reached max context, or drew one of `stop_ids` (an EOS; yielded, then no more).

    Raises:
      TpuExportError: rows the artifact cannot take (the program's check_rows).
    """
    program = session.program
    program.check_rows(rows, max_new_tokens)
    max_batch, max_context = program.spec.max_batch, program.spec.max_context
    keys = sampling.row_keys(len(rows))
    slots = list(range(len(rows)))
    fitting = [batch for batch in program.fill_batches if batch >= len(rows)]
    if fitting:
        # The session's other slots are free: padding rows go there.
        padding = fitting[0] - len(rows)
        fills = [([*rows, *[program.padding_row()] * padding], slots + list(range(len(rows), len(rows) + padding)), slots)]
    else:
        fills = [([row], [slot], [slot]) for row, slot in zip(rows, slots)]
    filled = [(session.fill(batch_rows, batch_slots, [Draw(sampling, keys[slot], 0) for slot in real]), real)
              for batch_rows, batch_slots, real in fills]
    tokens = [token for fill, real in filled for token in fill.tokens[:len(real)]]
    positions = [position for fill, real in filled for position in fill.positions[:len(real)]]
    stopped = [False] * len(rows)
    generated = 0
    if filled[0][0].generated:
        yield list(tokens)
        stopped = [token in stop_ids for token in tokens]
        generated = 1
    while generated < max_new_tokens:
        live = [not done and position < max_context for done, position in zip(stopped, positions)]
        if not any(live):
            return
        step_tokens = np.zeros(max_batch, np.int64)
        step_positions = np.zeros(max_batch, np.int64)
        # Idle slots decode token 0 at position 0 of their own slot, which nothing reads.
        for row, (token, position) in enumerate(zip(tokens, positions)):
            if live[row]:
                step_tokens[row], step_positions[row] = token, position
        logits = session.decode(step_tokens, step_positions)
        sampled = session.sample(logits, [Draw(sampling, keys[row], generated) if live[row] else None for row in range(len(rows))])
        new = [int(token) for token in sampled.tokens]
        yield [new[row] if live[row] else None for row in range(len(rows))]
        for row in range(len(rows)):
            if live[row]:
                tokens[row], positions[row], stopped[row] = new[row], positions[row] + 1, new[row] in stop_ids
        generated += 1
