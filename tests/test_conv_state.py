"""Short-convolution layers (LFM2's "conv" layers) in text generation: besides the attention layers'
keys and values, the cache holds each slot's last inputs to every conv layer's causal convolution
(conv_state), which prefill writes from each prompt's own last tokens and each decode step shifts by
one. A tiny LFM2 (conv, attention, conv, attention; kernel 3) is verified token for token against
Hugging Face generate(), whose own cache is the reference; planted conv-state bugs fail it."""

from __future__ import annotations

import dataclasses

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
from tpuexport.export.cache_states import DecodeConvStates, PrefillConvStates
from tpuexport.export.generation import ConvDecode, ConvPrefill
from tpuexport.verify import verify_generation
from tpuexport.verify.generation import eager_generate

MAX_CONTEXT, MAX_BATCH, NEW_TOKENS, KERNEL, HIDDEN = 32, 2, 8, 3, 64


def tiny_lfm2() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.Lfm2Config(vocab_size=256, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=128, conv_L_cache=KERNEL,
                                     layer_types=["conv", "full_attention", "conv", "full_attention"])
    return transformers.Lfm2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    """The tiny LFM2 converted for the cpu target, verified over 8 new tokens per prompt from prefill
    buckets of 12 and 20 tokens: (artifact, model)."""
    model = tiny_lfm2()
    artifact = tpuexport.convert(model, task="text-generation", max_context=MAX_CONTEXT, max_batch=MAX_BATCH, saved_model=False,
                                 buckets={"seq": [12, 20], "batch": [MAX_BATCH]}, target="cpu", verify_new_tokens=NEW_TOKENS,
                                 out=tmp_path_factory.mktemp("lfm2") / "lfm2.tpu")
    return artifact, model


def test_the_cache_holds_the_attention_layers_keys_and_the_conv_layers_states(lfm2):
    artifact, _ = lfm2
    generation = artifact.manifest["generation"]
    assert generation["cache_inputs"] == ["cache_k", "cache_v", "conv_state"]
    assert generation["conv_layers"] == [0, 2]
    assert generation["cache_shape"] == [2, MAX_BATCH, 2, MAX_CONTEXT, 16]  # the two attention layers only
    assert generation["conv_state_shape"] == [2, MAX_BATCH, HIDDEN, KERNEL]
    verification = artifact.manifest["verification"]
    assert verification["passed"] and verification["tokens_compared"] == 2 * MAX_BATCH * NEW_TOKENS
    decode = next(bucket for bucket in artifact.manifest["targets"]["cpu"]["buckets"] if bucket["entry_point"] == "decode")
    assert decode["memory"]["alias_bytes"] == generation["cache_bytes"]  # the states are donated and updated in place too
    assert tpuexport.verify_artifact(artifact.path).passed
    inspected = CliRunner().invoke(main, ["inspect", str(artifact.path)])
    assert inspected.exit_code == 0 and f"+ conv state [2, {MAX_BATCH}, {HIDDEN}, {KERNEL}] (layers 0,2)" in inspected.stdout


def test_runtime_generates_what_generate_does_from_prompts_longer_and_shorter_than_the_kernel(lfm2):
    """A 19-token prompt beside a 2-token one, shorter than the convolution's 3 inputs (its state is
    zero before position 0), each to the end of the context: the cpu executables' tokens are
    generate()'s."""
    artifact, model = lfm2
    prompts = [list(range(1, 20)), [99, 3]]
    new_tokens = MAX_CONTEXT - 19
    assert artifact.generate(prompts, max_new_tokens=new_tokens) == [eager_generate(model, prompt, new_tokens)[0] for prompt in prompts]


class ShiftedConvStates(PrefillConvStates):
    """Keeps the inputs one position earlier than each row's last: its last real token's input lost."""

    def update_conv_state(self, inputs, layer, kernel=None):
        self.lengths = self.lengths - 1
        try:
            return super().update_conv_state(inputs, layer, kernel)
        finally:
            self.lengths = self.lengths + 1


class UnshiftedConvStates(DecodeConvStates):
    """Returns the states as the step received them: the step's input never kept."""

    def written(self):
        return (self.states,)


class ShiftedConvPrefill(ConvPrefill):
    conv_type = ShiftedConvStates


class UnshiftedConvDecode(ConvDecode):
    conv_type = UnshiftedConvStates


@pytest.mark.parametrize("buggy", [ShiftedConvPrefill, UnshiftedConvDecode], ids=lambda cls: cls.__name__)
def test_planted_conv_state_bugs_fail_verification(lfm2, buggy):
    artifact, model = lfm2
    good = artifact.generation_program
    spec = dataclasses.replace(good.spec, prefill_buckets=(20,))
    name = "decode" if issubclass(buggy, ConvDecode) else "prefill"
    entry_points = {**good.entry_points, name: lowered_entry_point(buggy(model, spec), spec, name)}
    report = verify_generation(lower_stage.GenerationProgram(spec, entry_points, good.prefill_batches), model, new_tokens=NEW_TOKENS)
    assert not report.passed and "(cpu run)" in report.failure_summary()


def tiny_lfm3() -> transformers.PreTrainedModel:
    """A convolution, a sliding layer (window 8) and a full one, as LFM3's layers begin."""
    torch.manual_seed(0)
    config = transformers.Lfm3Config(vocab_size=256, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=128, conv_L_cache=KERNEL, sliding_window=8, pad_token_id=0,
                                     layer_types=["conv", "sliding_attention", "full_attention"])
    return transformers.Lfm3ForCausalLM(config).eval()


def test_conv_states_beside_the_sliding_layers_rings_generate_what_generate_does():
    """LFM3's layers: a convolution, a sliding layer whose window (8) is shorter than the 16-token
    prompts, whose keys are a ring apart, and a full layer; entry points lowered and verified over 8
    new tokens, rows of different lengths in one prefill batch."""
    model = tiny_lfm3()
    spec = export_stage.generation_spec(model, MAX_BATCH, MAX_CONTEXT, prefill_buckets=(16,))
    assert (spec.conv_layers, spec.window_layers, spec.cache_window) == ((0,), (1,), 8)
    assert spec.cache_inputs == ("cache_k", "cache_v", "window_cache_k", "window_cache_v", "conv_state")
    modules = export_stage.entry_point_modules(model, spec)
    entry_points = {name: lowered_entry_point(modules[name], spec, name) for name in ("prefill", "decode")}
    report = verify_generation(lower_stage.GenerationProgram(spec, entry_points, (MAX_BATCH,)), model, new_tokens=NEW_TOKENS)
    assert report.passed, report.failure_summary()
    assert report.tokens_compared() == MAX_BATCH * NEW_TOKENS and len(set(report.cases[0].lengths)) == MAX_BATCH


@pytest.mark.parametrize("options, refusal", [
    ({"kv_cache": "paged"}, r"--kv-cache paged: Lfm2ForCausalLM's short-convolution layers keep a state per row, .*use --kv-cache static"),
    ({"kv_cache_dtype": "int8"}, r"Lfm2ForCausalLM's short-convolution layers with --kv-cache-dtype int8 are not supported yet"),
], ids=["paged", "int8-kv"])
def test_what_the_conv_state_does_not_hold_yet_is_refused_in_one_line(tmp_path, options, refusal):
    with pytest.raises(TpuExportError, match=refusal):
        tpuexport.convert(tiny_lfm2(), task="text-generation", max_context=MAX_CONTEXT, max_batch=MAX_BATCH, target="cpu",
                          out=tmp_path / "lfm.tpu", **options)
    assert not (tmp_path / "lfm.tpu").exists()
