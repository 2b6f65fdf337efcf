"""Runs of identical blocks lowered as one scan (lower/scan.py): tiny Llama and BERT layers, and
hand-written stacks whose blocks differ, share inputs, or are read from outside."""

from __future__ import annotations

import families
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import tpuexport
from tpuexport import lower as lower_stage
from tpuexport.cli import main
from tpuexport.export import LoadedSource, SourceInfo, capture


def tiny_llama(layers: int = 3) -> dict:
    return families.transformers_family("llama", "decoder", "LlamaForCausalLM", "LlamaConfig", dict(families._DECODER, num_hidden_layers=layers),
                                        "text-generation", families.TEXT_DIMS).build()


def tiny_bert(layers: int = 3) -> dict:
    return families.transformers_family("bert", "encoder", "BertModel", "BertConfig", dict(families._TEXT, num_hidden_layers=layers),
                                        "feature-extraction", families.TEXT_DIMS).build()


def captured(built: dict):
    return capture(LoadedSource(built["model"], built["args"], built["dynamic_shapes"], None, SourceInfo("api")))


def eager(built: dict, inputs) -> list[np.ndarray]:
    with torch.no_grad():
        outputs = built["model"](*inputs)
    return [value.numpy() for value in (outputs.values() if isinstance(outputs, dict) else [outputs])]


def while_loops(lowered) -> int:
    return lowered.exported.mlir_module().count("stablehlo.while")


class Block(nn.Module):
    """A pre-norm MLP block with a residual; `mask` is the same for every block."""

    def __init__(self, width: int, activation=nn.GELU):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.activation = activation()
        self.down = nn.Linear(2 * width, width)

    def forward(self, hidden, mask):
        return hidden + self.down(self.activation(self.up(self.norm(hidden)))) * mask


class Stack(nn.Module):
    def __init__(self, activations, every_layer: bool = False, width: int = 16):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width, activation) for activation in activations)
        self.head = nn.Linear(width, 4)
        self.every_layer = every_layer

    def forward(self, x, mask):
        hidden = self.embed(x)
        keep = mask.unsqueeze(-1).to(hidden.dtype)
        seen = []
        for block in self.blocks:
            hidden = block(hidden, keep)
            seen.append(hidden)
        return torch.stack(seen).sum(0) if self.every_layer else self.head(hidden)


def stack(activations, every_layer: bool = False) -> dict:
    torch.manual_seed(0)
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=2, max=32)
    mask = torch.ones(2, 6)
    mask[1, 4:] = 0
    return {"model": Stack(activations, every_layer).eval(), "args": (torch.randn(2, 6, 8), mask),
            "dynamic_shapes": {"x": {0: batch, 1: seq}, "mask": {0: batch, 1: seq}}}


def test_llama_layers_scan_match_eager_and_the_unrolled_program(tmp_path):
    built = tiny_llama()
    lines = []
    artifact = tpuexport.convert(built["model"], built["args"], built["dynamic_shapes"], target="v5e", out=tmp_path / "llama.tpu",
                                 verify_budget_flops=0, progress=lambda stage, seconds, detail: lines.append(f"{stage}: {detail}"))
    assert artifact.manifest["verification"]["passed"] and artifact.manifest["verification"]["saved_model"]["passed"]
    [run] = artifact.manifest["scanned"]
    assert (run["module"], run["first"], run["count"], run["blocks_before_scan"]) == ("model.model.layers", 0, 3, 0)
    assert any(line.startswith("lower: ") and "scanned model.model.layers (3 blocks)" in line for line in lines), lines

    # Every stacked weight holds the blocks' state_dict entries in block order, and only those are stacked.
    program = artifact.program
    weights = dict(zip(program.weight_names, program.weights))
    state = built["model"].state_dict()
    stacked = run["weights"]
    assert stacked["model.model.layers.0-2.mlp.up_proj.weight"][2] == "model.model.layers.2.mlp.up_proj.weight"
    assert len(stacked) == 9  # q, k, v, o, gate, up, down, two norms
    for name, originals in stacked.items():
        assert weights[name].shape == (3, *state[originals[0]].shape)
        for block, original in enumerate(originals):
            np.testing.assert_array_equal(weights[name][block], state[original].numpy())
    unrolled = lower_stage.lower(captured(built).program, artifact.signature, scan=False)
    held = {original for originals in stacked.values() for original in originals}
    assert set(program.weight_names) - set(stacked) == set(unrolled.weight_names) - held
    assert while_loops(program) == 1 and while_loops(unrolled) == 0
    assert len(program.exported.mlir_module()) < 0.7 * len(unrolled.exported.mlir_module())
    torch.manual_seed(3)
    inputs = (torch.randint(3, 1000, (3, 11)), torch.ones(3, 11, dtype=torch.long))
    scanned_out, unrolled_out = program.run([x.numpy() for x in inputs]), unrolled.run([x.numpy() for x in inputs])
    np.testing.assert_allclose(scanned_out[0], unrolled_out[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(scanned_out[0], eager(built, inputs)[0], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def bert():
    built = tiny_bert()
    return built, captured(built)


@pytest.mark.parametrize("precision, before_scan", [("f32", 0), ("bf16", 0)])
def test_bert_layers_scan_as_the_unrolled_program_computes(bert, precision, before_scan):
    """Every layer takes and gives the precision's dtype (under bf16 attention gives bfloat16, as
    torch's does on bfloat16 operands): all are scanned, and the numbers are the unrolled program's."""
    built, model = bert
    scanned = lower_stage.lower(model.program, model.signature, precision)
    unrolled = lower_stage.lower(model.program, model.signature, precision, scan=False)
    [run] = scanned.scanned
    assert (run["module"], run["count"], run["blocks_before_scan"]) == ("model.encoder.layer", 3, before_scan)
    assert while_loops(scanned) == 1 and while_loops(unrolled) == 0
    inputs = [x.numpy() for x in built["args"]]
    # Under bf16 the scan's carry is each layer's bfloat16 output; unrolled, XLA may keep a layer's
    # output in f32 into the next (excess precision): they agree to bfloat16's rounding.
    tolerance = 1e-6 if precision == "f32" else 2e-2
    for got, expected in zip(scanned.run(inputs), unrolled.run(inputs)):
        np.testing.assert_allclose(got, expected, atol=tolerance, rtol=tolerance)
    if precision == "f32":
        for got, expected in zip(scanned.run(inputs), eager(built, built["args"])):
            np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


def test_blocks_that_differ_split_the_run():
    built = stack([nn.GELU, nn.GELU, nn.ReLU, nn.GELU, nn.GELU, nn.GELU])
    model = captured(built)
    lowered = lower_stage.lower(model.program, model.signature)
    assert [(run["first"], run["count"]) for run in lowered.scanned] == [(0, 2), (3, 3)]
    assert lowered.scanned[1]["weights"]["blocks.3-5.up.weight"] == ["blocks.3.up.weight", "blocks.4.up.weight", "blocks.5.up.weight"]
    assert "blocks.2.up.weight" in lowered.weight_names  # the odd block stays unrolled
    assert while_loops(lowered) == 2
    inputs = (torch.randn(5, 9, 8), (torch.rand(5, 9) > 0.3).float())
    np.testing.assert_allclose(lowered.run([x.numpy() for x in inputs])[0], eager(built, inputs)[0], atol=1e-5, rtol=1e-5)


def test_blocks_read_from_outside_the_run_stay_unrolled():
    """Every layer's output is read after the loop (as output_hidden_states does): no scan."""
    built = stack([nn.GELU] * 3, every_layer=True)
    model = captured(built)
    lowered = lower_stage.lower(model.program, model.signature)
    assert lowered.scanned == () and while_loops(lowered) == 0
    np.testing.assert_allclose(lowered.run([x.numpy() for x in built["args"]])[0], eager(built, built["args"])[0], atol=1e-5, rtol=1e-5)


def test_int8_dynamic_scans_and_static_int8_stays_unrolled():
    """Static int8 bakes each layer's activation scales into its ops as constants, so its blocks differ."""
    from tpuexport import quantize as quantize_stage

    built = stack([nn.GELU] * 3)
    float_model = captured(built)
    scanned = {}
    for mode in ("int8-dynamic", "int8"):
        model = quantize_stage.quantize(float_model, mode, [built["args"]], None, False).captured
        lowered = lower_stage.lower(model.program, model.signature)
        unrolled = lower_stage.lower(model.program, model.signature, scan=False)
        scanned[mode] = [run["count"] for run in lowered.scanned]
        inputs = [x.numpy() for x in built["args"]]
        np.testing.assert_allclose(lowered.run(inputs)[0], unrolled.run(inputs)[0], atol=1e-6, rtol=1e-6)
    assert scanned == {"int8-dynamic": [3], "int8": []}


def test_no_scan_gives_the_unrolled_program(tmp_path):
    built = stack([nn.GELU] * 3)
    artifact = tpuexport.convert(built["model"], built["args"], built["dynamic_shapes"], target="v5e", out=tmp_path / "stack.tpu",
                                 scan=False, saved_model=False)
    assert artifact.manifest["scanned"] == []
    assert list(artifact.program.weight_names) == list(built["model"].state_dict())
    assert while_loops(artifact.program) == 0
    assert "--no-scan" in CliRunner().invoke(main, ["convert", "--help"]).output
