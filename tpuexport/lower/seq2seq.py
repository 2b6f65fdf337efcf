"""An encoder-decoder generation program: its encode and decode entry points (each a LoweredProgram)
over one set of weights, and a session that drives them on CPU (encode, then decode step by step
from the decoder start token), holding the caches between calls as a serving runtime holds the
TPU buffers. What `Artifact.generate`, `tpuexport generate` and verification run.

A source is what the spec's `source` kind says: token ids (a list of ints, right-padded to an encode
bucket, with its length) or audio features (a float array [mel bins, frames], always full length)."""

from __future__ import annotations

import dataclasses
from typing import Collection, Iterator, Sequence

import numpy as np

from tpuexport.errors import TpuExportError
from tpuexport.export.cache_specs import Seq2SeqSpec
from tpuexport.lower.generation import FilledRows, Runner, check_slots, check_token_rows, cpu_runner, right_padded, stream_tokens
from tpuexport.lower.sampling import GREEDY, Draw, SampledTokens, Sampling, draw_tokens
from tpuexport.lower.lowered import LoweredProgram
from tpuexport.lower.program import EntryPoints


@dataclasses.dataclass(frozen=True)
class Seq2SeqProgram(EntryPoints):
    """The lowering stage's result for an encoder-decoder with `task="text-generation"`.

    Attributes:
      spec: the caches and their limits (export/seq2seq.py).
      entry_points: {"encode": LoweredProgram, "decode": LoweredProgram}, the same weights.
      encode_batches: the encode batch sizes compiled.
    """

    spec: Seq2SeqSpec
    entry_points: dict[str, LoweredProgram]
    encode_batches: tuple[int, ...]

    # The entry point that fills cache slots (a decode step advances them).
    fill_entry_point = "encode"

    @property
    def fill_batches(self) -> tuple[int, ...]:
        return self.encode_batches

    @property
    def source_kind(self) -> str:
        """What a row is: "tokens" (ids) or "features" (an audio source's [mel bins, frames])."""
        return self.spec.source

    def session(self, runner: Runner | None = None) -> "Seq2SeqSession":
        """Fresh caches and the calls that fill and advance them (on CPU, or through `runner`)."""
        return Seq2SeqSession(self, runner)

    def check_rows(self, rows: Sequence, max_new_tokens: int, features_usage: str = "") -> None:
        """Refuses sources the artifact cannot generate from, in one line (check_sources)."""
        check_sources(self.spec, rows, max_new_tokens, features_usage or FEATURES_USAGE)

    @property
    def longest_row(self) -> int:
        """The longest token source it takes (the longest source bucket)."""
        return self.spec.max_source

    def padding_row(self):
        """What fills an encode batch's unused row (its slot is free): one token, or silent features."""
        return padding_source(self.spec)

    @property
    def state_inputs(self) -> tuple[str, ...]:
        return self.spec.state_inputs

    def fill_buckets(self) -> list[dict[str, int]]:
        """Every compiled encode size, {"batch": b, "seq": s} (s: source length; audio features: {"batch": b})."""
        if self.spec.source == "features":
            return [{"batch": batch} for batch in self.encode_batches]
        return [{"batch": batch, "seq": seq} for batch in self.encode_batches for seq in self.spec.source_buckets]

    def manifest_section(self) -> dict:
        """The manifest's "generation" section."""
        return {**self.spec.to_json(), "encode_batches": list(self.encode_batches), "cache_inputs": list(self.state_inputs),
                "cache_bytes": self.spec.cache_bytes}

    @classmethod
    def from_manifest(cls, generation: dict, entry_points: dict[str, LoweredProgram]) -> "Seq2SeqProgram":
        return cls(Seq2SeqSpec.from_json(generation), entry_points, tuple(generation["encode_batches"]))

    def stream(self, sources: Sequence, max_new_tokens: int, runner: Runner | None = None, sampling: Sampling = GREEDY,
               stop_ids: Collection[int] = ()) -> Iterator[list[int | None]]:
        """Generation in a fresh session (lower/generation.stream_tokens), on CPU or through `runner`."""
        return stream_tokens(Seq2SeqSession(self, runner), sources, max_new_tokens, sampling, stop_ids)


class Seq2SeqSession:
    """The caches (decoder self-attention, cross-attention, source lengths) and the calls that fill
    and advance them.

    Attributes:
      program: the program.
      state: {state input name: array}, as the entry points take and return them.
    """

    def __init__(self, program: Seq2SeqProgram, runner: Runner | None = None):
        self.program = program
        self.run = runner or cpu_runner(program)
        spec = program.spec
        dtype = program.entry_points["decode"].signature.inputs[2].dtype
        state = {"cache_k": np.zeros(spec.cache_shape, dtype), "cache_v": np.zeros(spec.cache_shape, dtype),
                 "cross_k": np.zeros(spec.cross_shape, dtype), "cross_v": np.zeros(spec.cross_shape, dtype),
                 "source_lengths": np.ones(spec.max_batch, np.int64)}
        self.state = {name: state[name] for name in spec.state_inputs}

    def _call(self, name: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        signature = self.program.entry_points[name].signature
        outputs = self.run(name, [inputs[tensor.name] if tensor.name in inputs else self.state[tensor.name] for tensor in signature.inputs])
        outputs = dict(zip((tensor.name for tensor in signature.outputs), outputs))
        self.state.update({key: value for key, value in outputs.items() if key in self.state})
        return outputs

    def encode(self, sources: Sequence, slots: Sequence[int], seq: int | None = None) -> None:
        """Encodes sources into cache slots, token sources right-padded to an encode bucket.

        Args:
          sources: token ids per row, or audio features [mel bins, frames] per row (the spec's
            source kind); their count must be a compiled encode batch.
          slots: the cache slot of each row (distinct).
          seq: the source bucket to pad token sources to; None for the smallest that holds the
            longest source.
        Raises:
          TpuExportError: no bucket holds the sources, or a bad slot.
        """
        spec = self.program.spec
        if spec.source == "features":
            if len(sources) not in self.program.encode_batches:
                raise TpuExportError(f"encode of {len(sources)} sources: the compiled encode batches are {list(self.program.encode_batches)}")
            check_slots(slots, spec.max_batch)
            dtype = self.program.entry_points["encode"].signature.inputs[0].dtype
            self._call("encode", {"input_features": np.stack([np.asarray(source, np.float32) for source in sources]).astype(dtype),
                                  "slots": np.asarray(slots, np.int64)})
            return
        longest = max(len(source) for source in sources)
        if seq is None:
            fitting = [size for size in spec.source_buckets if size >= longest]
            if not fitting:
                raise TpuExportError(f"a source of {longest} tokens is longer than the longest source bucket ({spec.max_source}); shorten it "
                                     "or convert with a larger --bucket seq=")
            seq = fitting[0]
        if len(sources) not in self.program.encode_batches:
            raise TpuExportError(f"encode of {len(sources)} sources: the compiled encode batches are {list(self.program.encode_batches)}")
        check_slots(slots, spec.max_batch)
        tokens = right_padded(sources, seq)
        lengths = np.array([len(source) for source in sources], np.int64)
        self._call("encode", {"source": tokens, "lengths": lengths, "slots": np.asarray(slots, np.int64)})

    def fill(self, sources: Sequence, slots: Sequence[int], draws: Sequence[Draw | None] = (), top: bool = False) -> FilledRows:
        """Encodes sources into slots (see `encode`): each row decodes from the start token at position 0
        (nothing is drawn yet: `draws` and `top` are for the first decode step's `sample`)."""
        self.encode(sources, slots)
        return FilledRows([self.program.spec.decoder_start_token_id] * len(sources), [0] * len(sources), None)

    def sample(self, logits, draws: Sequence[Draw | None], top: bool = False) -> SampledTokens:
        """The next token of the first len(draws) rows of `logits` (lower/sampling.draw_tokens: the NumPy
        sampler, an encoder-decoder having no sample entry point)."""
        return draw_tokens(self.run, self.program.entry_points, logits, draws, top)

    def decode(self, tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """One decode step of every slot (max_batch tokens and positions): the logits [max_batch, vocab]."""
        outputs = self._call("decode", {"tokens": np.asarray(tokens, np.int64), "positions": np.asarray(positions, np.int64)})
        return outputs["logits"]


FEATURES_USAGE = "pass --features FILE.npy holding a float array [batch, {0}, {1}] (API: Artifact.generate(features=array))"


def check_sources(spec: Seq2SeqSpec, sources: Sequence, max_new_tokens: int, features_usage: str = FEATURES_USAGE) -> None:
    """Refuses sources the artifact cannot generate from, in one line (token sources:
    check_token_rows, a source must fit the longest source bucket; audio features: check_features,
    whose messages end with `features_usage`)."""
    if spec.source == "features":
        check_features(spec, sources, max_new_tokens, features_usage)
        return
    check_token_rows(sources, max_new_tokens, "source", spec.max_batch, spec.max_source,
                     lambda length: (f"a source of {length} tokens is longer than the artifact's longest source bucket ({spec.max_source}); "
                                     "shorten it or convert with a larger --bucket seq="),
                     spec.vocab)


def check_features(spec: Seq2SeqSpec, sources: Sequence, max_new_tokens: int, usage: str = FEATURES_USAGE) -> None:
    """Refuses audio sources the artifact cannot take, in one line: no source, more than max batch,
    max_new_tokens < 1, a source that is not a finite float array [mel bins, frames] of the spec's
    sizes. `usage` ends the messages: how to pass features, {0} and {1} the mel bins and frames."""
    mel, frames = spec.features
    usage = usage.format(mel, frames)
    if len(sources) == 0:
        raise TpuExportError(f"no source given; this artifact's sources are audio features: {usage}")
    if len(sources) > spec.max_batch:
        raise TpuExportError(f"{len(sources)} sources exceed the artifact's max batch {spec.max_batch}; give at most {spec.max_batch} "
                             "or convert with a larger --max-batch")
    if max_new_tokens < 1:
        raise TpuExportError(f"--max-new-tokens {max_new_tokens}: give at least 1")
    for source in sources:
        array = np.asarray(source)
        if array.shape != (mel, frames):
            raise TpuExportError(f"a source of shape {list(array.shape)}: this artifact's sources are audio features of {mel} mel bins x "
                                 f"{frames} frames each (frames padded or trimmed to {frames}, as Whisper's feature extractor does); {usage}")
        if array.dtype.kind != "f" and array.dtype.name != "bfloat16":
            raise TpuExportError(f"audio features of dtype {array.dtype}: give float features (float32); {usage}")
        if not np.isfinite(array.astype(np.float32)).all():
            raise TpuExportError("audio features hold NaN or infinite values; give finite log-mel features")


def padding_source(spec: Seq2SeqSpec):
    """A source that fills an encode batch's unused row (its slot is free): one token, or silent features."""
    return np.zeros(spec.features, np.float32) if spec.source == "features" else [0]


def source_rows(program, rows) -> list:
    """Sources as a program's stream takes them: audio features (a [batch, mel, frames] array or a
    sequence of [mel, frames] arrays) as arrays per row, else token ids as ints per row."""
    if program.source_kind == "features":
        return [np.asarray(row) for row in rows]
    return [list(map(int, row)) for row in rows]
