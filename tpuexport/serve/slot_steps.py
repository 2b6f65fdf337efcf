"""What runs each step for a static KV cache (`--kv-cache static`): a request's rows take cache slots,
are filled by prefill (or an encoder-decoder's encode) when admitted, and one decode step advances
every slot. The requests, streams, stops and metrics around it are serve/generation.py's scheduler's;
serve/paged_steps.py is the paged cache's counterpart.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from tpuexport.errors import TpuExportError
from tpuexport.lower.sampling import Draw
from tpuexport.runtime import Runner
from tpuexport.serve.metrics import Metrics


class SlotSteps:
    """Slots, prefill and decode (module docstring).

    Args:
      runner: the model's runtime (a static text-generation artifact's executables).
      metrics: where decode steps are counted.
      labels: {"model", "version"} metric labels.
    """

    def __init__(self, runner: Runner, metrics: Metrics, labels: dict[str, str]):
        self.runner = runner
        self.program = runner.generation_program
        # The batches the cache's slots are filled at (prefill's, or an encoder-decoder's encode's).
        self.fill_batches = self.program.fill_batches
        self.metrics = metrics
        self.labels = labels
        self.reset()

    def reset(self) -> None:
        """A fresh cache (after a failed step)."""
        self.session = self.program.session(runner=self.runner.device_runner())

    def check(self, sources: list, max_new_tokens: int) -> None:
        """Raises TpuExportError when no compiled fill batch can ever take the request's rows."""
        if self._fill_batch(len(sources), self.program.spec.max_batch) is None:
            raise TpuExportError(f"{len(sources)} prompts fit no compiled batch ({list(self.fill_batches)}) and batch 1 "
                                 "is not compiled; send as many prompts as a compiled batch, or convert with --bucket batch=1,...")

    def admit(self, request, free: list[int]) -> bool:
        """Gives the request's rows free slots if a fill batch fits them now."""
        batch = self._fill_batch(len(request.sources), len(free))
        if batch is None:
            return False
        for row, slot in zip(request.rows, free):
            row.slot = slot
        request.fill_batch = batch
        return True

    def release(self, slot: int) -> None:
        """Nothing to give back: a slot is free once no row holds it (the next fill overwrites it)."""

    def gauges(self) -> None:
        """Slots are the scheduler's gauge; nothing more to report."""

    def _fill_batch(self, rows: int, free: int) -> int | None:
        """The batch to fill the slots of `rows` prompts at with `free` slots: the smallest compiled
        batch that holds them and fits the free slots (its padding rows go there), else 1 (one
        prompt at a time) when compiled and the prompts fit; None: not now."""
        fitting = [batch for batch in self.fill_batches if rows <= batch <= free]
        if fitting:
            return min(fitting)
        return 1 if 1 in self.fill_batches and rows <= free else None

    def start(self, request, free: list[int], emit: Callable) -> None:
        """Fills the request's slots from its sources: prefill, whose logits give the first tokens
        (drawn on the device and handed to the request), or an encoder-decoder's encode, after which
        its rows decode from the decoder start token at position 0. `free`: the slots no row holds."""
        sources, slots = request.sources, [row.slot for row in request.rows]
        draws = [request.draw(row) for row in request.rows]
        if request.fill_batch >= len(sources):
            # Padding rows (one token each, or silent features) go to free slots, which their occupant's fill overwrites.
            padding = free[:request.fill_batch - len(sources)]
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
            emit(request, {row: (fill.sampled, index) for row, (fill, index) in enumerate(real)})

    def step(self, active: list, emit: Callable) -> None:
        """One decode step of every slot (idle ones decode token 0 at position 0, which nothing
        reads), then the sample step over its logits; each active request gets its rows' tokens."""
        max_batch = self.program.spec.max_batch
        tokens = np.zeros(max_batch, np.int64)
        positions = np.zeros(max_batch, np.int64)
        draws: list[Draw | None] = [None] * max_batch
        generating = [(request, index, row) for request in active for index, row in enumerate(request.rows)
                      if row.slot is not None and row.finish is None]
        for request, _, row in generating:
            tokens[row.slot], positions[row.slot], draws[row.slot] = row.token, row.position, request.draw(row)
        logits = self.session.decode(tokens, positions)
        sampled = self.session.sample(logits, draws, any(request.top_logprobs for request, _, _ in generating))
        self.metrics.decode_rows.labels(**self.labels).observe(len(generating))
        by_request: dict[int, dict] = {}
        for request, index, row in generating:
            row.position += 1  # the drawn token goes after the one just decoded
            by_request.setdefault(id(request), {})[index] = (sampled, row.slot)
        for request in active:
            if id(request) in by_request:
                emit(request, by_request[id(request)])
