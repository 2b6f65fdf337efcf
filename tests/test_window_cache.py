"""A KV cache bounded by the sliding window: a model whose every layer attends within one window
W < max_context (Mistral, Mixtral, Phi-3) keeps W positions per cache slot, a ring (position p at
index p mod W). Max context 32 > 4W with W 8, so prompts are longer than the window and decode
wraps the ring several times; verified token for token against Hugging Face generate(), whose
own sliding-window attention is the reference. Planted ring bugs fail that verification."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers

import tpuexport
from test_generation import lowered_entry_point, tiny_qwen2
from tpuexport import export as export_stage
from tpuexport import lower as lower_stage
from tpuexport.export.generation import Decode, Prefill, PrefillCache, ring_prefill_positions
from tpuexport.verify import verify_generation
from tpuexport.verify.generation import eager_generate

WINDOW, MAX_CONTEXT, MAX_BATCH, NEW_TOKENS = 8, 32, 2, 12


def tiny_mistral(**options) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.MistralConfig(**{**dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                                  sliding_window=WINDOW), **options})
    return transformers.MistralForCausalLM(config).eval()


@pytest.fixture(scope="module")
def mistral_ring(tmp_path_factory):
    """A tiny Mistral (window 8) converted for v5e and the cpu target, verified over 12 new tokens
    per prompt from buckets of 12 and 20 tokens (prompts of 20, 12, 5 and 3 tokens): (artifact, model)."""
    model = tiny_mistral()
    artifact = tpuexport.convert(model, task="text-generation", max_context=MAX_CONTEXT, max_batch=MAX_BATCH,
                                 buckets={"seq": [12, 20], "batch": [MAX_BATCH]}, target=["v5e", "cpu"], verify_new_tokens=NEW_TOKENS,
                                 out=tmp_path_factory.mktemp("mistral") / "mistral.tpu")
    return artifact, model


def test_the_cache_keeps_the_window_and_verifies_past_it(mistral_ring):
    artifact, _ = mistral_ring
    manifest = artifact.manifest
    generation = manifest["generation"]
    layers, kv_heads, head_dim = 2, 2, 16
    assert generation["cache_window"] == WINDOW
    assert generation["cache_shape"] == [layers, MAX_BATCH, kv_heads, WINDOW, head_dim]
    assert generation["cache_bytes"] == 2 * layers * MAX_BATCH * kv_heads * WINDOW * head_dim * 4  # a quarter of 32 positions'
    verification = manifest["verification"]
    assert verification["passed"] and verification["tokens_compared"] == 2 * MAX_BATCH * NEW_TOKENS
    # Prompts longer than 2W and shorter than W, each decoding 12 steps: the ring wraps at least once per row.
    assert sorted(length for case in verification["cases"] for length in case["lengths"]) == [3, 5, 12, 20]
    decode = next(bucket for bucket in manifest["targets"]["v5e"]["buckets"] if bucket["entry_point"] == "decode")
    assert decode["decode_step"]["cache_bytes"] == generation["cache_bytes"]
    assert decode["memory"]["alias_bytes"] >= generation["cache_bytes"]
    assert tpuexport.verify_artifact(artifact.path).passed  # `tpuexport verify` replays the stored cases over the ring


def test_runtime_generates_to_the_end_of_the_context_as_generate_does(mistral_ring):
    """The host keeps absolute positions: Artifact.generate and the runtime's stream (the cpu
    executables, the cache on the device) wrap the ring three times and match generate()."""
    artifact, model = mistral_ring
    prompts = [list(range(1, 20)), [99, 3, 7]]  # 19 tokens (> 2W) and 3
    new_tokens = MAX_CONTEXT - 19
    expected = [eager_generate(model, prompt, new_tokens)[0] for prompt in prompts]
    generated = artifact.generate(prompts, max_new_tokens=new_tokens)
    assert generated == expected
    streamed = [[] for _ in prompts]
    for step in tpuexport.runner(artifact.path).stream(prompts, max_new_tokens=new_tokens):
        for row, token in enumerate(step):
            streamed[row].append(token)
    assert streamed == expected


class AbsolutePositionDecode(Decode):
    """Writes and selects the step's key at its absolute position, not p mod W (clamped onto index W - 1)."""

    def ring_indexes(self, positions):
        return positions


class WindowEdgeDecode(Decode):
    """The ring's mask off by one at the window's edge: the oldest key in the window (q - W + 1) hidden."""

    def hidden_states(self, tokens, mask, positions, cache, keys):
        window = self.spec.cache_window
        oldest = (positions[:, 0] + 1) % window
        edge = torch.arange(window)[None, :] == oldest[:, None]
        hidden = edge & (positions[:, :1] >= window - 1)
        mask = torch.where(hidden[:, None, None], torch.finfo(mask.dtype).min, mask)
        return super().hidden_states(tokens, mask, positions, cache, keys)


class BucketTailPrefill(Prefill):
    """Keeps the bucket's last W positions instead of each row's: a row shorter than the bucket
    writes padding over its real keys."""

    class cache_type(PrefillCache):
        def kept(self, new):
            steps = torch.full_like(self.kept_columns[:, 0], new.shape[2])
            self.kept_columns = ring_prefill_positions(steps, self.kept_columns.shape[1])
            return super().kept(new)


@pytest.mark.parametrize("buggy", [AbsolutePositionDecode, WindowEdgeDecode, BucketTailPrefill], ids=lambda cls: cls.__name__)
def test_planted_ring_bugs_fail_verification(mistral_ring, buggy):
    artifact, model = mistral_ring
    good = artifact.generation_program
    spec = dataclasses.replace(good.spec, prefill_buckets=(20,))  # prompts of 20 and 5 tokens, decoding 12 steps
    name = "decode" if issubclass(buggy, Decode) else "prefill"
    entry_points = {**good.entry_points, name: lowered_entry_point(buggy(model, spec), spec, name)}
    report = verify_generation(lower_stage.GenerationProgram(spec, entry_points, good.prefill_batches), model, new_tokens=NEW_TOKENS)
    assert not report.passed and "(cpu run)" in report.failure_summary()
    assert report.cases[0].runs["cpu"].logits.relative_rms_error > 1e-3


def eager_greedy_logits(model, spec, prompts: list[list[int]], steps: int) -> torch.Tensor:
    """The eager entry points of `spec` driven greedily (prefill into slots in reverse order, then
    decode steps): logits [rows, steps, vocab]."""
    modules = export_stage.entry_point_modules(model, spec)
    cache = [torch.zeros(shape, dtype=getattr(torch, dtype)) for shape, dtype in spec.cache_tensors().values()]
    seq = max(len(prompt) for prompt in prompts)
    tokens = torch.zeros((len(prompts), seq), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = torch.tensor(prompt)
    lengths = torch.tensor([len(prompt) for prompt in prompts])
    slots = torch.arange(len(prompts) - 1, -1, -1)
    with torch.no_grad():
        output = modules["prefill"](tokens, lengths, slots, *cache)
        logits = [output["logits"]]
        for _ in range(steps - 1):
            cache = [output[name] for name in spec.cache_inputs]
            order = torch.argsort(slots)
            output = modules["decode"](logits[-1].argmax(-1)[order], (lengths + len(logits) - 1)[order], *cache)
            logits.append(output["logits"][slots])
    return torch.stack(logits, 1)


def tiny_phi3() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=128, sliding_window=WINDOW, pad_token_id=0)
    return transformers.Phi3ForCausalLM(config).eval()


def tiny_mixtral() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=128, sliding_window=WINDOW, num_local_experts=4,
                                        num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config).eval()


@pytest.mark.parametrize("family", [tiny_phi3, tiny_mixtral], ids=["phi3", "mixtral"])
def test_ring_entry_points_generate_what_generate_does(family):
    """Phi-3 and Mixtral (their windows applied to every layer, as Mistral's): the eager ring entry
    points' greedy tokens and logits are generate()'s, 11 steps from prompts of 21 and 4 tokens."""
    model = family()
    spec = export_stage.generation_spec(model, MAX_BATCH, MAX_CONTEXT, prefill_buckets=(24,))
    assert spec.cache_window == WINDOW
    prompts = [list(range(3, 24)), [5, 9, 11, 2]]
    logits = eager_greedy_logits(model, spec, prompts, 11)
    for row, prompt in enumerate(prompts):
        tokens, expected = eager_generate(model, prompt, 11)
        assert logits[row].argmax(-1).tolist() == tokens
        np.testing.assert_allclose(logits[row].numpy(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv_cache_dtype, prompts", [
    ("model", [list(range(3, 24)), [5, 9, 11, 2]]),
    ("int8", [list(range(3, 24)), [5, 9, 11, 2]]),
    ("model", [[7, 1, 4, 4, 9], [30, 2]]),  # a prefill bucket shorter than the window
    ("model", [list(range(40, 48)), list(range(50, 59))]),  # prompts of W and W + 1 tokens
], ids=["model", "int8", "bucket-below-window", "window-edge"])
def test_ring_computes_what_the_full_cache_does(kv_cache_dtype, prompts):
    """Eagerly, the ring and the max-context cache give the same logits for 11 steps (an int8 ring
    rounds each key as the full cache does: scales per position too)."""
    model = tiny_mistral()
    ring = export_stage.generation_spec(model, MAX_BATCH, MAX_CONTEXT, prefill_buckets=(24,), kv_cache_dtype=kv_cache_dtype)
    full = export_stage.generation_spec(model, MAX_BATCH, MAX_CONTEXT, prefill_buckets=(24,), kv_cache_dtype=kv_cache_dtype,
                                        sliding_window_cache="full")
    assert ring.cache_window == WINDOW and ring.cache_shape[3] == WINDOW and full.cache_window is None and full.cache_shape[3] == MAX_CONTEXT
    if kv_cache_dtype == "int8":
        assert ring.scale_shape == (2, MAX_BATCH, 2, WINDOW)
    torch.testing.assert_close(eager_greedy_logits(model, ring, prompts, 11), eager_greedy_logits(model, full, prompts, 11),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model, max_context, options, positions", [
    (tiny_mistral, MAX_CONTEXT, {"sliding_window_cache": "full"}, MAX_CONTEXT),
    (tiny_mistral, WINDOW, {}, WINDOW),  # the window is no shorter than the context: nothing to bound
    (lambda: tiny_mistral(sliding_window=None), MAX_CONTEXT, {}, MAX_CONTEXT),
    (tiny_qwen2, MAX_CONTEXT, {"sliding_window_cache": "full"}, MAX_CONTEXT),  # mixed layer types, unbounded
], ids=["full", "window-not-shorter", "no-window", "mixed-layer-types-full"])
def test_which_caches_are_bounded(model, max_context, options, positions):
    spec = export_stage.generation_spec(model(), MAX_BATCH, max_context, prefill_buckets=(max_context,), **options)
    assert spec.cache_shape[3] == positions and (spec.cache_window is None) == (positions == max_context)
    assert ("cache_window" in spec.to_json()) == (spec.cache_window is not None)


def tiny_gemma2() -> transformers.PreTrainedModel:
    """Layer 0 attends within the window, layer 1 to every position."""
    torch.manual_seed(0)
    config = transformers.Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=WINDOW)
    return transformers.Gemma2ForCausalLM(config).eval()


def tiny_gemma3() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                                           sliding_window=WINDOW, sliding_window_pattern=2)
    return transformers.Gemma3ForCausalLM(config).eval()


def test_mixed_layer_types_keep_the_sliding_layers_rings_apart():
    """Gemma 2 (sliding, full): the full layer keeps 32 positions in cache_k/cache_v, the sliding
    one a ring of 8 in window_cache_k/window_cache_v; lowered and verified against
    generate() over prompts of 20 and 5 tokens + 12 new each."""
    model = tiny_gemma2()
    spec = export_stage.generation_spec(model, MAX_BATCH, MAX_CONTEXT, prefill_buckets=(20,))
    assert spec.window_layers == (0,) and spec.cache_window == WINDOW
    assert spec.cache_shape == (1, MAX_BATCH, 2, MAX_CONTEXT, 16) and spec.window_cache_shape == (1, MAX_BATCH, 2, WINDOW, 16)
    assert spec.cache_inputs == ("cache_k", "cache_v", "window_cache_k", "window_cache_v")
    assert export_stage.GenerationSpec.from_json(spec.to_json()) == spec
    modules = export_stage.entry_point_modules(model, spec)
    entry_points = {name: lowered_entry_point(modules[name], spec, name) for name in ("prefill", "decode")}
    assert [tensor.name for tensor in entry_points["decode"].signature.inputs] == ["tokens", "positions", *spec.cache_inputs]
    report = verify_generation(lower_stage.GenerationProgram(spec, entry_points, (MAX_BATCH,)), model, new_tokens=NEW_TOKENS)
    assert report.passed, report.failure_summary()
    assert report.tokens_compared() == MAX_BATCH * NEW_TOKENS


@pytest.mark.parametrize("family", [tiny_qwen2, tiny_gemma3], ids=["qwen2", "gemma3"])
def test_mixed_ring_entry_points_generate_what_generate_does(family):
    model = family()
    spec = export_stage.generation_spec(model, MAX_BATCH, MAX_CONTEXT, prefill_buckets=(24,))
    assert spec.window_layers and len(spec.window_layers) < spec.layers
    for prompts in ([list(range(3, 24)), [5, 9, 11, 2]], [[7, 1, 4, 4, 9], [30, 2]]):
        logits = eager_greedy_logits(model, spec, prompts, 11)
        for row, prompt in enumerate(prompts):
            tokens, expected = eager_generate(model, prompt, 11)
            assert logits[row].argmax(-1).tolist() == tokens
            np.testing.assert_allclose(logits[row].numpy(), expected, atol=1e-4, rtol=1e-4)


def test_a_plan_splits_the_sliding_layers_rings_as_the_cache(tmp_path):
    with torch.device("meta"):
        model = tiny_gemma2()
    artifact = tpuexport.convert(model, task="text-generation", max_context=MAX_CONTEXT, max_batch=MAX_BATCH, weights=False,
                                 buckets={"seq": [20], "batch": [MAX_BATCH]}, target="v5e-4", sharding="tensor-parallel",
                                 mesh="model=2,data=2", out=tmp_path / "plan.tpu")
    generation = artifact.manifest["generation"]
    assert generation["window_layers"] == [0] and generation["window_cache_shape"] == [1, MAX_BATCH, 2, WINDOW, 16]
    target = artifact.manifest["targets"]["v5e-4"]
    for bucket in (bucket for bucket in target["buckets"] if bucket["entry_point"] != "sample"):  # sample takes no cache
        for name in generation["cache_inputs"]:
            assert target["sharding"][bucket["entry_point"]]["inputs"][name] == [None, "data", "model", None, None]
        if bucket["entry_point"] == "decode":
            assert bucket["decode_step"]["cache_bytes"] == generation["cache_bytes"] // 4


def test_int8_kv_with_mixed_rings_is_refused_in_one_line():
    with pytest.raises(tpuexport.TpuExportError, match="int8 with the window-bounded cache of Gemma2ForCausalLM .* "
                                                       "add --sliding-window-cache full"):
        export_stage.generation_spec(tiny_gemma2(), MAX_BATCH, MAX_CONTEXT, kv_cache_dtype="int8")
    assert export_stage.generation_spec(tiny_gemma2(), MAX_BATCH, MAX_CONTEXT, kv_cache_dtype="int8",
                                        sliding_window_cache="full").cache_window is None


def test_ring_prefill_keeps_each_rows_last_window_never_padding():
    lengths = torch.tensor([20, 5, 8, 9])
    kept = ring_prefill_positions(lengths, WINDOW)
    assert kept[0].tolist() == [16, 17, 18, 19, 12, 13, 14, 15]  # positions 12..19 at p mod 8
    assert kept[1].tolist() == [0, 1, 2, 3, 4, 4, 4, 4]  # a copy of the last real key past the prompt
    assert kept[2].tolist() == list(range(8)) and kept[3].tolist() == [8, 1, 2, 3, 4, 5, 6, 7]
    assert bool((kept < lengths[:, None]).all())


def test_bad_sliding_window_cache_is_one_line(tmp_path):
    from click.testing import CliRunner

    from tpuexport.cli import main

    source = tmp_path / "lm.py"
    source.write_text("import transformers\n\ndef build():\n    return transformers.MistralForCausalLM(transformers.MistralConfig(vocab_size=64, "
                      "hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, "
                      "sliding_window=4)).eval()\n")
    result = CliRunner().invoke(main, ["convert", f"{source}:build", "--task", "text-generation", "--max-context", "16",
                                       "--sliding-window-cache", "ring", "--target", "v5e", "-o", str(tmp_path / "lm.tpu")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "unknown --sliding-window-cache 'ring'; use one of bounded, full" in lines[0]
    assert not (tmp_path / "lm.tpu").exists()


def tiny_mimo_v2_flash() -> transformers.PreTrainedModel:
    """MiMo-V2-Flash's layers: a full one caching 2 kv heads, then two sliding ones caching twice as
    many (4) with attention sinks; values narrower than keys (v_head_dim 8, head_dim 16)."""
    torch.manual_seed(0)
    config = transformers.MiMoV2FlashConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, v_head_dim=8,
                                            max_position_embeddings=128, sliding_window=WINDOW, mlp_layer_types=["dense"] * 3,
                                            layer_types=["full_attention", "sliding_attention", "sliding_attention"])
    model = transformers.MiMoV2FlashForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.self_attn.sinks.normal_()
    return model


def test_sliding_layers_with_more_kv_heads_keep_their_own_rings():
    """The sliding layers' rings hold their 4 heads, the full layer's cache its 2; verified against generate()."""
    model = tiny_mimo_v2_flash()
    spec = export_stage.generation_spec(model, MAX_BATCH, MAX_CONTEXT, prefill_buckets=(20,))
    assert spec.window_layers == (1, 2) and spec.window_kv_heads == 4
    assert spec.cache_shape == (1, MAX_BATCH, 2, MAX_CONTEXT, 16) and spec.window_cache_shape == (2, MAX_BATCH, 4, WINDOW, 16)
    assert export_stage.GenerationSpec.from_json(spec.to_json()) == spec
    modules = export_stage.entry_point_modules(model, spec)
    entry_points = {name: lowered_entry_point(modules[name], spec, name) for name in ("prefill", "decode")}
    report = verify_generation(lower_stage.GenerationProgram(spec, entry_points, (MAX_BATCH,)), model, new_tokens=NEW_TOKENS)
    assert report.passed, report.failure_summary()
    assert report.tokens_compared() == MAX_BATCH * NEW_TOKENS


def test_sliding_layers_with_more_kv_heads_in_one_cache_are_refused_in_one_line():
    model = tiny_mimo_v2_flash()
    with pytest.raises(tpuexport.TpuExportError, match="sliding layers cache 4 kv heads x 16 and its full layers 2 x 16, which one cache cannot hold"):
        export_stage.generation_spec(model, MAX_BATCH, MAX_CONTEXT, sliding_window_cache="full")
    with pytest.raises(tpuexport.TpuExportError, match="--kv-cache paged: MiMoV2FlashForCausalLM's full and sliding layers cache 2 kv heads x 16 and 4"):
        export_stage.paged_spec(model, MAX_BATCH, MAX_CONTEXT, None, None, None, None)
    assert export_stage.generation_spec(tiny_gemma2(), MAX_BATCH, MAX_CONTEXT).window_kv_heads == 0  # same heads: as before
