"""Recurrent layers (Mamba-2's state-space mixers, gated DeltaNet's linear attention: Mamba-2, Granite 4,
Bamba, Nemotron-H, Qwen3-Next, Qwen3.5, Kimi Linear, ...) in text generation: the cache holds each
slot's recurrent state and its short convolution's last inputs beside the attention layers' keys.
Prefill runs each prompt aligned to the end of its bucket, the masked padding before it, so that a
layer's final state is its prompt's alone; decode advances the states by one token. Tiny models are
verified token for token against Hugging Face generate(); planted state bugs fail it."""

from __future__ import annotations

import pytest
import torch
import transformers
from click.testing import CliRunner

import tpuexport
from test_generation import lowered_entry_point
from tpuexport import export as export_stage
from tpuexport import lower as lower_stage
from tpuexport.cli import main
from tpuexport.errors import TpuExportError
from tpuexport.export.cache_states import DecodeRecurrentStates
from tpuexport.export.generation import RecurrentDecode, RecurrentPrefill
from tpuexport.verify import verify_generation
from tpuexport.verify.generation import eager_generate

MAX_CONTEXT, MAX_BATCH, NEW_TOKENS = 32, 2, 8


def tiny_granite4() -> transformers.PreTrainedModel:
    """A Mamba-2 layer (chunks of 8 positions: a 24-token prompt scans three) and an attention layer; no
    padding token, so the padding's embeddings are not zero and only the masks keep them out."""
    torch.manual_seed(0)
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, shared_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
        mamba_n_groups=1, mamba_chunk_size=8, max_position_embeddings=64, position_embedding_type="rope", pad_token_id=None,
        layer_types=["linear_attention", "full_attention"])
    model = transformers.GraniteMoeHybridForCausalLM(config).eval()
    with torch.no_grad():  # weights large enough that a few inputs more or less move the state visibly
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(std=0.1)
    return model


def tiny_mamba2() -> transformers.PreTrainedModel:
    """Two Mamba-2 layers and no attention: cache_k/cache_v hold no layer."""
    torch.manual_seed(0)
    config = transformers.Mamba2Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16,
                                       n_groups=2, chunk_size=8, expand=2, pad_token_id=0)
    return transformers.Mamba2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def granite():
    """(model, spec with one prefill bucket of 24, its entry points lowered)."""
    model = tiny_granite4()
    spec = export_stage.generation_spec(model, MAX_BATCH, MAX_CONTEXT, prefill_buckets=(24,))
    modules = export_stage.entry_point_modules(model, spec)
    return model, spec, {name: lowered_entry_point(modules[name], spec, name) for name in ("prefill", "decode")}


def verified(model, spec, entry_points):
    return verify_generation(lower_stage.GenerationProgram(spec, entry_points, (MAX_BATCH,)), model, new_tokens=NEW_TOKENS)


def test_the_cache_holds_the_states_and_left_padded_prompts_generate_what_generate_does(granite):
    """Rows of different lengths in one prefill batch (the shorter one's padding before it), 8 new tokens each."""
    model, spec, entry_points = granite
    assert spec.cache_inputs == ("cache_k", "cache_v", "conv_state", "recurrent_state") and spec.left_padded
    assert (spec.recurrent_layers, spec.conv_layers, spec.cache_shape[0]) == ((0,), (0,), 1)
    assert spec.recurrent_state_shape == (1, MAX_BATCH, 4, 32, 16) and spec.recurrent_dtype == "float32"
    report = verified(model, spec, entry_points)
    assert report.passed, report.failure_summary()
    assert report.tokens_compared() == MAX_BATCH * NEW_TOKENS and len(set(report.cases[0].lengths)) == MAX_BATCH


def tiny_falcon_h1() -> transformers.PreTrainedModel:
    """Two "hybrid" layers, each an attention and a Mamba-2 mixer side by side (chunks of 8 positions)."""
    torch.manual_seed(0)
    config = transformers.FalconH1Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, mamba_n_heads=16, mamba_d_state=8, mamba_chunk_size=8,
                                         max_position_embeddings=64, pad_token_id=None)
    return transformers.FalconH1ForCausalLM(config).eval()


def tiny_zamba2() -> transformers.PreTrainedModel:
    """A Mamba-2 layer, then a "hybrid" layer: the shared attention block beside a Mamba-2 mixer."""
    torch.manual_seed(0)
    config = transformers.Zamba2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=4, n_mamba_heads=8, mamba_headdim=16, mamba_d_state=16, attention_hidden_size=128,
                                       attention_head_dim=32, layers_block_type=["mamba", "hybrid"], max_position_embeddings=64, chunk_size=8,
                                       pad_token_id=None)
    return transformers.Zamba2ForCausalLM(config).eval()


@pytest.mark.parametrize("model, attending", [(tiny_falcon_h1, (0, 1)), (tiny_zamba2, (1,))], ids=["falcon-h1", "zamba2"])
def test_layers_attending_beside_their_recurrent_state_keep_both_and_generate_what_generate_does(model, attending):
    """Falcon-H1's layers and Zamba2's hybrid layer write keys and a recurrent state (Zamba2's first layer a
    state alone); rows of different lengths in one prefill batch."""
    model = model()
    spec = export_stage.generation_spec(model, MAX_BATCH, MAX_CONTEXT, prefill_buckets=(24,))
    assert spec.attending_recurrent_layers == spec.full_layers == attending and spec.recurrent_layers == (0, 1)
    assert spec.cache_inputs == ("cache_k", "cache_v", "conv_state", "recurrent_state") and spec.cache_shape[0] == len(attending)
    modules = export_stage.entry_point_modules(model, spec)
    report = verified(model, spec, {name: lowered_entry_point(modules[name], spec, name) for name in ("prefill", "decode")})
    assert report.passed, report.failure_summary()
    assert report.tokens_compared() == MAX_BATCH * NEW_TOKENS and len(set(report.cases[0].lengths)) == MAX_BATCH


class UnmaskedPaddingPrefill(RecurrentPrefill):
    """Prefill whose recurrent layers see the padding's tokens: a shorter prompt's state folds them in."""

    def hidden_states(self, tokens, mask, positions, cache, keys, padding=None):
        return super().hidden_states(tokens, mask, positions, cache, keys, padding=torch.ones_like(padding))


class FrozenStates(DecodeRecurrentStates):
    """Returns the states as the step received them: decode never advances them."""

    def written(self):
        return (self.states,)


class FrozenStateDecode(RecurrentDecode):
    recurrent_type = FrozenStates


@pytest.mark.parametrize("buggy", [UnmaskedPaddingPrefill, FrozenStateDecode], ids=lambda cls: cls.__name__)
def test_planted_recurrent_state_bugs_fail_verification(granite, buggy):
    model, spec, entry_points = granite
    name = "decode" if issubclass(buggy, RecurrentDecode) else "prefill"
    report = verified(model, spec, {**entry_points, name: lowered_entry_point(buggy(model, spec), spec, name)})
    assert not report.passed and "(cpu run)" in report.failure_summary()


def test_a_mamba2_artifact_without_attention_generates_what_generate_does(tmp_path):
    model = tiny_mamba2()
    artifact = tpuexport.convert(model, task="text-generation", max_context=MAX_CONTEXT, max_batch=MAX_BATCH, saved_model=False,
                                 buckets={"seq": [16], "batch": [MAX_BATCH]}, target="cpu", verify_new_tokens=4, out=tmp_path / "m2.tpu")
    generation = artifact.manifest["generation"]
    assert generation["cache_shape"][0] == 0 and generation["recurrent_layers"] == [0, 1]
    assert generation["recurrent_state_shape"] == [2, MAX_BATCH, 8, 16, 16]
    prompts = [list(range(1, 15)), [99, 3, 7]]
    assert artifact.generate(prompts, max_new_tokens=12) == [eager_generate(model, prompt, 12)[0] for prompt in prompts]
    inspected = CliRunner().invoke(main, ["inspect", str(artifact.path)])
    assert f"+ recurrent state [2, {MAX_BATCH}, 8, 16, 16] float32 (layers 0,1)" in inspected.stdout


def test_a_mamba_artifact_scans_its_prompt_in_one_loop_and_generates_what_generate_does(tmp_path):
    """Mamba (v1)'s selective scan is a Python loop over the prompt, which torch.export unrolls (a tiny
    Mamba at a bucket of 256 converted in 201 s, 3.4 MB of StableHLO); exported as one scan, its default
    context (2048, recorded by no config field) and that one prefill bucket convert in seconds."""
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8)).eval()
    artifact = tpuexport.convert(model, task="text-generation", max_batch=MAX_BATCH, saved_model=False, target="cpu", verify_new_tokens=4,
                                 out=tmp_path / "mamba.tpu")
    assert artifact.manifest["generation"]["prefill_buckets"] == [2048] and artifact.manifest["verification"]["passed"]
    prefill = (artifact.path / "program" / "prefill" / "stablehlo.mlir").read_text()
    assert "stablehlo.while" in prefill and len(prefill) < 500_000  # the scan a loop, not 2048 steps
    prompts = [list(range(1, 15)), [9, 3, 7]]
    assert artifact.generate(prompts, max_new_tokens=8) == [eager_generate(model, prompt, 8)[0] for prompt in prompts]


def tiny_rwkv() -> transformers.PreTrainedModel:
    return transformers.RwkvForCausalLM(transformers.RwkvConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                                                                intermediate_size=64, context_length=64)).eval()


@pytest.mark.parametrize("model, options, refusal", [
    (tiny_mamba2, {"kv_cache": "paged"}, r"--kv-cache paged: Mamba2ForCausalLM keeps a recurrent state per row .*use --kv-cache static"),
    (tiny_granite4, {"kv_cache_dtype": "int8"}, r"GraniteMoeHybridForCausalLM's recurrent layers with --kv-cache-dtype int8 are not supported"),
    (tiny_mamba2, {"buckets": {"seq": [8, 16]}}, r"recurrent layers take one prefill bucket .*not \[8, 16\]; give one --bucket seq=N"),
    (tiny_rwkv, {}, r"RwkvForCausalLM keeps a recurrent state .* outside transformers' cache, which the prefill/decode entry points cannot hold"),
], ids=["paged", "int8-kv", "two-buckets", "rwkv"])
def test_what_the_recurrent_states_do_not_hold_yet_is_refused_in_one_line(tmp_path, model, options, refusal):
    with pytest.raises(TpuExportError, match=refusal):
        tpuexport.convert(model(), task="text-generation", max_context=MAX_CONTEXT, max_batch=MAX_BATCH, target="cpu",
                          out=tmp_path / "lm.tpu", **options)
    assert not (tmp_path / "lm.tpu").exists()
