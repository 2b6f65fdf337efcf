"""Verification that an encoder-decoder's generation works: the artifact's encode and decode,
driven as a serving engine drives them, against Hugging Face `model.generate(do_sample=False)`.

One case per compiled encode bucket (batch b, source length src): b sources of different lengths
(the longest filling the bucket, the shortest a quarter of it) right-padded to src, encoded into
cache slots in reverse order (a slot is not its row), then N decode steps at max_batch from the
decoder start token, every row at its own position, the other slots idle. The eager reference
generates from each source alone, unpadded, greedily, and returns its raw logits of every step.
Audio sources (Whisper) are b different seeded random feature arrays [mel bins, frames], one case
per encode batch; generate() is given `input_features` (with the model's generation_config swapped
for the defaults, Whisper's generate applies no forced or suppressed tokens: plain greedy). Whisper's
generate() generates at most max_target_positions - 1 tokens, so verification with a max context of
all target positions compares one step fewer than asked.

The rule is verify/generation.py's: both CPU runs teacher-forced with generate's tokens, every
step's logits within the run's float tolerances, and the artifact's argmax equal to generate's
token at every step (a differing argmax whose two eager logits are within the logits tolerance is
a tie).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from tpuexport.logs import quiet_loggers
from tpuexport.lower.seq2seq import Seq2SeqProgram, Seq2SeqSession
from tpuexport.lower.generation import cpu_runner
from tpuexport.verify.generation import (DEFAULT_NEW_TOKENS, MAX_GOLDEN_BYTES, GenerationCase, GenerationReport, artifact_raised,
                                         compare_run, cpu_runs, store_golden_case, stored_cases)
from tpuexport.verify.tolerances import VerificationTolerances, default_tolerances
from tpuexport.verify.topk_ties import TiesToLowestIndex


@dataclasses.dataclass(frozen=True)
class Seq2SeqCase(GenerationCase):
    """One encode bucket's generation (GenerationCase's fields; `lengths` are the sources')."""

    @property
    def label(self) -> str:
        seq = f"_seq{self.sizes['seq']}" if "seq" in self.sizes else ""
        return f"encode batch{self.sizes['batch']}{seq} + {self.new_tokens} tokens"


def plan_sources(program: Seq2SeqProgram, sizes: dict[str, int], new_tokens: int, seed: int) -> tuple[list, list[int], int]:
    """A case's sources (token ids, or float32 audio features [mel bins, frames]), slots and
    new-token count (see the module docstring)."""
    spec = program.spec
    batch = sizes["batch"]
    new_tokens = max(1, min(new_tokens, spec.max_context))
    generator = np.random.default_rng(seed)
    if spec.source == "features":
        sources = [generator.standard_normal(spec.features).astype(np.float32) for _ in range(batch)]
    else:
        seq = sizes["seq"]
        lengths = [int(round(length)) for length in np.linspace(seq, max(1, seq // 4), batch)]
        sources = [[int(token) for token in generator.integers(0, spec.vocab, length)] for length in lengths]
    slots = [spec.max_batch - 1 - row for row in range(batch)]
    return sources, slots, new_tokens


def source_lengths(program: Seq2SeqProgram, sources: list) -> tuple[int, ...]:
    """Each source's length in source positions (audio features fill all of them)."""
    return tuple(program.spec.max_source if program.spec.source == "features" else len(source) for source in sources)


def eager_generate(model: torch.nn.Module, source, new_tokens: int, start: int) -> tuple[list[int], np.ndarray]:
    """generate(do_sample=False) from one unpadded source (token ids, or audio features as a numpy
    array [mel bins, frames], given as `input_features` in the model's dtype): (its new tokens, raw
    logits [steps, vocab]). The model's own generation_config is swapped for the defaults meanwhile
    (no EOS stop, no forced or suppressed tokens: verify/generation.py's eager_generate says why;
    Whisper's generate then adds no logits processor either)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=0, do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=0,
                              decoder_start_token_id=start, output_logits=True, return_dict_in_generate=True)
    own_config = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        # generate() warns about the settings given here (max_length beside max_new_tokens; Whisper's about
        # the suppress-token arguments it passes itself): nothing a user converting a model can act on.
        with torch.no_grad(), quiet_loggers("transformers.generation.utils"), TiesToLowestIndex():
            if isinstance(source, np.ndarray):
                output = model.generate(input_features=torch.from_numpy(source[None]).to(model.dtype), generation_config=config)
            else:
                output = model.generate(torch.tensor([list(source)]), attention_mask=torch.ones((1, len(source)), dtype=torch.long),
                                        generation_config=config)
    finally:
        model.generation_config = own_config
    tokens = [int(token) for token in output.sequences[0, 1:]]
    logits = np.stack([step[0].float().numpy() for step in output.logits])
    return tokens, logits


def teacher_forced_logits(session: Seq2SeqSession, sources, slots, seq: int | None, eager_tokens: list[list[int]]) -> np.ndarray:
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
                   new_tokens: int = DEFAULT_NEW_TOKENS, first_seed: int = 0) -> GenerationReport:
    """Generates with the artifact's encode and decode on CPU and compares with Hugging Face generate.

    Args:
      program: the lowered encoder-decoder program (with weights).
      model: the Hugging Face encoder-decoder it was captured from.
      tolerances: None for the defaults of the program's precision settings.
      new_tokens: tokens generated per source (at most max context).
      first_seed: the seed of the first encode bucket's sources (each next bucket's is one more);
        0 is what a conversion verifies, others give fresh sources.
    Returns:
      The GenerationReport, passed or not, with golden data (sources, eager tokens and logits).
    """
    decode = program.entry_points["decode"]
    tolerances = tolerances or default_tolerances(decode.resolved_precision, decode.matmul_precision, quantized=False)
    runs_programs = cpu_runs(program)
    # Whisper's generate() refuses to generate more than max_target_positions minus its start token (though
    # the last token is never fed back): the reference caps a max-context run one step short of the cache.
    reference_positions = getattr(model.config, "max_target_positions", None) if program.spec.source == "features" else None
    if reference_positions:
        new_tokens = min(new_tokens, reference_positions - 1)
    cases, golden = [], {}
    for index, sizes in enumerate(program.fill_buckets()):
        sources, slots, steps = plan_sources(program, sizes, new_tokens, seed=first_seed + index)
        lengths = source_lengths(program, sources)
        try:
            eager = [eager_generate(model, source, steps, program.spec.decoder_start_token_id) for source in sources]
        except Exception as error:  # the user's model may raise anything
            cases.append(Seq2SeqCase(sizes, lengths, tuple(slots), steps, {}, f"eager generate() raised {type(error).__name__}: {error}"))
            continue
        eager_tokens = [tokens for tokens, _ in eager]
        expected = np.stack([logits for _, logits in eager])
        try:
            actual = {name: teacher_forced_logits(Seq2SeqSession(program, cpu_runner(program, programs)), sources, slots, sizes.get("seq"),
                                                  eager_tokens)
                      for name, programs in runs_programs.items()}
        except Exception as error:  # XLA runtime errors, shape assertions
            cases.append(Seq2SeqCase(sizes, lengths, tuple(slots), steps, {}, artifact_raised(error)))
            continue
        runs = {name: compare_run(logits, expected, eager_tokens, getattr(tolerances, name)) for name, logits in actual.items()}
        stored = store_case(program, golden, index, sources, slots, sizes.get("seq"), eager_tokens, expected)
        cases.append(Seq2SeqCase(sizes, lengths, tuple(slots), steps, runs, golden=stored))
    return GenerationReport(decode.resolved_precision, decode.matmul_precision, tolerances, tuple(cases), golden)


def store_case(program: Seq2SeqProgram, golden: dict[str, np.ndarray], index: int, sources: list, slots: list[int], seq: int | None,
               tokens: list[list[int]], logits: np.ndarray) -> bool:
    """Adds one verified case's golden arrays (store_golden_case; audio sources as
    `<case>/features` [rows, mel bins, frames] float32 instead of padded prompts and lengths).

    Returns:
      Whether the case was stored.
    """
    if program.spec.source == "tokens":
        return store_golden_case(golden, index, sources, slots, seq, tokens, logits)
    arrays = {f"{index}/features": np.stack(sources).astype(np.float32), f"{index}/slots": np.array(slots, np.int32),
              f"{index}/eager_tokens": np.array(tokens, np.int32), f"{index}/eager_logits": logits}
    stored = index == 0 or sum(array.nbytes for array in (*golden.values(), *arrays.values())) <= MAX_GOLDEN_BYTES
    if stored:
        golden.update(arrays)
    return stored


def stored_sources(program: Seq2SeqProgram, golden: dict[str, np.ndarray], cases: list[dict]):
    """The stored cases as verify/generation.py's stored_cases yields them: (manifest case, lengths,
    sources, slots, eager tokens, eager logits); audio sources as their feature arrays."""
    if program.spec.source == "tokens":
        yield from stored_cases(golden, cases)
        return
    for index, case in enumerate(cases):
        if case["golden"]:
            sources = list(golden[f"{index}/features"])
            yield (case, source_lengths(program, sources), sources, [int(slot) for slot in golden[f"{index}/slots"]],
                   [list(map(int, row)) for row in golden[f"{index}/eager_tokens"]], golden[f"{index}/eager_logits"])


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
    for case, lengths, sources, slots, eager_tokens, expected in stored_sources(program, golden, cases):
        runs, error = {}, None
        try:
            for name, programs in runs_programs.items():
                logits = teacher_forced_logits(Seq2SeqSession(program, cpu_runner(program, programs)), sources, slots,
                                               case["sizes"].get("seq"), eager_tokens)
                runs[name] = compare_run(logits, expected, eager_tokens, getattr(tolerances, name))
        except Exception as exception:  # a damaged artifact can raise anything
            runs, error = {}, artifact_raised(exception)
        replayed.append(Seq2SeqCase(case["sizes"], tuple(lengths), tuple(slots), len(eager_tokens[0]), runs, error, golden=True))
    return GenerationReport(decode.resolved_precision, decode.matmul_precision, tolerances, tuple(replayed), {},
                            "stored generate() tokens and logits")
