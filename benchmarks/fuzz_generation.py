"""Property-based fuzzing of text-generation conversions: random small decoder LMs (family, layers,
heads, grouped key/value heads, head size, vocabulary, tied embeddings, sliding windows, dtype,
cache slots and context, prefill buckets) converted with `--task text-generation` for the cpu
target, then generated from with fresh prompts up to the last position of the context and compared
with Hugging Face generate(), token for token and logits within the conversion's tolerances; and
the runtime's loaded cpu executables (what `tpuexport generate` and `serve` run) generate what the
verified program does. `--kinds encoder-decoder` draws random small encoder-decoders instead (BART,
T5, Whisper: layers, heads, d_model, vocabulary, position limits, T5's relative buckets and
feed-forward, Whisper's mel bins and source positions, dtype, cache slots and context, source and
encode batch buckets, initializer or wider weights): encode + decode through verification with
fresh sources, and the runtime's executables from a full batch of fresh sources. `--kinds paged`
draws the decoder LMs converted with `--kv-cache paged` (page size, token budgets, max batch down to
one row): the step driven as verification drives it, with fresh prompts prefilled in chunks beside
another row's decode tokens, to the last position of the context, and the runtime's executables from
a full batch of prompts longer than the largest budget. `--kinds conv` draws LFM2s: short-convolution
layers (kernel 2-4) among attention layers in any order, their states in the cache beside the keys.

    python benchmarks/fuzz_generation.py --examples 40 [--seed 0] [--kinds decoder,encoder-decoder,paged,conv] [--log FILE]
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
import tempfile
import time
import traceback
import warnings

import numpy as np
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

import _common  # noqa: F401  (the checkout first on sys.path)
from fuzz_models import Outcome, refusal_reason

# Prompts per fresh check: the conversion verified seeds 0.. (one per prefill bucket); these are new.
FRESH_SEED = 1000
FAMILIES = ("llama", "qwen2", "mistral", "gemma", "gpt2")
SEQ2SEQ_FAMILIES = ("bart", "t5", "whisper")
KINDS = ("decoder", "encoder-decoder", "paged", "conv")


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
    page_size: int | None = None  # --kv-cache paged: positions per page; prefill_seq then holds the token budgets
    conv_layers: tuple[int, ...] = ()  # an LFM2's short-convolution layers (the others attend)
    conv_kernel: int = 0

    def describe(self) -> str:
        window = f" window {self.window}" if self.window else ""
        buckets = f"paged {self.page_size} tokens {list(self.prefill_seq)}" if self.page_size else f"prefill {list(self.prefill_seq)}"
        if self.conv_layers:
            window += f" conv layers {list(self.conv_layers)} kernel {self.conv_kernel}"
        return (f"{self.family} {self.layers}L {self.heads}/{self.kv_heads}h x {self.head_dim} vocab {self.vocab}"
                f"{' tied' if self.tied else ''}{window} {self.dtype} cache {self.max_batch}x{self.max_context} "
                f"{buckets} seed {self.seed}")


@st.composite
def generation_cases(draw) -> GenerationCase:
    family = draw(st.sampled_from(FAMILIES))
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


@st.composite
def paged_cases(draw) -> GenerationCase:
    """A decoder case over pages: the page size divides max context or not, token budgets below it or above."""
    case = draw(generation_cases())
    page_size = draw(st.sampled_from([size for size in (2, 4, 8, 16) if size <= case.max_context]))
    tokens = tuple(sorted(draw(st.sets(st.sampled_from((4, 8, 16)), min_size=1, max_size=2))))
    return dataclasses.replace(case, max_batch=draw(st.integers(1, 3)), prefill_seq=tokens, page_size=page_size)


@st.composite
def conv_cases(draw) -> GenerationCase:
    """An LFM2: short-convolution layers (kernel 2-4) among attention layers, at least one of each, in any order."""
    case = draw(generation_cases())
    layers = draw(st.integers(2, 4))
    conv = draw(st.lists(st.booleans(), min_size=layers, max_size=layers).filter(lambda kinds: any(kinds) and not all(kinds)))
    return dataclasses.replace(case, family="lfm2", layers=layers, window=None, conv_kernel=draw(st.integers(2, 4)),
                               conv_layers=tuple(index for index, is_conv in enumerate(conv) if is_conv))


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
        elif case.family == "lfm2":
            layer_types = ["conv" if index in case.conv_layers else "full_attention" for index in range(case.layers)]
            model = transformers.Lfm2ForCausalLM(transformers.Lfm2Config(**common, conv_L_cache=case.conv_kernel, layer_types=layer_types))
        elif case.family == "mistral":
            model = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=case.window))
        else:
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, use_sliding_window=case.window is not None,
                                                                           sliding_window=case.window, max_window_layers=1))
    return model.to(getattr(torch, case.dtype)).eval()


@dataclasses.dataclass(frozen=True)
class Seq2SeqFuzzCase:
    """One random encoder-decoder and its text-generation conversion. `positions`: BART's
    max_position_embeddings or Whisper's max_target_positions (T5's are relative: None);
    `source_buckets`: --bucket seq= (Whisper: its max_source_positions, 2 frames each);
    `encode_batches`: --bucket batch= (None: the default, 1 and max batch); `weight_std`: every
    weight but the norms drawn normal(0, std) (None: the initializer's, whose argmax tends to repeat a token)."""

    family: str
    layers: int
    heads: int
    d_model: int
    vocab: int
    positions: int | None
    t5_buckets: int
    t5_gated: bool
    tied: bool
    mel_bins: int
    dtype: str
    max_batch: int
    max_context: int
    source_buckets: tuple[int, ...]
    encode_batches: tuple[int, ...] | None
    weight_std: float | None
    seed: int

    def describe(self) -> str:
        if self.family == "whisper":
            details = f" mel {self.mel_bins} source {self.source_buckets[0]} targets {self.positions}"
        elif self.family == "t5":
            details = f" buckets {self.t5_buckets}{' gated' if self.t5_gated else ''}{' tied' if self.tied else ''} source {list(self.source_buckets)}"
        else:
            details = f" positions {self.positions} source {list(self.source_buckets)}"
        batches = "" if self.encode_batches is None else f" encode {list(self.encode_batches)}"
        weights = "" if self.weight_std is None else f" std {self.weight_std}"
        return (f"{self.family} {self.layers}L {self.heads}h d{self.d_model} vocab {self.vocab}{details} {self.dtype} "
                f"cache {self.max_batch}x{self.max_context}{batches}{weights} seed {self.seed}")


@st.composite
def seq2seq_cases(draw) -> Seq2SeqFuzzCase:
    family = draw(st.sampled_from(SEQ2SEQ_FAMILIES))
    heads = draw(st.sampled_from((1, 2, 4)))
    max_batch = draw(st.integers(1, 3))
    if family == "whisper":
        # Real Whisper has more source positions (1500) than target positions (448): both orders are drawn.
        source_buckets = (draw(st.sampled_from((4, 8, 16, 32))),)
    else:
        source_buckets = tuple(sorted(draw(st.sets(st.sampled_from((4, 8, 16)), min_size=1, max_size=2))))
    encode_batches = draw(st.one_of(st.none(), st.sets(st.integers(1, max_batch), min_size=1).map(lambda batches: tuple(sorted(batches)))))
    return Seq2SeqFuzzCase(
        family=family, layers=draw(st.integers(1, 2)), heads=heads,
        d_model=draw(st.sampled_from([size for size in (16, 24, 32, 48, 64) if size % heads == 0 and size // heads >= 4])),
        vocab=draw(st.integers(40, 300)), positions=None if family == "t5" else draw(st.sampled_from((16, 32, 64))),
        t5_buckets=draw(st.sampled_from((8, 16, 32))), t5_gated=draw(st.booleans()), tied=draw(st.booleans()),
        mel_bins=draw(st.sampled_from((4, 8, 16))), dtype=draw(st.sampled_from(("float32", "bfloat16"))), max_batch=max_batch,
        max_context=draw(st.sampled_from((8, 16, 24, 32))), source_buckets=source_buckets, encode_batches=encode_batches,
        weight_std=draw(st.sampled_from((None, 0.15))), seed=draw(st.integers(0, 2**16)))


def build_seq2seq(case: Seq2SeqFuzzCase):
    """The case's transformers encoder-decoder LM, random weights from its seed, in its dtype."""
    import torch
    import transformers

    torch.manual_seed(case.seed)
    ffn = 2 * case.d_model
    if case.family == "t5":
        config = transformers.T5Config(vocab_size=case.vocab, d_model=case.d_model, d_kv=case.d_model // case.heads, d_ff=ffn,
                                       num_layers=case.layers, num_decoder_layers=case.layers, num_heads=case.heads,
                                       relative_attention_num_buckets=case.t5_buckets, feed_forward_proj="gated-gelu" if case.t5_gated else "relu",
                                       tie_word_embeddings=case.tied, decoder_start_token_id=0)
        model = transformers.T5ForConditionalGeneration(config)
    else:
        common = dict(vocab_size=case.vocab, d_model=case.d_model, encoder_layers=case.layers, decoder_layers=case.layers,
                      encoder_attention_heads=case.heads, decoder_attention_heads=case.heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn)
        if case.family == "bart":
            model = transformers.BartForConditionalGeneration(transformers.BartConfig(**common, max_position_embeddings=case.positions))
        else:
            config = transformers.WhisperConfig(**common, num_mel_bins=case.mel_bins, max_source_positions=case.source_buckets[0],
                                                max_target_positions=case.positions, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                decoder_start_token_id=1)
            model = transformers.WhisperForConditionalGeneration(config)
    if case.weight_std is not None:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "norm" not in name:
                    parameter.normal_(0.0, case.weight_std)
    return model.to(getattr(torch, case.dtype)).eval()


def seq2seq_runtime_mismatch(artifact, case: Seq2SeqFuzzCase) -> str | None:
    """The runtime's cpu executables generate, from a full batch of fresh sources (token sources of
    different lengths up to the longest bucket; random features), to the end of the context, what
    the verified program generates on CPU (Artifact.stream). None when they do, else the first difference."""
    import tpuexport

    generator = np.random.default_rng(case.seed + FRESH_SEED)
    spec = artifact.generation_program.spec
    if spec.source == "features":
        sources = generator.standard_normal((case.max_batch, *spec.features)).astype(np.float32)
    else:
        sources = [generator.integers(0, case.vocab, int(generator.integers(1, spec.max_source + 1))).tolist() for _ in range(case.max_batch)]
    expected = list(artifact.stream(sources, case.max_context))
    ran = list(tpuexport.runner(artifact.path).stream(sources, case.max_context))
    if len(ran) != len(expected):
        return f"runtime {len(ran)} steps vs program {len(expected)}"
    for step, (ran_step, verified) in enumerate(zip(ran, expected)):
        if list(ran_step) != list(verified):
            return f"step {step}: runtime {list(ran_step)} vs program {list(verified)}"
    return None


def runtime_mismatch(artifact, case: GenerationCase) -> str | None:
    """What users run: the cpu executables loaded by the runtime (tpuexport.runner) generate, from
    a full batch of prompts of different lengths to the end of the context, what the artifact's
    verified program generates on CPU (Artifact.stream). None when they do, else the first difference."""
    import tpuexport

    generator = np.random.default_rng(case.seed + FRESH_SEED)
    # Over pages a prompt longer than the largest token budget is prefilled in chunks.
    longest = case.max_context // 2 if case.page_size else max(case.prefill_seq or (case.max_context,))
    prompts = [generator.integers(0, case.vocab, int(generator.integers(2, longest + 1))).tolist() for _ in range(case.max_batch)]
    expected = list(artifact.stream(prompts, case.max_context))
    for step, (ran, verified) in enumerate(zip(tpuexport.runner(artifact.path).stream(prompts, case.max_context), expected)):
        if list(ran) != list(verified):
            return f"step {step}: runtime {list(ran)} vs program {list(verified)} (prompt lengths {[len(p) for p in prompts]})"
    return None


def check(case: GenerationCase | Seq2SeqFuzzCase) -> Outcome:
    """Converts a case for the cpu target and generates from fresh prompts (or sources) against generate()."""
    import tpuexport
    from tpuexport.errors import TpuExportError, VerificationError
    from tpuexport.verify import verify_generation, verify_paged_generation, verify_seq2seq

    encoder_decoder = isinstance(case, Seq2SeqFuzzCase)
    try:
        with tempfile.TemporaryDirectory(prefix="tpuexport-fuzz-generation-") as scratch:
            if encoder_decoder:
                model = build_seq2seq(case)
                buckets = {"seq": list(case.source_buckets)} if case.family != "whisper" else {}
                if case.encode_batches is not None:
                    buckets["batch"] = list(case.encode_batches)
            else:
                model = build(case)
                buckets = {"tokens" if case.page_size else "seq": list(case.prefill_seq)} if case.prefill_seq else {}
            paged = dict(kv_cache="paged", page_size=case.page_size) if getattr(case, "page_size", None) else {}
            artifact = tpuexport.convert(model, task="text-generation", max_context=case.max_context, max_batch=case.max_batch,
                                         buckets=buckets or None, target="cpu", out=pathlib.Path(scratch) / "case.tpu", saved_model=False,
                                         **paged)
            # Fresh prompts, and as many new tokens as the context holds: the last positions are reached.
            verify = verify_seq2seq if encoder_decoder else verify_paged_generation if paged else verify_generation
            # Over pages, half the context for prompts prefilled in chunks and half for new tokens.
            new_tokens = case.max_context // 2 if paged else case.max_context
            report = verify(artifact.generation_program, model, new_tokens=new_tokens, first_seed=FRESH_SEED)
            runtime = (seq2seq_runtime_mismatch if encoder_decoder else runtime_mismatch)(artifact, case) if report.passed else None
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
    parser.add_argument("--kinds", default="decoder", help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--log", type=pathlib.Path, help="append one line per case here as it finishes")
    parser.add_argument("--summarize", type=pathlib.Path, nargs="+", metavar="LOG", help="print these logs' figures and exit")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    kinds = args.kinds.split(",")
    if not kinds or set(kinds) - set(KINDS):
        parser.error(f"--kinds {args.kinds}: give some of {', '.join(KINDS)}")
    strategies = {"decoder": generation_cases(), "encoder-decoder": seq2seq_cases(), "paged": paged_cases(), "conv": conv_cases()}
    warnings.filterwarnings("ignore")
    started = time.perf_counter()

    @seed(args.seed)
    @settings(max_examples=args.examples, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(*(strategies[kind] for kind in kinds)))
    def run(case: GenerationCase | Seq2SeqFuzzCase) -> None:
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
