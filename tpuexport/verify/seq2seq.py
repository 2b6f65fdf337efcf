"""Verification that an encoder-decoder's generation works: the artifact's encode and decode,
driven as a serving engine drives them, against Hugging Face `model.generate(do_sample=False)`.

One case per compiled encode bucket (batch b, source length src): b sources of different lengths
(the longest filling the bucket, the shortest a quarter of it) right-padded to src, encoded into
cache slots in reverse order (a slot is not its row), then N decode steps at max_batch from the
decoder start token, every row at its own position, the other slots idle. The eager reference
generates from each source alone, unpadded, greedily, and returns its raw logits of every step.

The rule is verify/generation.py's: both CPU runs teacher-forced with generate's tokens, every
step's logits within the run's float tolerances, and the artifact's argmax equal to generate's
token at every step (a differing argmax whose two eager logits are within the logits tolerance is
a tie).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

from tpuexport.lower.seq2seq import Seq2SeqProgram, Seq2SeqSession
from tpuexport.lower.generation import cpu_runner
from tpuexport.verify.generation import (DEFAULT_NEW_TOKENS, GenerationCase, GenerationReport, artifact_raised, compare_run, cpu_runs,
                                         store_golden_case, stored_cases)
from tpuexport.verify.tolerances import VerificationTolerances, default_tolerances


@dataclasses.dataclass(frozen=True)
class Seq2SeqCase(GenerationCase):
    """One encode bucket's generation (GenerationCase's fields; `lengths` are the sources')."""

    @property
    def label(self) -> str:
        return f"encode batch{self.sizes['batch']}_seq{self.sizes['seq']} + {self.new_tokens} tokens"


def plan_sources(program: Seq2SeqProgram, sizes: dict[str, int], new_tokens: int, seed: int) -> tuple[list[list[int]], list[int], int]:
    """A case's sources, slots and new-token count (see the module docstring)."""
    spec = program.spec
    batch, seq = sizes["batch"], sizes["seq"]
    new_tokens = max(1, min(new_tokens, spec.max_context))
    lengths = [int(round(length)) for length in np.linspace(seq, max(1, seq // 4), batch)]
    generator = np.random.default_rng(seed)
    sources = [[int(token) for token in generator.integers(0, spec.vocab, length)] for length in lengths]
    slots = [spec.max_batch - 1 - row for row in range(batch)]
    return sources, slots, new_tokens


def eager_generate(model: torch.nn.Module, source: Sequence[int], new_tokens: int, start: int) -> tuple[list[int], np.ndarray]:
    """generate(do_sample=False) from one unpadded source: (its new tokens, raw logits [steps, vocab]).
    The model's own generation_config is swapped for the defaults meanwhile (no EOS stop, no forced
    or suppressed tokens: verify/generation.py's eager_generate says why)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=0, do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=0,
                              decoder_start_token_id=start, output_logits=True, return_dict_in_generate=True)
    own_config = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        with torch.no_grad():
            output = model.generate(torch.tensor([list(source)]), attention_mask=torch.ones((1, len(source)), dtype=torch.long),
                                    generation_config=config)
    finally:
        model.generation_config = own_config
    tokens = [int(token) for token in output.sequences[0, 1:]]
    logits = np.stack([step[0].float().numpy() for step in output.logits])
    return tokens, logits


def teacher_forced_logits(session: Seq2SeqSession, sources, slots, seq: int, eager_tokens: list[list[int]]) -> np.ndarray:
    """The artifact's logits of every step, each decode step fed the eager token: [rows, steps, vocab]."""
    spec = session.program.spec
    session.encode(sources, slots, seq=seq)
    logits = [[] for _ in sources]
    for step in range(len(eager_tokens[0])):
        tokens = np.zeros(spec.max_batch, np.int64)
        positions = np.zeros(spec.max_batch, np.int64)
        for row, slot in enumerate(slots):
            tokens[slot] = spec.decoder_start_token_id if step == 0 else eager_tokens[row][step - 1]
            positions[slot] = step
        step_logits = session.decode(tokens, positions)
        for row, slot in enumerate(slots):
            logits[row].append(step_logits[slot])
    return np.stack([np.stack(row) for row in logits]).astype(np.float32)


def verify_seq2seq(program: Seq2SeqProgram, model: torch.nn.Module, tolerances: VerificationTolerances | None = None,
                   new_tokens: int = DEFAULT_NEW_TOKENS) -> GenerationReport:
    """Generates with the artifact's encode and decode on CPU and compares with Hugging Face generate.

    Args:
      program: the lowered encoder-decoder program (with weights).
      model: the Hugging Face encoder-decoder it was captured from.
      tolerances: None for the defaults of the program's precision settings.
      new_tokens: tokens generated per source (at most max context).
    Returns:
      The GenerationReport, passed or not, with golden data (sources, eager tokens and logits).
    """
    decode = program.entry_points["decode"]
    tolerances = tolerances or default_tolerances(decode.resolved_precision, decode.matmul_precision, quantized=False)
    runs_programs = cpu_runs(program)
    cases, golden = [], {}
    for index, sizes in enumerate(program.encode_buckets()):
        sources, slots, steps = plan_sources(program, sizes, new_tokens, seed=index)
        lengths = tuple(len(source) for source in sources)
        try:
            eager = [eager_generate(model, source, steps, program.spec.decoder_start_token_id) for source in sources]
        except Exception as error:  # the user's model may raise anything
            cases.append(Seq2SeqCase(sizes, lengths, tuple(slots), steps, {}, f"eager generate() raised {type(error).__name__}: {error}"))
            continue
        eager_tokens = [tokens for tokens, _ in eager]
        expected = np.stack([logits for _, logits in eager])
        try:
            actual = {name: teacher_forced_logits(Seq2SeqSession(program, cpu_runner(program, programs)), sources, slots, sizes["seq"],
                                                  eager_tokens)
                      for name, programs in runs_programs.items()}
        except Exception as error:  # XLA runtime errors, shape assertions
            cases.append(Seq2SeqCase(sizes, lengths, tuple(slots), steps, {}, artifact_raised(error)))
            continue
        runs = {name: compare_run(logits, expected, eager_tokens, getattr(tolerances, name)) for name, logits in actual.items()}
        stored = store_golden_case(golden, index, sources, slots, sizes["seq"], eager_tokens, expected)
        cases.append(Seq2SeqCase(sizes, lengths, tuple(slots), steps, runs, golden=stored))
    return GenerationReport(decode.resolved_precision, decode.matmul_precision, tolerances, tuple(cases), golden)


def replay_golden(program: Seq2SeqProgram, golden: dict[str, np.ndarray], cases: list[dict],
                  tolerances: VerificationTolerances) -> GenerationReport:
    """Re-runs an encoder-decoder artifact's stored cases (the CI gate's check): the stored sources,
    teacher-forced with the stored eager tokens, compared with the stored eager logits by the rule
    above, in both CPU runs (verify/generation.py's replay_golden, with encode for prefill).

    Returns:
      A GenerationReport of the stored cases (a run that raises becomes its case's error).
    """
    decode = program.entry_points["decode"]
    runs_programs = cpu_runs(program)
    replayed = []
    for case, lengths, sources, slots, eager_tokens, expected in stored_cases(golden, cases):
        runs, error = {}, None
        try:
            for name, programs in runs_programs.items():
                logits = teacher_forced_logits(Seq2SeqSession(program, cpu_runner(program, programs)), sources, slots, case["sizes"]["seq"],
                                               eager_tokens)
                runs[name] = compare_run(logits, expected, eager_tokens, getattr(tolerances, name))
        except Exception as exception:  # a damaged artifact can raise anything
            runs, error = {}, artifact_raised(exception)
        replayed.append(Seq2SeqCase(case["sizes"], tuple(lengths), tuple(slots), len(eager_tokens[0]), runs, error, golden=True))
    return GenerationReport(decode.resolved_precision, decode.matmul_precision, tolerances, tuple(replayed), {},
                            "stored generate() tokens and logits")
