"""Verification that generation works: the artifact's prefill and decode, driven as a serving
engine drives them, against Hugging Face `model.generate(do_sample=False)`.

One case per compiled prefill bucket (batch b, prompt length seq): b prompts of different lengths
(the shortest a quarter of the longest, the longest filling the bucket where the context leaves
room for the new tokens), right-padded to seq, prefilled into cache slots in reverse order (a
slot is not its row), then N decode steps at max_batch, every row at its own position, the other
slots idle. The eager reference generates each prompt alone, unpadded, greedily, and returns its
raw logits of every step.

Both CPU runs (TPU-faithful and plain f32, tolerances.py) are teacher-forced: each decode step is
fed the eager model's token, so that one near-tie flip does not change every later step. Per run:

  logits   every step's logits of every row within the run's float tolerances (compare.py);
  tokens   at every step, the artifact's argmax is the eager token. Under teacher forcing that is
           exactly "free-running greedy generation by the artifact equals generate token for
           token": the first step where they differ is the first step where the argmaxes differ.
           A differing argmax is a TIE, reported and not a failure, when the eager logits of the
           two tokens are within the logits tolerance of each other (atol + rtol * |eager logit| +
           scale_tol * rms(eager logits of that step)): rounding decides such a pair, and the
           logits check bounds the numbers either way. Any other difference fails.

A weight-only artifact is verified against generate() of the model with its weights rounded as the
artifact rounds them (that is what it computes). How far that moves generation from the float
model is measured, not gated (FloatDivergence): the first step where greedy generation with the
rounded weights leaves the float model's, and the SQNR of the artifact's logits (TPU-faithful run)
against the float model's over the steps before it, where both saw the same tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import jax
import numpy as np
import torch

from tpuexport.lower.generation import GenerationProgram, GenerationSession, cpu_runner
from tpuexport.lower.matmul_precision import MATMUL_PRECISIONS
from tpuexport.lower.program import EntryPoints
from tpuexport.memory import return_freed_memory
from tpuexport.verify.compare import OutputComparison, Tolerances, compare_output, sqnr_db
from tpuexport.verify.report import RUNS, summary_section, tpu_arithmetic_hint
from tpuexport.verify.sizes import MAX_FILL_TEMPORARY_BYTES
from tpuexport.verify.tolerances import VerificationTolerances, default_tolerances
from tpuexport.verify.topk_ties import TiesToLowestIndex
from tpuexport.verify.tpu_numerics import tpu_faithful

DEFAULT_NEW_TOKENS = 8
MAX_GOLDEN_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class TokenDifference:
    """A step where the artifact's argmax is not the eager token.

    Attributes:
      row, step: where (step 0 is prefill's token).
      eager, artifact: the two token ids.
      gap: eager logit of the eager token minus eager logit of the artifact's token.
      margin: the logits tolerance at that step; gap <= margin is a tie.
    """

    row: int
    step: int
    eager: int
    artifact: int
    gap: float
    margin: float

    @property
    def tie(self) -> bool:
        return self.gap <= self.margin

    @property
    def described(self) -> str:
        """"token A where generate() gives E (eager logit gap ... > tie margin ...)": what a failure says."""
        return (f"token {self.artifact} where generate() gives {self.eager} (eager logit gap {self.gap:.3g} > "
                f"tie margin {self.margin:.3g})")


@dataclasses.dataclass(frozen=True)
class GenerationRun:
    """One run (tpu or cpu) of one case.

    Attributes:
      logits: every row's logits over every step, compared as one output.
      tokens_compared: rows x steps.
      differences: steps where the argmax differs (ties and divergences).
    """

    logits: OutputComparison
    tokens_compared: int
    differences: tuple[TokenDifference, ...]

    @property
    def divergence(self) -> TokenDifference | None:
        return next((difference for difference in self.differences if not difference.tie), None)

    @property
    def passed(self) -> bool:
        return self.logits.passed and self.divergence is None


@dataclasses.dataclass(frozen=True)
class FloatDivergence:
    """A weight-only case's distance from the float model's greedy generation.

    Attributes:
      tokens_compared: rows x steps.
      first: the earliest step where greedy generation with the rounded weights gives another
        token than the float model: {"row", "step", "float_token", "token"}; None if none does.
      sqnr_db: the artifact's logits (TPU-faithful run) against the float model's, each row's steps
        up to and including its divergence (the same tokens before it); None if identical.
    """

    tokens_compared: int
    first: dict | None
    sqnr_db: float | None


@dataclasses.dataclass(frozen=True)
class GenerationCase:
    """One prefill bucket's generation.

    Attributes:
      sizes: the prefill bucket {"batch", "seq"}.
      lengths: prompt length per row; slots: cache slot per row.
      new_tokens: tokens generated per row.
      runs: {"tpu": GenerationRun, "cpu": GenerationRun}.
      error: why the case could not run (the artifact or eager model raised), else None.
      golden: whether its prompts, eager tokens and logits are stored.
      float_divergence: a weight-only case's distance from the float model, else None.
      note: why the case runs at other sizes than its prefill bucket's (verified_fills), else None.
    """

    sizes: dict[str, int]
    lengths: tuple[int, ...]
    slots: tuple[int, ...]
    new_tokens: int
    runs: dict[str, GenerationRun]
    error: str | None = None
    golden: bool = False
    float_divergence: FloatDivergence | None = None
    note: str | None = None

    @property
    def label(self) -> str:
        return f"prefill batch{self.sizes['batch']}_seq{self.sizes['seq']} + {self.new_tokens} tokens"

    @property
    def passed(self) -> bool:
        return self.error is None and all(run.passed for run in self.runs.values())


@dataclasses.dataclass(frozen=True)
class GenerationReport:
    """The generation verification's result (the text-generation counterpart of VerificationReport)."""

    precision: str
    matmul_precision: str
    tolerances: VerificationTolerances
    cases: tuple[GenerationCase, ...]
    golden: dict[str, np.ndarray]
    against: str = "Hugging Face generate(do_sample=False), eager PyTorch"

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(case.passed for case in self.cases)

    def tokens_compared(self) -> int:
        return sum(case.runs["cpu"].tokens_compared for case in self.cases if "cpu" in case.runs)

    def ties(self) -> int:
        """Steps (of tokens_compared) where a run's argmax differs from generate's within the tie margin; a
        step tied in both runs counts once."""
        return sum(len({(d.row, d.step) for run in case.runs.values() for d in run.differences if d.tie}) for case in self.cases)

    def worst_errors(self) -> dict[str, float]:
        return {run: max((case.runs[run].logits.relative_rms_error for case in self.cases if run in case.runs), default=0.0)
                for run in RUNS}

    def float_divergence(self) -> dict | None:
        """Weight-only: the cases' FloatDivergence together (the earliest divergence, the lowest SQNR); None otherwise."""
        measured = [(case, case.float_divergence) for case in self.cases if case.float_divergence is not None]
        if not measured:
            return None
        diverged = [{"case": case.label, **divergence.first} for case, divergence in measured if divergence.first is not None]
        sqnrs = [divergence.sqnr_db for _, divergence in measured if divergence.sqnr_db is not None]
        return {"against": "generate(do_sample=False) of the float model", "tokens_compared": sum(d.tokens_compared for _, d in measured),
                "first": min(diverged, key=lambda first: first["step"], default=None), "sqnr_db": min(sqnrs, default=None)}

    def failure_summary(self, hint: bool = True) -> str:
        """Names every failed case and run, one clause each, and (with `hint`) what TPU arithmetic alone departing suggests."""
        clauses = []
        for case in self.cases:
            if case.error:
                clauses.append(f"{case.label}: {case.error}")
            for name, run in case.runs.items():
                divergence = run.divergence
                if divergence is not None:
                    clauses.append(f"{case.label} ({name} run): row {divergence.row} (prompt of {case.lengths[divergence.row]} tokens), "
                                   f"step {divergence.step}: {divergence.described}")
                if not run.logits.passed:
                    clauses.append(f"{case.label} ({name} run): logits {run.logits.describe_failure()} "
                                   f"[{getattr(self.tolerances, name).describe()}]")
        failed_runs = {name for case in self.cases for name, run in case.runs.items() if not run.passed}
        if hint and failed_runs == {"tpu"} and self.matmul_precision != "highest" and not any(case.error for case in self.cases):
            clauses.append(tpu_arithmetic_hint(self.matmul_precision))
        return "; ".join(clauses) or "generation matches"

    def manifest_section(self) -> dict:
        """The manifest's "verification" block of a text-generation artifact."""
        return {
            **summary_section(self),
            "tokens_compared": self.tokens_compared(),
            "ties": self.ties(),
            "cases": [{"label": case.label, "sizes": case.sizes, "lengths": list(case.lengths), "slots": list(case.slots),
                       "new_tokens": case.new_tokens, "golden": case.golden, **({"note": case.note} if case.note else {})}
                      for case in self.cases],
        }

    def to_json(self) -> dict:
        return {
            "passed": self.passed,
            "against": self.against,
            "precision": self.precision,
            "matmul_precision": self.matmul_precision,
            "tolerances": self.tolerances.to_json(),
            "rule": __doc__.split("Both CPU runs", 1)[1].strip().replace("\n", " "),
            "tokens_compared": self.tokens_compared(),
            "ties": self.ties(),
            "float_divergence": self.float_divergence(),
            "cases": [
                {
                    "label": case.label, "sizes": case.sizes, "lengths": list(case.lengths), "slots": list(case.slots),
                    "new_tokens": case.new_tokens, "passed": case.passed, "error": case.error, "golden": case.golden, "note": case.note,
                    "float_divergence": dataclasses.asdict(case.float_divergence) if case.float_divergence else None,
                    "runs": {name: {"passed": run.passed, "tokens_compared": run.tokens_compared,
                                    "logits": {**dataclasses.asdict(run.logits), "passed": run.logits.passed},
                                    "differences": [{**dataclasses.asdict(d), "tie": d.tie} for d in run.differences]}
                             for name, run in case.runs.items()},
                }
                for case in self.cases
            ],
        }


def verified_fills(program: GenerationProgram, bound: int = MAX_FILL_TEMPORARY_BYTES) -> list[tuple[dict[str, int], str | None]]:
    """The sizes each prefill bucket's case runs at, and why they are not the bucket's (or None).

    A bucket whose fill needs more than `bound` bytes of XLA:CPU temporaries (the plain f32 run's
    memory analysis, compiled here before anything runs) is verified with fewer rows (halved until
    it fits), then shorter prompts: rows are independent in every entry point, and the TPU runs
    the compiled bucket either way. Sizes two buckets shrink to are verified once.
    """
    prefill = program.entry_points["prefill"]
    fills: list[tuple[dict[str, int], str | None]] = []
    for bucket in program.fill_buckets():
        sizes = dict(bucket)
        needed = prefill.run_temporary_bytes(sizes)
        while needed > bound and (sizes["batch"] > 1 or sizes["seq"] > 1):
            sizes = {**sizes, "batch": sizes["batch"] // 2} if sizes["batch"] > 1 else {**sizes, "seq": sizes["seq"] // 2}
            needed = prefill.run_temporary_bytes(sizes)
        if sizes == bucket:
            fills.append((sizes, None))
        elif all(sizes != seen for seen, _ in fills):
            fills.append((sizes, f"prefill bucket batch {bucket['batch']} x seq {bucket['seq']} verified at batch {sizes['batch']} x seq "
                                 f"{sizes['seq']}: its fill needs more than {bound / 2**20:,.1f} MiB of CPU temporaries"))
    return fills


def any_batch(program: GenerationProgram) -> GenerationProgram:
    """The program as verification drives it: the portable program prefills any batch up to max batch
    on CPU (verified_fills may run fewer rows than a bucket's), where a runtime's executables take
    the compiled batches only."""
    return dataclasses.replace(program, prefill_batches=tuple(range(1, program.spec.max_batch + 1)))


def plan_prompts(program: GenerationProgram, sizes: dict[str, int], new_tokens: int, seed: int) -> tuple[list[list[int]], list[int], int]:
    """A case's prompts, slots and new-token count (see the module docstring).

    Returns:
      (prompts, slots, new tokens per row).
    """
    spec = program.spec
    batch, seq = sizes["batch"], sizes["seq"]
    new_tokens = max(1, min(new_tokens, spec.max_context - 1))
    longest = max(1, min(seq, spec.max_context - new_tokens))
    new_tokens = min(new_tokens, spec.max_context - longest) or 1
    shortest = max(1, longest // 4)
    lengths = [int(round(length)) for length in np.linspace(longest, shortest, batch)]
    generator = np.random.default_rng(seed)
    prompts = [[int(token) for token in generator.integers(0, spec.vocab, length)] for length in lengths]
    slots = [spec.max_batch - 1 - row for row in range(batch)]
    return prompts, slots, new_tokens


def eager_generate(model: torch.nn.Module, prompt: Sequence[int], new_tokens: int) -> tuple[list[int], np.ndarray]:
    """generate(do_sample=False) of one unpadded prompt: (its new tokens, raw logits [steps, vocab])."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=0, do_sample=False, num_beams=1, eos_token_id=None,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    # generate() fills what the config leaves None (eos_token_id among them) from the model's own
    # generation_config: a model whose config names an EOS token stopped its rows at different steps
    # (found by benchmarks/fuzz_generation.py, a Gemma with EOS 1 in a 60-token vocabulary). The
    # model's is swapped for the defaults while generating, and put back.
    own_config = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        with torch.no_grad(), TiesToLowestIndex():
            output = model.generate(torch.tensor([list(prompt)]), attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
                                    generation_config=config)
    finally:
        model.generation_config = own_config
    tokens = [int(token) for token in output.sequences[0, len(prompt):]]
    logits = np.stack([step[0].float().numpy() for step in output.logits])
    return tokens, logits


def eager_references(program: GenerationProgram, model: torch.nn.Module, new_tokens: int,
                     fill_bytes: int = MAX_FILL_TEMPORARY_BYTES) -> list[list[tuple[list[int], np.ndarray]]]:
    """generate() of every case's prompts (plan_prompts; the cases verified_fills gives within
    `fill_bytes`): per prefill bucket, per row, (new tokens, logits [steps, vocab]). Raises what the model raises."""
    references = []
    for index, (sizes, _) in enumerate(verified_fills(program, fill_bytes)):
        prompts, _, steps = plan_prompts(program, sizes, new_tokens, seed=index)
        references.append([eager_generate(model, prompt, steps) for prompt in prompts])
    return references


def float_divergence(actual: np.ndarray, eager_tokens: list[list[int]], reference: list[tuple[list[int], np.ndarray]]) -> FloatDivergence:
    """A weight-only run's distance from the float model (module docstring).

    Args:
      actual: the artifact's teacher-forced logits [rows, steps, vocab] (TPU-faithful run).
      eager_tokens: generate()'s tokens with the rounded weights, per row.
      reference: the float model's (tokens, logits) per row.
    """
    first, expected, quantized = None, [], []
    for row, (tokens, (float_tokens, float_logits)) in enumerate(zip(eager_tokens, reference)):
        step = next((step for step, (token, float_token) in enumerate(zip(tokens, float_tokens)) if token != float_token), None)
        if step is not None and (first is None or step < first["step"]):
            first = {"row": row, "step": step, "float_token": float_tokens[step], "token": tokens[step]}
        seen = len(tokens) if step is None else step + 1
        expected.append(float_logits[:seen])
        quantized.append(actual[row, :seen])
    return FloatDivergence(int(actual.shape[0] * actual.shape[1]), first, sqnr_db(expected, quantized))


def teacher_forced_logits(session: GenerationSession, prompts, slots, seq: int, eager_tokens: list[list[int]]) -> np.ndarray:
    """The artifact's logits of every step, each decode step fed the eager token: [rows, steps, vocab]."""
    spec = session.program.spec
    steps = len(eager_tokens[0])
    first = session.prefill(prompts, slots, seq=seq)
    logits = [[row_logits] for row_logits in first]
    for step in range(1, steps):
        tokens = np.zeros(spec.max_batch, np.int64)
        positions = np.zeros(spec.max_batch, np.int64)
        for row, slot in enumerate(slots):
            tokens[slot], positions[slot] = eager_tokens[row][step - 1], len(prompts[row]) + step - 1
        step_logits = session.decode(tokens, positions)
        for row, slot in enumerate(slots):
            logits[row].append(step_logits[slot])
    return np.stack([np.stack(row) for row in logits]).astype(np.float32)


def cpu_runs(program: EntryPoints) -> dict[str, dict[str, jax.export.Exported]]:
    """The entry points' programs of each CPU run (RUNS): "tpu" their TPU-faithful rewrites, "cpu" the programs as lowered
    (a static or paged generation program's)."""
    precision = MATMUL_PRECISIONS[program.weights_program.matmul_precision]
    return {"tpu": {name: tpu_faithful(lowered.exported, precision) for name, lowered in program.entry_points.items()},
            "cpu": {name: lowered.exported for name, lowered in program.entry_points.items()}}


def teacher_forced_runs(program: GenerationProgram, runs: dict[str, dict[str, jax.export.Exported]], prompts, slots, seq: int,
                        eager_tokens: list[list[int]]) -> dict[str, np.ndarray]:
    """Each run's teacher_forced_logits, in a session of its own.

    A run whose programs are an earlier run's (a bfloat16 program has no f32 matmul to round, so
    its TPU-faithful rewrite is the program itself) has that run's logits: the same XLA:CPU
    executables on the same inputs compute them again, bit for bit, in as much time and memory.

    Args:
      program: the generation program.
      runs: cpu_runs(program).
      prompts, slots, seq, eager_tokens: as for teacher_forced_logits.
    Returns:
      {run: logits [rows, steps, vocab]}.
    """
    logits: dict[str, np.ndarray] = {}
    for name, programs in runs.items():
        earlier = next((other for other in logits if all(runs[other][entry] is programs[entry] for entry in programs)), None)
        logits[name] = logits[earlier] if earlier else teacher_forced_logits(GenerationSession(any_batch(program), cpu_runner(program, programs)), prompts,
                                                                               slots, seq, eager_tokens)
    return logits


def compare_run(actual: np.ndarray, expected: np.ndarray, eager_tokens: list[list[int]], tolerances: Tolerances) -> GenerationRun:
    """Compares one run's teacher-forced logits [rows, steps, vocab] with eager's (module docstring rule)."""
    differences = []
    for row in range(actual.shape[0]):
        for step in range(actual.shape[1]):
            chosen, eager = int(actual[row, step].argmax()), eager_tokens[row][step]
            if chosen != eager:
                logits = expected[row, step].astype(np.float64)
                margin = (tolerances.atol + tolerances.rtol * abs(logits[eager]) + tolerances.scale_tol * float(np.sqrt(np.mean(logits ** 2)))
                          + tolerances.quantization_steps * float(np.abs(logits).max()) / 127.0)  # int8 programs' steps (compare.py)
                differences.append(TokenDifference(row, step, eager, chosen, float(logits[eager] - logits[chosen]), float(margin)))
    return GenerationRun(compare_output("logits", actual, expected, tolerances), int(actual.shape[0] * actual.shape[1]),
                         tuple(differences))


def verify_generation(program: GenerationProgram, model: torch.nn.Module, tolerances: VerificationTolerances | None = None,
                      new_tokens: int = DEFAULT_NEW_TOKENS,
                      float_reference: list[list[tuple[list[int], np.ndarray]]] | None = None,
                      first_seed: int = 0, fill_bytes: int = MAX_FILL_TEMPORARY_BYTES) -> GenerationReport:
    """Generates with the artifact's entry points on CPU and compares with Hugging Face generate.

    Args:
      program: the lowered generation program (with weights).
      model: the Hugging Face causal LM it was captured from (a weight-only program's: computing
        with the rounded weights).
      tolerances: None for the defaults of the program's precision settings.
      new_tokens: tokens generated per prompt (fewer where the context has no room).
      float_reference: a weight-only program's float model generations (eager_references, taken
        before the weights were rounded): each case then measures its FloatDivergence.
      first_seed: the seed of the first prefill bucket's prompts (each next bucket's is one more);
        0 is what a conversion verifies (and float_reference was drawn with), others give fresh prompts.
      fill_bytes: the CPU temporaries a case's fill may need (verified_fills).
    Returns:
      The GenerationReport, passed or not, with golden data (prompts, eager tokens and logits).
    """
    decode = program.entry_points["decode"]
    tolerances = tolerances or default_tolerances(decode.resolved_precision, decode.matmul_precision, quantized=False)
    runs_programs = cpu_runs(program)
    cases, golden = [], {}
    for index, (sizes, note) in enumerate(verified_fills(program, fill_bytes)):
        prompts, slots, steps = plan_prompts(program, sizes, new_tokens, seed=first_seed + index)
        lengths = tuple(len(prompt) for prompt in prompts)
        try:
            eager = [eager_generate(model, prompt, steps) for prompt in prompts]
        except Exception as error:  # the user's model may raise anything
            cases.append(GenerationCase(sizes, lengths, tuple(slots), steps, {}, f"eager generate() raised {type(error).__name__}: {error}",
                                        note=note))
            continue
        eager_tokens = [tokens for tokens, _ in eager]
        expected = np.stack([logits for _, logits in eager])
        return_freed_memory()  # what generate() freed is in this thread's heap; XLA:CPU allocates from its own threads'
        try:
            actual = teacher_forced_runs(program, runs_programs, prompts, slots, sizes["seq"], eager_tokens)
        except Exception as error:  # XLA runtime errors, shape assertions
            cases.append(GenerationCase(sizes, lengths, tuple(slots), steps, {}, artifact_raised(error), note=note))
            continue
        runs = {name: compare_run(logits, expected, eager_tokens, getattr(tolerances, name)) for name, logits in actual.items()}
        divergence = None if float_reference is None else float_divergence(actual["tpu"], eager_tokens, float_reference[index])
        stored = store_golden_case(golden, index, prompts, slots, sizes["seq"], eager_tokens, expected)
        cases.append(GenerationCase(sizes, lengths, tuple(slots), steps, runs, golden=stored, float_divergence=divergence, note=note))
        del actual, expected, eager
        return_freed_memory()  # the next case's sizes differ: it cannot reuse this one's freed blocks
    return GenerationReport(decode.resolved_precision, decode.matmul_precision, tolerances, tuple(cases), golden)


def store_golden_case(golden: dict[str, np.ndarray], index: int, prompts: list[list[int]], slots: list[int], seq: int,
                      tokens: list[list[int]], logits: np.ndarray) -> bool:
    """Adds one verified case's golden arrays (what the gate replays) while the golden data stays
    within MAX_GOLDEN_BYTES; the first case is always stored.

    Args:
      golden: the golden arrays so far, keyed "<case>/<name>"; updated in place.
      index: the case's number.
      prompts, slots: the case's prompts (unpadded) and the cache slots they were given.
      seq: the prefill bucket's length the prompts are padded to.
      tokens, logits: the reference's greedy tokens per row and its logits of every step.
    Returns:
      Whether the case was stored.
    """
    arrays = {f"{index}/prompts": _padded(prompts, seq), f"{index}/lengths": np.array([len(prompt) for prompt in prompts], np.int32),
              f"{index}/slots": np.array(slots, np.int32), f"{index}/eager_tokens": np.array(tokens, np.int32),
              f"{index}/eager_logits": logits}
    size = sum(array.nbytes for array in arrays.values())
    stored = index == 0 or sum(array.nbytes for array in golden.values()) + size <= MAX_GOLDEN_BYTES
    if stored:
        golden.update(arrays)
    return stored


def artifact_raised(error: BaseException) -> str:
    """A verification case's error when the artifact's run raised (XLA runtime errors, shape
    assertions, a damaged artifact): the exception's type and first 300 characters on one line."""
    return f"the artifact raised {type(error).__name__}: {' '.join(str(error).split())[:300]}"


def _padded(prompts: list[list[int]], seq: int) -> np.ndarray:
    tokens = np.zeros((len(prompts), seq), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = prompt
    return tokens


def stored_cases(golden: dict[str, np.ndarray], cases: list[dict]) -> Iterator[tuple]:
    """The stored golden cases of a generation artifact, for a replay.

    Args:
      golden: the golden arrays ("<case>/prompts", "lengths", "slots", "eager_tokens", "eager_logits").
      cases: the manifest's verification cases (sizes, golden flag), in order.
    Returns:
      Per case with golden data: (manifest case, lengths, prompts without their padding, slots,
      eager tokens per row, eager logits).
    """
    for index, case in enumerate(cases):
        if not case["golden"]:
            continue
        lengths = [int(length) for length in golden[f"{index}/lengths"]]
        prompts = [list(map(int, row[:length])) for row, length in zip(golden[f"{index}/prompts"], lengths)]
        slots = [int(slot) for slot in golden[f"{index}/slots"]]
        eager_tokens = [list(map(int, row)) for row in golden[f"{index}/eager_tokens"]]
        yield case, lengths, prompts, slots, eager_tokens, golden[f"{index}/eager_logits"]


def replay_golden(program: GenerationProgram, golden: dict[str, np.ndarray], cases: list[dict],
                  tolerances: VerificationTolerances) -> GenerationReport:
    """Re-runs the stored golden cases of a text-generation artifact (the CI gate's check): the
    stored prompts, teacher-forced with the stored eager tokens, compared with the stored eager
    logits by the rule above, in both CPU runs.

    Args:
      program: the artifact's generation program (with weights).
      golden: the golden arrays ("<case>/prompts", "lengths", "slots", "eager_tokens", "eager_logits").
      cases: the manifest's verification cases (sizes, golden flag), in order.
      tolerances: the artifact's verification tolerances.
    Returns:
      A GenerationReport of the stored cases (a run that raises becomes its case's error).
    """
    decode = program.entry_points["decode"]
    runs_programs = cpu_runs(program)
    replayed = []
    for case, lengths, prompts, slots, eager_tokens, expected in stored_cases(golden, cases):
        runs, error = {}, None
        try:
            actual = teacher_forced_runs(program, runs_programs, prompts, slots, case["sizes"]["seq"], eager_tokens)
            runs = {name: compare_run(logits, expected, eager_tokens, getattr(tolerances, name)) for name, logits in actual.items()}
        except Exception as exception:  # a damaged artifact can raise anything
            error = artifact_raised(exception)
        replayed.append(GenerationCase(case["sizes"], tuple(lengths), tuple(slots), len(eager_tokens[0]), runs, error, golden=True))
    return GenerationReport(decode.resolved_precision, decode.matmul_precision, tolerances, tuple(replayed), {},
                            "stored generate() tokens and logits")
