"""Text generation from a streamed checkpoint (--task text-generation --checkpoint): the causal LM is
built with its parameters on the meta device, its prefill and decode entry points are exported and
lowered from shapes, the checkpoint's tensors stream once into the one weights file (weight-only
modes quantized as they stream), and generation is verified against generate() of the model with
the checkpoint's memory-mapped tensors (real torch, jax, libtpu and transformers; no mocks)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

import tpuexport
from test_checkpoint import save_sharded
from test_cli import tpuexport_in_process as tpuexport_cli  # the command line, in this process
from tpuexport.quantize.weight_only import WeightOnlyScheme, stored_tensors

MAX_CONTEXT, MAX_BATCH = 64, 2
# A tiny Llama with tied embeddings (as Llama-3.2-1B ties them): the tied lm_head streams under the embedding's name.
LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, tie_word_embeddings=True)
FACTORY = f"""
import torch, transformers

def build():
    config = transformers.LlamaConfig(**{LLAMA!r})
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
"""


def tiny_llama(dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).to(dtype).eval()


def generation_options(tmp_path) -> list:
    return ["--task", "text-generation", "--max-context", MAX_CONTEXT, "--max-batch", MAX_BATCH, "--bucket", "seq=16",
            "--bucket", f"batch={MAX_BATCH}", "--target", "v5e"]


def test_a_bf16_llama_generates_from_its_sharded_checkpoint_through_the_cli(tmp_path):
    model = tiny_llama(torch.bfloat16)
    state = {name: tensor for name, tensor in model.state_dict().items() if name != "lm_head.weight"}  # tied: saved once
    checkpoint = save_sharded(state, tmp_path / "ckpt")
    (tmp_path / "llama.py").write_text(FACTORY)

    result = tpuexport_cli("convert", f"{tmp_path / 'llama.py'}:build", "--checkpoint", checkpoint, *generation_options(tmp_path),
                           "-o", tmp_path / "lm.tpu")

    assert result.returncode == 0, result.stderr
    assert "streamed from the checkpoint ckpt" in result.stderr
    artifact = tpuexport.load(tmp_path / "lm.tpu")
    manifest = artifact.manifest
    assert manifest["source"]["checkpoint"] == "ckpt" and manifest["task"] == "text-generation"
    verification = manifest["verification"]
    assert verification["passed"] and verification["tokens_compared"] >= MAX_BATCH * 8
    # One weights file for both entry points, holding the checkpoint's bf16 tensors bit for bit (the tied
    # lm_head once, under the embedding's name), memory-mapped when read back.
    program = artifact.generation_program
    assert program.entry_points["prefill"].weights is program.entry_points["decode"].weights
    weights = dict(zip(program.weights_program.weight_names, program.weights_program.weights))
    assert all(isinstance(array, np.memmap) for array in weights.values())
    assert "model.lm_head.weight" in program.weights_program.tied
    for name, tensor in state.items():
        if "rotary" in name:
            continue
        stored = torch.from_numpy(np.asarray(weights[f"model.{name}"]).view(np.int16)).view(torch.bfloat16)
        assert torch.equal(stored, tensor), name
    # The artifact's greedy tokens are generate()'s on the original model (the verification's teacher-forced
    # comparison, driven free-running here through the runtime's session).
    prompt = [5, 17, 42, 9]
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert artifact.generate([prompt], max_new_tokens=6) == [expected]
    assert tpuexport.verify_artifact(tmp_path / "lm.tpu").passed


def test_int4_weight_only_generation_quantizes_the_checkpoint_as_it_streams(tmp_path):
    model = tiny_llama()
    safetensors.torch.save_file({name: tensor for name, tensor in model.state_dict().items() if name != "lm_head.weight"},
                                str(tmp_path / "llama.safetensors"))
    with tpuexport.parameters_on_meta():
        meta_model = tiny_llama()

    artifact = tpuexport.convert(meta_model, task="text-generation", max_context=MAX_CONTEXT, max_batch=MAX_BATCH,
                                 buckets={"seq": [16], "batch": [MAX_BATCH]}, target="v5e", out=tmp_path / "int4.tpu",
                                 checkpoint=tmp_path / "llama.safetensors", quantize="int4-weight-only", group_size=32,
                                 verify_new_tokens=4)

    manifest = artifact.manifest
    assert manifest["source"]["checkpoint"] == "llama.safetensors"
    assert all(parameter.is_meta for parameter in meta_model.parameters())  # the user's model is left as it was
    # Verified against generate() with the weights rounded as the artifact rounds them; the distance from the
    # float model is measured.
    verification = manifest["verification"]
    assert verification["passed"] and "float_divergence" in json.loads((artifact.path / "verification" / "report.json").read_text())
    quantization = manifest["quantization"]
    assert quantization["mode"] == "int4-weight-only" and quantization["weight_bytes"]["ratio"] < 0.3
    # The streamed integers and scales are the model's own float weights rounded by the scheme.
    program = artifact.generation_program.weights_program
    weights = dict(zip(program.weight_names, program.weights))
    scheme = WeightOnlyScheme("int4-weight-only", 32)
    state = model.state_dict()
    assert len(quantization["weights"]) == 2 * 7 + 1  # every layer's seven projections and the tied embedding
    for name, entry in quantization["weights"].items():
        packed, scale = stored_tensors(state[name.removeprefix("model.")], scheme, entry["axis"])
        np.testing.assert_array_equal(np.asarray(weights[name]), packed.numpy(), err_msg=name)
        np.testing.assert_array_equal(np.asarray(weights[entry["scale"]]).view(np.int16), scale.view(torch.int16).numpy(), err_msg=name)


@pytest.mark.parametrize("change, expected", [
    ("misshapen", "holds 1 tensor(s) of another shape than the model's: model.norm.weight (32,) (model (64,))"),
    ("int8", "--quantize with --checkpoint is not supported"),
])
def test_bad_checkpoint_input_is_one_line(tmp_path, change, expected):
    state = {name: tensor for name, tensor in tiny_llama(torch.bfloat16).state_dict().items() if name != "lm_head.weight"}
    options = []
    if change == "misshapen":
        state["model.norm.weight"] = state["model.norm.weight"][:32].clone()
    else:
        options = ["--quantize", "int8", "--random-calibration"]
    safetensors.torch.save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(tmp_path / "ckpt.safetensors"))
    (tmp_path / "llama.py").write_text(FACTORY)

    result = tpuexport_cli("convert", f"{tmp_path / 'llama.py'}:build", "--checkpoint", tmp_path / "ckpt.safetensors",
                           *generation_options(tmp_path), *options, "-o", tmp_path / "lm.tpu")

    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert expected in line, result.stderr
    assert not (tmp_path / "lm.tpu").exists() and not list(tmp_path.glob(".*lm.tpu*"))
