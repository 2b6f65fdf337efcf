"""Continuous batching of generate requests: every request of a text-generation model shares one KV
cache, and each step advances every running row.

One `GenerationScheduler` thread per served text-generation model loops:
  1. admits waiting requests, oldest first, while the cache takes them (one that does not fit waits,
     and so do those behind it); each row gets a slot of the cache (a static cache's slot, a paged
     cache's row of the step);
  2. runs one step of the running rows and hands each request its rows' new tokens, drawn by the
     sample entry point on the device (only the tokens and their logprobs come to the host);
  3. ends the rows that are done: a stop token (an EOS), a stop string (its TextRow), max tokens,
     or max context; a finished row frees its slot at once, a request ends with its last row (or
     when its client is gone).
What a step runs is the cache's policy, chosen by the artifact's entry points:
  - serve/slot_steps.py (prefill and decode entry points, a static cache): an admitted request's
    prompts are prefilled into its slots (its first tokens drawn from the prefill's logits; an
    encoder-decoder's sources are encoded instead), then one decode step runs every slot;
  - serve/paged_steps.py (a `step` entry point, a paged cache): admission by free pages, and each
    step mixes the running rows' decode tokens with chunks of the prompts still prefilling.
A request therefore joins the running batch between two steps instead of waiting for the others to
finish; its tokens are the ones it would get alone (rows do not interact: the same executables,
each row attending to its own slot or pages only, each row's draws keyed by its seed and the index
of the token drawn, not by its slot). A failing step fails the requests it ran (their clients get
the error) and the loop goes on with a fresh cache.

Metrics (serve/metrics.py): time to first token, inter-token latency, end-to-end latency and queue
time per request; requests running and waiting, cache slots in use (a paged cache: pages in use and
free, cached pages, prefix cache queries and hits, and its steps' prefill and decode tokens); prompt
and generated tokens.
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
from tpuexport.serve.paged_steps import PagedSteps
from tpuexport.serve.slot_steps import SlotSteps
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
    """One row of a request: its slot while it generates, the token and position of its next decode step,
    and the prompt tokens whose keys and values it took from the prefix cache at admission (not prefilled)."""

    slot: int | None = None
    token: int = 0
    position: int = 0
    generated: int = 0
    finish: str | None = None
    cached_tokens: int = 0


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

    @property
    def cached_tokens(self) -> int:
        """The request's prompt tokens found in the prefix cache (final once its first step arrived)."""
        return sum(row.cached_tokens for row in self.request.rows)


class GenerationScheduler:
    """Runs a text-generation model's generate requests with continuous batching (module docstring).

    Args:
      runner: the model's runtime (a text-generation artifact's executables).
      metrics: where steps, tokens and latencies are counted.
      labels: {"model", "version"} metric labels.
      prefix_caching: a paged cache shares the full pages of identical prompt prefixes between rows
        (serve/paged_steps.py); a static cache has none.
    """

    def __init__(self, runner: Runner, metrics: Metrics, labels: dict[str, str], prefix_caching: bool = True):
        self.runner = runner
        self.program = runner.generation_program
        self.spec = self.program.spec
        self.metrics = metrics
        self.labels = labels
        # What runs each step: a paged program's one step entry point, else prefill (or encode) and decode over slots.
        self.steps = (PagedSteps(runner, metrics, labels, prefix_caching) if "step" in self.program.entry_points
                      else SlotSteps(runner, metrics, labels))
        self.waiting: collections.deque[_Request] = collections.deque()
        self.active: list[_Request] = []
        self.closed = False
        self.wake = threading.Condition()
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
            lower/seq2seq.check_sources; the policy's `check`: no compiled batch holds them, or
            more pages than the cache has), or of the other kind than the model's sources.
          ShuttingDown: after `close`.
        """
        sources = self._sources(rows, kind)
        self.program.check_rows(sources, max_new_tokens, SERVE_FEATURES_USAGE)
        self.steps.check(sources, max_new_tokens)
        request = _Request(sources, max_new_tokens, sampling, frozenset(stop_ids), top_logprobs, list(texts) if texts else None,
                           rows=[_Row() for _ in sources], keys=sampling.row_keys(len(sources)))
        with self.wake:
            if self.closed:
                raise ShuttingDown("the server is shutting down; retry on another replica")
            self.waiting.append(request)
            # Only the queue's gauge: the cache's are the scheduler thread's to read (it changes them outside the lock).
            self.metrics.requests_waiting.labels(**self.labels).set(len(self.waiting))
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
                    self.steps.start(request, self._free_slots(), self._emit)
                self._release()
                if self.active:
                    self.steps.step(self.active, self._emit)
                self._release()
            except Exception as error:  # the requests that ran fail; the next ones get a fresh cache
                for request in self.active:
                    request.put(error)
                self.active = []
                self.steps.reset()
            with self.wake:
                self._gauges()

    def _gauges(self) -> None:
        labels = self.labels
        self.metrics.requests_running.labels(**labels).set(len(self.active))
        self.metrics.requests_waiting.labels(**labels).set(len(self.waiting))
        self.metrics.cache_slots_used.labels(**labels).set(self.spec.max_batch - len(self._free_slots()))
        self.steps.gauges()

    def _admissible(self) -> list[_Request]:
        """The waiting requests that the cache takes now (the policy's `admit`), oldest first (one
        that does not fit waits, and so do those behind it: no request is starved by smaller ones);
        they become active."""
        admitted = []
        while self.waiting:
            request = self.waiting[0]
            if request.cancelled:
                self.waiting.popleft()
                continue
            if not self.steps.admit(request, self._free_slots()):
                break
            self.waiting.popleft()
            self.active.append(request)
            admitted.append(request)
            self.metrics.queue_time.labels(**self.labels).observe(time.perf_counter() - request.arrived)
            if self.source_kind == PROMPTS:
                self.metrics.prompt_tokens.labels(**self.labels).inc(sum(len(row) for row in request.sources))
        return admitted

    def _free_slots(self) -> list[int]:
        used = {row.slot for request in self.active for row in request.rows if row.slot is not None}
        return [slot for slot in range(self.spec.max_batch) if slot not in used]

    def _emit(self, request: _Request, rows: dict[int, tuple[SampledTokens, int]]) -> None:
        """Hands a request its rows' new tokens ({row index: (the sample step's result, the row's
        index in it)}) and finishes the rows that are done. Each row's `position` is already where
        its new token goes (the policy set it)."""
        count = len(request.rows)
        step = Step([None] * count, [None] * count, [None] * count, [None] * count, [""] * count if request.texts else [None] * count)
        for index, (sampled, position) in rows.items():
            row, token = request.rows[index], int(sampled.tokens[position])
            row.generated += 1
            row.token = token
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
        """Frees the slots (and the policy's hold, e.g. pages) of finished rows, and ends the
        requests whose rows have all finished (or whose client is gone)."""
        still = []
        for request in self.active:
            for row in request.rows:
                if (row.finish is not None or request.cancelled) and row.slot is not None:
                    self.steps.release(row.slot)
                    row.slot = None
            if request.cancelled or all(row.finish is not None for row in request.rows):
                request.put(_DONE)
                self.metrics.e2e_latency.labels(**self.labels).observe(time.perf_counter() - request.arrived)
            else:
                still.append(request)
        self.active = still
