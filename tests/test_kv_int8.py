"""--kv-cache-dtype int8: text-generation entry points over an int8 KV cache with f32 scales per
(layer, slot, kv-head, position), verified token for token against the same entry points run
eagerly; planted scale bugs fail that verification; the runtime and CLI carry the scales; bad input."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch

import tpuexport
from test_cli import tpuexport_in_process  # the command line, in this process
from test_generation import MAX_BATCH, MAX_CONTEXT, lowered_entry_point, tiny_gpt2, tiny_llama
from tpuexport import export as export_stage
from tpuexport import lower as lower_stage
from tpuexport.errors import TpuExportError
from tpuexport.export.functional_cache import DecodeCache, dequantize_kv, quantize_kv, write_decode_cache, write_prefill_cache
from tpuexport.export.generation import Decode
from tpuexport.export.cache_specs import CACHE_SCALE_INPUTS, SCALE_LAYOUT
from tpuexport.lower import generation as lowered_generation
from tpuexport.verify import INT8_KV_AGAINST, eager_references, verify_int8_kv_generation
from tpuexport.verify.tolerances import default_tolerances


def convert_int8_kv(model, out, **options):
    return tpuexport.convert(model, task="text-generation", max_context=MAX_CONTEXT, max_batch=MAX_BATCH, kv_cache_dtype="int8",
                             buckets={"seq": [16], "batch": [MAX_BATCH]}, out=out, **{"target": ["v5e", "cpu"], **options})


@pytest.fixture(scope="session")
def llama_int8_kv(tmp_path_factory):
    """A tiny Llama converted with an int8 KV cache for v5e and the cpu target: (artifact, model)."""
    model = tiny_llama()
    return convert_int8_kv(model, tmp_path_factory.mktemp("llama_int8_kv") / "llama.tpu"), model


def test_manifest_records_the_int8_cache_and_its_scales(llama_int8_kv):
    artifact, model = llama_int8_kv
    manifest = artifact.manifest
    generation = manifest["generation"]
    layers, kv_heads, head_dim = 2, 2, 16
    assert generation["kv_cache_dtype"] == "int8" and generation["dtype"] == "float32"
    assert generation["scale_shape"] == [layers, MAX_BATCH, kv_heads, MAX_CONTEXT] and generation["scale_dtype"] == "float32"
    assert generation["cache_inputs"] == ["cache_k", "cache_v", "cache_k_scale", "cache_v_scale"]
    values = layers * MAX_BATCH * kv_heads * MAX_CONTEXT
    assert generation["cache_bytes"] == 2 * values * head_dim + 2 * values * 4  # int8 keys and values + f32 scales
    for entry in (manifest["entry_points"][name] for name in ("prefill", "decode")):  # sample takes logits, no cache
        assert entry["donated_inputs"] == generation["cache_inputs"] and set(entry["state"]) == set(generation["cache_inputs"])
        inputs = {spec["name"]: spec["dtype"] for spec in entry["signature"]["inputs"]}
        assert inputs["cache_k"] == "int8" and inputs["cache_v_scale"] == "float32"
    decode = next(bucket for bucket in manifest["targets"]["v5e"]["buckets"] if bucket["entry_point"] == "decode")
    assert decode["decode_step"]["cache_bytes"] == generation["cache_bytes"]
    # The compiled decode step aliases the int8 cache and its scales with its outputs (updated in place).
    assert decode["memory"]["alias_bytes"] >= generation["cache_bytes"]


def test_verified_against_the_eager_int8_entry_points_and_measured_against_float(llama_int8_kv):
    artifact, _ = llama_int8_kv
    report = json.loads((artifact.path / "verification" / "report.json").read_text())
    assert report["passed"] and report["against"] == INT8_KV_AGAINST and report["tokens_compared"] > 0
    divergence = report["float_divergence"]
    assert divergence["against"] == "generate(do_sample=False) of the float model"
    assert divergence["sqnr_db"] is None or divergence["sqnr_db"] > 30  # int8 KV of a tiny f32 Llama: 47 dB measured
    # The manifest's quantization section records it, with no warning at that SQNR.
    assert artifact.manifest["quantization"] == {**artifact.manifest["quantization"], "mode": "int8-kv-cache", "warnings": [],
                                                 "outputs": [{"name": "logits", "sqnr_db": divergence["sqnr_db"]}]}
    assert tpuexport.verify_artifact(artifact.path).passed  # the gate replays the stored int8-KV cases


def test_logits_far_from_float_warn_naming_the_options_that_made_them_so():
    """Below 15 dB the section's warning names the logits and the option to drop: the int8 cache's, and
    with weight-only int4 weights too, both."""
    from tpuexport.verify.quantization_report import generation_fix, int8_kv_section

    [warning] = int8_kv_section([{"name": "logits", "sqnr_db": 12.25}])["warnings"]
    assert warning.startswith("output logits is 12.2 dB from the float model (below 15 dB)") and "without --kv-cache-dtype int8" in warning
    assert int8_kv_section([{"name": "logits", "sqnr_db": 15.5}])["warnings"] == []
    both = generation_fix(4, True)
    assert "--keep-float REGEX" in both and "int8-weight-only" in both and "--kv-cache-dtype int8" in both


def test_generate_runtime_and_cli_carry_the_scales(llama_int8_kv):
    artifact, model = llama_int8_kv
    prompts = [[5, 17, 42, 7], [99, 3]]
    expected = artifact.generate(prompts, max_new_tokens=6)
    # The eager int8-KV entry points generate the same tokens.
    spec = artifact.generation_program.spec
    modules = export_stage.entry_point_modules(model, spec)
    cache = [torch.zeros(shape, dtype=getattr(torch, dtype)) for shape, dtype in spec.cache_tensors().values()]
    tokens = torch.tensor([prompt + [0] * (16 - len(prompt)) for prompt in prompts])
    lengths = torch.tensor([len(prompt) for prompt in prompts])
    with torch.no_grad():
        out = modules["prefill"](tokens, lengths, torch.arange(2), *cache)
        eager = [out["logits"].argmax(-1)]
        for step in range(1, 6):
            out = modules["decode"](eager[-1], lengths + step - 1, *[out[name] for name in spec.cache_inputs])
            eager.append(out["logits"].argmax(-1))
    assert expected == torch.stack(eager, 1).tolist()

    runner = tpuexport.runner(artifact.path)
    assert [list(step) for step in zip(*runner.stream(prompts, max_new_tokens=6))] == expected
    prefill = runner.run([tokens.numpy(), lengths.numpy(), np.arange(2), *[np.zeros(shape, dtype) for shape, dtype in
                                                                          spec.cache_tensors().values()]], "prefill")
    assert all(isinstance(prefill[name], jax.Array) for name in spec.cache_inputs)  # the scales stay on the device too
    assert float(np.asarray(prefill["cache_k_scale"])[:, :, :, :4].min()) > 0

    result = tpuexport_in_process("generate", artifact.path, "--tokens", "5,17,42,7", "--tokens", "99,3", "--max-new-tokens", 6)
    assert result.returncode == 0, result.stderr
    assert [[int(token) for token in line.split()] for line in result.stdout.strip().splitlines()] == [list(p) for p in zip(*expected)]


class LateScaleCache(DecodeCache):
    """Decode writes each scale one position after its key's."""

    def write(self, cache, new, layer, layout=None):
        if layout != SCALE_LAYOUT:
            return super().write(cache, new, layer, layout)
        return write_decode_cache(cache, new, layer, self.positions + 1, layout)


class LateScaleDecode(Decode):
    cache_type = LateScaleCache


# The scales written one position late (the step's own position keeps a stale scale: what a decode that
# never writes them does too) fail it; test_generation.py's planted cache bugs cover the keys' writes.
@pytest.mark.parametrize("buggy_decode", [LateScaleDecode], ids=lambda cls: cls.__name__)
def test_planted_scale_bugs_fail_verification(llama_int8_kv, buggy_decode):
    artifact, model = llama_int8_kv
    good = artifact.generation_program
    spec = good.spec
    decode = lowered_entry_point(buggy_decode(model, spec), spec, "decode")
    program = lower_stage.GenerationProgram(spec, {"prefill": good.entry_points["prefill"], "decode": decode}, good.prefill_batches)
    decode_lowered = good.entry_points["decode"]
    tolerances = default_tolerances(decode_lowered.resolved_precision, decode_lowered.matmul_precision, quantized=False)
    report = verify_int8_kv_generation(program, export_stage.entry_point_modules(model, spec), tolerances,
                                       eager_references(program, model, 6), new_tokens=6)
    assert not report.passed and "(cpu run)" in report.failure_summary()
    assert report.cases[0].runs["cpu"].logits.relative_rms_error > 1e-3


def test_gpt2_with_weight_only_int8_and_int8_kv(tmp_path):
    """A second family, with the weights int8 too: verified against the int8-KV entry points computing
    with the rounded weights; the float model's generate() measured."""
    artifact = convert_int8_kv(tiny_gpt2(), tmp_path / "gpt2.tpu", target="cpu", quantize="int8-weight-only")
    report = json.loads((artifact.path / "verification" / "report.json").read_text())
    assert report["passed"] and report["against"] == INT8_KV_AGAINST
    assert artifact.manifest["generation"]["kv_cache_dtype"] == "int8" and artifact.manifest["quantization"]["mode"] == "int8-weight-only"
    assert report["float_divergence"]["tokens_compared"] == report["tokens_compared"]
    assert len(artifact.generate([[1, 2, 3]], max_new_tokens=4)[0]) == 4


@pytest.mark.parametrize("layout", ["layer_batch_head_pos", "layer_batch_pos_head"])
def test_scale_writes_lower_as_their_eager_meaning(layout):
    """The scales ([layers, batch, kv_heads, context], no head_dim) go through the cache's write ops."""
    torch.manual_seed(0)
    scales = torch.rand(2, 3, 2, 8)
    new, positions = torch.rand(3, 2), torch.tensor([0, 7, 9])
    eager = write_decode_cache(scales, new, 1, positions, SCALE_LAYOUT)
    lowered = lowered_generation.write_decode_cache(jax.numpy.asarray(scales.numpy()), jax.numpy.asarray(new.numpy()), 1,
                                                    jax.numpy.asarray(positions.numpy()), SCALE_LAYOUT)
    np.testing.assert_array_equal(np.asarray(lowered), eager.numpy())
    assert eager[1, 1, :, 7].tolist() == new[1].tolist() and eager[1, 2, :, 7].tolist() == new[2].tolist()  # 9 clamped onto 7
    prompts, slots = torch.rand(2, 2, 5), torch.tensor([2, 0])
    eager = write_prefill_cache(scales, prompts, 0, slots, SCALE_LAYOUT)
    lowered = jax.jit(lowered_generation.write_prefill_cache, static_argnums=(2, 4))(
        jax.numpy.asarray(scales.numpy()), jax.numpy.asarray(prompts.numpy()), 0, jax.numpy.asarray(slots.numpy()), SCALE_LAYOUT)
    np.testing.assert_array_equal(np.asarray(lowered), eager.numpy())


def test_quantize_kv_is_symmetric_int8_per_vector():
    torch.manual_seed(0)
    keys = torch.randn(2, 3, 5, 16)
    keys[0, 0, 0] = 0  # an all-zero vector: scale 0, q 0
    q, scale = quantize_kv(keys, torch.float32)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == keys.shape[:-1]
    assert q.abs().amax(-1)[scale > 0].eq(127).all() and scale[0, 0, 0] == 0 and q[0, 0, 0].eq(0).all()
    error = (dequantize_kv(q, scale, torch.float32) - keys).abs()
    assert (error <= scale[..., None] / 2 + 1e-7).all()  # within half a step


@pytest.mark.parametrize("arguments, expected", [
    (["--max-context", "32", "--kv-cache-dtype", "int4"], "unknown --kv-cache-dtype 'int4'; use one of model, int8"),
    (["--forward", "--kv-cache-dtype", "int8"], "--kv-cache-dtype int8 applies to --task text-generation only"),
    (["--max-context", "32", "--kv-cache-dtype", "int8", "--quantize", "int8-dynamic"], "--kv-cache-dtype int8 with --quantize int8-dynamic"),
])
def test_bad_kv_cache_dtype_is_one_line(tmp_path, arguments, expected):
    from click.testing import CliRunner

    from tpuexport.cli import main

    factory = tmp_path / "lm.py"
    factory.write_text("import torch, transformers\n\ndef build():\n    return transformers.GPT2LMHeadModel(transformers.GPT2Config("
                       "vocab_size=256, n_embd=64, n_layer=1, n_head=4))\n\ndef linear():\n    return torch.nn.Linear(4, 4), (torch.ones(2, 4),)\n")
    # A factory's model converts as a forward program unless --task text-generation is given.
    source, task = (f"{factory}:linear", []) if arguments[0] == "--forward" else (f"{factory}:build", ["--task", "text-generation"])
    arguments = [argument for argument in arguments if argument != "--forward"]
    result = CliRunner().invoke(main, ["convert", source, *task, *arguments, "-o", str(tmp_path / "lm.tpu")])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and expected in lines[0], result.output
    assert sorted(path.name for path in tmp_path.iterdir()) == ["lm.py"]


def test_default_cache_is_the_models_dtype_without_scales():
    spec = export_stage.generation_spec(tiny_llama(), MAX_BATCH, MAX_CONTEXT, prefill_buckets=(16,))
    assert spec.cache_inputs == ("cache_k", "cache_v") and "kv_cache_dtype" not in spec.to_json()
    assert not set(CACHE_SCALE_INPUTS) & set(spec.cache_tensors())
    with pytest.raises(TpuExportError, match="unknown --kv-cache-dtype"):
        export_stage.generation_spec(tiny_llama(), MAX_BATCH, MAX_CONTEXT, kv_cache_dtype="fp8")


def test_bf16_llama_from_a_checkpoint_with_bf16_scales(tmp_path):
    """A bf16 model streamed from its checkpoint: the scales are bf16 (the model's dtype) and, like the
    bf16 cache of a float conversion, updated in place by the CPU runs."""
    import safetensors.torch
    import transformers

    model = tiny_llama().to(torch.bfloat16)
    safetensors.torch.save_file(model.state_dict(), tmp_path / "model.safetensors")
    with tpuexport.parameters_on_meta():
        on_meta = transformers.LlamaForCausalLM(model.config).to(torch.bfloat16).eval()
    artifact = convert_int8_kv(on_meta, tmp_path / "bf16.tpu", target="cpu", checkpoint=tmp_path / "model.safetensors")
    generation = artifact.manifest["generation"]
    assert generation["scale_dtype"] == "bfloat16" and generation["dtype"] == "bfloat16"
    report = json.loads((artifact.path / "verification" / "report.json").read_text())
    assert report["passed"] and report["against"] == INT8_KV_AGAINST
    assert len(artifact.generate([[1, 2, 3], [4, 5]], max_new_tokens=4)[1]) == 4


def test_plan_on_a_slice_splits_the_cache_with_the_heads_and_the_scales_with_the_cache(tmp_path):
    """A plan (no weights) of the tiny Llama for a v5e-4 slice, tensor-parallel over model=2 with data=2: the
    cache and its scales split with the kv heads and the rows. (The cache in the model's dtype splits the same
    way: test_window_cache.py's plan splits the full layer's f32 cache and the sliding layers' rings so.)"""
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128)).eval()
    artifact = convert_int8_kv(model, tmp_path / "plan.tpu", weights=False, target="v5e-4", sharding="tensor-parallel", mesh="model=2,data=2")
    assert artifact.plan_only and artifact.manifest["program"]["weights"] is None
    target = artifact.manifest["targets"]["v5e-4"]
    buckets = {bucket["entry_point"]: bucket for bucket in target["buckets"]}
    for name in ("prefill", "decode"):  # sample takes logits, no cache
        inputs = target["sharding"][name]["inputs"]
        # [layers, batch, kv_heads, context(, head_dim)]: batch over data, kv heads over model, the scales alike
        assert inputs["cache_k"] == inputs["cache_v"] == [None, "data", "model", None, None]
        assert inputs["cache_k_scale"] == inputs["cache_v_scale"] == [None, "data", "model", None]
        assert buckets[name]["memory"]["alias_bytes"] > 0
    # Each chip's decode step reads a quarter of the cache and its scales.
    assert buckets["decode"]["decode_step"]["cache_bytes"] == artifact.manifest["generation"]["cache_bytes"] // 4
    with pytest.raises(tpuexport.TpuExportError, match="plan without weights"):
        artifact.generate([1, 2], max_new_tokens=2)


def test_serve_generates_over_the_int8_cache(llama_int8_kv, tmp_path):
    """`tpuexport serve` keeps the int8 cache and its scales for concurrent generate requests: each
    streams the tokens it would get alone."""
    from concurrent.futures import ThreadPoolExecutor

    import requests

    from conftest import served

    artifact, _ = llama_int8_kv
    with served(artifact.path, tmp_path / "server.log") as base:
        url = f"{base}/v1/models/llama:generate"
        requested = [[5, 17, 42, 7], [99, 3]]

        def generate(prompt):
            with requests.post(url, json={"prompts": [prompt], "max_new_tokens": 5}, stream=True, timeout=120) as answer:
                assert answer.status_code == 200
                return json.loads([line for line in answer.iter_lines() if line][-1])["generated"][0]

        with ThreadPoolExecutor(len(requested)) as pool:
            answers = list(pool.map(generate, requested))
        assert answers == [artifact.generate([prompt], max_new_tokens=5)[0] for prompt in requested]
