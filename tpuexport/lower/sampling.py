"""Sampling parameters per row, and what the `sample` entry point computes (export/sampling.py),
written again in NumPy float32 op for op: verification's reference (verify/sampling.py) and the
sampler of an artifact converted before it had a `sample` entry point.

The uniforms are bit-for-bit the entry point's (integer hashing) and so are the top-k thresholds
(counts); the other floating-point steps are the same operations, so a draw differs only where
two candidates' perturbed scores, or a top-p bisection step's mass and p, are within rounding of
each other (`margins` says how close each row came).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tpuexport.errors import TpuExportError
from tpuexport.lower.registry import register_lowering
from tpuexport.sampling_constants import BISECTION_STEPS, TOP_LOGPROBS

_MULTIPLIERS = (np.int32(0x7FEB352D), np.int32(0x846CA68B - (1 << 32)))


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a request's rows draw their tokens.

    Attributes:
      temperature: 0 for the greedy token (argmax), else the logits' divisor.
      top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1: all).
      top_k: keep the top_k most likely tokens (0: all).
      seed: the draws' seed (same seed, prompt and parameters: the same tokens), or None for a
        random one per request.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        check_sampling(self.temperature, self.top_p, self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def row_keys(self, rows: int) -> list[int]:
        """Each row's 32-bit key (as int32): the seed (a random one when None) folded to 32 bits and
        mixed with the row's index, so that a request's rows draw apart."""
        seed = int.from_bytes(os.urandom(8), "little") if self.seed is None else self.seed
        folded = np.array([(seed ^ (seed >> 32)) & 0xFFFFFFFF], np.uint32).view(np.int32)
        return [int(key) for key in mix32(mix32(folded) ^ np.arange(rows, dtype=np.int32))]



def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """Raises TpuExportError (one line) for sampling parameters out of range."""
    if not temperature >= 0:  # also NaN
        raise TpuExportError(f"temperature {temperature} is negative; give 0 (greedy) or more")
    if not 0 < top_p <= 1:
        raise TpuExportError(f"top_p {top_p} is outside (0, 1]; give a probability above 0, 1 for no truncation")
    if top_k < 0:
        raise TpuExportError(f"top_k {top_k} is negative; give 0 (no truncation) or a number of tokens")


GREEDY = Sampling()


@dataclasses.dataclass(frozen=True)
class SampledTokens:
    """The sample entry point's outputs for some rows (host arrays).

    Attributes:
      tokens: [rows] the drawn (or greedy) token ids.
      logprobs: [rows] each token's log probability under the model (log_softmax of the logits).
      top_ids, top_logprobs: [rows, N] the N most likely tokens and their log probabilities, or
        None when not asked for.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None


@register_lowering("tpuexport::top_k_floor")
def top_k_floor(scaled, top_k):
    """export/sampling.py's top_k_floor as one loop (jax.lax.fori_loop), its steps as the eager op's."""
    def halve(_, bounds):
        low, high = bounds
        middle = low + (high - low) * 0.5
        enough = (scaled >= middle).sum(-1, keepdims=True) >= top_k[:, None]
        return jnp.where(enough, middle, low), jnp.where(enough, high, middle)

    return jax.lax.fori_loop(0, BISECTION_STEPS, halve, (scaled.min(-1, keepdims=True), scaled.max(-1, keepdims=True)))[0]


@register_lowering("tpuexport::top_p_floor")
def top_p_floor(masked, top_p):
    """export/sampling.py's top_p_floor as one loop (jax.lax.fori_loop), its steps as the eager op's."""
    probabilities = jax.nn.softmax(masked, axis=-1)

    def halve(_, bounds):
        low, high = bounds
        middle = low + (high - low) * 0.5
        below_p = jnp.where(masked > middle, probabilities, 0).sum(-1, keepdims=True) < top_p[:, None]
        return jnp.where(below_p, low, middle), jnp.where(below_p, middle, high)

    low = jnp.where(jnp.isinf(masked), jnp.inf, masked).min(-1, keepdims=True) - 1
    return jax.lax.fori_loop(0, BISECTION_STEPS, halve, (low, masked.max(-1, keepdims=True)))[0]


def mix32(bits: np.ndarray) -> np.ndarray:
    """export/sampling.py's mix32 on int32 arrays (wrapping multiplication)."""
    bits = np.asarray(bits, np.int32)
    with np.errstate(over="ignore"):
        bits = bits ^ _shifted_right(bits, 16)
        bits = bits * _MULTIPLIERS[0]
        bits = bits ^ _shifted_right(bits, 15)
        bits = bits * _MULTIPLIERS[1]
    return bits ^ _shifted_right(bits, 16)


def _shifted_right(bits: np.ndarray, shift: int) -> np.ndarray:
    return (bits >> shift) & np.int32((1 << (32 - shift)) - 1)


def uniforms(seed: np.ndarray, step: np.ndarray, vocab: int) -> np.ndarray:
    """export/sampling.py's uniforms: [rows, vocab] float32 in (0, 1)."""
    with np.errstate(over="ignore"):
        key = mix32(mix32(np.asarray(seed, np.int32)) + np.asarray(step, np.int32))[:, None]
        index = np.arange(vocab, dtype=np.int32)[None, :]
        bits = mix32(mix32(index ^ key) + key)
    return (_shifted_right(bits, 9).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / (1 << 23))


def sample_reference(logits, temperature, top_p, top_k, seed, step, top_logprobs: int = TOP_LOGPROBS) -> dict[str, np.ndarray]:
    """The sample entry point in NumPy float32 (export/sampling.py's Sample, op for op).

    Returns:
      {"tokens", "logprobs", "top_ids", "top_logprobs"} as the entry point returns them, and
      "margins" [rows]: how far each sampled row's draw was from going another way (the gap between
      its two best perturbed scores, and the closest a top-p bisection step's mass came to p; inf
      for a greedy row), for telling a rounding tie from a wrong draw.
    """
    logits = np.asarray(logits, np.float32)
    temperature, top_p = np.asarray(temperature, np.float32), np.asarray(top_p, np.float32)
    top_k = np.asarray(top_k, np.int64)
    rows, vocab = logits.shape
    sampled = temperature > 0
    scaled = logits / np.where(sampled, temperature, np.float32(1))[:, None]
    k = np.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    k_floor = _top_k_floor(scaled, k) if (sampled & (k < vocab)).any() else np.full((rows, 1), -np.inf, np.float32)
    masked = np.where(scaled >= k_floor, scaled, np.float32(-np.inf))
    p_floor, p_margins = np.full((rows, 1), -np.inf, np.float32), np.full(rows, np.inf, np.float32)
    if (sampled & (top_p < 1)).any():
        p_floor, p_margins = _top_p_floor(masked, top_p)
    p_floor = np.where(top_p[:, None] < 1, p_floor, np.float32(-np.inf))
    gumbel = -np.log(-np.log(uniforms(seed, step, vocab)))
    perturbed = np.where(masked > p_floor, masked + gumbel, np.float32(-np.inf))
    tokens = np.where(sampled, perturbed.argmax(-1), logits.argmax(-1))
    maximum = logits.max(-1, keepdims=True)
    normalizer = (np.log(np.exp(logits - maximum).sum(-1, keepdims=True)) + maximum)[:, 0]
    top_ids = np.argsort(-logits, axis=-1, kind="stable")[:, :min(top_logprobs, vocab)]
    best_two = -np.sort(-perturbed, axis=-1)[:, :2] if vocab > 1 else np.concatenate([perturbed, perturbed - np.inf], 1)
    margins = np.where(sampled, np.minimum(best_two[:, 0] - best_two[:, 1], np.where(top_p < 1, p_margins, np.inf)), np.inf)
    return {"tokens": tokens.astype(np.int64), "logprobs": np.take_along_axis(logits, tokens[:, None], 1)[:, 0] - normalizer,
            "top_ids": top_ids, "top_logprobs": np.take_along_axis(logits, top_ids, 1) - normalizer[:, None], "margins": margins}


def _top_k_floor(scaled: np.ndarray, k: np.ndarray) -> np.ndarray:
    """export/sampling.py's top_k_floor."""
    low, high = scaled.min(-1, keepdims=True), scaled.max(-1, keepdims=True)
    for _ in range(BISECTION_STEPS):
        middle = low + (high - low) * np.float32(0.5)
        enough = (scaled >= middle).sum(-1, keepdims=True) >= k[:, None]
        low, high = np.where(enough, middle, low), np.where(enough, high, middle)
    return low


def _top_p_floor(masked: np.ndarray, top_p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """export/sampling.py's top_p_floor, and per row the closest a step's mass came to p."""
    with np.errstate(invalid="ignore"):
        exponentials = np.exp(masked - masked.max(-1, keepdims=True))
    probabilities = exponentials / exponentials.sum(-1, keepdims=True)
    low = np.where(np.isinf(masked), np.float32(np.inf), masked).min(-1, keepdims=True) - np.float32(1)
    high = masked.max(-1, keepdims=True)
    margins = np.full(len(masked), np.inf, np.float32)
    for _ in range(BISECTION_STEPS):
        middle = low + (high - low) * np.float32(0.5)
        mass = np.where(masked > middle, probabilities, np.float32(0)).sum(-1, keepdims=True, dtype=np.float32)
        margins = np.minimum(margins, np.abs(mass - top_p[:, None])[:, 0])
        below_p = mass < top_p[:, None]
        low, high = np.where(below_p, low, middle), np.where(below_p, middle, high)
    return low, margins


@dataclasses.dataclass(frozen=True)
class Draw:
    """One row's draw: its request's sampling, the row's key (Sampling.row_keys) and the index of the
    token it draws (its step: 0 for a row's first generated token)."""

    sampling: Sampling
    key: int
    step: int


# The sample entry point's inputs for a row that draws nothing (an idle cache slot, a padding row).
_IDLE = Draw(Sampling(), 0, 0)


def sampling_inputs(draws: Sequence[Draw | None], count: int) -> list[np.ndarray]:
    """The sample entry point's per-row inputs (temperature, top_p, top_k, seed, step) for `count`
    rows of logits, row i drawing draws[i] (greedy where None or beyond them)."""
    rows = [draw or _IDLE for draw in draws] + [_IDLE] * (count - len(draws))
    return [np.array([row.sampling.temperature for row in rows], np.float32), np.array([row.sampling.top_p for row in rows], np.float32),
            np.array([row.sampling.top_k for row in rows], np.int64), np.array([row.key for row in rows], np.int64),
            np.array([row.step for row in rows], np.int64)]


def draw_tokens(run, entry_points, logits, draws: Sequence[Draw | None], top: bool = False) -> SampledTokens:
    """The next token of each row of `logits` (the first len(draws) rows' are returned): the program's
    sample entry point through `run` where it has one (the logits may stay on the device: only the
    tokens, their logprobs and, with `top`, the top ones come to the host), else the NumPy reference
    on the host (an artifact converted before it had one; the same draws).

    Args:
      run: the session's runner, (entry point, inputs) -> outputs.
      entry_points: the program's entry points (by name).
      logits: [rows, vocab] from prefill or decode (host or device array).
      draws: per row, its Draw (None: greedy, e.g. an idle slot).
      top: whether the top TOP_LOGPROBS alternatives are wanted.
    """
    inputs = sampling_inputs(draws, logits.shape[0])
    if "sample" in entry_points:
        tokens, logprobs, top_ids, top_logprobs = run("sample", [logits, *inputs])
    else:
        reference = sample_reference(np.asarray(logits), *inputs)
        tokens, logprobs, top_ids, top_logprobs = (reference[name] for name in ("tokens", "logprobs", "top_ids", "top_logprobs"))
    # Copied whole, then cut on the host: slicing a device array would compile and run a gather on the
    # devices (on every device of a multi-host slice, from this process alone).
    rows = len(draws)
    return SampledTokens(np.asarray(tokens)[:rows], np.asarray(logprobs)[:rows], np.asarray(top_ids)[:rows] if top else None,
                         np.asarray(top_logprobs)[:rows] if top else None)
