"""--kv-cache paged with weight-only weights (--quantize int8-weight-only / int4-weight-only) and with
weights streamed from a safetensors checkpoint (tasks/generation.py): the step is quantized and
streamed as the static entry points are, verified against generate() on the model with its weights
rounded and dequantized (its distance from the float model measured), and Artifact.generate gives
that model's greedy tokens, also through `tpuexport serve` and the `openai` SDK; a wrong scale in one layer, or a reference that does not round, fails
the comparison (PT2E int8 stays refused: tests/test_paged.py). A tiny Llama as tests/test_paged.py's."""

from __future__ import annotations

import copy
import json

import numpy as np
import openai
import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

import tpuexport
from conftest import served
from test_generation import tiny_llama
from tpuexport.arrays import load_arrays
from tpuexport.cli import main
from tpuexport.quantize.weight_only import WeightOnlyScheme, fake_quantized, scheme_for
from tpuexport.verify.paged_generation import replay_golden, verify_paged_generation
from tpuexport.verify.tolerances import default_tolerances

MAX_CONTEXT, MAX_BATCH, PAGE_SIZE, TOKENS, GROUP = 64, 2, 4, 8, 32
PAGED = dict(task="text-generation", max_context=MAX_CONTEXT, max_batch=MAX_BATCH, kv_cache="paged", page_size=PAGE_SIZE,
             buckets={"tokens": [TOKENS], "rows": [MAX_BATCH]}, target="cpu", verify_new_tokens=6, saved_model=False)


@pytest.fixture(scope="module")
def int8_paged(tmp_path_factory):
    """A tiny Llama's paged artifact with int8 weight-only weights: (artifact, float model, the safetensors file of its weights)."""
    model = tiny_llama()
    directory = tmp_path_factory.mktemp("paged_int8")
    safetensors.torch.save_file(model.state_dict(), str(directory / "llama.safetensors"))
    artifact = tpuexport.convert(model, quantize="int8-weight-only", out=directory / "int8.tpu", **PAGED)
    return artifact, model, directory / "llama.safetensors"


def dequantized(model: torch.nn.Module, quantization: dict) -> torch.nn.Module:
    """A copy of `model` whose weights the artifact quantizes are rounded to its scheme and dequantized (the step's
    state names carry the `model.` prefix of export/paged.py's Step)."""
    scheme = WeightOnlyScheme(quantization["mode"], quantization.get("group_size"))
    rounded = copy.deepcopy(model)
    state = dict(rounded.named_parameters())
    with torch.no_grad():
        for name, entry in quantization["weights"].items():
            weight = state[name.removeprefix("model.")]
            weight.copy_(fake_quantized(weight, scheme_for(scheme, weight.shape, entry["axis"]), entry["axis"]))
    return rounded


def greedy(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    with torch.no_grad():
        return [model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
                for prompt in prompts]


PROMPTS = [[int(token) for token in np.random.default_rng(3).integers(0, 256, 13)], [5, 6]]


def test_int8_weight_only_step_generates_what_the_dequantized_model_does(int8_paged):
    """Verified against generate() with the weights rounded as the step rounds them, its distance from the float
    model measured; the manifest and inspect describe the weights as for the static cache; Artifact.generate's
    greedy tokens (a 13-token prompt in chunks beside a decoding row) are the dequantized model's."""
    artifact, model, _ = int8_paged
    manifest = artifact.manifest
    verification = manifest["verification"]
    assert verification["passed"] and verification["tokens_compared"] == 12
    report = json.loads((artifact.path / verification["report"]).read_text())
    divergence = report["float_divergence"]
    assert divergence["against"] == "generate(do_sample=False) of the float model" and divergence["tokens_compared"] == 12
    assert divergence["sqnr_db"] > 20.0
    quantization = manifest["quantization"]
    assert quantization["mode"] == "int8-weight-only" and len(quantization["weights"]) == 2 * 7 + 2  # projections, embedding, lm_head
    assert quantization["weights"]["model.lm_head.weight"]["bits"] == 8 and quantization["weight_bytes"]["ratio"] < 0.3
    inspected = CliRunner().invoke(main, ["inspect", str(artifact.path)])
    assert inspected.exit_code == 0 and "quantized int8-weight-only: 16 weights" in inspected.output, inspected.output
    assert artifact.generate(PROMPTS, 6) == greedy(dequantized(model, quantization), PROMPTS, 6)


def test_openai_completion_over_the_int8_weight_only_step(int8_paged):
    """`tpuexport serve` over the weight-only paged artifact, one greedy completion of token ids through the `openai`
    SDK (the model carries no tokenizer): the dequantized model's tokens."""
    artifact, model, _ = int8_paged
    with served(artifact.path, artifact.path.parent / "server.log") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[0], temperature=0, max_tokens=6)
    assert answer.choices[0].model_extra["token_ids"] == greedy(dequantized(model, artifact.manifest["quantization"]), PROMPTS[:1], 6)[0]


def test_planted_weight_only_bugs_fail_the_comparison(int8_paged):
    """The stored case replays; with one layer's scale 10% off, it fails. The step compared with the float model's
    generate() (a reference that does not round as the step does) fails too."""
    artifact, model, _ = int8_paged
    program = artifact.generation_program
    verification = artifact.manifest["verification"]
    golden = load_arrays(artifact.read_checked(verification["golden"]))
    tolerances = default_tolerances("f32", "default", quantized=False)
    assert replay_golden(program, golden, verification["cases"], tolerances).passed

    step = program.weights_program
    scale = artifact.manifest["quantization"]["weights"]["model.model.layers.1.mlp.down_proj.weight"]["scale"]
    planted = program.with_weights(tuple((np.asarray(weight, np.float32) * 1.1).astype(weight.dtype) if name == scale else weight
                                         for name, weight in zip(step.weight_names, step.weights)))
    assert not replay_golden(planted, golden, verification["cases"], tolerances).passed
    assert not verify_paged_generation(program, model, tolerances, new_tokens=6).passed


def test_weights_streamed_from_a_checkpoint_are_the_in_memory_ones(int8_paged):
    """The same model built on the meta device, its weights streamed from the safetensors file: the step quantizes
    them as they stream into the same integers and scales, verifies against generate() of the dequantized
    checkpoint model, and generates the in-memory artifact's tokens."""
    artifact, _, checkpoint = int8_paged
    with tpuexport.parameters_on_meta():
        meta_model = tiny_llama()
    streamed = tpuexport.convert(meta_model, quantize="int8-weight-only", checkpoint=checkpoint, out=checkpoint.parent / "streamed.tpu",
                                 **PAGED)
    manifest = streamed.manifest
    assert manifest["source"]["checkpoint"] == "llama.safetensors" and manifest["verification"]["passed"]
    assert "float_divergence" in json.loads((streamed.path / manifest["verification"]["report"]).read_text())
    assert all(parameter.is_meta for parameter in meta_model.parameters())
    ours, theirs = streamed.generation_program.weights_program, artifact.generation_program.weights_program
    assert ours.weight_names == theirs.weight_names
    for name, mine, other in zip(ours.weight_names, ours.weights, theirs.weights):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(other), err_msg=name)
    assert streamed.generate(PROMPTS, 6) == artifact.generate(PROMPTS, 6)


def test_int4_weight_only_step_converts_and_verifies(tmp_path):
    model = tiny_llama()
    artifact = tpuexport.convert(model, quantize="int4-weight-only", group_size=GROUP, out=tmp_path / "int4.tpu", **PAGED)
    manifest = artifact.manifest
    assert manifest["verification"]["passed"] and manifest["quantization"]["mode"] == "int4-weight-only"
    assert manifest["quantization"]["weight_bytes"]["ratio"] < 0.2
    assert artifact.generate(PROMPTS, 6) == greedy(dequantized(model, manifest["quantization"]), PROMPTS, 6)

