"""Verification of a text-generation artifact's `sample` entry point (export/sampling.py), on CPU.

  exact        rows of logits (random, some rounded to bfloat16 so that values tie) with every kind of
               parameters (greedy, temperature, top-k, top-p, both) and random seeds and steps: the
               program's tokens equal the NumPy reference's (lower/sampling.py), which computes the same
               uniforms bit for bit. A differing sampled token counts as a tie only where the reference
               came within TIE_MARGIN of drawing it (two perturbed scores, or a top-p mass and p, that
               close); a greedy row must equal the argmax. Logprobs within LOGPROB_TOLERANCE, the top
               ids equal.
  statistical  per row of a few designed distributions (a temperature, a top-k, a top-p whose last
               token carries a large share, all three), DRAWS draws through the program (the same
               logits, one seed, steps 0..DRAWS-1): the total-variation distance between the draws'
               frequencies and softmax(logits / T) truncated by Hugging Face's own logits processors
               (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, in generate()'s order)
               must stay within a bound the right sampler exceeds with probability below
               FAILURE_PROBABILITY: E[TV] <= 1/2 sum_i sqrt(q_i (1 - q_i) / n), plus McDiarmid's
               sqrt(ln(1 / FAILURE_PROBABILITY) / 2n) (one draw moves the distance by at most 1/n).
               A wrong temperature, or a top-p that keeps one token too few or too many, exceeds it
               (tests/test_sampling.py plants both).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
import torch

from tpuexport.lower.sampling import sample_reference

DRAWS = 10_000
FAILURE_PROBABILITY = 1e-9
TIE_MARGIN = 1e-4
LOGPROB_TOLERANCE = 1e-4
EXACT_ROWS = 96
# Elements per call of the program (rows x vocab) while drawing: bounds the memory a draw takes.
DRAW_ELEMENTS = 1 << 22
# (temperature, top_p, top_k, the distribution's leading probabilities at temperature 1): the rest of
# the vocabulary far below. The top-p design's cut falls after its third token (0.30 + 0.25 + 0.20 >=
# 0.7), and its fourth token carries 0.15: a top-p one token off moves the distribution by >= 0.15.
DESIGNS = (
    (0.6, 1.0, 0, (0.22, 0.17, 0.14, 0.11, 0.09, 0.07, 0.06, 0.05, 0.04, 0.03, 0.01, 0.01)),
    (1.0, 1.0, 4, (0.22, 0.17, 0.14, 0.11, 0.09, 0.07, 0.06, 0.05, 0.04, 0.03, 0.01, 0.01)),
    (1.0, 0.7, 0, (0.30, 0.25, 0.20, 0.15, 0.06, 0.04)),
    (1.5, 0.9, 8, (0.25, 0.2, 0.15, 0.1, 0.08, 0.07, 0.05, 0.04, 0.03, 0.02, 0.01)),
)
# The rest of the vocabulary, this far below the designed tokens' logits (exp(-40) ~ 4e-18 each).
BACKGROUND = -40.0

# The sample entry point run on CPU: its inputs (logits, temperature, top_p, top_k, seed, step) -> its outputs.
SampleRun = Callable[[list[np.ndarray]], list[np.ndarray]]


@dataclasses.dataclass(frozen=True)
class DistributionCheck:
    """One designed row's draws against Hugging Face's distribution.

    Attributes:
      temperature, top_p, top_k: its parameters.
      support: tokens of nonzero expected probability.
      draws: tokens drawn.
      distance: total-variation distance between the draws' frequencies and the expected distribution.
      bound: the distance the right sampler exceeds with probability below FAILURE_PROBABILITY.
    """

    temperature: float
    top_p: float
    top_k: int
    support: int
    draws: int
    distance: float
    bound: float

    @property
    def passed(self) -> bool:
        return self.distance <= self.bound

    def describe(self) -> str:
        return (f"temperature {self.temperature:g}, top_p {self.top_p:g}, top_k {self.top_k}: total variation {self.distance:.4f} "
                f"{'<=' if self.passed else '>'} {self.bound:.4f} over {self.draws} draws")


@dataclasses.dataclass(frozen=True)
class SamplingVerification:
    """The sample entry point's verification (module docstring).

    Attributes:
      rows: rows compared exactly with the reference.
      mismatches: sampled rows whose token differs where the reference did not come within TIE_MARGIN.
      ties: rows whose token differs within TIE_MARGIN (rounding: counted, not failed).
      greedy_mismatches: greedy rows whose token is not the argmax.
      logprob_error: the largest logprob difference (the drawn token's and the top ones').
      top_ids_equal: whether every row's top ids equal the reference's.
      distributions: the statistical checks.
    """

    rows: int
    mismatches: int
    ties: int
    greedy_mismatches: int
    logprob_error: float
    top_ids_equal: bool
    distributions: tuple[DistributionCheck, ...]

    @property
    def exact_passed(self) -> bool:
        return not self.mismatches and not self.greedy_mismatches and self.logprob_error <= LOGPROB_TOLERANCE and self.top_ids_equal

    @property
    def passed(self) -> bool:
        return self.exact_passed and all(check.passed for check in self.distributions)

    def describe(self) -> str:
        draws = sum(check.draws for check in self.distributions)
        return (f"sample: {self.rows} rows equal the NumPy reference ({self.ties} rounding tie(s)); {len(self.distributions)} "
                f"distributions x {self.distributions[0].draws if self.distributions else 0} draws within their total-variation bounds "
                f"({draws} draws), {'passed' if self.passed else 'FAILED'}")

    def failure_summary(self) -> str:
        problems = []
        if self.greedy_mismatches:
            problems.append(f"{self.greedy_mismatches} greedy row(s) not the argmax")
        if self.mismatches:
            problems.append(f"{self.mismatches} sampled row(s) differ from the reference beyond rounding")
        if self.logprob_error > LOGPROB_TOLERANCE:
            problems.append(f"logprobs differ by {self.logprob_error:.2e} > {LOGPROB_TOLERANCE:g}")
        if not self.top_ids_equal:
            problems.append("top logprob ids differ")
        problems += [check.describe() for check in self.distributions if not check.passed]
        return "sampling: " + "; ".join(problems)

    def to_json(self) -> dict:
        return {"passed": self.passed, "exact": {"rows": self.rows, "mismatches": self.mismatches, "ties": self.ties,
                                                 "greedy_mismatches": self.greedy_mismatches, "logprob_error": self.logprob_error,
                                                 "top_ids_equal": self.top_ids_equal, "tie_margin": TIE_MARGIN},
                "statistical": [{**dataclasses.asdict(check), "passed": check.passed} for check in self.distributions],
                "failure_probability": FAILURE_PROBABILITY}


def verify_sampling(run: SampleRun, vocab: int, seed: int = 0, draws: int = DRAWS) -> SamplingVerification:
    """Both checks of the module docstring.

    Args:
      run: the sample entry point on CPU (e.g. its LoweredProgram's `run`).
      vocab: its logits' width.
      seed: seeds the rows, parameters and keys chosen.
      draws: draws per designed distribution.
    """
    rng = np.random.default_rng(seed)
    exact = _exact(run, vocab, rng)
    distributions = tuple(_distribution(run, vocab, design, rng, draws) for design in DESIGNS)
    return SamplingVerification(*exact, distributions)


def _exact(run: SampleRun, vocab: int, rng: np.random.Generator) -> tuple:
    rows = EXACT_ROWS
    scales = rng.choice([0.5, 3.0, 12.0], rows).astype(np.float32)
    logits = (rng.standard_normal((rows, vocab)) * scales[:, None]).astype(np.float32)
    tied = rng.random(rows) < 1 / 3  # bfloat16 logits (a bf16 model's): many exactly equal values
    logits[tied] = _bfloat16_rounded(logits[tied])
    temperature = rng.choice([0.0, 0.3, 1.0, 1.7], rows).astype(np.float32)
    top_p = rng.choice([1.0, 0.95, 0.6, 0.2], rows).astype(np.float32)
    top_k = rng.choice([0, 1, 7, 50, vocab], rows).astype(np.int64)
    seeds = rng.integers(-(1 << 31), 1 << 31, rows).astype(np.int64)
    steps = rng.integers(0, 1 << 20, rows).astype(np.int64)
    inputs = [logits, temperature, top_p, top_k, seeds, steps]
    tokens, logprobs, top_ids, top_logprobs = run(inputs)
    reference = sample_reference(*inputs, top_logprobs=top_ids.shape[1])
    differs = np.asarray(tokens) != reference["tokens"]
    greedy = temperature == 0
    ties = differs & ~greedy & (reference["margins"] < TIE_MARGIN)
    logprob_error = max(float(np.abs(np.asarray(logprobs) - reference["logprobs"]).max()),
                        float(np.abs(np.asarray(top_logprobs) - reference["top_logprobs"]).max()))
    return (rows, int((differs & ~greedy & ~ties).sum()), int(ties.sum()), int((differs & greedy).sum()), logprob_error,
            bool(np.array_equal(np.asarray(top_ids), reference["top_ids"])))


def _bfloat16_rounded(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16's 8 bits of mantissa (and back to float32)."""
    return torch.from_numpy(values).to(torch.bfloat16).to(torch.float32).numpy()


def _distribution(run: SampleRun, vocab: int, design: tuple, rng: np.random.Generator, draws: int) -> DistributionCheck:
    temperature, top_p, top_k, leading = design
    logits = np.full(vocab, BACKGROUND, np.float32)
    positions = rng.choice(vocab, len(leading), replace=False)
    logits[positions] = np.log(np.asarray(leading, np.float64)).astype(np.float32)
    expected = hugging_face_distribution(logits, temperature, top_p, top_k)
    key = int(rng.integers(-(1 << 31), 1 << 31))
    chunk = max(1, DRAW_ELEMENTS // vocab)
    counts = np.zeros(vocab, np.int64)
    for start in range(0, draws, chunk):
        rows = min(chunk, draws - start)
        inputs = [np.broadcast_to(logits, (rows, vocab)), np.full(rows, temperature, np.float32), np.full(rows, top_p, np.float32),
                  np.full(rows, top_k, np.int64), np.full(rows, key, np.int64), np.arange(start, start + rows, dtype=np.int64)]
        counts += np.bincount(np.asarray(run(inputs)[0]), minlength=vocab)
    frequencies = counts / draws
    distance = 0.5 * float(np.abs(frequencies - expected).sum())
    bound = 0.5 * float(np.sqrt(expected * (1 - expected) / draws).sum()) + math.sqrt(math.log(1 / FAILURE_PROBABILITY) / (2 * draws))
    return DistributionCheck(temperature, top_p, top_k, int((expected > 0).sum()), draws, distance, bound)


def hugging_face_distribution(logits: np.ndarray, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """The next-token distribution generate(do_sample=True) draws from for one row of logits, through
    transformers' own logits processors in generate()'s order (float64)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = torch.from_numpy(np.asarray(logits, np.float64))[None]
    processors = [TemperatureLogitsWarper(temperature)]
    if top_k:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        processors.append(TopPLogitsWarper(top_p))
    for processor in processors:
        scores = processor(None, scores)
    return torch.softmax(scores, -1)[0].numpy()
