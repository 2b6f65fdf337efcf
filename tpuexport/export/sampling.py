"""The `sample` entry point of a text-generation artifact: next tokens drawn on the device from the
logits prefill or decode left there, so that only token ids and a few logprobs reach the host.

  sample(logits[rows, vocab], temperature[rows], top_p[rows], top_k[rows], seed[rows], step[rows])
      -> {tokens[rows], logprobs[rows], top_ids[rows, N], top_logprobs[rows, N]}

Per row, as Hugging Face's logits processors define the distribution (TemperatureLogitsWarper, then
TopKLogitsWarper, then TopPLogitsWarper, each keeping at least one token):
  temperature 0   the greedy token: argmax of the logits (the first of equal maxima), as generate()
                  with do_sample=False takes it;
  temperature T   z = logits / T;
  top_k k         (k <= 0 or k >= vocab: off) keeps the tokens whose z is at least the k-th largest z;
  top_p p         (p >= 1: off) keeps, in descending order of z, each token whose preceding
                  tokens' probability (softmax of the kept z) is below p: the smallest set whose
                  mass reaches p; a token tied with the last kept one is kept too;
                  both thresholds are found by bisection over the row's values (BISECTION_STEPS
                  halvings, each a compare and a sum over the vocabulary), not by sorting it:
                  XLA:CPU sorted 8 x 128256 logits in 0.48 s, the two bisections take 0.08 s;
  the draw        Gumbel-max: argmax over the kept tokens of z + g, g = -log(-log(u)), which draws
                  token i with probability softmax(z over the kept tokens)_i.

The uniforms u[row, i] come from a counter-based generator: a 32-bit integer hash of (seed, step,
token index), written with int32 wrapping multiplies, xors and masked shifts, which torch.export
captures and XLA computes alike on CPU and TPU; lower/sampling.py computes the same bits in NumPy,
so the artifact's draws for a seed are reproducible and checkable (verify/sampling.py). A row's
draws depend on its seed and step only: not on its cache slot, nor on the other rows.

Logprobs are the model's (log_softmax of the logits, before temperature and truncation, as vLLM
reports them by default): the drawn token's, and the N largest with their ids (ties: lower id first).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from tpuexport.sampling_constants import BISECTION_STEPS, TOP_LOGPROBS

# The rows one call may take: decode's max batch at serving time; the statistical verification
# draws thousands of rows in one call (the compiled buckets are the serving sizes only).
MAX_ROWS = 1 << 16
# lowbias32 (Chris Wellons' 32-bit integer hash): its multipliers as int32 (two's complement).
_MULTIPLIERS = (0x7FEB352D, 0x846CA68B - (1 << 32))
# A uniform is 23 hashed bits m as (m + 0.5) * 2^-23: exact in float32, within [2^-24, 1 - 2^-24]
# (24 bits would round the largest to 1.0, whose Gumbel noise is infinite).
_UNIFORM_SCALE = 1.0 / (1 << 23)


def _shifted_right(bits: torch.Tensor, shift: int) -> torch.Tensor:
    """A logical right shift of int32 bit patterns (>> on int32 is arithmetic: mask the sign's copies)."""
    return (bits >> shift) & ((1 << (32 - shift)) - 1)


def mix32(bits: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int32 bit patterns (multiplication wraps modulo 2^32)."""
    bits = bits ^ _shifted_right(bits, 16)
    bits = bits * _MULTIPLIERS[0]
    bits = bits ^ _shifted_right(bits, 15)
    bits = bits * _MULTIPLIERS[1]
    return bits ^ _shifted_right(bits, 16)


def uniforms(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """u[row, i] in (0, 1), float32: 23 hashed bits of (seed[row], step[row], i), plus half a unit."""
    key = mix32(mix32(seed.to(torch.int32)) + step.to(torch.int32))[:, None]
    index = torch.arange(vocab, dtype=torch.int32, device=seed.device)[None, :]
    bits = mix32(mix32(index ^ key) + key)
    return (_shifted_right(bits, 9).to(torch.float32) + 0.5) * _UNIFORM_SCALE


@torch.library.custom_op("tpuexport::top_k_floor", mutates_args=())
def top_k_floor(scaled: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Per row, the lowest z top-k keeps, by bisection (no sort): the largest t found with at least k
    values >= t, after BISECTION_STEPS halvings of [min z, max z] (adjacent floats: exactly the k-th
    largest z). A row whose k keeps everything (k = vocab) gets about its minimum. Returns [rows, 1].

    An op of its own so that it lowers as one loop (lower/sampling.py: a fori_loop; unrolled, the
    steps made capture, lowering and compilation several times slower). This is its eager meaning."""
    low, high = scaled.min(-1, keepdim=True).values, scaled.max(-1, keepdim=True).values
    for _ in range(BISECTION_STEPS):
        middle = low + (high - low) * 0.5
        enough = (scaled >= middle).sum(-1, keepdim=True) >= top_k[:, None]
        low, high = torch.where(enough, middle, low), torch.where(enough, high, middle)
    return low


@top_k_floor.register_fake
def _(scaled, top_k):
    return scaled.new_empty((scaled.shape[0], 1))


@torch.library.custom_op("tpuexport::top_p_floor", mutates_args=())
def top_p_floor(masked: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the z top-p keeps the tokens above, by bisection (no sort): the largest t found where
    the probability (softmax of `masked`) of the tokens above t is still >= p. Keeping z > t keeps,
    in descending order, each token whose preceding tokens' probability is below p (a token tied
    with the last kept one too). `masked`: z with -inf outside top-k. Returns [rows, 1].

    An op of its own, as top_k_floor. This is its eager meaning."""
    probabilities = torch.softmax(masked, dim=-1)
    finite = torch.where(torch.isinf(masked), torch.full_like(masked, torch.inf), masked)
    low, high = finite.min(-1, keepdim=True).values - 1, masked.max(-1, keepdim=True).values
    for _ in range(BISECTION_STEPS):
        middle = low + (high - low) * 0.5
        below_p = torch.where(masked > middle, probabilities, torch.zeros_like(probabilities)).sum(-1, keepdim=True) < top_p[:, None]
        low, high = torch.where(below_p, low, middle), torch.where(below_p, middle, high)
    return low


@top_p_floor.register_fake
def _(masked, top_p):
    return masked.new_empty((masked.shape[0], 1))


def first_max(values: torch.Tensor) -> torch.Tensor:
    """argmax over the last axis (the first of equal maxima) as a max, then the least index holding
    it: two plain reductions, which XLA:CPU vectorizes (its argmax, one reduction of value-index
    pairs, took 5 ms for 8 x 128256 logits, this 1.6 ms; fused with the Gumbel noise 68 vs 18 ms)."""
    index = torch.arange(values.shape[-1], device=values.device)
    return torch.where(values == values.max(-1, keepdim=True).values, index, values.shape[-1]).min(-1).values


def _no_floor(scaled: torch.Tensor) -> torch.Tensor:
    """[rows, 1] of -inf: a threshold that keeps every token."""
    return torch.full_like(scaled[:, :1], -torch.inf)


class Sample(nn.Module):
    """The sample entry point (module docstring). It holds no weights: the pipeline gives it the
    program's weights as unused arguments, the one calling convention of every entry point.

    A step whose rows are all greedy runs the argmax only; top-k and top-p run when a row asks for
    them (torch.cond: on the device only the taken branch runs)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.top_logprobs = min(TOP_LOGPROBS, vocab)

    def forward(self, logits, temperature, top_p, top_k, seed, step):
        rows = logits.shape[0]
        for per_row in (temperature, top_p, top_k, seed, step):
            torch._check(per_row.shape[0] == rows)
        logits = logits.float()
        greedy = first_max(logits)
        sampled = temperature > 0
        tokens = torch.cond(sampled.any(), self.draw, lambda logits, *_: (first_max(logits),),
                            (logits, temperature, top_p, top_k, seed, step))[0]
        tokens = torch.where(sampled, tokens, greedy)
        normalizer = torch.logsumexp(logits, dim=-1)
        top_values, top_ids = torch.topk(logits, self.top_logprobs, dim=-1)
        return {"tokens": tokens, "logprobs": logits.gather(1, tokens[:, None])[:, 0] - normalizer, "top_ids": top_ids,
                "top_logprobs": top_values - normalizer[:, None]}

    def draw(self, logits, temperature, top_p, top_k, seed, step):
        """The sampled rows' tokens (a greedy row's is meaningless: its temperature is 0)."""
        sampled = temperature > 0
        scaled = self.scale(logits, torch.where(sampled, temperature, torch.ones_like(temperature)))
        k = torch.where((top_k <= 0) | (top_k > self.vocab), torch.full_like(top_k, self.vocab), top_k)
        k_floor = torch.cond((sampled & (k < self.vocab)).any(), lambda scaled, k: (self.k_floor(scaled, k),),
                             lambda scaled, k: (_no_floor(scaled),), (scaled, k))[0]
        masked = torch.where(scaled >= k_floor, scaled, torch.full_like(scaled, -torch.inf))
        p_floor = torch.cond((sampled & (top_p < 1)).any(), lambda masked, top_p: (self.p_floor(masked, top_p),),
                             lambda masked, top_p: (_no_floor(masked),), (masked, top_p))[0]
        p_floor = torch.where(top_p[:, None] < 1, p_floor, _no_floor(masked))
        gumbel = -torch.log(-torch.log(uniforms(seed, step, self.vocab)))
        perturbed = torch.where(masked > p_floor, masked + gumbel, torch.full_like(scaled, -torch.inf))
        return (first_max(perturbed),)

    # The steps as methods: a test plants a bug in one (tests/test_sampling.py).
    def scale(self, logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        return logits / temperature[:, None]

    def k_floor(self, scaled: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return top_k_floor(scaled, k)

    def p_floor(self, masked: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        return top_p_floor(masked, top_p)


def sample_example_arguments(vocab: int) -> tuple[tuple, dict]:
    """The sample entry point's example inputs (two rows) and torch.export dynamic_shapes (rows 1..MAX_ROWS)."""
    rows = torch.export.Dim("rows", min=1, max=MAX_ROWS)
    args = (torch.zeros((2, vocab)), torch.ones(2), torch.ones(2), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long),
            torch.zeros(2, dtype=torch.long))
    return args, tuple({0: rows} for _ in args)


@functools.cache
def sample_program(vocab: int) -> torch.export.ExportedProgram:
    """The sample entry point's program over `vocab` tokens, exported once per process and vocabulary size.

    It depends on nothing else (it holds no weights), and exporting it costs as much as exporting a tiny
    model (0.85 s, most of it torch.cond tracing its branches); every text-generation conversion of
    that vocabulary in the process takes this one program, and lower/lowering.py decomposes it once.
    """
    args, dynamic_shapes = sample_example_arguments(vocab)
    with torch.no_grad():
        return torch.export.export(Sample(vocab), args, dynamic_shapes=dynamic_shapes)
