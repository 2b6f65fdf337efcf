"""Indexed attention (DeepSeek Sparse Attention's "indexed_attention" layers: DeepSeek-V3.2, GLM-MoE-DSA,
HY-V4, AXK2) in text generation: each layer's indexer scores every earlier position with keys of its
own and its attention reads only the top index_topk of them. The cache holds the indexer's keys beside
the layers' (indexer_keys), which prefill writes for the prompt and each decode step for its token.
A tiny DeepSeek-V3.2 choosing 4 of up to 32 keys is verified token for token against Hugging Face
generate(); planted indexer-key bugs fail it."""

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
from tpuexport.export.cache_states import DecodeIndexerKeys, PrefillIndexerKeys
from tpuexport.export.generation import IndexedDecode, IndexedPrefill
from tpuexport.verify import verify_generation
from tpuexport.verify.generation import eager_generate

MAX_CONTEXT, MAX_BATCH, NEW_TOKENS, TOP_K, INDEXER_DIM = 32, 2, 8, 4, 16


def tiny_deepseek_v32(index_topk: int = TOP_K) -> transformers.PreTrainedModel:
    """Two indexed layers (multi-head latent attention; the second's feed-forward a mixture of experts)."""
    torch.manual_seed(0)
    config = transformers.DeepseekV32Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8,
        index_n_heads=4, index_head_dim=INDEXER_DIM, index_topk=index_topk, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, max_position_embeddings=64, pad_token_id=0)
    return transformers.DeepseekV32ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """The tiny DeepSeek-V3.2 converted for the cpu target, prefill buckets of 8 and 24 tokens (two rows),
    verified over 8 new tokens: (model, artifact). Its program's entry points are the good ones the
    planted bugs below replace one of."""
    model = tiny_deepseek_v32()
    artifact = tpuexport.convert(model, task="text-generation", max_context=MAX_CONTEXT, max_batch=MAX_BATCH, saved_model=False,
                                 buckets={"seq": [8, 24], "batch": [MAX_BATCH]}, target="cpu", verify_new_tokens=NEW_TOKENS,
                                 out=tmp_path_factory.mktemp("deepseek") / "ds.tpu")
    return model, artifact


def verified(model, spec, entry_points):
    return verify_generation(lower_stage.GenerationProgram(spec, entry_points, (MAX_BATCH,)), model, new_tokens=NEW_TOKENS)


def test_the_indexer_keys_sit_beside_the_cache_and_generate_what_generate_does(deepseek):
    """Prompts of up to 24 tokens and 8 new tokens each (the conversion's verification against generate()),
    rows of different lengths in one prefill batch; with 4 keys of up to 32 chosen per query, and the same
    weights choosing every key generate other tokens."""
    model, artifact = deepseek
    spec = artifact.generation_program.spec
    assert spec.cache_inputs == ("cache_k", "cache_v", "indexer_keys") and spec.indexed_layers == (0, 1)
    assert spec.indexer_keys_shape == (2, MAX_BATCH, 1, MAX_CONTEXT, INDEXER_DIM)
    verification = artifact.manifest["verification"]
    assert verification["passed"] and [case["sizes"] for case in verification["cases"]] == [{"batch": MAX_BATCH, "seq": 8},
                                                                                             {"batch": MAX_BATCH, "seq": 24}]
    assert verification["tokens_compared"] == 2 * MAX_BATCH * NEW_TOKENS
    assert all(len(set(case["lengths"])) == MAX_BATCH for case in verification["cases"])
    prompt = list(range(3, 23))
    assert eager_generate(model, prompt, NEW_TOKENS)[0] != eager_generate(tiny_deepseek_v32(index_topk=64), prompt, NEW_TOKENS)[0]


class UnwrittenIndexerKeys(PrefillIndexerKeys):
    """Prefill that leaves the slots' indexer keys as they were: decode scores stale (zero) keys."""

    def written(self):
        return (self.keys_received,)

    def __init__(self, keys, layers, slots):
        super().__init__(keys, layers, slots)
        self.keys_received = keys


class OwnKeyUnseen(DecodeIndexerKeys):
    """Decode whose indexer scores the keys as received, without the step's own at its position."""

    def update_indexer(self, new, layer):
        super().update_indexer(new, layer)
        return self.keys[self.index[layer]][:, 0].to(new.dtype)


class UnwrittenPrefill(IndexedPrefill):
    indexer_type = UnwrittenIndexerKeys


class OwnKeyUnseenDecode(IndexedDecode):
    indexer_type = OwnKeyUnseen


@pytest.mark.parametrize("buggy", [UnwrittenPrefill, OwnKeyUnseenDecode], ids=lambda cls: cls.__name__)
def test_planted_indexer_key_bugs_fail_verification(deepseek, buggy):
    model, artifact = deepseek
    good = artifact.generation_program
    spec = dataclasses.replace(good.spec, prefill_buckets=(24,))
    name = "decode" if issubclass(buggy, IndexedDecode) else "prefill"
    entry_points = {entry: good.entry_points[entry] for entry in ("prefill", "decode")}
    report = verified(model, spec, {**entry_points, name: lowered_entry_point(buggy(model, spec), spec, name)})
    assert not report.passed and "(cpu run)" in report.failure_summary()


def test_an_artifact_generates_what_generate_does_and_inspect_names_the_indexer_keys(deepseek):
    model, artifact = deepseek
    generation = artifact.manifest["generation"]
    assert generation["indexed_layers"] == [0, 1] and generation["indexer_keys_shape"] == [2, MAX_BATCH, 1, MAX_CONTEXT, INDEXER_DIM]
    prompts = [list(range(1, 15)), [99, 3, 7]]
    assert artifact.generate(prompts, max_new_tokens=12) == [eager_generate(model, prompt, 12)[0] for prompt in prompts]
    inspected = CliRunner().invoke(main, ["inspect", str(artifact.path)])
    assert f"+ indexer keys [2, {MAX_BATCH}, 1, {MAX_CONTEXT}, {INDEXER_DIM}] (layers 0,1)" in inspected.stdout


@pytest.mark.parametrize("options, refusal", [
    ({"kv_cache": "paged"}, r"--kv-cache paged: DeepseekV32ForCausalLM's indexed attention layers keep indexer keys .*use --kv-cache static"),
    ({"kv_cache_dtype": "int8"}, r"DeepseekV32ForCausalLM's indexed attention layers with --kv-cache-dtype int8 are not supported yet"),
    ({"buckets": {"seq": [2, 16]}}, r"prefill bucket seq=2 is out of range: .*a bucket holds at least the indexer's top 4 keys"),
], ids=["paged", "int8-kv", "bucket-below-top-k"])
def test_what_the_indexer_keys_do_not_hold_yet_is_refused_in_one_line(tmp_path, options, refusal):
    with pytest.raises(TpuExportError, match=refusal):
        tpuexport.convert(tiny_deepseek_v32(), task="text-generation", max_context=MAX_CONTEXT, max_batch=MAX_BATCH, target="cpu",
                          out=tmp_path / "ds.tpu", **options)
    assert not (tmp_path / "ds.tpu").exists()


def test_indexed_layers_beside_sliding_layers_keep_the_rings_apart_and_generate_what_generate_does():
    """dots3's layers: an indexed one choosing 4 keys and a sliding one within 8 with a wider latent, prompts past both."""
    torch.manual_seed(0)
    config = transformers.Dots3NoteTextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=128, shared_experts_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, head_dim=24, index_n_heads=4, index_head_dim=INDEXER_DIM, index_topk=TOP_K, n_routed_experts=4,
        num_experts_per_tok=2, sliding_window=8, max_position_embeddings=64, pad_token_id=0,
        layer_types=["indexed_attention", "sliding_attention"], mlp_layer_types=["dense", "sparse"], swa_num_attention_heads=4,
        swa_num_key_value_heads=4, swa_q_lora_rank=32, swa_kv_lora_rank=48, swa_head_dim=24, swa_qk_nope_head_dim=16, swa_v_head_dim=16)
    model = transformers.Dots3NoteForCausalLM(config).eval()
    spec = export_stage.generation_spec(model, MAX_BATCH, MAX_CONTEXT, prefill_buckets=(24,))
    assert spec.window_layers == (1,) and spec.indexed_layers == (0,) and spec.cache_window == 8
    # Both cache their latent (keys) and rotary key (values) as one head: the sliding layer's latent is wider.
    assert spec.cache_shape[-1] == 32 and spec.window_cache_shape[-1] == 48
    assert spec.cache_inputs == ("cache_k", "cache_v", "window_cache_k", "window_cache_v", "indexer_keys")
    modules = export_stage.entry_point_modules(model, spec)
    report = verified(model, spec, {name: lowered_entry_point(modules[name], spec, name) for name in ("prefill", "decode")})
    assert report.passed, report.failure_summary()
    assert report.tokens_compared() == MAX_BATCH * NEW_TOKENS
