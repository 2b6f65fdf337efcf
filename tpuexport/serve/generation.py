"""Continuous batching of generate requests: every request of a text-generation model shares one KV
cache, a row (prompt) per cache slot, and one decode step advances every slot in use.

One `GenerationScheduler` thread per served text-generation model loops:
  1. admits waiting requests, oldest first, while the cache has free slots for them: their prompts
     are prefilled into free slots at the smallest compiled prefill batch that holds them and whose
     padding rows find free slots too (as `Runner.stream` does), else one prompt at a time (batch
     1, compiled by default), and each row's first token is drawn from the prefill's logits by the
     sample entry point, on the device; an encoder-decoder's sources (token ids, or an audio
     model's features [mel bins, frames]; padding rows: one token, or silent features) are encoded
     into the slots alike, and its rows start decoding from the decoder start token;
  2. runs one decode step over all slots (idle ones decode token 0 at their own position 0, which
     nothing reads), then the sample entry point over its logits, which stay on the device (only
     the tokens and their logprobs come to the host), and hands each request its rows' new tokens;
  3. ends the rows that are done: a stop token (an EOS), a stop string (its TextRow), max tokens,
     or max context; a finished row frees its slot at once, a request ends with its last row (or
     when its client is gone).
A request therefore joins the running batch between two decode steps instead of waiting for the
others to finish; its tokens are the ones it would get alone (rows do not interact: the same
executables, each row attending to its own slot only, each row's draws keyed by its seed and the
index of the token drawn, not by its slot). A failing step fails the requests it ran (their clients
get the error) and the loop goes on with a fresh cache.

Metrics (serve/metrics.py): time to first token, inter-token latency, end-to-end latency and queue
time per request; requests running and waiting, cache slots in use; prompt and generated tokens.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import queue
import threading
import time
from typing import Callable, Collection, Iterator, Sequence

import numpy as np

from tpuexport.errors import TpuExportError
from tpuexport.lower.sampling import GREEDY, Draw, SampledTokens, Sampling
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
# Why a row finished (OpenAI's finish_reason): a stop token or string, or max tokens / max context.
STOP, LENGTH = "stop", "length"


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of a request, as its stream yields it.

    Attributes:
      tokens: per row, its new token, or None (a row that finished before this step).
      logprobs: per row, that token's log probability under the model, or None.
      top: per row, its top [(token id, logprob)] when the request asked for top logprobs, else None.
      finished: per row, why it finished at this step (STOP or LENGTH), or None.
      text: per row, the text this step released (its TextRow's; "" while a possible stop string
        is held back), or None for a request without texts.
    """

    tokens: list[int | None]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None]
    finished: list[str | None]
    text: list[str | None]


@dataclasses.dataclass(eq=False)
class _Row:
    """One row of a request: its slot while it generates, the token and position of its next decode step."""

    slot: int | None = None
    token: int = 0
    position: int = 0
    generated: int = 0
    finish: str | None = None


@dataclasses.dataclass(eq=False)
class _Request:
    """One generate request: its sources (token ids per row, or an audio model's features per row),
    how its rows draw and stop, its rows once admitted, and where its steps go."""

    sources: list
    max_new_tokens: int
    sampling: Sampling = GREEDY
    stop_ids: frozenset = frozenset()
    top_logprobs: int = 0
    texts: list | None = None
    steps: queue.Queue = dataclasses.field(default_factory=queue.Queue)
    rows: list[_Row] = dataclasses.field(default_factory=list)
    keys: list[int] = dataclasses.field(default_factory=list)
    fill_batch: int = 0
    cancelled: bool = False
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    last_token: float | None = None
    # Called after each put (from the scheduler's thread): wakes an asyncio reader (GenerationStream.__anext__).
    notify: Callable[[], None] = lambda: None

    def put(self, item) -> None:
        self.steps.put(item)
        try:
            self.notify()
        except RuntimeError:  # the reader's event loop has closed (the server is stopping): nobody awaits the step
            pass

    def draw(self, row: _Row) -> Draw:
        return Draw(self.sampling, self.keys[self.rows.index(row)], row.generated)


class GenerationStream:
    """A request's steps as they come (Step; `tokens` as `Runner.stream` yields them), iterated in a
    thread or awaited (`async for`); `cancel` (a client gone) frees its slots after the current step.
    Iterating raises the error of a step that failed."""

    def __init__(self, request: _Request):
        self.request = request
        self._ready: asyncio.Event | None = None

    def __iter__(self) -> Iterator[Step]:
        return self

    def __next__(self) -> Step:
        step = self.request.steps.get()
        if step is _DONE:
            self.request.put(_DONE)  # iterating again stays at the end
            raise StopIteration
        if isinstance(step, BaseException):
            raise step
        return step

    def __aiter__(self) -> "GenerationStream":
        return self

    async def __anext__(self) -> Step:
        """The next step, awaited in an event loop (no thread blocks on the queue meanwhile)."""
        if self._ready is None:
            loop, self._ready = asyncio.get_running_loop(), asyncio.Event()
            self.request.notify = lambda: loop.call_soon_threadsafe(self._ready.set)
        while True:
            self._ready.clear()
            try:
                step = self.request.steps.get_nowait()
            except queue.Empty:
                await self._ready.wait()
                continue
            if step is _DONE:
                self.request.steps.put(_DONE)
                raise StopAsyncIteration
            if isinstance(step, BaseException):
                raise step
            return step

    def cancel(self) -> None:
        self.request.cancelled = True


class GenerationScheduler:
    """Runs a text-generation model's generate requests with continuous batching (module docstring).

    Args:
      runner: the model's runtime (a text-generation artifact's executables).
      metrics: where steps, tokens and latencies are counted.
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

    def submit(self, rows, max_new_tokens: int, kind: str = PROMPTS, sampling: Sampling = GREEDY, stop_ids: Collection[int] = (),
               top_logprobs: int = 0, texts: Sequence | None = None) -> GenerationStream:
        """Queues a request.

        Args:
          rows: token ids per row (kind "prompts": a decoder's prompts, a text encoder-decoder's
            sources), or an audio encoder-decoder's features (kind "features": a float array
            [batch, mel bins, frames]).
          max_new_tokens: tokens to generate per row (fewer where a row stops or reaches max context).
          kind: "prompts" or "features", as the request named its rows.
          sampling: how its rows draw their tokens (greedy by default).
          stop_ids: tokens that finish a row (its EOS ids, the request's stop token ids); the stop
            token is the row's last.
          top_logprobs: how many of the likeliest tokens each step reports per row (0: none).
          texts: per row, a TextRow (serve/text.py) that detokenizes its tokens and finds its stop
            strings, or None.
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
        request = _Request(sources, max_new_tokens, sampling, frozenset(stop_ids), top_logprobs, list(texts) if texts else None,
                           rows=[_Row() for _ in sources], keys=sampling.row_keys(len(sources)))
        with self.wake:
            if self.closed:
                raise ShuttingDown("the server is shutting down; retry on another replica")
            self.waiting.append(request)
            self._gauges()
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
        return self.program.session(runner=self.runner.device_runner())

    def _loop(self) -> None:
        while True:
            with self.wake:
                while not self.waiting and not self.active and not self.closed:
                    self.wake.wait()
                if self.closed and not self.waiting and not self.active:
                    return
                admitted = self._admissible()
                self._gauges()
            try:
                for request in admitted:
                    self._fill(request)
                self._release()
                if self.active:
                    self._decode()
                self._release()
            except Exception as error:  # the requests that ran fail; the next ones get a fresh cache
                for request in self.active:
                    request.put(error)
                self.active = []
                self.session = self._new_session()
            with self.wake:
                self._gauges()

    def _gauges(self) -> None:
        labels = self.labels
        self.metrics.requests_running.labels(**labels).set(len(self.active))
        self.metrics.requests_waiting.labels(**labels).set(len(self.waiting))
        self.metrics.cache_slots_used.labels(**labels).set(self.spec.max_batch - len(self._free_slots()))

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
            for row, slot in zip(request.rows, free):
                row.slot = slot
            request.fill_batch = batch
            self.active.append(request)
            admitted.append(request)
            self.metrics.queue_time.labels(**self.labels).observe(time.perf_counter() - request.arrived)
            if self.source_kind == PROMPTS:
                self.metrics.prompt_tokens.labels(**self.labels).inc(sum(len(row) for row in request.sources))
        return admitted

    def _free_slots(self) -> list[int]:
        used = {row.slot for request in self.active for row in request.rows if row.slot is not None}
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
        (drawn on the device and handed to the request), or an encoder-decoder's encode, after which
        its rows decode from the decoder start token at position 0."""
        sources, slots = request.sources, [row.slot for row in request.rows]
        draws = [request.draw(row) for row in request.rows]
        if request.fill_batch >= len(sources):
            # Padding rows (one token each, or silent features) go to free slots, which their occupant's fill overwrites.
            padding = self._free_slots()[:request.fill_batch - len(sources)]
            fills = [([*sources, *[self.program.padding_row()] * len(padding)], [*slots, *padding], draws)]
        else:
            fills = [([source], [slot], [draw]) for source, slot, draw in zip(sources, slots, draws)]
        filled = [(self.session.fill(rows, batch_slots, batch_draws, request.top_logprobs > 0), len(batch_draws))
                  for rows, batch_slots, batch_draws in fills]
        # Each fill's real rows (its padding rows follow them), in the request's row order.
        real = [(fill, index) for fill, count in filled for index in range(count)]
        for row, (fill, index) in zip(request.rows, real):
            row.token, row.position = fill.tokens[index], fill.positions[index]
        if filled[0][0].generated:
            self._emit(request, {row: (fill.sampled, index) for row, (fill, index) in enumerate(real)}, decoded=False)

    def _decode(self) -> None:
        """One decode step of every slot, then the sample step over its logits; each active request
        gets its rows' tokens."""
        tokens = np.zeros(self.spec.max_batch, np.int64)
        positions = np.zeros(self.spec.max_batch, np.int64)
        draws: list[Draw | None] = [None] * self.spec.max_batch
        generating = [(request, index, row) for request in self.active for index, row in enumerate(request.rows)
                      if row.slot is not None and row.finish is None]
        for request, _, row in generating:
            tokens[row.slot], positions[row.slot], draws[row.slot] = row.token, row.position, request.draw(row)
        logits = self.session.decode(tokens, positions)
        sampled = self.session.sample(logits, draws, any(request.top_logprobs for request, _, _ in generating))
        self.metrics.decode_rows.labels(**self.labels).observe(len(generating))
        by_request: dict[int, dict] = {}
        for request, index, row in generating:
            by_request.setdefault(id(request), {})[index] = (sampled, row.slot)
        for request in self.active:
            if id(request) in by_request:
                self._emit(request, by_request[id(request)], decoded=True)

    def _emit(self, request: _Request, rows: dict[int, tuple[SampledTokens, int]], decoded: bool) -> None:
        """Hands a request its rows' new tokens ({row index: (the sample step's result, the row's
        index in it)}) and finishes the rows that are done. `decoded`: the tokens follow a decode
        step (the rows advance a position), not a prefill (the first tokens)."""
        count = len(request.rows)
        step = Step([None] * count, [None] * count, [None] * count, [None] * count, [""] * count if request.texts else [None] * count)
        for index, (sampled, position) in rows.items():
            row, token = request.rows[index], int(sampled.tokens[position])
            row.generated += 1
            row.token, row.position = token, row.position + decoded
            step.tokens[index], step.logprobs[index] = token, float(sampled.logprobs[position])
            if request.top_logprobs:
                step.top[index] = [(int(top_id), float(logprob)) for top_id, logprob in
                                   zip(sampled.top_ids[position][:request.top_logprobs], sampled.top_logprobs[position][:request.top_logprobs])]
            stop_token, stop_string = token in request.stop_ids, False
            if request.texts and not stop_token:  # a stop token has no text
                step.text[index], stop_string = request.texts[index].push(token)
            if stop_token or stop_string:
                row.finish = STOP
            elif row.generated >= request.max_new_tokens or row.position >= self.spec.max_context:
                row.finish = LENGTH
            if row.finish is not None and request.texts and not stop_string:  # no stop string can complete now
                step.text[index] += request.texts[index].flush()
            step.finished[index] = row.finish
        now = time.perf_counter()
        if request.last_token is None:
            self.metrics.time_to_first_token.labels(**self.labels).observe(now - request.arrived)
        else:
            self.metrics.inter_token_latency.labels(**self.labels).observe(now - request.last_token)
        request.last_token = now
        request.put(step)
        self.metrics.generated_tokens.labels(**self.labels).inc(len(rows))

    def _release(self) -> None:
        """Frees the slots of finished rows, and ends the requests whose rows have all finished (or
        whose client is gone)."""
        still = []
        for request in self.active:
            for row in request.rows:
                if row.finish is not None or request.cancelled:
                    row.slot = None
            if request.cancelled or all(row.finish is not None for row in request.rows):
                request.put(_DONE)
                self.metrics.e2e_latency.labels(**self.labels).observe(time.perf_counter() - request.arrived)
            else:
                still.append(request)
        self.active = still
