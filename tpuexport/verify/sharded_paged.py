"""Verifying a paged text-generation artifact's slice plans: its step partitioned as for the TPU on N
virtual CPU devices, the pages carried between steps, against the paged verification's eager references.

As sharded_generation.py does for the static cache, one stored case of the paged verification
(paged_generation.py) is replayed, teacher-forced with its stored generate() tokens and compared
with its stored logits by the same rule: the case with the most prompts, then the smallest token
budget (the most steps: the longer prompt prefilled in chunks while the shorter decodes). Its steps
are the ones a session makes (chunks beside decode tokens, pages interleaved from one free list):
a session whose runner records each step's inputs plans them, the child runs them partitioned
(sharded_child.py, the cache donated and carried on the devices), and a session replaying the
child's logits step by step collects them as the single-device verification does.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from tpuexport.compile.hlo import collectives
from tpuexport.compile.sharding import ShardingPlan
from tpuexport.lower.paged import PagedGenerationProgram, PagedSession
from tpuexport.verify.generation import GenerationReport
from tpuexport.verify.paged_generation import PagedCase, teacher_forced_logits
from tpuexport.verify.report import RUNS
from tpuexport.verify.sharded_generation import (ShardedGenerationVerification, _aliased_outputs, compare_runs, raised, run_calls,
                                                 stored_case)


def verify_sharded_paged(program: PagedGenerationProgram, plans: dict[str, ShardingPlan], targets: Sequence[str],
                         report: GenerationReport) -> ShardedGenerationVerification:
    """Replays one verified paged case with the step partitioned by `plans` on CPU devices (module docstring).

    Args:
      program: the paged generation program (with weights).
      plans: {entry point: ShardingPlan} of one slice target.
      targets: the slice targets using these plans (for reports).
      report: the passed paged generation report (its stored cases and tolerances).
    Returns:
      The ShardedGenerationVerification, passed or not.
    Raises:
      TpuExportError: the child process itself failed (not a mismatch).
    """
    start = time.perf_counter()
    chosen = stored_case(report, lambda chosen: (-len(chosen[2]), chosen[0]["sizes"]["tokens"], chosen[0]["sizes"]["rows"]))
    if chosen is None:
        return ShardedGenerationVerification(tuple(targets), plans, None, report.tolerances, {}, {}, (), time.perf_counter() - start,
                                             "no stored generation case to replay")
    manifest_case, lengths, prompts, rows, eager_tokens, expected = chosen
    sizes = manifest_case["sizes"]
    chunk = max(1, sizes["tokens"] // len(prompts))

    def collected(runner) -> np.ndarray:
        return teacher_forced_logits(PagedSession(program, runner), prompts, rows, chunk, sizes, eager_tokens)

    recorded = RecordedSteps(program)
    collected(recorded)
    logits, errors, hlo, resharded = run_calls(program, plans, recorded.calls)
    runs, worst = {}, {}
    error = raised(errors)
    if error is None:
        runs, worst = compare_runs({run: collected(ReplayedSteps(logits.get(run, logits["cpu"]), recorded.cache_count)) for run in RUNS},
                                   expected, eager_tokens, report.tolerances)
    case = PagedCase(sizes, tuple(lengths), tuple(rows), len(eager_tokens[0]), runs, golden=True, chunk=chunk)
    return ShardedGenerationVerification(tuple(targets), plans, case, report.tolerances,
                                         {entry: collectives(text) for entry, text in hlo.items()},
                                         {entry: _aliased_outputs(text) for entry, text in hlo.items()}, tuple(resharded),
                                         time.perf_counter() - start, error, worst)


class RecordedSteps:
    """A session's runner that runs nothing: it records each step's inputs (None for the cache, which
    the child carries) and gives back zero logits and the cache as it came. Teacher forcing makes a
    session's steps independent of the logits, so the recorded steps are the ones a real run makes.

    Attributes:
      calls: [("step", inputs in its signature order)] in order.
    """

    def __init__(self, program: PagedGenerationProgram):
        self.vocab = program.spec.vocab
        self.cache_count = len(program.spec.cache_inputs)
        self.calls: list[tuple[str, list[np.ndarray | None]]] = []

    def __call__(self, entry: str, inputs: list) -> list:
        indices = inputs[:-self.cache_count]
        self.calls.append((entry, [*indices, *[None] * self.cache_count]))
        rows = indices[3].shape[0]  # page_indices: [rows, pages per row]
        return [np.zeros((rows, self.vocab), np.float32), *inputs[-self.cache_count:]]


class ReplayedSteps:
    """A session's runner that gives back the logits of recorded steps, in order, with the cache as it came."""

    def __init__(self, logits: list[np.ndarray], cache_count: int):
        self.logits = iter(logits)
        self.cache_count = cache_count

    def __call__(self, entry: str, inputs: list) -> list:
        return [next(self.logits), *inputs[-self.cache_count:]]
