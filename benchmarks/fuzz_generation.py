"""Property-based fuzzing of text-generation conversions: random small decoder LMs (family, layers,
heads, grouped key/value heads, head size, vocabulary, tied embeddings, sliding windows, dtype,
cache slots and context, prefill buckets) converted with `--task text-generation` for the cpu
target, then generated from with fresh prompts up to the last position of the context and compared
with Hugging Face generate(), token for token and logits within the conversion's tolerances; and
the runtime's loaded cpu executables (what `tpuexport generate` and `serve` run) generate what the
verified program does.

    python benchmarks/fuzz_generation.py --examples 40 [--seed 0] [--log FILE]
    python benchmarks/fuzz_generation.py --summarize FILE [FILE ...]

Prints the cases run, the outcomes (ok, refused with one line, verify-failed, silent-mismatch,
crash), refusals by reason, every failure's case, and last `silent mismatches: K` (must be 0).
A silent mismatch is an artifact whose conversion verified and whose fresh prompts do not match
generate(), or whose executables generate other tokens than its program; a crash is a conversion raising anything but TpuExportError / VerificationError.
Weight-only modes are not drawn here (their reference is the dequantized model; fuzz.py covers
their lowering), nor is int8 PT2E (its entry points are calibrated per conversion).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import tempfile
import time
import traceback
import warnings

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fuzz_models import Outcome, refusal_reason  # noqa: E402

# Prompts per fresh check: the conversion verified seeds 0.. (one per prefill bucket); these are new.
FRESH_SEED = 1000
FAMILIES = ("llama", "qwen2", "mistral", "gemma", "gpt2")


@dataclasses.dataclass(frozen=True)
class GenerationCase:
    """One random decoder LM and its text-generation conversion."""

    family: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    window: int | None
    dtype: str
    max_batch: int
    max_context: int
    prefill_seq: tuple[int, ...]
    seed: int

    def describe(self) -> str:
        window = f" window {self.window}" if self.window else ""
        return (f"{self.family} {self.layers}L {self.heads}/{self.kv_heads}h x {self.head_dim} vocab {self.vocab}"
                f"{' tied' if self.tied else ''}{window} {self.dtype} cache {self.max_batch}x{self.max_context} "
                f"prefill {list(self.prefill_seq)} seed {self.seed}")


@st.composite
def generation_cases(draw, families: tuple[str, ...] = FAMILIES) -> GenerationCase:
    family = draw(st.sampled_from(families))
    heads = draw(st.sampled_from((1, 2, 4)))
    # GPT-2 has no grouped key/value heads.
    kv_heads = heads if family == "gpt2" else draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0]))
    max_context = draw(st.sampled_from((16, 24, 40)))
    prefill = tuple(sorted(draw(st.sets(st.sampled_from((4, 8, 16)), min_size=1, max_size=2))))
    window = draw(st.sampled_from((None, 3, 8))) if family in ("mistral", "qwen2") else None
    return GenerationCase(
        family=family, layers=draw(st.integers(1, 2)), heads=heads, kv_heads=kv_heads,
        head_dim=draw(st.sampled_from((8, 16, 32))), vocab=draw(st.integers(40, 300)), tied=draw(st.booleans()), window=window,
        dtype=draw(st.sampled_from(("float32", "bfloat16"))), max_batch=draw(st.integers(1, 3)), max_context=max_context,
        prefill_seq=tuple(seq for seq in prefill if seq < max_context), seed=draw(st.integers(0, 2**16)))


def build(case: GenerationCase):
    """The case's transformers causal LM, random weights from its seed, in its dtype."""
    import torch
    import transformers

    torch.manual_seed(case.seed)
    hidden = case.heads * case.head_dim
    if case.family == "gpt2":
        config = transformers.GPT2Config(vocab_size=case.vocab, n_embd=hidden, n_layer=case.layers, n_head=case.heads,
                                         n_positions=case.max_context, tie_word_embeddings=case.tied)
        model = transformers.GPT2LMHeadModel(config)
    else:
        common = dict(vocab_size=case.vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=case.layers,
                      num_attention_heads=case.heads, num_key_value_heads=case.kv_heads, head_dim=case.head_dim,
                      max_position_embeddings=case.max_context, tie_word_embeddings=case.tied)
        if case.family == "llama":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
        elif case.family == "gemma":
            model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**common))
        elif case.family == "mistral":
            model = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=case.window))
        else:
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, use_sliding_window=case.window is not None,
                                                                           sliding_window=case.window, max_window_layers=1))
    return model.to(getattr(torch, case.dtype)).eval()


def runtime_mismatch(artifact, case: GenerationCase) -> str | None:
    """What users run: the cpu executables loaded by the runtime (tpuexport.runner) generate, from
    a full batch of prompts of different lengths to the end of the context, what the artifact's
    verified program generates on CPU (Artifact.stream). None when they do, else the first difference."""
    import tpuexport

    generator = np.random.default_rng(case.seed + FRESH_SEED)
    longest = max(case.prefill_seq or (case.max_context,))
    prompts = [generator.integers(0, case.vocab, int(generator.integers(2, longest + 1))).tolist() for _ in range(case.max_batch)]
    expected = list(artifact.stream(prompts, case.max_context))
    for step, (ran, verified) in enumerate(zip(tpuexport.runner(artifact.path).stream(prompts, case.max_context), expected)):
        if list(ran) != list(verified):
            return f"step {step}: runtime {list(ran)} vs program {list(verified)} (prompt lengths {[len(p) for p in prompts]})"
    return None


def check(case: GenerationCase) -> Outcome:
    """Converts a case for the cpu target and generates from fresh prompts against generate()."""
    import tpuexport
    from tpuexport.errors import TpuExportError, VerificationError
    from tpuexport.verify import verify_generation

    try:
        model = build(case)
        with tempfile.TemporaryDirectory(prefix="tpuexport-fuzz-generation-") as scratch:
            buckets = {"seq": list(case.prefill_seq)} if case.prefill_seq else None
            artifact = tpuexport.convert(model, task="text-generation", max_context=case.max_context, max_batch=case.max_batch,
                                         buckets=buckets, target="cpu", out=pathlib.Path(scratch) / "case.tpu", saved_model=False)
            # Fresh prompts, and as many new tokens as the context holds: the last positions are reached.
            report = verify_generation(artifact.generation_program, model, new_tokens=case.max_context, first_seed=FRESH_SEED)
            runtime = runtime_mismatch(artifact, case) if report.passed else None
    except TpuExportError as error:
        return Outcome("refused", refusal_reason(error), str(error))
    except VerificationError as error:
        return Outcome("verify-failed", "verification failed", str(error))
    except Exception as error:  # a traceback the user would see
        return Outcome("crash", type(error).__name__, "".join(traceback.format_exception(error))[-3000:])
    if not report.passed:
        return Outcome("silent-mismatch", "fresh prompts do not match generate()", report.failure_summary())
    if runtime:
        return Outcome("silent-mismatch", "the runtime's executables do not generate what the program does", runtime)
    return Outcome("ok", detail=f"{report.tokens_compared()} tokens, {report.ties()} tie(s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", type=pathlib.Path, help="append one line per case here as it finishes")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated families to draw from (default: all)")
    parser.add_argument("--summarize", type=pathlib.Path, nargs="+", metavar="LOG", help="print these logs' figures and exit")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    warnings.filterwarnings("ignore")
    started = time.perf_counter()

    @seed(args.seed)
    @settings(max_examples=args.examples, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(generation_cases(tuple(args.families.split(","))))
    def run(case: GenerationCase) -> None:
        outcome = check(case)
        line = "\t".join((f"{time.perf_counter() - started:.0f}", outcome.kind, outcome.reason, case.describe(),
                          outcome.detail.replace("\n", " ")[:2000] if outcome.kind in ("silent-mismatch", "crash") else ""))
        print(line, flush=True)
        if args.log:
            with args.log.open("a") as log:
                log.write(line + "\n")

    run()
    if args.log:
        summarize([args.log])


def summarize(logs: list[pathlib.Path]) -> None:
    """Prints the figures of logged runs added up (fuzz.py's summary, by family and dtype), and last
    `silent mismatches: K`."""
    import fuzz

    fuzz.summarize(logs, lambda description: f"{description.split()[0]} {_dtype(description)}", "family, dtype")


def _dtype(description: str) -> str:
    return "bf16" if " bfloat16 " in description else "f32"


if __name__ == "__main__":
    main()
