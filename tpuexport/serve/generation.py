"""Continuous batching of generate requests: every request of a text-generation model shares one KV
cache, a prompt per cache slot, and one decode step advances every slot in use.

One `GenerationScheduler` thread per served text-generation model loops:
  1. admits waiting requests, oldest first, while the cache has free slots for them: their prompts
     are prefilled into free slots at the smallest compiled prefill batch that holds them and whose
     padding rows find free slots too (as `Runner.stream` does), else one prompt at a time (batch
     1, compiled by default), and each request gets its first tokens; an encoder-decoder's sources
     (token ids, or an audio model's features [mel bins, frames]; padding rows: one token, or
     silent features) are encoded into the slots alike, and its rows start decoding from the
     decoder start token;
  2. runs one decode step over all slots (idle ones decode token 0 at their own position 0, which
     nothing reads) and hands each request its rows' new tokens;
  3. releases the slots of requests that are done (max_new_tokens, every row at max context, or
     the client gone).
A request therefore joins the running batch between two decode steps instead of waiting for the
others to finish; its tokens are the ones it would get alone (rows do not interact: the same
executables, each row attending to its own slot only). A failing step fails the requests it ran
(their clients get the error) and the loop goes on with a fresh cache.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
from typing import Iterator

import numpy as np

from tpuexport.errors import TpuExportError
from tpuexport.runtime import Runner
from tpuexport.serve.batching import ShuttingDown
from tpuexport.serve.metrics import Metrics
from tpuexport.signature import TensorSpec

_DONE = object()
PROMPTS, FEATURES = "prompts", "features"  # what a generate request's rows are
GENERATE_SIGNATURE = "generate"  # gRPC Predict's signature_name for generation (serve/grpc_service.py)
DEFAULT_NEW_TOKENS = 32
SERVE_FEATURES_USAGE = ('send "features", a float array [batch, {0}, {1}] (REST: a list of {0} x {1} nested lists per source; '
                        'gRPC, the one for real audio sizes: a float32 TensorProto input "features")')


@dataclasses.dataclass(eq=False)
class _Request:
    """One generate request: its sources (token ids per row, or an audio model's features per
    row), its slots once admitted, and where its steps go."""

    sources: list
    max_new_tokens: int
    steps: queue.Queue = dataclasses.field(default_factory=queue.Queue)
    slots: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)  # each row's last token
    positions: list[int] = dataclasses.field(default_factory=list)  # where each row's next token goes
    fill_batch: int = 0
    emitted: int = 0
    cancelled: bool = False

    def live(self, max_context: int) -> list[bool]:
        return [position < max_context for position in self.positions]


class GenerationStream:
    """A request's steps as they come: each step's new token per prompt (None for a row that
    reached max context), as `Runner.stream` yields them; `cancel` (a client gone) frees its slots
    after the current step. Iterating raises the error of a step that failed."""

    def __init__(self, request: _Request):
        self.request = request

    def __iter__(self) -> Iterator[list[int | None]]:
        return self

    def __next__(self) -> list[int | None]:
        step = self.request.steps.get()
        if step is _DONE:
            self.request.steps.put(_DONE)  # iterating again stays at the end
            raise StopIteration
        if isinstance(step, BaseException):
            raise step
        return step

    def cancel(self) -> None:
        self.request.cancelled = True


class GenerationScheduler:
    """Runs a text-generation model's generate requests with continuous batching (module docstring).

    Args:
      runner: the model's runtime (a text-generation artifact's executables).
      metrics: where decode steps and generated tokens are counted.
      labels: {"model", "version"} metric labels.
    """

    def __init__(self, runner: Runner, metrics: Metrics, labels: dict[str, str]):
        self.runner = runner
        self.program = runner.artifact.generation_program
        self.spec = self.program.spec
        # The batches the cache's slots are filled at (prefill's, or an encoder-decoder's encode's).
        self.fill_batches = self.program.fill_batches
        self.metrics = metrics
        self.labels = labels
        self.waiting: collections.deque[_Request] = collections.deque()
        self.active: list[_Request] = []
        self.closed = False
        self.wake = threading.Condition()
        self.session = self._new_session()
        self.thread = threading.Thread(target=self._loop, name=f"generation-{labels['model']}-{labels['version']}", daemon=True)
        self.thread.start()

    def submit(self, rows, max_new_tokens: int, kind: str = PROMPTS) -> "GenerationStream":
        """Queues a request.

        Args:
          rows: token ids per row (kind "prompts": a decoder's prompts, a text encoder-decoder's
            sources), or an audio encoder-decoder's features (kind "features": a float array
            [batch, mel bins, frames]).
          max_new_tokens: tokens to generate per row (fewer where a row reaches max context).
          kind: "prompts" or "features", as the request named its rows.
        Returns:
          Its steps as they come (GenerationStream).
        Raises:
          TpuExportError: rows the artifact cannot take (lower/generation.check_prompts,
            lower/seq2seq.check_sources), or of the other kind than the model's sources.
          ShuttingDown: after `close`.
        """
        sources = self._sources(rows, kind)
        self.program.check_rows(sources, max_new_tokens, SERVE_FEATURES_USAGE)
        if self._fill_batch(len(sources), self.spec.max_batch) is None:
            raise TpuExportError(f"{len(sources)} prompts fit no compiled batch ({list(self.fill_batches)}) and batch 1 "
                                 "is not compiled; send as many prompts as a compiled batch, or convert with --bucket batch=1,...")
        request = _Request(sources, max_new_tokens)
        with self.wake:
            if self.closed:
                raise ShuttingDown("the server is shutting down; retry on another replica")
            self.waiting.append(request)
            self.wake.notify()
        return GenerationStream(request)

    @property
    def source_kind(self) -> str:
        """What a request's rows must be: "features" for an audio encoder-decoder, else "prompts" (token ids)."""
        return FEATURES if self.program.source_kind == "features" else PROMPTS

    def signature(self) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """(inputs, outputs) of gRPC's generate: the rows ("features" [batch, mel bins, frames] float32,
        or "prompts" [batch, length] token ids) and "max_new_tokens"; "tokens" [batch, steps]."""
        if self.source_kind == FEATURES:
            rows = TensorSpec(FEATURES, ("batch", *self.spec.features), "float32", "float32")
        else:
            rows = TensorSpec(PROMPTS, ("batch", "length"), "int64", "int64")
        return [rows, TensorSpec("max_new_tokens", (), "int64", "int64")], [TensorSpec("tokens", ("batch", "steps"), "int64", "int64")]

    def _sources(self, rows, kind: str) -> list:
        """A request's rows as the sessions take them: token ids as ints per row, features as an array per row.

        Raises:
          TpuExportError: rows of the other kind than the model's sources, or features that are
            not a [batch, mel bins, frames] array.
        """
        if kind != self.source_kind:
            if self.source_kind == FEATURES:
                raise TpuExportError('this model generates from audio features, not token ids: ' + SERVE_FEATURES_USAGE.format(*self.spec.features))
            raise TpuExportError('this model generates from token ids, not audio features (its encoder is not an audio model): '
                                 'send "prompts", a list of token id lists')
        if kind == PROMPTS:
            return [list(map(int, row)) for row in rows]
        array = np.asarray(rows)
        if array.ndim != 3:
            raise TpuExportError(f"audio features of shape {list(array.shape)}: " + SERVE_FEATURES_USAGE.format(*self.spec.features))
        return list(array)

    def close(self) -> None:
        """Stops taking requests, finishes those admitted or waiting, and ends the thread."""
        with self.wake:
            self.closed = True
            self.wake.notify()
        self.thread.join()

    def _new_session(self):
        return self.program.session(runner=lambda name, inputs: list(self.runner.run(inputs, name).values()))

    def _loop(self) -> None:
        while True:
            with self.wake:
                while not self.waiting and not self.active and not self.closed:
                    self.wake.wait()
                if self.closed and not self.waiting and not self.active:
                    return
                admitted = self._admissible()
            try:
                for request in admitted:
                    self._fill(request)
                self._release()
                if self.active:
                    self._decode()
                self._release()
            except Exception as error:  # the requests that ran fail; the next ones get a fresh cache
                for request in self.active:
                    request.steps.put(error)
                self.active = []
                self.session = self._new_session()

    def _admissible(self) -> list[_Request]:
        """The waiting requests that fit the free slots now, oldest first (one that does not fit
        waits, and so do those behind it: no request is starved by smaller ones); they become active."""
        admitted = []
        while self.waiting:
            request = self.waiting[0]
            if request.cancelled:
                self.waiting.popleft()
                continue
            free = self._free_slots()
            batch = self._fill_batch(len(request.sources), len(free))
            if batch is None:
                break
            self.waiting.popleft()
            request.slots, request.fill_batch = free[:len(request.sources)], batch
            self.active.append(request)
            admitted.append(request)
        return admitted

    def _free_slots(self) -> list[int]:
        used = {slot for request in self.active for slot in request.slots}
        return [slot for slot in range(self.spec.max_batch) if slot not in used]

    def _fill_batch(self, rows: int, free: int) -> int | None:
        """The batch to fill the slots of `rows` prompts at with `free` slots: the smallest compiled
        batch that holds them and fits the free slots (its padding rows go there), else 1 (one
        prompt at a time) when compiled and the prompts fit; None: not now."""
        fitting = [batch for batch in self.fill_batches if rows <= batch <= free]
        if fitting:
            return min(fitting)
        return 1 if 1 in self.fill_batches and rows <= free else None

    def _fill(self, request: _Request) -> None:
        """Fills the request's slots from its sources: prefill, whose logits give the first tokens
        (handed to the request), or an encoder-decoder's encode, after which its rows decode from
        the decoder start token at position 0."""
        rows, slots = request.sources, request.slots
        if request.fill_batch >= len(rows):
            # Padding rows (one token each, or silent features) go to free slots, which their occupant's fill overwrites.
            padding = [slot for slot in self._free_slots() if slot not in slots][:request.fill_batch - len(rows)]
            fills = [([*rows, *[self.program.padding_row()] * len(padding)], [*slots, *padding])]
        else:
            fills = [([row], [slot]) for row, slot in zip(rows, slots)]
        filled = [self.session.fill(batch_rows, batch_slots) for batch_rows, batch_slots in fills]
        request.tokens = [token for fill in filled for token in fill.tokens][:len(rows)]
        request.positions = [position for fill in filled for position in fill.positions][:len(rows)]
        if filled[0].generated:
            self._emit(request, list(request.tokens))

    def _decode(self) -> None:
        """One decode step of every slot; each active request gets its rows' tokens."""
        tokens = np.zeros(self.spec.max_batch, np.int64)
        positions = np.zeros(self.spec.max_batch, np.int64)
        for request in self.active:
            for slot, token, position, live in zip(request.slots, request.tokens, request.positions, request.live(self.spec.max_context)):
                if live:
                    tokens[slot], positions[slot] = token, position
        logits = self.session.decode(tokens, positions)
        self.metrics.decode_rows.labels(**self.labels).observe(sum(sum(request.live(self.spec.max_context)) for request in self.active))
        for request in self.active:
            live = request.live(self.spec.max_context)
            new = [int(logits[slot].argmax()) for slot in request.slots]
            self._emit(request, [token if alive else None for token, alive in zip(new, live)])
            request.tokens = [token if alive else old for token, old, alive in zip(new, request.tokens, live)]
            request.positions = [position + 1 for position in request.positions]

    def _emit(self, request: _Request, step: list[int | None]) -> None:
        request.steps.put(step)
        request.emitted += 1
        self.metrics.generated_tokens.labels(**self.labels).inc(sum(token is not None for token in step))

    def _release(self) -> None:
        """Ends the requests that are done, freeing their slots."""
        still = []
        for request in self.active:
            if request.cancelled or request.emitted >= request.max_new_tokens or not any(request.live(self.spec.max_context)):
                request.steps.put(_DONE)
            else:
                still.append(request)
        self.active = still
