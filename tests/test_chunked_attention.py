"""Chunked attention (Llama 4's "chunked_attention" layers) in text generation: a query at position q
sees the keys k <= q of its own chunk of attention_chunk_size positions (k // C == q // C). Their keys
are kept for every position, as a full layer's, and the chunk lives in the masks, static and paged.
Llama 4's layers without rotary embeddings also scale their queries by a temperature of their
position, which the model counts from the cache's length; the entry points give it the true one.
A tiny Llama 4 (chunks of 8, temperature steps every 4 positions) is verified token for token
against Hugging Face generate(); planted chunk and temperature bugs fail it."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers

import tpuexport
from test_generation import lowered_entry_point
from tpuexport import export as export_stage
from tpuexport import lower as lower_stage
from tpuexport.export import generation as generation_capture
from tpuexport.export.generation import Decode
from tpuexport.verify import verify_generation

MAX_CONTEXT, MAX_BATCH, NEW_TOKENS, CHUNK = 32, 2, 8, 8


def tiny_llama4() -> transformers.PreTrainedModel:
    """Two chunked layers with rotary embeddings and a full one without (and so with the temperature),
    mixture-of-experts feed-forward in the second; floor_scale 4: the temperature changes every 4
    positions (Llama 4's is 8192)."""
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, intermediate_size_mlp=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, attention_chunk_size=CHUNK, floor_scale=4, attn_scale=0.5,
        no_rope_layers=[1, 1, 0], moe_layers=[1], num_local_experts=4, pad_token_id=0,
        layer_types=["chunked_attention", "chunked_attention", "full_attention"])
    model = transformers.Llama4ForCausalLM(config).eval()
    with torch.no_grad():  # weights large enough that the chunks and the temperature change the tokens
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(std=0.1)
    return model


@pytest.fixture(scope="module")
def llama4():
    """(model, spec, its entry points lowered)."""
    model = tiny_llama4()
    spec = export_stage.generation_spec(model, MAX_BATCH, MAX_CONTEXT, prefill_buckets=(24,))
    modules = export_stage.entry_point_modules(model, spec)
    return model, spec, {name: lowered_entry_point(modules[name], spec, name) for name in ("prefill", "decode")}


def verified(model, spec, entry_points):
    return verify_generation(lower_stage.GenerationProgram(spec, entry_points, (MAX_BATCH,)), model, new_tokens=NEW_TOKENS)


def test_chunked_layers_keep_every_position_and_generate_what_generate_does(llama4):
    """Prompts of up to 24 tokens (three chunks) and 8 new tokens each, rows of different lengths in
    one prefill batch: every chunked layer's keys are in the one cache, and the tokens are generate()'s."""
    model, spec, entry_points = llama4
    assert spec.cache_shape[0] == 3 and spec.cache_window is None and spec.window_layers == ()
    report = verified(model, spec, entry_points)
    assert report.passed, report.failure_summary()
    assert report.tokens_compared() == MAX_BATCH * NEW_TOKENS and len(set(report.cases[0].lengths)) == MAX_BATCH


class UnchunkedDecode(Decode):
    """Decode whose chunked layers see every earlier key."""

    def __init__(self, model, spec):
        super().__init__(model, spec)
        self.chunks = {}


def test_planted_chunk_bug_fails_verification(llama4):
    model, spec, entry_points = llama4
    report = verified(model, spec, {**entry_points, "decode": lowered_entry_point(UnchunkedDecode(model, spec), spec, "decode")})
    assert not report.passed and "(cpu run)" in report.failure_summary()


def test_queries_without_their_positions_temperature_fail_verification(llama4, monkeypatch):
    """Decode lowered without `positions_known`: the model's own count gives every step position 0's
    temperature."""
    model, spec, entry_points = llama4
    monkeypatch.setattr(generation_capture, "positions_known", lambda model, positions, keys: contextlib.nullcontext())
    decode = export_stage.entry_point_modules(model, spec)["decode"]
    report = verified(model, spec, {**entry_points, "decode": lowered_entry_point(decode, spec, "decode")})
    assert not report.passed and "(cpu run)" in report.failure_summary()


def test_chunked_layers_over_pages_generate_what_generate_does(tmp_path):
    """The paged step masks each chunked layer's queries to their chunk of the row's pages: verified at
    conversion, and the runtime's tokens past two chunk boundaries are generate()'s."""
    model = tiny_llama4()
    artifact = tpuexport.convert(model, task="text-generation", max_context=MAX_CONTEXT, max_batch=MAX_BATCH, kv_cache="paged",
                                 page_size=8, buckets={"tokens": [16]}, target="cpu", saved_model=False, verify_new_tokens=NEW_TOKENS,
                                 out=tmp_path / "llama4.tpu")
    assert artifact.manifest["verification"]["passed"]
    prompt = [5, 17, 42, 7, 11, 23, 8, 61, 9, 2, 30, 4]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert artifact.generate(prompt, 12, ignore_eos=True) == [expected[0, len(prompt):].tolist()]
