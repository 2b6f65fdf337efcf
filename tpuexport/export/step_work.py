"""A paged step's work as a serving engine lays it out: which rows' tokens go into a step
(`plan_step`: decode tokens first, then prefill chunks under the token budget) and the step's index
inputs for them (`step_inputs`). The runtime's session, verification and PT2E calibration drive the
step alike. Apart from paged.py (the step's torch module) because the runtime uses it without torch."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from tpuexport.export.cache_specs import PagedSpec


def plan_step(prompts_left: dict[int, list[int]], decoding: dict[int, int], budget: int, chunk: int | None = None) -> dict[int, list[int]]:
    """One step's work under a token budget: every decoding row's one token first, then prefill
    chunks (at most `chunk` tokens per row, None: as many as the budget leaves) in `prompts_left`'s
    order (a server's: the order it admitted them, oldest first).

    Args:
      prompts_left: {row: its prompt tokens not yet in the cache}; consumed here.
      decoding: {row: its next token} of rows whose prompt is in.
      budget: the step's largest token budget.
    """
    work = {row: [token] for row, token in list(decoding.items())[:budget]}
    room = budget - len(work)
    for row in prompts_left:
        if room <= 0:
            break
        take = min(room, len(prompts_left[row]), chunk or room)
        if take:
            work[row], prompts_left[row] = prompts_left[row][:take], prompts_left[row][take:]
            room -= take
    return work


def step_inputs(spec: PagedSpec, work: dict[int, Sequence[int]], lengths: dict[int, int], pages: dict[int, list[int]], budget: int,
                rows: int) -> tuple[np.ndarray, ...]:
    """The step's index inputs (tokens, positions, token_rows, page_indices, kv_lens; int64) at bucket
    (budget tokens, rows).

    Args:
      work: {row: its new tokens}, laid out in row order (padding tokens, row -1, fill the budget).
      lengths: {row: positions written once this step's tokens are}, for every row holding pages.
      pages: {row: its pages in order}, covering its length.
    """
    tokens, positions, token_rows = np.zeros(budget, np.int64), np.zeros(budget, np.int64), np.full(budget, -1, np.int64)
    start = 0
    for row in sorted(work):
        new = list(work[row])
        end = start + len(new)
        tokens[start:end], positions[start:end], token_rows[start:end] = new, range(lengths[row] - len(new), lengths[row]), row
        start = end
    page_indices = np.zeros((rows, spec.pages_per_row), np.int64)
    kv_lens = np.zeros(rows, np.int64)
    for row, row_pages in pages.items():
        if row < rows:
            page_indices[row, :len(row_pages)] = row_pages
            kv_lens[row] = lengths[row]
    return tokens, positions, token_rows, page_indices, kv_lens
