"""Conversions whose weights stream from a checkpoint: the model is built with its parameters on the
meta device, exported and lowered from shapes, and the checkpoint's tensors are copied one at a
time into the artifact (real torch, jax, libtpu, TensorFlow and transformers; no mocks)."""

from __future__ import annotations

import json
import pathlib
import types

import numpy as np
import pytest
import safetensors.torch
import torch
from torch import nn

import tpuexport
from conftest import EXAMPLES, build_example
from tpuexport.artifact.weights import ALIGNMENT
from test_cli import tpuexport_in_process as tpuexport_cli  # the command line, in this process



def save_sharded(state: dict[str, torch.Tensor], directory: pathlib.Path, shards: int = 2) -> pathlib.Path:
    """Saves a state_dict as Hugging Face does: model-0000k-of-0000n.safetensors and an index."""
    directory.mkdir(parents=True)
    names = list(state)
    weight_map = {}
    for index in range(shards):
        file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = names[index::shards]
        safetensors.torch.save_file({name: state[name].contiguous() for name in part}, str(directory / file))
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def test_a_conversion_streamed_from_a_sharded_checkpoint_matches_eager(tmp_path, transformer_artifact):
    built = build_example("transformer")
    model = built["model"].eval()
    checkpoint = save_sharded(model.state_dict(), tmp_path / "ckpt")

    # Without verification's optional sizes: the always-run cases read every streamed weight, and the
    # weights are compared with the in-memory conversion's below.
    result = tpuexport_cli("convert", f"{EXAMPLES / 'transformer.py'}:build", "--checkpoint", checkpoint, "--target", "v5e",
                           "--verify-budget", "0", "--out", tmp_path / "streamed.tpu")

    assert result.returncode == 0, result.stderr
    assert "weights" in result.stderr and "streamed from the checkpoint ckpt" in result.stderr
    artifact = tpuexport.load(tmp_path / "streamed.tpu")
    assert artifact.manifest["source"]["checkpoint"] == "ckpt"
    assert artifact.manifest["verification"]["passed"] and artifact.manifest["tf_serving"]
    # The weights the stream wrote are the ones a conversion of the model in memory stores (the
    # encoder's two layers stacked for their scan), and the artifact computes what the model does.
    streamed, in_memory = artifact.program, transformer_artifact.program
    assert streamed.weight_names == in_memory.weight_names and any(len(parts) > 1 for parts in streamed.weight_parts.values())
    for name, mapped, held in zip(streamed.weight_names, streamed.weights, in_memory.weights):
        np.testing.assert_array_equal(mapped, held, err_msg=name)
    tokens, mask = built["args"]
    with torch.no_grad():
        expected = model(tokens, mask)
    outputs = artifact.run(tokens, mask)
    for name in ("logits", "hidden"):
        torch.testing.assert_close(outputs[name], expected[name], atol=0.05, rtol=0.05)
    assert tpuexport.verify_artifact(tmp_path / "streamed.tpu").passed


def test_weights_files_are_aligned_and_memory_mapped_when_read_back(transformer_artifact, tmp_path):
    """XLA:CPU runs a 64-byte-aligned host array in place; the writer lays tensors out so that
    they are, and reading an artifact maps its file rather than loading it."""
    program = transformer_artifact.program
    path = tmp_path / "weights.safetensors"
    tpuexport.artifact.write_weights(path, program.weight_names, program.weight_specs, lambda name: [torch.from_numpy(
        np.array(program.weights[program.weight_names.index(name)]))])
    arrays = tpuexport.artifact.map_weights(path)
    for name, array in zip(program.weight_names, program.weights):
        np.testing.assert_array_equal(arrays[name], array)
    aligned = [name for name, array in arrays.items() if array.ctypes.data % ALIGNMENT == 0]
    sizes = {name: array.nbytes for name, array in arrays.items()}
    assert len(aligned) >= sum(size % ALIGNMENT == 0 for size in sizes.values())
    assert all(isinstance(array, np.memmap) for array in arrays.values())
    reread = tpuexport.load(transformer_artifact.path).program.weights
    assert all(isinstance(array, np.memmap) for array in reread)


def test_an_empty_weight_writes_no_bytes_whatever_its_strides(tmp_path):
    """PT2E's quantized Llama attention lifts an empty constant whose stride is 0, which torch cannot view
    as bytes: writing a tiny LLaVA's int8 artifact stopped there with a RuntimeError."""
    path = tmp_path / "weights.safetensors"
    empty = torch.zeros(()).expand(0)
    specs = [types.SimpleNamespace(shape=(0,), dtype="float32"), types.SimpleNamespace(shape=(2,), dtype="float32")]
    tpuexport.artifact.write_weights(path, ["empty", "pair"], specs, lambda name: [empty if name == "empty" else torch.ones(2)])
    arrays = tpuexport.artifact.map_weights(path)
    assert arrays["empty"].shape == (0,) and arrays["pair"].tolist() == [1.0, 1.0]


class TiedDecoder(nn.Module):
    """A Hugging Face Llama with tied embeddings and rotary frequencies (a buffer computed when
    built, not in checkpoints), wrapped to return logits, as users wrap models to pick outputs."""

    def __init__(self):
        super().__init__()
        import transformers

        config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
        self.model = transformers.LlamaForCausalLM(config).eval()

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def test_a_wrapped_hugging_face_checkpoint_with_tied_weights_streams_through_the_api(tmp_path):
    torch.manual_seed(0)
    original = TiedDecoder().eval()
    original.model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")  # Hugging Face's own sharded layout
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert "lm_head.weight" not in json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    register_parameter = torch.nn.Module.register_parameter
    with tpuexport.parameters_on_meta():
        model = TiedDecoder()
    assert torch.nn.Module.register_parameter is register_parameter
    assert all(parameter.is_meta for parameter in model.parameters()) and not any(buffer.is_meta for buffer in model.buffers())

    tokens = torch.randint(0, 128, (2, 8))
    seq = torch.export.Dim("seq", min=2, max=32)
    artifact = tpuexport.convert(model, (tokens,), {"input_ids": {1: seq}}, target="v5e", out=tmp_path / "tied.tpu",
                                 checkpoint=tmp_path / "hf", saved_model=False, verify_budget_flops=0)  # no optional sizes: none is read

    assert artifact.manifest["verification"]["passed"]
    assert all(parameter.is_meta for parameter in model.parameters())  # the user's model is left as it was
    with torch.no_grad():
        expected = original(tokens)
    torch.testing.assert_close(artifact.run(tokens), expected, atol=0.02, rtol=0.02)


def test_a_checkpoint_that_does_not_fit_the_model_fails_in_one_line(tmp_path):
    built = build_example("transformer")
    state = built["model"].state_dict()
    args, shapes = built["args"], built["dynamic_shapes"]

    def refused(checkpoint) -> str:
        out = tmp_path / f"refused{len(list(tmp_path.iterdir()))}.tpu"
        with tpuexport.parameters_on_meta():
            model = type(built["model"])()
        with pytest.raises(tpuexport.TpuExportError) as error:
            tpuexport.convert(model, args, shapes, target="v5e", out=out, checkpoint=checkpoint, saved_model=False)
        assert not out.exists()
        return str(error.value)

    lacking = {name: tensor for name, tensor in state.items() if name != "classify.weight"}  # a lazy Mapping works as well
    assert "has no tensor for 1 of the model's weights (classify.weight)" in refused(lacking)
    torch.save({**state, "embed.weight": state["embed.weight"][:10]}, tmp_path / "small.pt")  # a .pt state_dict, read weights_only
    assert "embed.weight (10, 64) (model (1000, 64))" in refused(tmp_path / "small.pt")
    assert "does not exist" in refused(tmp_path / "nowhere.safetensors")

    result = tpuexport_cli("convert", f"{EXAMPLES / 'transformer.py'}:build", "--checkpoint", tmp_path / "nowhere", "--target", "v5e",
                           "--out", tmp_path / "cli.tpu")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: checkpoint") and "does not exist" in result.stderr
    assert not (tmp_path / "cli.tpu").exists()
