"""Verification of a paged text-generation program (`--kv-cache paged`): its step, driven as a serving
engine drives it, against Hugging Face `model.generate(do_sample=False)`.

One case per compiled step bucket (token budget T, rows R): up to two prompts of different lengths
(the longer takes at least three chunks, the shorter a third of it) in rows counted from the last
(a prompt's row is not its index), their pages handed out interleaved from one free list. Each step
gives every decoding row its one token first and then prefill chunks of at most T // prompts tokens
per row: the longer prompt is prefilled in chunks smaller than itself while the shorter one already
decodes, in the same steps. Every step runs at the case's bucket (padding tokens fill the budget).

Both CPU runs are teacher-forced with generate()'s tokens and compared with its logits by the rule of
verify/generation.py (logits within the run's tolerances at every step; the argmax is generate()'s
token, or a tie within the logits tolerance): greedy generation over pages equals generate() token
for token. The report and golden data take the form of the static cache's (GenerationReport).

A weight-only step is compared with generate() of the model with its weights rounded as the step
rounds them, and its distance from the float model's generate() measured, as the static cache's
(verify/generation.py: FloatDivergence). A step over an int8 cache (--kv-cache-dtype int8) is compared,
as the static int8 cache is (verify/int8_kv_generation.py), with the same step run eagerly in PyTorch
and driven greedily in the same session steps (its argmax fed back), since generate()'s float cache does
not round as the pages do; its distance from the float model's generate() is measured.

An int8 (PT2E) step is compared the same way with the PT2E-converted step (its int8 rounding modelled
in float) with the int8 tolerances, as an int8 static program is with its PT2E entry points
(verify/quantized_generation.py); every op of the step against the PT2E model's own values at one
calibration step's inputs; its distance from the float model's generate() measured as a weight-only
step's (the SQNR of its logits up to each row's first divergence) for the quantization report.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from tpuexport.lower.generation import cpu_runner
from tpuexport.export.step_work import plan_step
from tpuexport.lower.paged import PagedGenerationProgram, PagedSession
from tpuexport.verify.generation import (DEFAULT_NEW_TOKENS, GenerationCase, GenerationReport, artifact_raised, compare_run, cpu_runs,
                                         eager_generate, float_divergence, store_golden_case, stored_cases)
from tpuexport.verify.int8_kv_generation import INT8_KV_AGAINST
from tpuexport.verify.conformance import check_ops
from tpuexport.verify.quantized_generation import QuantizedGenerationReport, op_sizes, torch_runner
from tpuexport.verify.tolerances import VerificationTolerances, default_tolerances


@dataclasses.dataclass(frozen=True)
class PagedCase(GenerationCase):
    """A GenerationCase of the paged step: sizes {"tokens", "rows"}, `slots` the prompts' rows, and the chunk."""

    chunk: int = 0

    @property
    def label(self) -> str:
        return f"step tokens{self.sizes['tokens']}_rows{self.sizes['rows']} (prefill chunks of {self.chunk}) + {self.new_tokens} tokens"


def plan_case(program: PagedGenerationProgram, sizes: dict[str, int], new_tokens: int, seed: int) -> tuple[list[list[int]], list[int], int, int]:
    """A case's prompts, rows, chunk and new-token count (module docstring).

    Returns:
      (prompts, the row of each, the chunk, new tokens per prompt).
    """
    spec = program.spec
    count = min(sizes["rows"], 2, sizes["tokens"])
    chunk = max(1, sizes["tokens"] // count)
    new_tokens = max(1, min(new_tokens, spec.max_context - 2))
    longest = max(2, min(spec.max_context - new_tokens, 2 * chunk + 3))
    lengths = [longest, max(1, longest // 3)][:count]
    generator = np.random.default_rng(seed)
    prompts = [[int(token) for token in generator.integers(0, spec.vocab, length)] for length in lengths]
    return prompts, [sizes["rows"] - 1 - index for index in range(count)], chunk, new_tokens


def teacher_forced_logits(session: PagedSession, prompts: list[list[int]], rows: list[int], chunk: int, sizes: dict[str, int],
                          eager_tokens: list[list[int]]) -> np.ndarray:
    """The step's logits of every generated position of every prompt, each decode token generate()'s: [prompts, steps, vocab]."""
    return driven_logits(session, prompts, rows, chunk, sizes, len(eager_tokens[0]), lambda prompt, done, logits: eager_tokens[prompt][done - 1])


def greedy_logits(session: PagedSession, prompts: list[list[int]], rows: list[int], chunk: int, sizes: dict[str, int],
                  steps: int) -> tuple[list[list[int]], np.ndarray]:
    """Greedy generation through the session's steps: (each prompt's tokens, the logits [prompts, steps, vocab])."""
    logits = driven_logits(session, prompts, rows, chunk, sizes, steps, lambda prompt, done, logits: int(np.argmax(logits)))
    return [[int(np.argmax(step)) for step in prompt] for prompt in logits], logits


def driven_logits(session: PagedSession, prompts: list[list[int]], rows: list[int], chunk: int, sizes: dict[str, int], steps: int,
                  next_token) -> np.ndarray:
    """The step's logits of `steps` generated positions of every prompt, [prompts, steps, vocab], the
    steps planned as a server plans them (plan_step: decode tokens first, prefill chunks of at most
    `chunk` tokens) at bucket `sizes`; next_token(prompt index, positions generated, their last logits)
    gives each decode token."""
    index = {row: position for position, row in enumerate(rows)}
    prompts_left = {row: list(prompt) for row, prompt in sorted(zip(rows, prompts))}  # chunked in row order
    decoding: dict[int, int] = {}
    collected: dict[int, list[np.ndarray]] = {row: [] for row in rows}
    while prompts_left or decoding:
        work = plan_step(prompts_left, decoding, sizes["tokens"], chunk)
        logits = session.step(work, sizes)
        for row in work:
            if prompts_left.get(row):
                continue
            prompts_left.pop(row, None)
            collected[row].append(np.asarray(logits[row], np.float32))
            done = len(collected[row])
            if done < steps:
                decoding[row] = next_token(index[row], done, collected[row][-1])
            else:
                decoding.pop(row, None)
                session.release(row)
    return np.stack([np.stack(collected[row]) for row in rows])


def teacher_forced_runs(program: PagedGenerationProgram, runs: dict, prompts, rows, chunk: int, sizes: dict[str, int],
                        eager_tokens: list[list[int]]) -> dict[str, np.ndarray]:
    """Each run's teacher_forced_logits in a session of its own (a run whose programs are an earlier run's has its logits)."""
    logits: dict[str, np.ndarray] = {}
    for name, programs in runs.items():
        earlier = next((other for other in logits if all(runs[other][entry] is programs[entry] for entry in programs)), None)
        logits[name] = logits[earlier] if earlier else teacher_forced_logits(PagedSession(program, cpu_runner(program, programs)), prompts,
                                                                               rows, chunk, sizes, eager_tokens)
    return logits


def step_buckets(program: PagedGenerationProgram) -> list[dict[str, int]]:
    """Every compiled step size {"tokens", "rows"}."""
    spec = program.spec
    return [{"tokens": tokens, "rows": rows} for rows in spec.row_buckets for tokens in spec.token_buckets]


def eager_references(program: PagedGenerationProgram, model: torch.nn.Module, new_tokens: int = DEFAULT_NEW_TOKENS,
                     first_seed: int = 0) -> list[list[tuple[list[int], np.ndarray]]]:
    """generate() of every case's prompts (plan_case): per step bucket, per prompt, (new tokens, logits
    [steps, vocab]). Raises what the model raises."""
    references = []
    for number, sizes in enumerate(step_buckets(program)):
        prompts, _, _, steps = plan_case(program, sizes, new_tokens, first_seed + number)
        references.append([eager_generate(model, prompt, steps) for prompt in prompts])
    return references


def verify_paged_generation(program: PagedGenerationProgram, model: torch.nn.Module, tolerances: VerificationTolerances | None = None,
                            new_tokens: int = DEFAULT_NEW_TOKENS,
                            float_reference: list[list[tuple[list[int], np.ndarray]]] | None = None,
                            first_seed: int = 0, eager_step: torch.nn.Module | None = None, against: str = INT8_KV_AGAINST) -> GenerationReport:
    """Generates with the step on CPU, case by case (module docstring), and compares with generate().

    Args:
      program: the paged generation program (with weights).
      model: the causal LM it was captured from (a weight-only program's: computing with the rounded weights).
      tolerances: None for the defaults of the program's precision settings.
      new_tokens: tokens generated per prompt.
      float_reference: a weight-only program's float model generations (eager_references with the same
        first_seed, taken before the weights were rounded): each case then measures its FloatDivergence,
        as verify/generation.py's cases do.
      first_seed: the seed of the first bucket's prompts (each next bucket's is one more).
      eager_step: an int8-cache program's step module (export/paged.py Step over `model`), or an int8
        (PT2E) program's converted step, the reference instead of generate() (module docstring); None
        for generate().
      against: what `eager_step` is (the report's `against`).
    Returns:
      The GenerationReport of PagedCases, passed or not, with golden data.
    """
    step = program.weights_program
    tolerances = tolerances or default_tolerances(step.resolved_precision, step.matmul_precision, quantized=False)
    runs_programs = cpu_runs(program)
    cases, golden = [], {}
    for number, sizes in enumerate(step_buckets(program)):
        prompts, rows, chunk, steps = plan_case(program, sizes, new_tokens, first_seed + number)
        lengths = tuple(len(prompt) for prompt in prompts)
        try:
            if eager_step is None:
                eager = [eager_generate(model, prompt, steps) for prompt in prompts]
                eager_tokens, expected = [tokens for tokens, _ in eager], np.stack([logits for _, logits in eager])
            else:
                eager_tokens, expected = greedy_logits(PagedSession(program, torch_runner({"step": eager_step})), prompts, rows, chunk, sizes, steps)
        except Exception as error:  # the user's model may raise anything
            raised = "eager generate()" if eager_step is None else f"the reference ({against})"
            cases.append(PagedCase(sizes, lengths, tuple(rows), steps, {}, f"{raised} raised {type(error).__name__}: {error}", chunk=chunk))
            continue
        try:
            actual = teacher_forced_runs(program, runs_programs, prompts, rows, chunk, sizes, eager_tokens)
        except Exception as error:  # XLA runtime errors, shape assertions, a session refusal
            cases.append(PagedCase(sizes, lengths, tuple(rows), steps, {}, artifact_raised(error), chunk=chunk))
            continue
        runs = {name: compare_run(logits, expected, eager_tokens, getattr(tolerances, name)) for name, logits in actual.items()}
        divergence = None if float_reference is None else float_divergence(actual["tpu"], eager_tokens, float_reference[number])
        stored = store_golden_case(golden, number, prompts, rows, max(lengths), eager_tokens, expected)
        cases.append(PagedCase(sizes, lengths, tuple(rows), steps, runs, golden=stored, float_divergence=divergence, chunk=chunk))
    report = GenerationReport(step.resolved_precision, step.matmul_precision, tolerances, tuple(cases), golden)
    return report if eager_step is None else dataclasses.replace(report, against=against)


PT2E_AGAINST = "the PT2E-converted step's greedy generation, eager PyTorch"


def verify_quantized_paged_generation(program: PagedGenerationProgram, float_model: torch.nn.Module, reference_step: torch.nn.Module,
                                      tolerances: VerificationTolerances, new_tokens: int,
                                      first_inputs: tuple[torch.Tensor, ...]) -> QuantizedGenerationReport:
    """Verifies an int8 (PT2E) paged program (module docstring).

    Args:
      program: the lowered int8 paged program (with weights).
      float_model: the float Hugging Face causal LM.
      reference_step: the PT2E-converted step module.
      tolerances: the int8 tolerances (default_tolerances(..., quantized=True)).
      new_tokens: tokens generated per prompt.
      first_inputs: one calibration step's inputs (the op-by-op check's).
    """
    float_reference = eager_references(program, float_model, new_tokens)

    def converted_step(*inputs):  # the session's index arrays are the lowered step's int32; the PT2E program's are int64
        return reference_step(*(tensor.long() for tensor in inputs[:5]), *inputs[5:])

    report = verify_paged_generation(program, float_model, tolerances, new_tokens, float_reference, eager_step=converted_step,
                                     against=PT2E_AGAINST)
    divergence = report.float_divergence() or {}
    step = program.entry_points["step"]
    comparison = {
        "rule": "SQNR of the artifact's teacher-forced logits (TPU-faithful run) against the float model's generate() over each "
                "row's steps up to its first divergence; first_divergence: the first step where the float model's greedy token is "
                "not the int8 one (empty: none)",
        "logits": {"sqnr_db": divergence.get("sqnr_db")},
        "first_divergence": [divergence["first"]] if divergence.get("first") else [],
    }
    fields = {field.name: getattr(report, field.name) for field in dataclasses.fields(report)}
    return QuantizedGenerationReport(**fields, float_comparison=comparison,
                                     conformance={"step": check_ops(step.graph, list(first_inputs), op_sizes(step, list(first_inputs)))},
                                     rule=" ".join(__doc__[__doc__.index("An int8 (PT2E) step"):].split()))


def replay_golden(program: PagedGenerationProgram, golden: dict[str, np.ndarray], cases: list[dict],
                  tolerances: VerificationTolerances) -> GenerationReport:
    """Re-runs a paged artifact's stored cases (the gate's check) by the same rule, in both CPU runs."""
    step = program.weights_program
    runs_programs = cpu_runs(program)
    replayed = []
    for case, lengths, prompts, rows, eager_tokens, expected in stored_cases(golden, cases):
        sizes = case["sizes"]
        chunk = max(1, sizes["tokens"] // len(prompts))
        runs, error = {}, None
        try:
            actual = teacher_forced_runs(program, runs_programs, prompts, rows, chunk, sizes, eager_tokens)
            runs = {name: compare_run(logits, expected, eager_tokens, getattr(tolerances, name)) for name, logits in actual.items()}
        except Exception as exception:  # a damaged artifact can raise anything
            error = artifact_raised(exception)
        replayed.append(PagedCase(sizes, tuple(lengths), tuple(rows), len(eager_tokens[0]), runs, error, golden=True, chunk=chunk))
    return GenerationReport(step.resolved_precision, step.matmul_precision, tolerances, tuple(replayed), {},
                            "stored generate() tokens and logits")
