"""A paged text-generation program (`--kv-cache paged`): its step and sample entry points over one set of
weights and one cache of pages, and a session that drives them on CPU: pages handed to rows as they
grow, prompts prefilled in chunks within a step's token budget beside other rows' decode tokens.

The session's page handling is what a driver needs to generate and verify, not a scheduler: rows are
the caller's, pages come from a free list in the order rows need them (so rows' pages interleave) and
go back when a row is released. A server hands the session its own page pool instead (serve/
prefix_cache.py: pages shared between rows whose prompts begin alike), and starts a row over pages
that already hold its prefix (`PagedSession.start_row`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Collection, Iterator, Sequence

import jax.numpy as jnp
import numpy as np

from tpuexport.errors import TpuExportError
from tpuexport.export.cache_specs import PAGES_DIM, PagedSpec
from tpuexport.export.step_work import plan_step, step_inputs
from tpuexport.lower.generation import Runner, check_token_rows, cpu_runner
from tpuexport.lower.lowered import LoweredProgram
from tpuexport.lower.program import EntryPoints
from tpuexport.lower.registry import register_lowering
from tpuexport.lower.sampling import GREEDY, Draw, SampledTokens, Sampling, draw_tokens


@register_lowering("tpuexport::write_pages")
def write_pages(cache, new, layer: int, slots):
    """export/paged.py's `write_pages` as one scatter of the step's [tokens, 2 * kv_heads * head_dim]
    into the layer's pages, in place on the donated cache; a padding token's slot (< 0) is sent past
    the last page, whose update the scatter drops."""
    pages, page_size = cache.shape[1], cache.shape[2]
    flat = jnp.where(slots >= 0, slots, pages * page_size)
    return cache.at[layer, flat // page_size, flat % page_size].set(new.astype(cache.dtype), mode="drop")


@dataclasses.dataclass(frozen=True)
class PagedGenerationProgram(EntryPoints):
    """The lowering stage's result for a decoder with `--kv-cache paged`.

    Attributes:
      spec: the pages and their limits (export/paged.py).
      entry_points: {"step": LoweredProgram, "sample": LoweredProgram}, the same weights (sample reads none).
    """

    spec: PagedSpec
    entry_points: dict[str, LoweredProgram]

    fill_entry_point = "step"
    source_kind = "tokens"

    @property
    def weights_program(self) -> LoweredProgram:
        return self.entry_points["step"]

    @property
    def state_inputs(self) -> tuple[str, ...]:
        return self.spec.cache_inputs

    @property
    def state_sizes(self) -> dict[str, int]:
        return {PAGES_DIM: self.spec.num_pages}

    def manifest_section(self) -> dict:
        """The manifest's "generation" section (kind "paged")."""
        return {**self.spec.to_json(), "cache_inputs": list(self.spec.cache_inputs), "cache_bytes": self.spec.cache_bytes}

    @classmethod
    def from_manifest(cls, generation: dict, entry_points: dict[str, LoweredProgram]) -> "PagedGenerationProgram":
        return cls(PagedSpec.from_json(generation), entry_points)

    def at_pages(self, num_pages: int) -> "PagedGenerationProgram":
        """The program over a cache of `num_pages` pages (a target's executables' count: its step buckets' "pages")."""
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, num_pages=num_pages))

    def session(self, runner: Runner | None = None, pool=None) -> "PagedSession":
        return PagedSession(self, runner, pool)

    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, runner: Runner | None = None, sampling: Sampling = GREEDY,
               stop_ids: Collection[int] = ()) -> Iterator[list[int | None]]:
        """Generation in a fresh session (stream_paged), on CPU or through `runner`."""
        return stream_paged(PagedSession(self, runner), prompts, max_new_tokens, sampling, stop_ids)

    @property
    def longest_row(self) -> int:
        """The longest prompt it takes: one position short of max context (room for a generated token)."""
        return self.spec.max_context - 1

    def check_rows(self, rows: Sequence[Sequence[int]], max_new_tokens: int, features_usage: str = "") -> None:
        spec = self.spec
        check_token_rows(rows, max_new_tokens, "prompt", spec.max_batch, self.longest_row,
                         lambda length: (f"a prompt of {length} tokens leaves no room in max context {spec.max_context}; shorten it or "
                                         "convert with a larger --max-context"), spec.vocab)


class FreePages:
    """The session's page pool by default: one free list, handed out from the end (a row's pages are
    not in order, and rows' pages interleave). serve/prefix_cache.PrefixCache is the other pool.

    Attributes:
      free: the pages no row holds.
    """

    def __init__(self, num_pages: int):
        self.free = list(range(num_pages))

    def available(self) -> int:
        """Pages `take` can hand out."""
        return len(self.free)

    def take(self) -> int:
        """A page for a row to write (available() > 0)."""
        return self.free.pop()

    def give_back(self, pages: list[int]) -> None:
        """A released row's pages, in its order."""
        self.free.extend(reversed(pages))


class PagedSession:
    """The pages, the rows' page tables and the step that appends to them.

    Attributes:
      program: the paged program.
      cache: (cache_kv,) as numpy arrays (or a runtime's device arrays).
      pool: where rows' pages come from and go back to (FreePages unless the caller gives its own).
      lengths: {row: positions written}; pages: {row: its pages in order}.
    """

    def __init__(self, program: PagedGenerationProgram, runner: Runner | None = None, pool=None):
        self.program = program
        self.run = runner or cpu_runner(program)
        spec = program.spec
        inputs = program.entry_points["step"].signature.inputs
        self.index_dtypes = [tensor.dtype for tensor in inputs[:5]]
        self.cache = tuple(np.zeros(shape, tensor.dtype) for (shape, _), tensor in zip(spec.cache_tensors().values(), inputs[5:], strict=True))
        self.pool = pool or FreePages(spec.num_pages)
        self.pages: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def start_row(self, row: int, pages: list[int], length: int) -> None:
        """Row `row` (not running) starts over `pages`, whose first `length` positions already hold its
        prefix (a prefix cache's full pages, which the row must not write: its first step writes
        position `length` on), as if it had written them."""
        if self.pages.get(row) or length > len(pages) * self.program.spec.page_size:
            raise TpuExportError(f"row {row} cannot start at position {length} over {len(pages)} page(s) of "
                                 f"{self.program.spec.page_size} (it is running, or the pages are too few)")
        self.pages[row], self.lengths[row] = list(pages), length

    def release(self, row: int) -> None:
        """Gives the row's pages back (its request ended)."""
        self.pool.give_back(self.pages.pop(row, []))
        self.lengths.pop(row, None)

    def _grow(self, row: int, length: int) -> None:
        spec = self.program.spec
        needed = math.ceil(length / spec.page_size) - len(self.pages.setdefault(row, []))
        if needed > self.pool.available():
            raise TpuExportError(f"row {row} needs {needed} more page(s) of {spec.page_size} positions and {self.pool.available()} are free "
                                 f"(--num-pages {spec.num_pages}); end a request or convert with more pages")
        for _ in range(max(0, needed)):
            self.pages[row].append(self.pool.take())

    def step(self, work: dict[int, Sequence[int]], sizes: dict[str, int] | None = None) -> dict[int, np.ndarray]:
        """One step (`step_logits`): {row: the logits [vocab] after its last new token}."""
        logits = self.step_logits(work, sizes)
        return {row: logits[row] for row in work}

    def step_logits(self, work: dict[int, Sequence[int]], sizes: dict[str, int] | None = None):
        """One step: each row's new tokens appended after its written positions.

        Args:
          work: {row (0..max_batch-1): its new tokens (a prefill chunk or one decode token)}.
          sizes: the compiled bucket {"tokens", "rows"} to run at; None for the smallest that holds the work.
        Returns:
          The step's logits [bucket rows, vocab] as the runner gives them (on the device through a
          runtime: `sample` takes them there); row r's are those after its last new token.
        Raises:
          TpuExportError: more tokens than the largest token budget, a row past max context or
            max batch, or no free page.
        """
        spec = self.program.spec
        count = sum(len(tokens) for tokens in work.values())
        if any(not 0 <= row < spec.max_batch for row in work):
            raise TpuExportError(f"rows {sorted(work)} must be within 0..{spec.max_batch - 1} (--max-batch {spec.max_batch})")
        fitting = [size for size in spec.token_buckets if size >= count and (sizes is None or size == sizes["tokens"])]
        rows_fitting = [size for size in spec.row_buckets if size > max(work) and (sizes is None or size == sizes["rows"])]
        if not fitting or not rows_fitting:
            raise TpuExportError(f"a step of {count} tokens in rows up to {max(work)} fits no compiled bucket "
                                 f"{sizes or ''} (token budgets {list(spec.token_buckets)}, rows {list(spec.row_buckets)})")
        budget, rows = fitting[0], rows_fitting[0]
        for row in sorted(work):
            first = self.lengths.get(row, 0)
            if first + len(work[row]) > spec.max_context:
                raise TpuExportError(f"row {row} would reach {first + len(work[row])} positions, past max context {spec.max_context}")
            self._grow(row, first + len(work[row]))
            self.lengths[row] = first + len(work[row])
        inputs = step_inputs(spec, work, self.lengths, self.pages, budget, rows)
        arrays = [array.astype(dtype) for array, dtype in zip(inputs, self.index_dtypes)]
        logits, *cache = self.run("step", [*arrays, *self.cache])
        self.cache = tuple(cache)
        return logits

    def sample(self, logits, draws: Sequence[Draw | None], top: bool = False) -> SampledTokens:
        """The next token of the first len(draws) rows of a step's logits (lower/sampling.draw_tokens)."""
        return draw_tokens(self.run, self.program.entry_points, logits, draws, top)


def stream_paged(session: PagedSession, rows: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling = GREEDY,
                 stop_ids: Collection[int] = (), chunk: int | None = None) -> Iterator[list[int | None]]:
    """Generation over pages: each step fills the largest token budget with the running rows' decode
    tokens and the next chunks of the prompts still prefilling (plan_step); yields, per step that
    generates a token, each row's new token, None for a row without one (still prefilling, or
    finished: it reached max context, or drew one of `stop_ids`, yielded then no more). Row i is
    prompt i.
    """
    program = session.program
    program.check_rows(rows, max_new_tokens)
    spec = program.spec
    keys = sampling.row_keys(len(rows))
    prompts_left = {row: list(prompt) for row, prompt in enumerate(rows)}
    decoding: dict[int, int] = {}
    generated = [0] * len(rows)
    budget = spec.token_buckets[-1]
    while prompts_left or decoding:
        work = plan_step(prompts_left, decoding, budget, chunk)
        logits = session.step_logits(work)  # stays where the runner left it: the sample step takes its rows there
        ready = sorted(row for row in work if not prompts_left.get(row))  # decode rows and prompts now complete
        for row in ready:
            prompts_left.pop(row, None)
        if not ready:  # a step of prefill chunks alone generates nothing
            continue
        draws: list[Draw | None] = [None] * (ready[-1] + 1)
        for row in ready:
            draws[row] = Draw(sampling, keys[row], generated[row])
        sampled = session.sample(logits, draws)
        new = {row: int(sampled.tokens[row]) for row in ready}
        yield [new.get(row) for row in range(len(rows))]
        for row, token in new.items():
            generated[row] += 1
            if token in stop_ids or generated[row] >= max_new_tokens or session.lengths[row] >= spec.max_context:
                decoding.pop(row, None)
                session.release(row)
            else:
                decoding[row] = token
