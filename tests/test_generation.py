"""Text generation (--task text-generation): prefill and decode entry points over one KV cache,
verified token for token against Hugging Face generate(do_sample=False); planted cache bugs fail
that verification; `tpuexport generate` and its bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest
import requests
import torch
import transformers

import tpuexport
from conftest import ROOT, served
from test_cli import tpuexport_in_process  # the command line, in this process
from tpuexport.pipeline import ConversionOptions, passes
from tpuexport import export as export_stage
from tpuexport import lower as lower_stage
from tpuexport.export.functional_cache import DecodeCache, write_decode_cache, write_prefill_cache
from tpuexport.export.generation import Decode
from tpuexport.export.cache_specs import CACHE_LAYOUTS
from tpuexport.export.huggingface import generation_context
from tpuexport.lower import generation as lowered_generation
from tpuexport.lower.cpu_dots import fold_transposes_into_dots
from tpuexport.lower.cpu_program import cpu_program, state_positions
from tpuexport.lower.lowered import DeviceState
from tpuexport.lower.stablehlo_rewrite import rewrite_module
from tpuexport.verify import verify_generation
from tpuexport.verify.generation import cpu_runs, plan_prompts, teacher_forced_runs

MAX_CONTEXT, MAX_BATCH = 64, 2


def tiny_llama() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(config).eval()


def tiny_gpt2() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    return transformers.GPT2LMHeadModel(config).eval()


def tiny_mllama_text() -> transformers.PreTrainedModel:
    """A causal LM whose `base_model` is itself: its base_model_prefix "language_model" names no attribute
    (its text model is `model`), as Llama4ForCausalLM's does too."""
    torch.manual_seed(0)
    config = transformers.MllamaTextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, cross_attention_layers=[1], max_position_embeddings=128, pad_token_id=0,
                                           bos_token_id=1, eos_token_id=2)
    return transformers.MllamaForCausalLM(config).eval()


def tiny_opt() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return transformers.OPTForCausalLM(transformers.OPTConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                              ffn_dim=128, max_position_embeddings=128, word_embed_proj_dim=64)).eval()


def tiny_gpt_neo() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.GPTNeoConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                                       window_size=6, max_position_embeddings=128)
    return transformers.GPTNeoForCausalLM(config).eval()


def tiny_qwen2(**options) -> transformers.PreTrainedModel:
    """A tiny Qwen2: layer 0 full attention, layer 1 attends to the last 6 positions only (mixed layer
    types: the model takes a mask per type), unless `options` say otherwise."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**{**dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                                use_sliding_window=True, sliding_window=6, max_window_layers=1), **options})
    return transformers.Qwen2ForCausalLM(config).eval()


def lowered_entry_point(module: torch.nn.Module, spec: export_stage.GenerationSpec, name: str) -> lower_stage.LoweredProgram:
    """One entry point captured and lowered as the pipeline does it."""
    args, dynamic_shapes = export_stage.example_arguments(spec)[name]
    captured = export_stage.capture(export_stage.LoadedSource(module, args, dynamic_shapes, None, export_stage.SourceInfo("api")))
    return lower_stage.lower(captured.program, captured.signature)


@pytest.fixture(scope="session")
def llama_conversion(tmp_path_factory):
    """A tiny Llama converted for text generation, for v5e and the cpu target (the runtime's executables),
    with prefill batches 1 and 2 (the default: a request of one prompt can join a running decode
    batch), as tpuexport.convert does it: (artifact, model, the compiler processes its CompileJob started)."""
    model = tiny_llama()
    out = tmp_path_factory.mktemp("llama") / "llama.tpu"
    options = ConversionOptions(("v5e", "cpu"), out, buckets={"seq": [16]}, task="text-generation", max_context=MAX_CONTEXT,
                                max_batch=MAX_BATCH)
    # Processes of its own (the session's kept ones live on): ended, and so judged, with the block.
    with tpuexport.kept_compilers(), passes(export_stage.LoadedSource(model, None, None, None, export_stage.SourceInfo("api")),
                                            options) as conversion:
        compilers = list(conversion.job.children)
    return tpuexport.load(out), model, compilers


@pytest.fixture(scope="session")
def llama_generation(llama_conversion):
    """(artifact, model) of llama_conversion."""
    artifact, model, _ = llama_conversion
    return artifact, model


def test_one_compiler_process_per_target_compiles_every_entry_point(llama_conversion):
    artifact, _, compilers = llama_conversion
    # Two targets, three entry points: two processes, each started with the request for all of them, all ended.
    assert len(compilers) == 2 and len({child.pid for child in compilers}) == 2
    assert all(child.returncode == 0 for child in compilers)
    compiled = {(target, name) for target in ("v5e", "cpu") for name in artifact.records.entry_points
                if artifact.records.buckets(target, name)}
    assert compiled == {(target, name) for target in ("v5e", "cpu") for name in ("prefill", "decode", "sample")}


def test_llama_artifact_generates_what_generate_does(llama_generation):
    artifact, model = llama_generation
    manifest = artifact.manifest
    verification = manifest["verification"]
    assert verification["passed"] and verification["tokens_compared"] >= MAX_BATCH * 8
    # Every prefill bucket verified; rows of different lengths, right-padded in one prefill bucket, written to slots that are not their rows.
    assert [case["sizes"] for case in verification["cases"]] == [{"batch": 1, "seq": 16}, {"batch": MAX_BATCH, "seq": 16}]
    case = verification["cases"][-1]
    assert case["sizes"] == {"batch": MAX_BATCH, "seq": 16} and len(set(case["lengths"])) == MAX_BATCH and max(case["lengths"]) == 16
    assert case["slots"] == [1, 0]
    # One weights file shared by the entry points; the cache donated and aliased by the compiled executables
    # of prefill and decode; sample draws from their logits and holds no state.
    assert list(manifest["entry_points"]) == ["prefill", "decode", "sample"]
    assert [entry["donated_inputs"] for entry in manifest["entry_points"].values()] == [["cache_k", "cache_v"]] * 2 + [[]]
    assert manifest["program"]["weights"] == "weights/weights.safetensors"
    buckets = {bucket["entry_point"]: bucket for bucket in manifest["targets"]["v5e"]["buckets"]}
    cache_bytes = manifest["generation"]["cache_bytes"]
    assert all(buckets[name]["memory"]["alias_bytes"] >= cache_bytes for name in ("prefill", "decode"))
    assert buckets["decode"]["decode_step"]["xla_bytes_accessed"] > 0
    # Free-running generation through the artifact equals generate() of each prompt alone.
    prompts = [[5, 17, 42, 7], [99, 3]]
    generated = artifact.generate(prompts, max_new_tokens=10)
    for prompt, tokens in zip(prompts, generated):
        expected = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert tokens == expected[0, len(prompt):].tolist()


def test_generate_takes_token_ids_as_a_tensor_as_generate_does(llama_generation):
    """input_ids as transformers' generate() takes them, a tensor [batch, length] (or [length] for one
    prompt), generate what the same ids as lists do; a float tensor is one line."""
    artifact, _ = llama_generation
    prompts = [[5, 17, 42, 7], [99, 3, 8, 1]]
    expected = artifact.generate(prompts, max_new_tokens=4)
    assert artifact.generate(torch.tensor(prompts), max_new_tokens=4) == expected
    assert artifact.generate(torch.tensor(prompts[1]), max_new_tokens=4) == expected[1:]
    with pytest.raises(tpuexport.TpuExportError, match=r"must be integers of shape \[batch, length\] or \[length\]; got float32 \[2, 4\]"):
        artifact.generate(torch.tensor(prompts, dtype=torch.float32))


def tiny_cohere() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.CohereConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=128, logit_scale=0.5)
    return transformers.CohereForCausalLM(config).eval()


def tiny_granite() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.GraniteConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=128, logits_scaling=4.0)
    return transformers.GraniteForCausalLM(config).eval()


def tiny_modernbert_decoder() -> transformers.PreTrainedModel:
    """A prediction head (dense, activation, norm) before the output projection, a sliding layer
    (window 8) beside a full one."""
    torch.manual_seed(0)
    config = transformers.ModernBertDecoderConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=4, max_position_embeddings=128, local_attention=16, pad_token_id=0,
                                                  bos_token_id=1, eos_token_id=2, sep_token_id=2, cls_token_id=1,
                                                  layer_types=["sliding_attention", "full_attention"])
    return transformers.ModernBertDecoderForCausalLM(config).eval()


def tiny_deepseek_v3() -> transformers.PreTrainedModel:
    """Multi-head latent attention (its cache: one latent "head" of kv_lora_rank for keys, the rotary
    part's width for values) and grouped top-k expert routing behind a dense first layer."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
        max_position_embeddings=128)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # transformers zeroes the router's gate: every expert would tie
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0.0, 0.02)
    return model


@pytest.mark.parametrize("family", [tiny_gpt2, tiny_gpt_neo, tiny_deepseek_v3, tiny_modernbert_decoder],
                         ids=["gpt2", "gpt-neo-mask-buffer", "deepseek-v3-latent-cache", "modernbert-decoder-prediction-head"])
def test_entry_points_match_generate(family):
    """GPT-2: learned absolute positions. (Qwen2's sliding-window layer beside a full one, its window
    shorter than the prompt, is verified against generate() in test_window_cache.py's mixed-ring and
    test_paged.py's sliding-window tests.) GPT-Neo masks with a
    fixed [1, 1, P, P] `bias` buffer, banded (window 6) in its local layer, sliced by the keys' count:
    torch.export specialized the prompt length to P, and over the cache the slice's last row would
    mask every decode query as at position P - 1; each such module reads its own mask. (Cohere's and Granite's
    scaled logits, computed by the same LM forward as ModernBERT's head below: the eager test after this one.) DeepSeek-V3 caches
    keys and values of different widths (the cache is as wide as the wider; it once took the
    config's heads x head_dim and failed to export). ModernBERT's decoder puts a prediction head
    before its output projection: the logits once skipped it (every logit off, relative RMS 1.56)."""
    model = family()
    spec = export_stage.generation_spec(model, MAX_BATCH, MAX_CONTEXT, prefill_buckets=(16,))
    modules = export_stage.entry_point_modules(model, spec)
    entry_points = {name: lowered_entry_point(modules[name], spec, name) for name in ("prefill", "decode")}
    report = verify_generation(lower_stage.GenerationProgram(spec, entry_points, (MAX_BATCH,)), model, new_tokens=8)
    assert report.passed, report.failure_summary()
    assert report.tokens_compared() == MAX_BATCH * 8
    assert len(set(report.cases[0].lengths)) == MAX_BATCH  # rows of different lengths in one prefill batch


@pytest.mark.parametrize("family", [tiny_cohere, tiny_granite], ids=["cohere-logit-scale", "granite-logits-scaling"])
def test_the_entry_points_logits_are_scaled_as_the_models_forward_scales_them(family):
    """Cohere multiplies its logits by logit_scale, Granite divides them by logits_scaling (once refused): the
    entry points take the logits from the LM's own forward, so prefill's and each decode step's logits are the
    model's over the whole prefix, scaled. (That the lowered entry points compute what this eager path does, a
    forward after the base model included, test_entry_points_match_generate verifies with ModernBERT's
    prediction head, and test_window_cache.py with Gemma 2's soft-capped logits.)"""
    model = family()
    tokens, logits = stepped_logits(model)
    with torch.no_grad():
        expected = model(tokens).logits[0, 7:].float()
        unscaled = model.lm_head(model.model(tokens).last_hidden_state)[0, 7:].float()
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(expected, unscaled, atol=1e-3)  # the scale changes them


def stepped_logits(model: transformers.PreTrainedModel) -> tuple[torch.Tensor, torch.Tensor]:
    """(a 12-token row, the eager entry points' logits for it: prefill of its first 8 tokens, then a
    decode step a token), the logits of positions 7 to 11, as the model's own over the row are."""
    spec = export_stage.generation_spec(model, 1, 32, prefill_buckets=(8,))
    modules = export_stage.entry_point_modules(model, spec)
    tokens = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = [torch.zeros(shape, dtype=getattr(torch, dtype)) for shape, dtype in spec.cache_tensors().values()]
    with torch.no_grad():
        output = modules["prefill"](tokens[:, :8], torch.tensor([8]), torch.tensor([0]), *cache)
        steps = [output["logits"]]
        for position in range(8, 12):
            output = modules["decode"](tokens[:, position], torch.tensor([position]), *[output[name] for name in spec.cache_inputs])
            steps.append(output["logits"])
    return tokens, torch.cat(steps)


@pytest.mark.parametrize("model, expected", [
    (lambda: tiny_qwen2(layer_types=["full_attention", "chunked_attention"]),
     "Qwen2ForCausalLM has chunked_attention layers but its config gives no attention_chunk_size; set it in config.json"),
], ids=["chunked-attention-without-its-chunk"])
def test_what_the_entry_points_do_not_model_is_refused(tmp_path, model, expected):
    with pytest.raises(tpuexport.TpuExportError, match=expected):
        tpuexport.convert(model(), task="text-generation", max_context=32, max_batch=2, target="v5e", out=tmp_path / "lm.tpu")
    assert list(tmp_path.iterdir()) == []


def test_float_divergence_is_the_first_step_the_rounded_weights_change():
    """A weight-only case against the float model: the earliest differing greedy step over the rows,
    and the SQNR over each row's steps up to it (later steps saw other tokens)."""
    from tpuexport.verify.compare import sqnr_db
    from tpuexport.verify.generation import float_divergence

    generator = np.random.default_rng(0)
    float_logits = generator.normal(size=(2, 5, 16)).astype(np.float32)
    actual = float_logits + generator.normal(scale=0.1, size=float_logits.shape).astype(np.float32)
    float_tokens = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    rounded_tokens = [[1, 2, 3, 4, 11], [6, 7, 12, 9, 10]]  # row 0 leaves at step 4, row 1 at step 2
    divergence = float_divergence(actual, rounded_tokens, [(tokens, logits) for tokens, logits in zip(float_tokens, float_logits)])
    assert divergence.first == {"row": 1, "step": 2, "float_token": 8, "token": 12}
    assert divergence.tokens_compared == 10
    assert divergence.sqnr_db == sqnr_db([float_logits[0], float_logits[1, :3]], [actual[0], actual[1, :3]])
    same = float_divergence(actual, float_tokens, [(tokens, logits) for tokens, logits in zip(float_tokens, float_logits)])
    assert same.first is None and same.sqnr_db == sqnr_db(list(float_logits), list(actual))


class LateWriteCache(DecodeCache):
    """Off by one: writes each new key one position after the token's."""

    def write(self, cache, new, layer):
        on_time = self.positions
        self.positions = on_time + 1
        written = super().write(cache, new, layer)
        self.positions = on_time
        return written


class OffByOneDecode(Decode):
    cache_type = LateWriteCache


class ShiftedRotaryDecode(Decode):
    """The cache is written at the right place, the rotary embedding computed one position late."""

    def hidden_states(self, tokens, mask, positions, cache, keys):
        return super().hidden_states(tokens, mask, positions + 1, cache, keys)


def test_eager_generation_ignores_the_models_own_eos_token():
    """generate() took the EOS token from the model's generation_config and stopped rows early, so
    rows of one case had different lengths (a crash in verification; benchmarks/fuzz_generation.py)."""
    from tpuexport.verify.generation import eager_generate

    model = tiny_llama()
    first, _ = eager_generate(model, [5, 17, 42], 1)
    model.generation_config.eos_token_id = first[0]
    tokens, logits = eager_generate(model, [5, 17, 42], 6)
    assert len(tokens) == 6 and logits.shape == (6, model.config.vocab_size) and tokens[0] == first[0]
    assert model.generation_config.eos_token_id == first[0]  # the model's own config is back


def test_a_fill_over_the_memory_bound_is_verified_with_fewer_rows(llama_generation):
    """A prefill bucket whose CPU fill needs more temporaries than the bound (XLA:CPU's memory
    analysis, before anything runs) is verified with fewer rows, and says so; the bucket is still
    compiled for the TPU as it is."""
    artifact, model = llama_generation
    program = artifact.generation_program
    prefill = program.entry_points["prefill"]
    one_row, two_rows = (prefill.run_temporary_bytes({"batch": batch, "seq": 16}) for batch in (1, 2))
    assert 0 < one_row < two_rows
    only_two_rows = lower_stage.GenerationProgram(program.spec, program.entry_points, (MAX_BATCH,))
    report = verify_generation(only_two_rows, model, new_tokens=4, fill_bytes=one_row)
    [case] = report.cases
    assert report.passed and case.sizes == {"batch": 1, "seq": 16} and len(case.lengths) == 1
    assert case.note.startswith("prefill bucket batch 2 x seq 16 verified at batch 1 x seq 16: its fill needs more than")
    assert report.manifest_section()["cases"][0]["note"] == case.note
    # Within the bound, every bucket runs as compiled.
    assert [case.sizes for case in verify_generation(only_two_rows, model, new_tokens=4, fill_bytes=two_rows).cases] == [{"batch": 2, "seq": 16}]


# One bug per mechanism: the cache written at the wrong position (which also leaves the token's own
# position unwritten: a decode that never writes fails the same way), and a right write with the rotary
# embedding at the wrong position.
@pytest.mark.parametrize("buggy_decode", [OffByOneDecode, ShiftedRotaryDecode], ids=lambda cls: cls.__name__)
def test_planted_cache_bugs_fail_verification(llama_generation, buggy_decode):
    artifact, model = llama_generation
    good = artifact.generation_program
    spec = good.spec
    decode = lowered_entry_point(buggy_decode(model, spec), spec, "decode")
    program = lower_stage.GenerationProgram(spec, {"prefill": good.entry_points["prefill"], "decode": decode}, good.prefill_batches)
    report = verify_generation(program, model, new_tokens=6)
    assert not report.passed
    # The exact f32 run departs from eager, not just the TPU-rounded one.
    assert "(cpu run)" in report.failure_summary()
    case = report.cases[0]
    assert case.runs["cpu"].logits.relative_rms_error > 1e-3


@pytest.mark.parametrize("layout", CACHE_LAYOUTS)
def test_cache_writes_lower_as_their_eager_meaning(layout):
    """The cache writes' JAX lowerings (dynamic_update_slice per row) store what their eager index_put
    stores, positions and slots outside the cache clamped onto it."""
    torch.manual_seed(0)
    shape = (2, 3, 2, 8, 4) if layout == "layer_batch_head_pos" else (2, 3, 8, 2, 4)
    cache = torch.randn(shape)
    new, positions = torch.randn(3, 2, 4), torch.tensor([0, 7, 9])
    eager = write_decode_cache(cache, new, 1, positions, layout)
    lowered = lowered_generation.write_decode_cache(jax.numpy.asarray(cache.numpy()), jax.numpy.asarray(new.numpy()), 1,
                                                    jax.numpy.asarray(positions.numpy()), layout)
    np.testing.assert_array_equal(np.asarray(lowered), eager.numpy())
    prompts, slots = torch.randn(2, 2, 5, 4), torch.tensor([2, 0])
    eager = write_prefill_cache(cache, prompts, 0, slots, layout)
    lowered = jax.jit(lowered_generation.write_prefill_cache, static_argnums=(2, 4))(
        jax.numpy.asarray(cache.numpy()), jax.numpy.asarray(prompts.numpy()), 0, jax.numpy.asarray(slots.numpy()), layout)
    np.testing.assert_array_equal(np.asarray(lowered), eager.numpy())
    assert not torch.equal(eager, cache)


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    """The tiny Llama in bfloat16 converted for the cpu target alone, max context 128 (its decode step's
    temporaries are then well below the cache's size, test_cpu_executables_update_a_bf16_cache_as_bit_patterns),
    one prefill bucket of 2 x 16, 4 new tokens verified, no SavedModel: (artifact, model)."""
    model = tiny_llama().to(torch.bfloat16)
    artifact = tpuexport.convert(model, task="text-generation", max_context=128, max_batch=MAX_BATCH, buckets={"seq": [16], "batch": [MAX_BATCH]},
                                 target="cpu", out=tmp_path_factory.mktemp("bf16_llama") / "llama.tpu", saved_model=False, verify_new_tokens=4)
    return artifact, model


@pytest.fixture(scope="module")
def lowered_llama(request):
    """dtype -> (the tiny Llama in that dtype, its spec with a prefill bucket of 16, its prefill and decode
    lowered): the entry points of a conversion's artifact (f32: llama_generation's, bf16: bf16_llama's),
    which lowers them as lowered_entry_point does; a conversion is made only for the dtypes asked for."""
    conversions = {torch.float32: "llama_generation", torch.bfloat16: "bf16_llama"}

    def lowered(dtype: torch.dtype):
        artifact, model = request.getfixturevalue(conversions[dtype])
        program = artifact.generation_program
        return model, program.spec, {name: program.entry_points[name] for name in ("prefill", "decode")}

    return lowered


def test_cpu_runs_write_a_bf16_cache_in_place(lowered_llama):
    """XLA:CPU widens bfloat16 ops to f32, so each cache write became a convert of the whole cache
    (issue #20: verification's time grew with the square of the layers). The program as the CPU runs
    it (lower/cpu_program.py) writes the cache's bit patterns: the same outputs bit for bit as the
    program with only its dots' transposes folded (cpu_dots.py, which sums in another order), and
    XLA:CPU's updates of the whole cache are ui16 (in place), not f32."""
    _, spec, entry_points = lowered_llama(torch.bfloat16)
    generator = np.random.default_rng(0)
    cache = generator.standard_normal(spec.cache_shape).astype(jax.numpy.bfloat16)
    inputs = {"prefill": [generator.integers(0, 256, (2, 16)), np.array([16, 5]), np.array([1, 0]), cache, cache + 1],
              "decode": [generator.integers(0, 256, 2), np.array([16, 5]), cache, cache + 1]}
    # (whether the update is its fusion's root, so that XLA:CPU runs it in place; its element type)
    cache_updates = re.compile(rf"(ROOT )?%\S+ = (\w+)\[{','.join(map(str, spec.cache_shape))}\]\S* dynamic-update-slice\(")
    for name, arrays in inputs.items():
        lowered = entry_points[name]
        assert lowered.signature.inputs[-1].dtype == "bfloat16"
        weights = [jax.numpy.asarray(weight) for weight in lowered.weights]
        args = [jax.numpy.asarray(array.astype(input_spec.dtype)) for array, input_spec in zip(arrays, lowered.signature.inputs)]
        folded = rewrite_module(lowered.exported, fold_transposes_into_dots)
        as_exported = jax.jit(folded.call).lower(weights, args).compile()
        expected = as_exported(weights, args)

        actual = lowered.run(arrays)

        for output, reference in zip(actual, expected):
            output = np.asarray(output)  # the cache: a DeviceState
            np.testing.assert_array_equal(output.view(np.uint16) if output.dtype == jax.numpy.bfloat16 else output,
                                          np.asarray(reference).view(np.uint16) if reference.dtype == jax.numpy.bfloat16 else reference)
        specs = lowered.signature.inputs
        state = state_positions([s.name for s in specs], [s.name for s in lowered.signature.outputs], [s.dtype for s in specs])
        cpu = cpu_program(lowered.exported, len(weights), state)
        assert cpu.bits_inputs == (len(specs) - 2, len(specs) - 1) and cpu.bits_outputs == (1, 2)  # the cache
        state_args = [jax.numpy.asarray(array.view(np.uint16)) if position in cpu.bits_inputs else array for position, array in enumerate(args)]
        compiled = jax.jit(cpu.exported.call).lower(weights, state_args).compile()
        assert set(cache_updates.findall(compiled.as_text())) == {("ROOT ", "u16")}


def test_a_cpu_runs_cache_is_updated_where_it_lies(lowered_llama):
    """A decode step's bfloat16 cache comes back on the device (a DeviceState) and, passed to the next
    step, is donated to it: the step writes into the same buffer, so verification holds one cache,
    not the step's input and its output (2 GiB at Llama-3.2-1B's 8 x 4096 context)."""
    _, spec, entry_points = lowered_llama(torch.bfloat16)
    decode = entry_points["decode"]
    cache = np.random.default_rng(0).standard_normal(spec.cache_shape).astype(jax.numpy.bfloat16)
    tokens, positions = np.array([3, 4]), np.array([16, 5])
    _, *first = decode.run([tokens, positions, cache, cache])
    assert all(isinstance(state, DeviceState) for state in first)
    buffers = [state.bits.unsafe_buffer_pointer() for state in first]
    logits, *second = decode.run([tokens, positions + 1, *first])
    assert all(state.bits.is_deleted() for state in first)  # donated
    assert [state.bits.unsafe_buffer_pointer() for state in second] == buffers
    _, *again = decode.run([tokens, positions + 1, *decode.run([tokens, positions, cache, cache])[1:]])
    np.testing.assert_array_equal(np.asarray(second[0]).view(np.uint16), np.asarray(again[0]).view(np.uint16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_both_runs_run_once_when_they_are_one_program(lowered_llama, dtype):
    """A bfloat16 program has no f32 matmul for the TPU-faithful rewrite to round: both CPU runs are
    the same program, and verification runs it once for both; an f32 program's runs differ."""
    _, spec, entry_points = lowered_llama(dtype)
    program = lower_stage.GenerationProgram(spec, entry_points, (MAX_BATCH,))
    prompts, slots, steps = plan_prompts(program, {"batch": MAX_BATCH, "seq": 16}, 3, seed=0)
    tokens = [[1] * steps for _ in prompts]

    logits = teacher_forced_runs(program, cpu_runs(program), prompts, slots, 16, tokens)

    assert (logits["tpu"] is logits["cpu"]) == (dtype == torch.bfloat16)
    assert logits["tpu"].shape == (MAX_BATCH, steps, spec.vocab)


def test_generate_cli_prints_tokens_step_by_step(llama_generation):
    artifact, _ = llama_generation
    expected = artifact.generate([[1, 2, 3], [9, 8]], max_new_tokens=5)
    result = tpuexport_in_process("generate", artifact.path, "--tokens", "1,2,3", "--tokens", "9,8", "--max-new-tokens", 5)
    assert result.returncode == 0, result.stderr
    steps = [line.split() for line in result.stdout.strip().splitlines()]
    assert [[int(token) for token in step] for step in steps] == [list(pair) for pair in zip(*expected)]


@pytest.mark.parametrize("arguments, expected", [
    (["--tokens", ",".join(["1"] * (MAX_CONTEXT + 1))], "longer than the artifact's max context"),
    (["--tokens", "1,2", "--tokens", "3", "--tokens", "4"], "exceed the artifact's max batch 2"),
    (["--tokens", "1,x"], "malformed --tokens"),
    (["--tokens", "1,999"], "outside the vocabulary"),
])
def test_generate_bad_input_is_one_line(llama_generation, arguments, expected):
    from click.testing import CliRunner

    from tpuexport.cli import main

    artifact, _ = llama_generation
    result = CliRunner().invoke(main, ["generate", str(artifact.path), *arguments])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.output


def test_text_generation_needs_max_context_unless_the_config_says(tmp_path):
    """A model with no Hugging Face config has no maximum position to default to: one line. A causal
    LM's config gives it, from a factory or the API as from a directory (max_position_embeddings)."""
    from click.testing import CliRunner

    from tpuexport.cli import main

    factory = tmp_path / "lm.py"
    factory.write_text("import torch\n\ndef build():\n    return torch.nn.Linear(4, 4)\n")
    result = CliRunner().invoke(main, ["convert", f"{factory}:build", "--task", "text-generation", "-o", str(tmp_path / "lm.tpu")])
    assert result.exit_code == 2 and "needs --max-context" in result.output
    assert sorted(path.name for path in tmp_path.iterdir()) == ["lm.py"]
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=24)).eval()
    # The conversion as tpuexport.convert(model, task="text-generation", weights=False, target="cpu") runs it, through
    # the export (the cache's positions are decided there; the manifest records the spec's, e.g. test_huggingface.py's).
    options = ConversionOptions(("cpu",), tmp_path / "plan.tpu", weights=False, task="text-generation")
    with passes(export_stage.LoadedSource(model, None, None, None, export_stage.SourceInfo("api")), options, "export") as conversion:
        assert conversion.spec.state.spec.max_context == 24 and conversion.spec.state.spec.to_json()["max_context"] == 24
    # Less a padding offset where positions are numbered past it (RoBERTa).
    roberta = transformers.RobertaForCausalLM(transformers.RobertaConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, max_position_embeddings=66,
        is_decoder=True))
    assert generation_context(roberta) == 64


def test_gate_replays_the_stored_generation(llama_generation):
    artifact, _ = llama_generation
    report = tpuexport.verify_artifact(artifact.path)
    assert report.passed, [check.message for check in report.checks]
    golden = next(check for check in report.checks if check.name == "golden")
    assert "stored generation case(s)" in golden.message and golden.details["cases"][0]["runs"]["cpu"]["passed"]


def test_generation_artifact_refuses_single_program_calls(llama_generation):
    artifact, _ = llama_generation
    with pytest.raises(tpuexport.TpuExportError, match="has no entry point 'serving_default'; it has prefill, decode, sample; use Artifact.generate"):
        artifact.run(np.zeros((1, 4), np.int64))
    assert json.loads(json.dumps(artifact.manifest["generation"]))["layout"] == "layer_batch_head_pos"
    assert dataclasses.asdict(artifact.generation_program.spec)["max_batch"] == MAX_BATCH


def test_runtime_generates_from_the_cpu_executables_with_the_cache_on_the_device(llama_generation):
    artifact, _ = llama_generation
    runner = tpuexport.runner(artifact.path)
    prompts = [[5, 17, 42, 7], [99, 3]]

    generated = [[] for _ in prompts]
    for step in runner.stream(prompts, max_new_tokens=8):
        for row, token in enumerate(step):
            generated[row].append(token)

    assert runner.target == "cpu" and runner.compiled_here is None and set(runner.entry_points) == {"prefill", "decode", "sample"}
    assert generated == artifact.generate(prompts, max_new_tokens=8)
    # The cache comes back as device arrays and goes in again without a copy to the host.
    spec = artifact.generation_program.spec
    cache = [np.zeros(spec.cache_shape, np.float32)] * 2
    prefill = runner.run([np.array([[5, 17] + [0] * 14] * 2), np.array([2, 2]), np.array([0, 1]), *cache], "prefill")
    assert isinstance(prefill["cache_k"], jax.Array) and isinstance(prefill["logits"], np.ndarray)
    decode = runner.run([np.array([1, 2]), np.array([2, 2]), prefill["cache_k"], prefill["cache_v"]], "decode")
    assert decode["logits"].shape == (MAX_BATCH, spec.vocab) and prefill["cache_k"].is_deleted()  # donated, updated in place


def test_cpu_executables_update_a_bf16_cache_as_bit_patterns(bf16_llama):
    """The cpu target's executables take and return a bf16 KV cache as uint16 bit patterns (the form
    XLA:CPU updates in place, lower/cpu_program.py); the runner hands them from step to step and
    generates what the artifact's own CPU run does. A decode step's temporaries stay below the
    cache's size: its writes wait for its reads, so XLA:CPU makes no copy of the cache."""
    artifact, _ = bf16_llama
    buckets = artifact.manifest["targets"]["cpu"]["buckets"]
    assert all(bucket["state_as_bits"] == ["cache_k", "cache_v"] for bucket in buckets if bucket["entry_point"] != "sample")
    (decode,) = [bucket for bucket in buckets if bucket["entry_point"] == "decode"]
    assert decode["memory"]["temp_bytes"] < artifact.generation_program.spec.cache_bytes  # 103,554 with the copy; the cache 65,536

    runner = tpuexport.runner(artifact.path)
    prompts = [[5, 17, 42, 7], [99, 3]]
    assert [list(step) for step in runner.stream(prompts, max_new_tokens=6)] == [list(step) for step in zip(*artifact.generate(prompts, max_new_tokens=6))]
    spec = artifact.generation_program.spec
    cache = [np.zeros(spec.cache_shape, jax.numpy.bfloat16)] * 2
    prefill = runner.run([np.array([[5, 17] + [0] * 14] * 2), np.array([2, 2]), np.array([0, 1]), *cache], "prefill")
    assert prefill["cache_k"].dtype == np.uint16 and np.asarray(prefill["cache_k"]).view(jax.numpy.bfloat16).any()
    bf16_cache = [jax.numpy.asarray(np.asarray(prefill[name]).view(jax.numpy.bfloat16)) for name in ("cache_k", "cache_v")]
    from_bits = runner.run([np.array([1, 2]), np.array([2, 2]), prefill["cache_k"], prefill["cache_v"]], "decode")
    from_bf16 = runner.run([np.array([1, 2]), np.array([2, 2]), *bf16_cache], "decode")
    np.testing.assert_array_equal(from_bits["logits"], from_bf16["logits"])
    np.testing.assert_array_equal(np.asarray(from_bits["cache_v"]), np.asarray(from_bf16["cache_v"]))
    assert prefill["cache_k"].is_deleted()  # donated, updated in place


def test_serve_batches_generate_requests_continuously(llama_generation, tmp_path):
    """Concurrent generate requests share the KV cache's slots and its decode steps; a request that
    finds no free slot waits and joins between two steps of the others; each one streams, as JSON
    lines, the tokens it would get alone."""
    artifact, _ = llama_generation
    with served(artifact.path, tmp_path / "server.log") as base:
        url = f"{base}/v1/models/llama:generate"
        requested = [([5, 17, 42, 7], 4), ([99, 3], 12), ([8, 8, 1], 6)]  # three requests, two slots

        def generate(prompt, max_new_tokens):
            with requests.post(url, json={"prompts": [prompt], "max_new_tokens": max_new_tokens}, stream=True, timeout=120) as answer:
                assert answer.status_code == 200 and answer.headers["content-type"] == "application/x-ndjson"
                return [json.loads(line) for line in answer.iter_lines() if line]

        with ThreadPoolExecutor(len(requested)) as pool:
            answers = list(pool.map(lambda request: generate(*request), requested))
        bad = requests.post(url, json={"prompts": [[5, 100000]], "max_new_tokens": 6}, timeout=60)
        two = requests.post(url, json={"prompts": [[5, 17, 42, 7], [99, 3]], "max_new_tokens": 3}, timeout=60)  # one request, two rows
        metrics = requests.get(f"{base}/metrics", timeout=10).text
        # A client that goes away after its first step frees its slots: its request stops well before
        # the 61 decode steps it asked for (the server notices the closed connection at its next
        # write; on a loaded machine that has taken up to 24 steps, and a cancel that does nothing
        # runs all 61).
        def decode_steps():
            text = requests.get(f"{base}/metrics", timeout=10).text
            return float(re.search(r'tpuexport_decode_rows_count\{model="llama",version="1"\} (\S+)', text).group(1))

        before = decode_steps()
        for _ in range(MAX_BATCH):
            with requests.post(url, json={"prompts": [[5, 17]], "max_new_tokens": MAX_CONTEXT - 2}, stream=True, timeout=120) as abandoned:
                next(abandoned.iter_lines())
        time.sleep(1.0)
        settled = decode_steps()
        time.sleep(1.0)
        assert decode_steps() == settled < before + (MAX_CONTEXT - 2) // 2
        assert generate([99, 3], 2)[-1]["generated"] == artifact.generate([[99, 3]], 2)

        for (prompt, max_new_tokens), lines in zip(requested, answers):
            assert [line["step"] for line in lines[:-1]] == list(range(max_new_tokens))
            (alone,) = artifact.generate([prompt], max_new_tokens=max_new_tokens)
            assert [line["tokens"][0] for line in lines[:-1]] == alone == lines[-1]["generated"][0]
        assert json.loads(two.text.splitlines()[-1])["generated"] == artifact.generate([[5, 17, 42, 7], [99, 3]], 3)
        assert bad.status_code == 400 and "token id 100000 is outside the vocabulary" in bad.json()["error"]
        # Decode steps ran two requests' rows at once: more rows than steps.
        rows = float(re.search(r'tpuexport_decode_rows_sum\{model="llama",version="1"\} (\S+)', metrics).group(1))
        steps = float(re.search(r'tpuexport_decode_rows_count\{model="llama",version="1"\} (\S+)', metrics).group(1))
        assert steps < rows < 2 * steps
        assert 'tpuexport_generated_tokens_total{model="llama",version="1"} ' in metrics
        # OpenAI's API on the same port, for a model converted from Python (no tokenizer): token prompts, no chat.
        completion = requests.post(f"{base}/v1/completions", json={"model": "llama", "prompt": [99, 3], "max_tokens": 3, "temperature": 0},
                                   timeout=60).json()
        assert completion["choices"][0]["token_ids"] == artifact.generate([[99, 3]], 3)[0]
        chat = requests.post(f"{base}/v1/chat/completions", json={"model": "llama", "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert chat.status_code == 400 and chat.json()["error"]["code"] == "chat_template_missing"


PLAN_WITHOUT_THE_CACHE = """
import sys, torch, transformers, tpuexport
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2**17)).eval()
artifact = tpuexport.convert(model, task="text-generation", max_context=2**17, max_batch=64, weights=False, buckets={"seq": [16], "batch": [1]},
                             target="v5e", saved_model=False, out=sys.argv[1])
print(artifact.manifest["generation"]["cache_bytes"], max(peak.anonymous_bytes for peak in artifact.records.stage_memory.values()))
"""


def test_a_plan_does_not_allocate_its_kv_cache(tmp_path):
    """A plan needs the cache's shape only: a tiny model whose cache at 64 x 2^17 is 4 GiB plans in
    a process that never holds it (the cache was once made as zeros on the CPU: 8 GiB for Llama-3-8B
    at 32 x 2048). Anonymous memory is what the process owns; the total resident size also counts
    the pages of torch's and JAX's shared libraries, which vary by machine (over 2 GiB on CI with
    torch's CUDA build, 1.1 GiB here)."""
    result = subprocess.run([sys.executable, "-c", PLAN_WITHOUT_THE_CACHE, str(tmp_path / "plan.tpu")], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    cache_bytes, peak_anonymous = map(int, result.stdout.split()[-2:])
    assert cache_bytes == 4 * 2**30
    assert peak_anonymous < cache_bytes / 4, f"peak anonymous memory {peak_anonymous / 2**30:.2f} GiB"


def test_the_logits_base_model_answer_puts_back_a_forward_the_instance_held():
    """The entry points' logits run the LM's forward with its base model answering the hidden rows
    (export/generation.py's _answering): a forward the base model instance held already, as an
    accelerate hook sets, is put back afterwards, and a class forward is left as it was."""
    from tpuexport.export.generation import _answering

    hooked, plain = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    hook = hooked.forward = lambda *args, **kwargs: "hooked"
    answered = []
    with _answering([hooked, plain], "answer", answered):
        assert hooked(torch.zeros(2)) == plain(torch.zeros(2)) == "answer"
    assert answered == [hooked, plain]
    assert hooked.forward is hook and hooked(torch.zeros(2)) == "hooked"
    assert "forward" not in plain.__dict__ and plain(torch.zeros(2)).shape == (2,)


@pytest.mark.parametrize("family", [tiny_opt, tiny_llama, tiny_mllama_text],
                         ids=["opt-decoder-called-directly", "llama", "mllama-base-model-prefix-names-no-attribute"])
def test_the_entry_points_logits_are_the_lm_heads_of_the_chosen_rows(family):
    """OPT's causal LM calls its decoder (`self.model.decoder`), not its base model OPTModel: answering
    only the base model ran the decoder a second time over the hidden rows given as embeddings (logits
    off by up to 0.03 on a tiny f32 OPT; coverage's opt generate-f32 failed verification, session 18).
    The part of the base model the LM's forward calls answers too. MllamaForCausalLM's `base_model` is
    the LM itself (answering it gave no logits; calling it gave no last_hidden_state: the sweep's mllama
    was refused, issue 35): its text model answers."""
    model = family()
    spec = export_stage.generation_spec(model, 2, 32, prefill_buckets=(16,))
    hidden = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        logits = Decode(model, spec).logits(hidden)
        torch.testing.assert_close(logits, model.lm_head(hidden).float(), atol=0, rtol=0)


def tiny_trocr() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.TrOCRConfig(vocab_size=256, d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128,
                                      max_position_embeddings=128, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    return transformers.TrOCRForCausalLM(config).eval()


def test_a_decoder_numbering_positions_from_its_cache_length_decodes_each_token_at_its_position():
    """TrOCR's decoder (and BART-style ForCausalLM decoders) takes no position_ids: it numbers positions
    from the cache's length, which the entry points' caches do not report, so every decode step embedded
    position 0 (the sweep's trocr failed verification, decode logits' relative RMS error 0.85). Its
    learned position embedding gets each token's position: the eager entry points' logits, prefill
    then decode steps, are the model's own over the whole prefix."""
    model = tiny_trocr()
    tokens, logits = stepped_logits(model)
    with torch.no_grad():
        expected = model(tokens).logits[0, 7:].float()
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_a_causal_lm_that_takes_no_kv_cache_is_refused_in_one_line():
    """OpenAI GPT's forward takes no cache (generate() recomputes the whole sequence each step) and reads
    the entry points' 4D mask as a 2D one: torch.export failed in its own code ("permute a tensor of rank
    6"). It is refused naming why, before any export."""
    torch.manual_seed(0)
    model = transformers.OpenAIGPTLMHeadModel(transformers.OpenAIGPTConfig(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=32))
    with pytest.raises(tpuexport.TpuExportError, match=r"^--task text-generation: OpenAIGPTLMHeadModel \(openai-gpt\) takes no KV cache "
                       r".*--task feature-extraction\)$"):
        export_stage.generation_spec(model.eval(), 1, 16)
