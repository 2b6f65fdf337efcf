"""What runs each step for a paged KV cache (`--kv-cache paged`): one `step` entry point that mixes the
running rows' decode tokens with chunks of newly admitted prompts under the step's token budget. The
requests, streams, stops and metrics around it are serve/generation.py's scheduler's;
serve/slot_steps.py is the static cache's counterpart.

Admission reserves pages: a request is admitted (oldest first) when it has a free row of the step
for each of its rows and the pages no running row holds or has reserved cover each row's worst case,
its prompt plus max tokens less one (the last token drawn is never written; at most max context). The session hands the pages out only as a row's
positions are written and the row gives them all back when it ends (an early stop frees its unused
reservation too), so a running row never finds the cache full; the price is that a request asking
for many more tokens than it generates holds pages it never writes until it ends. A request that
needs more pages than the cache has is refused at submit (HTTP 400).

Prefix caching (on unless `tpuexport serve --no-prefix-caching`; serve/prefix_cache.py): a row whose
prompt begins with full pages that another row wrote (running, or ended and its pages still cached)
starts over those pages and prefills from the first page it does not find; admission counts the pages
it finds as not needing a page of their own (a cached page it takes back counts against the free
ones, since it can no longer be handed out). Rows share only full pages, which nobody writes again, so
a row's tokens are those it gets without the cache (up to the floating-point rounding of a position
computed in another chunk of the step).

Each step (export/step_work.plan_step) takes one decode token of every running row first (more rows than
the largest token budget holds take turns, the longest waiting first), then fills the budget with the
next chunks of the prompts still prefilling, oldest first: a prompt longer than the budget is
prefilled over several steps while the other rows keep decoding.
Rows whose prompt is complete after the step (and the decoding rows) draw their next token from
the step's logits with the sample entry point on the device, keyed per request row and token index
as for a static cache, so a request's tokens do not depend on what else runs.
"""

from __future__ import annotations

import math
from typing import Callable

from tpuexport.errors import TpuExportError
from tpuexport.export.step_work import plan_step
from tpuexport.runtime import Runner
from tpuexport.serve.metrics import Metrics
from tpuexport.serve.prefix_cache import ROOT_KEY, PrefixCache, page_keys


class PagedSteps:
    """Rows of the step, pages and chunked prefill (module docstring).

    Args:
      runner: the model's runtime (a paged text-generation artifact's executables).
      metrics: where steps, their tokens and the pages are counted.
      labels: {"model", "version"} metric labels.
      prefix_caching: share full pages of identical prefixes between rows (module docstring).
    """

    def __init__(self, runner: Runner, metrics: Metrics, labels: dict[str, str], prefix_caching: bool = True):
        self.runner = runner
        self.program = runner.generation_program
        self.spec = self.program.spec
        self.metrics = metrics
        self.labels = labels
        self.prefix_caching = prefix_caching
        self.reset()

    def reset(self) -> None:
        """A fresh cache (after a failed step): every page free, nothing reserved, prefilling or cached."""
        self.prefix_cache = PrefixCache(self.spec.num_pages, self.spec.page_size) if self.prefix_caching else None
        self.session = self.program.session(runner=self.runner.device_runner(), pool=self.prefix_cache)
        self.reserved: dict[int, int] = {}  # {row of the step: the pages its page table can reach, its worst case}
        # Prefix caching: {row: its tokens in the cache}, {row: the chain keys of its full pages so far}.
        self.written: dict[int, list[int]] = {}
        self.page_keys: dict[int, list[bytes]] = {}
        self.prompts_left: dict[int, list[int]] = {}  # {row: prompt tokens not yet in the cache}, oldest first
        self.steps_run = 0
        self.last_run: dict[int, int] = {}  # {row: the step it last ran in}: decode tokens beyond the budget take turns

    def pages_for(self, prompt: list, max_new_tokens: int) -> int:
        """The pages a row can write: its prompt and every token it generates but the last, within max context."""
        return math.ceil(min(len(prompt) + max_new_tokens - 1, self.spec.max_context) / self.spec.page_size)

    def check(self, sources: list, max_new_tokens: int) -> None:
        """Raises TpuExportError when the request's rows need more pages than the whole cache has."""
        needed = sum(self.pages_for(source, max_new_tokens) for source in sources)
        if needed > self.spec.num_pages:
            raise TpuExportError(f"{len(sources)} prompt(s) with max tokens {max_new_tokens} need {needed} pages of {self.spec.page_size} "
                                 f"positions and the KV cache has {self.spec.num_pages}; send fewer prompts or ask for fewer tokens")

    @property
    def free_pages(self) -> int:
        """Pages that no running row holds and that no running row's reservation will take: what
        admission takes from (the pool's free and cached pages, less the pages the running rows
        may still add to their page tables)."""
        pending = sum(pages - len(self.session.pages.get(slot, ())) for slot, pages in self.reserved.items())
        return self.session.pool.available() - pending

    def admit(self, request, free: list[int]) -> bool:
        """Gives the request's rows free rows of the step and reserves their pages, if both suffice now;
        each row starts over the cached pages of its prompt's prefix (with prefix caching)."""
        if len(free) < len(request.rows):
            return False
        found = [self.prefix_cache.lookup(source) if self.prefix_cache is not None else ([], []) for source in request.sources]
        needed = [self.pages_for(source, request.max_new_tokens) - len(pages) for source, (pages, _) in zip(request.sources, found)]
        taken_back = self.prefix_cache.taking([page for pages, _ in found for page in pages]) if self.prefix_cache is not None else 0
        if sum(needed) > self.free_pages - taken_back:
            return False
        for row, slot, source, (pages, keys) in zip(request.rows, free, request.sources, found):
            row.slot = slot
            self.reserved[slot] = self.pages_for(source, request.max_new_tokens)
            cached = row.cached_tokens = len(pages) * self.spec.page_size
            self.prompts_left[slot] = list(source[cached:])
            if self.prefix_cache is not None:
                self.prefix_cache.hold(pages)
                self.session.start_row(slot, pages, cached)
                self.written[slot], self.page_keys[slot] = list(source[:cached]), keys
                self.metrics.prefix_cache_queries.labels(**self.labels).inc(len(source))
                self.metrics.prefix_cache_hits.labels(**self.labels).inc(cached)
        return True

    def release(self, slot: int) -> None:
        """The row ended: its pages go back to the pool (free, or cached under their keys) and its reservation ends."""
        self.session.release(slot)
        for held in (self.reserved, self.prompts_left, self.last_run, self.written, self.page_keys):
            held.pop(slot, None)

    def gauges(self) -> None:
        """Pages in use, free (what admission takes from) and cached (prefix caching)."""
        self.metrics.kv_cache_pages_used.labels(**self.labels).set(self.spec.num_pages - self.session.pool.available())
        self.metrics.kv_cache_pages_free.labels(**self.labels).set(self.free_pages)
        self.metrics.kv_cache_pages_cached.labels(**self.labels).set(len(self.prefix_cache.cached) if self.prefix_cache is not None else 0)

    def _register(self, work: dict[int, list[int]]) -> None:
        """After a step: the pages its rows filled become shareable under their chain keys."""
        size = self.spec.page_size
        for slot, tokens in work.items():
            written, keys = self.written[slot], self.page_keys[slot]
            written.extend(tokens)
            full = len(written) // size
            if full > len(keys):
                new = page_keys(written[len(keys) * size:full * size], size, keys[-1] if keys else ROOT_KEY)
                for page, key in zip(self.session.pages[slot][len(keys):full], new):
                    self.prefix_cache.register(page, key)
                keys.extend(new)

    def start(self, request, free: list[int], emit: Callable) -> None:
        """Nothing runs at admission: the prompt's chunks go into the next steps."""

    def step(self, active: list, emit: Callable) -> None:
        """One step: the running rows' decode tokens and the next prompt chunks (module docstring),
        then the sample step for the rows that draw a token; each request gets its rows' tokens."""
        rows = {row.slot: (request, index, row) for request in active for index, row in enumerate(request.rows)
                if row.slot is not None and row.finish is None}
        longest_waiting = sorted((slot for slot in rows if slot not in self.prompts_left), key=lambda slot: self.last_run.get(slot, -1))
        decoding = {slot: rows[slot][2].token for slot in longest_waiting}
        work = plan_step(self.prompts_left, decoding, self.spec.token_buckets[-1])
        logits = self.session.step_logits(work)
        if self.prefix_cache is not None:
            self._register(work)
        self.steps_run += 1
        self.last_run.update(dict.fromkeys(work, self.steps_run))
        decoded = sum(slot in decoding for slot in work)
        self.metrics.step_tokens.labels(**self.labels, kind="decode").inc(decoded)
        self.metrics.step_tokens.labels(**self.labels, kind="prefill").inc(sum(map(len, work.values())) - decoded)
        drawing = sorted(slot for slot in work if not self.prompts_left.get(slot))  # decoding rows and prompts now complete
        for slot in drawing:
            self.prompts_left.pop(slot, None)
        if not drawing:  # a step of prefill chunks only draws nothing
            return
        draws = [None] * (drawing[-1] + 1)
        for slot in drawing:
            request, _, row = rows[slot]
            draws[slot] = request.draw(row)
        sampled = self.session.sample(logits, draws, any(rows[slot][0].top_logprobs for slot in drawing))
        self.metrics.decode_rows.labels(**self.labels).observe(len(drawing))
        by_request: dict[int, tuple] = {}
        for slot in drawing:
            request, index, row = rows[slot]
            row.position = self.session.lengths[slot]  # where the drawn token goes
            by_request.setdefault(id(request), (request, {}))[1][index] = (sampled, slot)
        for request, tokens in by_request.values():
            emit(request, tokens)
