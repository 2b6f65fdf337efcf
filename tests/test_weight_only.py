"""Weight-only int8/int4 (quantize/weight_only.py, lower/quantized_weights.py): streamed from a
checkpoint, verified against the dequantized-weight model, planted bugs caught, s8/s4 weights in
the compiled TPU program, one-line errors for bad group sizes."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
import torch
from click.testing import CliRunner
from planted_bugs import WEIGHT_ONLY_BUGS, WEIGHT_ONLY_CONVOLUTION_BUGS

import tpuexport
from tpuexport import compile as compile_stage
from tpuexport import export as export_stage
from tpuexport import lower as lower_stage
from tpuexport import verify as verify_stage
from tpuexport.safetensors_files import read_safetensors_header
from tpuexport.cli import main
from tpuexport.errors import EXIT_BAD_INPUT, TpuExportError
from tpuexport.lower.quantized_weights import QuantizedArray, quantized_matmul
from tpuexport.quantize.weight_only import (INT8_ODD_CONVOLUTION_REASON, DequantizedReference, WeightOnlyScheme, check_scheme,
                                            pack_int4, quantize_tensor)
from tpuexport.verify.verification import eager_outputs

WIDTH, HIDDEN, VOCAB, LAYERS = 64, 128, 256, 2
GROUP = 32  # two groups per 64-wide row: the planted group bugs have a neighbour to go wrong with


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.q_proj = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.o_proj = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.up_proj = torch.nn.Linear(WIDTH, HIDDEN, bias=False)
        self.down_proj = torch.nn.Linear(HIDDEN, WIDTH, bias=False)

    def forward(self, x):
        x = x + self.o_proj(torch.nn.functional.silu(self.q_proj(self.norm(x))))
        return x + self.down_proj(torch.nn.functional.silu(self.up_proj(self.norm(x))))


class TinyDecoder(torch.nn.Module):
    """Token embedding, identical blocks (scanned), an lm_head: the weights an LLM quantizes."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, WIDTH)
        self.layers = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.lm_head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))


def seeded_checkpoint(model_class, directory) -> tuple[torch.nn.Module, object]:
    """(a float model_class built from seed 0, its safetensors checkpoint in `directory`)."""
    torch.manual_seed(0)
    model = model_class().eval()
    path = directory / "model.safetensors"
    safetensors.torch.save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()}, path)
    return model, path


def streamed_conversion(model_class, args, dynamic_shapes, path, out, mode) -> tpuexport.Artifact:
    """model_class converted with `mode` from its checkpoint at `path`, built on the meta device."""
    with tpuexport.parameters_on_meta():
        on_meta = model_class().eval()
    return tpuexport.convert(on_meta, args, dynamic_shapes, out=out, checkpoint=path, quantize=mode, group_size=GROUP, saved_model=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return seeded_checkpoint(TinyDecoder, tmp_path_factory.mktemp("checkpoint"))


@pytest.mark.parametrize("mode", ["int8-weight-only", "int4-weight-only"])
def test_checkpoint_streams_quantized_weights_verified_against_dequantized_model(tmp_path, checkpoint, mode):
    model, path = checkpoint
    artifact = streamed_conversion(TinyDecoder, (tokens(),), None, path, tmp_path / "m.tpu", mode)
    manifest = artifact.manifest
    assert manifest["verification"]["passed"]
    section = manifest["quantization"]
    bits = 4 if mode.startswith("int4") else 8
    # Every matmul and embedding weight, stacked over the scanned blocks; norms stay float.
    assert sorted(section["weights"]) == sorted(["embed_tokens.weight", "lm_head.weight"] + [
        f"layers.0-1.{name}.weight" for name in ("q_proj", "o_proj", "up_proj", "down_proj")])
    assert manifest["scanned"][0]["count"] == LAYERS
    header, _ = read_safetensors_header(artifact.path / manifest["program"]["weights"])
    up = header["layers.0-1.up_proj.weight"]
    assert up["shape"] == [LAYERS, HIDDEN, WIDTH // 2 if bits == 4 else WIDTH]
    assert up["dtype"] == ("U8" if bits == 4 else "I8")
    scale = header["layers.0-1.up_proj.weight_scale"]
    assert scale["shape"] == [LAYERS, HIDDEN, WIDTH // GROUP if bits == 4 else 1] and scale["dtype"] == "BF16"
    assert header["layers.0-1.norm.weight"]["dtype"] == "F32"
    assert section["weight_bytes"]["ratio"] <= (0.15 if bits == 4 else 0.27)

    # The artifact computes what the float model computes with its weights rounded and dequantized...
    axes = {part: entry["axis"] for name, entry in section["weights"].items()
            for part in ([f"layers.{i}.{name.split('.', 2)[2]}" for i in range(LAYERS)] if name.startswith("layers.0-1") else [name])}
    reference = DequantizedReference(model, axes, WeightOnlyScheme(mode, GROUP))
    fresh = tokens(1)
    [expected] = eager_outputs(reference, (fresh,))
    actual = np.asarray(artifact.run(fresh))
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    # ...which is close to, but not, the float model: SQNR reported per output.
    [floating] = eager_outputs(model, (fresh,))
    assert not np.allclose(actual, floating, rtol=1e-5, atol=1e-6)
    [output] = section["outputs"]
    assert output["name"] == "output_0" and (output["sqnr_db"] > 35 if bits == 8 else 12 < output["sqnr_db"] < 35)
    assert (section["warnings"] == []) == (output["sqnr_db"] >= 15)


def test_an_output_far_from_float_is_warned_about_naming_it_and_keep_float(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)).eval()
    with torch.no_grad():
        model[0].weight[:, ::GROUP] = 1.0  # one outlier per int4 group sets its scale: most of the others round to 0
    artifact = tpuexport.convert(model, (torch.randn(2, 64),), None, out=tmp_path / "m.tpu", quantize="int4-weight-only",
                                 group_size=GROUP, saved_model=False)
    section = artifact.manifest["quantization"]
    [output] = section["outputs"]
    assert artifact.manifest["verification"]["passed"] and output["sqnr_db"] < 15
    [warning] = section["warnings"]
    assert warning.startswith(f"output output_0 is {output['sqnr_db']:.1f} dB from the float model (below 15 dB): keep the weights")
    assert "--keep-float REGEX" in warning and "int8-weight-only" in warning


def test_quantize_and_pack_round_trip():
    weight = torch.randn(4, 64)
    integers, scale = quantize_tensor(weight, WeightOnlyScheme("int4-weight-only", GROUP), -1)
    assert integers.abs().max() <= 7 and scale.shape == (4, 2) and scale.dtype == torch.bfloat16
    packed = pack_int4(integers)
    assert packed.shape == (4, 32) and packed.dtype == torch.uint8
    low = (packed & 0x0F).to(torch.int16)
    assert torch.equal(torch.where(low > 7, low - 16, low), integers[:, 0::2].to(torch.int16))  # element 2i: low nibble
    error = (integers.float().reshape(4, 2, GROUP) * scale.float()[..., None]).reshape(4, 64) - weight
    assert error.abs().max() <= scale.float().max() / 2 + 1e-6


@pytest.mark.parametrize("axis", [-1, -2])
def test_int4_product_from_pairs_equals_the_product_of_the_weight_torch_packed(axis):
    """The program's int4 product (the weight read as s4 pairs, never unpacked) equals x @ w for the
    weight torch quantized and packed, stored (out, in) and read transposed, or stored (in, out)."""
    weight = torch.randn(24, 64) if axis == -1 else torch.randn(64, 24)
    integers, scale = quantize_tensor(weight, WeightOnlyScheme("int4-weight-only", 16), axis)
    values = jnp.asarray(pack_int4(integers).numpy())
    quantized = QuantizedArray(values, jnp.asarray(scale.float().numpy()), 4, axis, jnp.dtype(jnp.float32), transposed=axis == -1)
    x = torch.randn(2, 5, 64)
    dequantized = (integers.float() * scale.float().repeat_interleave(16, dim=axis))
    expected = x @ (dequantized.T if axis == -1 else dequantized)
    np.testing.assert_allclose(np.asarray(quantized_matmul(jnp.asarray(x.numpy()), quantized)), expected.numpy(), rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def captured(checkpoint):
    model, _ = checkpoint
    return export_stage.capture(export_stage.LoadedSource(model, (tokens(),), None, None, export_stage.SourceInfo("api")))


@pytest.mark.parametrize("bug", sorted(WEIGHT_ONLY_BUGS))
def test_planted_int4_bugs_fail_verification(captured, bug):
    scheme = WeightOnlyScheme("int4-weight-only", GROUP)
    tolerances = verify_stage.default_tolerances("f32", "default", quantized=False)
    with WEIGHT_ONLY_BUGS[bug]():
        lowered = lower_stage.lower(captured.program, captured.signature, weight_only=scheme)
        axes = {part: entry["axis"] for name, entry in lowered.quantized.items() for part in lowered.weight_parts[name]}
        report = verify_stage.verify(lowered, DequantizedReference(captured.reference, axes, scheme), captured.example_inputs,
                                     tolerances, budget_flops=0)
    assert not report.passed, bug


class Projection(torch.nn.Module):
    """One LLM-sized MLP (Llama-3-8B's up and down projections) in bfloat16."""

    def __init__(self):
        super().__init__()
        self.up_proj = torch.nn.Linear(4096, 14336, bias=False, dtype=torch.bfloat16)
        self.down_proj = torch.nn.Linear(14336, 4096, bias=False, dtype=torch.bfloat16)

    def forward(self, x):
        return self.down_proj(self.up_proj(x))


@pytest.mark.parametrize("mode, element", [("int8-weight-only", "s8"), ("int4-weight-only", "u8")])
def test_tpu_program_reads_integer_weights_without_a_dequantized_copy(mode, element):
    """The compiled v5e program takes the weights as integers (s4 packed in u8 for int4) and its
    temporaries stay far below one dequantized bf16 weight (117 MB each here)."""
    model = Projection().to("meta")
    captured = export_stage.capture(export_stage.on_meta_device(
        export_stage.LoadedSource(model, (torch.zeros(8, 4096, dtype=torch.bfloat16, device="meta"),), None, None,
                                  export_stage.SourceInfo("api"))))
    lowered = lower_stage.lower(captured.program, captured.signature, weights=False, weight_only=check_scheme(mode, 128))
    [target] = compile_stage.resolve_targets(["v5e"])
    [compiled] = compile_stage.compile_program(lowered, [target], compile_stage.make_buckets(lowered.signature, None)).results
    entry = compiled.hlo_text[compiled.hlo_text.index("\nENTRY"):]
    parameters = re.findall(r"= (\w+)\[([\d,]*)\]\S* parameter\((\d+)\)", entry.split("\n}")[0])
    by_position = {int(position): (kind, dims) for kind, dims, position in parameters}
    up, down = (lowered.weight_names.index(f"{name}.weight") for name in ("up_proj", "down_proj"))
    packed = 2 if element == "u8" else 1
    assert by_position[up] == (element, f"14336,{4096 // packed}") and by_position[down] == (element, f"4096,{14336 // packed}"), parameters
    dequantized_bytes = 4096 * 14336 * 2
    assert compiled.memory["temp_bytes"] < dequantized_bytes / 10, compiled.memory
    integer_bytes = 2 * 4096 * 14336 // (2 if element == "u8" else 1)
    assert integer_bytes <= compiled.memory["argument_bytes"] < integer_bytes * 1.1


@pytest.mark.parametrize("group, message", [
    ("48", "--group-size 48 does not divide weight"),
    ("0", "--group-size 0 is not a positive even number"),
])
def test_bad_group_size_is_one_line(tmp_path, group, message):
    script = tmp_path / "model.py"
    script.write_text("import torch\n"
                      "def build():\n"
                      "    return {'model': torch.nn.Sequential(torch.nn.Linear(64, 64)).eval(), 'args': (torch.randn(2, 64),)}\n")
    result = CliRunner().invoke(main, ["convert", f"{script}:build", "--quantize", "int4-weight-only", "--group-size", group,
                                       "--no-saved-model", "-o", str(tmp_path / "m.tpu")])
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and message in error_lines[0], result.stderr
    assert "Traceback" not in result.output and not (tmp_path / "m.tpu").exists()


def test_inspect_lists_quantized_weights(tmp_path):
    built = {"model": torch.nn.Sequential(torch.nn.Linear(64, 32)).eval(), "args": (torch.randn(2, 64),)}
    artifact = tpuexport.convert(built["model"], built["args"], None, out=tmp_path / "m.tpu", quantize="int4-weight-only",
                                 group_size=GROUP, saved_model=False)
    result = CliRunner().invoke(main, ["inspect", str(artifact.path)])
    assert result.exit_code == 0, result.output
    assert "quantized int4-weight-only: 1 weights" in result.output
    assert "0.weight: int4, groups of 32 along axis -1, scales 0.weight_scale" in result.output
    summary = json.loads(CliRunner().invoke(main, ["inspect", str(artifact.path), "--json"]).stdout)
    assert summary["quantization"]["weights"]["0.weight"]["bits"] == 4
    with pytest.raises(TpuExportError, match="not a regular expression"):
        tpuexport.convert(built["model"], built["args"], None, out=tmp_path / "k.tpu", quantize="int8-weight-only",
                          keep_float="(", saved_model=False)


def test_tensor_parallel_plan_splits_int4_weights_and_their_scales_alike(captured):
    """On a slice, packed int4 weights are recognized as their layers and their scales follow their split."""
    lowered = lower_stage.lower(captured.program, captured.signature, weights=False,
                                weight_only=WeightOnlyScheme("int4-weight-only", GROUP))
    [target] = compile_stage.resolve_targets(["v5e-8"])
    request = compile_stage.make_request("replica=4,model=2", "tensor-parallel")
    plan = compile_stage.plan_sharding(request, target, lowered.weight_names, lowered.weight_specs, lowered.signature,
                                       compile_stage.make_buckets(lowered.signature, None), lowered.stacked)
    specs = dict(plan.weights)
    assert specs["layers.0-1.up_proj.weight"] == specs["layers.0-1.up_proj.weight_scale"] == (None, "model")  # output features
    assert specs["layers.0-1.down_proj.weight"] == specs["layers.0-1.down_proj.weight_scale"] == (None, None, "model")  # input features
    assert specs["layers.0-1.o_proj.weight"] == specs["layers.0-1.o_proj.weight_scale"] == (None, None, "model")
    assert specs["embed_tokens.weight"] == specs["embed_tokens.weight_scale"] == ("model",)


def test_keep_float_keeps_matching_weights_float(captured):
    lowered = lower_stage.lower(captured.program, captured.signature, weights=False,
                                weight_only=WeightOnlyScheme("int8-weight-only", keep_float=r"^(lm_head|embed_tokens)\."))
    assert sorted(lowered.quantized) == sorted(f"layers.0-1.{name}.weight" for name in ("q_proj", "o_proj", "up_proj", "down_proj"))
    specs = dict(zip(lowered.weight_names, lowered.weight_specs))
    assert specs["lm_head.weight"].dtype == specs["embed_tokens.weight"].dtype == np.float32
    assert "lm_head.weight_scale" not in specs


class PositionBias(torch.nn.Module):
    """T5's shape of the problem: a lookup table with one value per head (rows of 4, shorter than
    a group) beside matmul weights that int4 quantizes."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Embedding(16, 4)
        self.proj = torch.nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x, buckets):
        return self.proj(x) + self.bias(buckets).sum(-1, keepdim=True)


def test_int4_keeps_a_lookup_table_with_rows_shorter_than_a_group_float():
    model = PositionBias().eval()
    args = (torch.randn(2, WIDTH), torch.tensor([1, 3]))
    program = torch.export.export(model, args).run_decompositions()
    lowered = lower_stage.lower(program, export_stage.describe(program, args), weights=False,
                                weight_only=WeightOnlyScheme("int4-weight-only", group_size=GROUP))
    assert sorted(lowered.quantized) == ["proj.weight"]


def test_generation_artifact_with_int4_weights_generates_what_the_dequantized_model_does(tmp_path):
    """Prefill and decode share the quantized weights; verification compares with generate() on the
    model whose weights are rounded and dequantized; the decode step's arguments are the int4 weights and the cache."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config).eval()
    artifact = tpuexport.convert(model, task="text-generation", max_context=32, max_batch=2, buckets={"seq": [16], "batch": [2]},
                                 target="v5e", out=tmp_path / "llama.tpu", quantize="int4-weight-only", group_size=GROUP)
    manifest = artifact.manifest
    assert manifest["verification"]["passed"] and manifest["verification"]["tokens_compared"] > 0
    # Its distance from the float model's generate(), measured on the artifact's logits.
    report = json.loads((artifact.path / manifest["verification"]["report"]).read_text())
    divergence = report["float_divergence"]
    assert divergence["tokens_compared"] == manifest["verification"]["tokens_compared"]
    assert 5.0 < divergence["sqnr_db"] < 60.0
    assert divergence["first"] is None or 0 <= divergence["first"]["step"] < report["cases"][0]["new_tokens"]
    quantized = manifest["quantization"]["weights"]
    assert "model.model.embed_tokens.weight" in quantized and quantized["model.lm_head.weight"]["bits"] == 4
    assert manifest["quantization"]["weight_bytes"]["ratio"] < 0.15
    # The logits are the section's output, at that SQNR; below 15 dB, a warning names them and --keep-float.
    assert manifest["quantization"]["outputs"] == [{"name": "logits", "sqnr_db": divergence["sqnr_db"]}]
    warnings = manifest["quantization"]["warnings"]
    assert (warnings == []) == (divergence["sqnr_db"] >= 15), warnings
    assert all(warning.startswith("output logits is ") and "--keep-float" in warning for warning in warnings)
    decode = next(bucket for bucket in manifest["targets"]["v5e"]["buckets"] if bucket["entry_point"] == "decode")
    assert decode["memory"]["argument_bytes"] < manifest["program"]["weight_bytes"] + manifest["generation"]["cache_bytes"] + 2**20


def test_large_weights_are_rounded_in_row_blocks_alike(monkeypatch):
    from tpuexport.quantize import weight_only

    weight = torch.randn(10, 64)
    scheme = WeightOnlyScheme("int4-weight-only", GROUP)
    whole = quantize_tensor(weight, scheme, -1), weight_only.fake_quantized(weight, scheme, -1)
    monkeypatch.setattr(weight_only, "ROWS_AT_ONCE", 3)
    blocks = quantize_tensor(weight, scheme, -1), weight_only.fake_quantized(weight, scheme, -1)
    assert torch.equal(whole[0][0], blocks[0][0]) and torch.equal(whole[0][1], blocks[0][1]) and torch.equal(whole[1], blocks[1])
    transposed = quantize_tensor(weight.T.contiguous(), scheme, -2)  # (in, out): rows are the contraction axis, one block
    assert transposed[1].shape == (2, 10)


class ConvBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(32, 32, 3, padding=1)

    def forward(self, x):
        return x + torch.relu(self.conv(x))


class TinyConvNet(torch.nn.Module):
    """The convolutions weight-only quantizes: conv2d (a 3-channel stem whose contraction, 27, int4
    cannot pack; grouped with a bias; pointwise) and conv1d blocks (as many in as out channels:
    a scale on the wrong side of the contraction still runs)."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.conv = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=2)
        self.point = torch.nn.Conv2d(16, 32, 1)
        self.blocks = torch.nn.ModuleList(ConvBlock() for _ in range(2))
        self.head = torch.nn.Linear(32, 10)

    def forward(self, image):
        x = torch.relu(self.point(torch.relu(self.conv(torch.relu(self.stem(image))))))
        x = x.flatten(2)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(-1))


def images(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def conv_checkpoint(tmp_path_factory):
    return seeded_checkpoint(TinyConvNet, tmp_path_factory.mktemp("conv_checkpoint"))


@pytest.mark.parametrize("mode", ["int8-weight-only", "int4-weight-only"])
def test_convolution_weights_quantized_per_output_channel_verified_against_dequantized_model(tmp_path, conv_checkpoint, mode):
    model, path = conv_checkpoint
    batch = torch.export.Dim("batch", min=1, max=8)
    artifact = streamed_conversion(TinyConvNet, (images(),), {"image": {0: batch}}, path, tmp_path / "m.tpu", mode)
    manifest = artifact.manifest
    assert manifest["verification"]["passed"]
    bits = 4 if mode.startswith("int4") else 8
    weights = manifest["quantization"]["weights"]
    assert sorted(weights) == ["blocks.0.conv.weight", "blocks.1.conv.weight", "conv.weight", "head.weight", "point.weight", "stem.weight"]
    # One scale per output channel; the weight stored as its [out, in/groups x kernel] matrix.
    header, _ = read_safetensors_header(artifact.path / manifest["program"]["weights"])
    conv = weights["conv.weight"]
    assert conv["axis"] == [-3, -2, -1] and conv["kernel_shape"] == [16, 4, 3, 3] and conv["bits"] == bits and conv["group_size"] == 36
    assert header["conv.weight"]["shape"] == [16, 36 // (2 if bits == 4 else 1)]
    assert header["conv.weight"]["dtype"] == ("U8" if bits == 4 else "I8")
    assert header["conv.weight_scale"] == {**header["conv.weight_scale"], "shape": [16, 1], "dtype": "BF16"}
    assert header["blocks.1.conv.weight_scale"]["shape"] == [32, 1] and weights["blocks.1.conv.weight"]["axis"] == [-2, -1]
    stem = weights["stem.weight"]
    assert (stem["bits"], stem.get("reason")) == ((8, INT8_ODD_CONVOLUTION_REASON) if bits == 4 else (8, None))
    assert header["conv.bias"]["dtype"] == "F32"
    listed = CliRunner().invoke(main, ["inspect", str(artifact.path)]).output
    assert f"conv.weight: int{bits}, convolution [16, 4, 3, 3] per output channel, scales conv.weight_scale" in listed

    # The artifact computes what the float model computes with its weights rounded and dequantized...
    reference = DequantizedReference(model, {name: entry["axis"] for name, entry in weights.items()}, WeightOnlyScheme(mode, GROUP))
    fresh = images(1)
    [expected] = eager_outputs(reference, (fresh,))
    actual = np.asarray(artifact.run(fresh))
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    # ...which is not the float model's.
    [floating] = eager_outputs(model, (fresh,))
    assert not np.allclose(actual, floating, rtol=1e-5, atol=1e-6)
    [output] = manifest["quantization"]["outputs"]
    assert output["sqnr_db"] > 35 if bits == 8 else 12 < output["sqnr_db"] < 35


@pytest.fixture(scope="module")
def conv_captured(conv_checkpoint):
    model, _ = conv_checkpoint
    return export_stage.capture(export_stage.LoadedSource(model, (images(),), None, None, export_stage.SourceInfo("api")))


@pytest.mark.parametrize("bug", sorted(WEIGHT_ONLY_CONVOLUTION_BUGS))
def test_planted_convolution_scale_bugs_fail_verification(conv_captured, bug):
    scheme = WeightOnlyScheme("int8-weight-only")
    tolerances = verify_stage.default_tolerances("f32", "default", quantized=False)
    with WEIGHT_ONLY_CONVOLUTION_BUGS[bug]():
        lowered = lower_stage.lower(conv_captured.program, conv_captured.signature, weight_only=scheme)
        axes = {part: entry["axis"] for name, entry in lowered.quantized.items() for part in lowered.weight_parts[name]}
        report = verify_stage.verify(lowered, DequantizedReference(conv_captured.reference, axes, scheme), conv_captured.example_inputs,
                                     tolerances, budget_flops=0)
    assert not report.passed, bug


@pytest.mark.parametrize("mode, element", [("int8-weight-only", "s8"), ("int4-weight-only", "u8")])
def test_tpu_convolutions_read_integer_weights_without_a_float_copy(conv_captured, mode, element):
    """On v5e the convolution weights are integer arguments and no op outside a fusion makes a
    float array of a convolution weight's size (as a kernel, its matrix or per feature group; no
    activation here has one of these sizes): the conversion happens inside the convolution's fusion."""
    lowered = lower_stage.lower(conv_captured.program, conv_captured.signature, weights=False,
                                weight_only=check_scheme(mode, GROUP))
    [target] = compile_stage.resolve_targets(["v5e"])
    [compiled] = compile_stage.compile_program(lowered, [target], compile_stage.make_buckets(lowered.signature, None)).results
    entry = compiled.hlo_text[compiled.hlo_text.index("\nENTRY"):].split("\n}")[0]
    parameters = {int(position): (kind, dims) for kind, dims, position in re.findall(r"= (\w+)\[([\d,]*)\]\S* parameter\((\d+)\)", entry)}
    convolutions = {name: entry for name, entry in lowered.quantized.items() if "kernel_shape" in entry}
    assert len(convolutions) == 5
    floating_sizes = {int(np.prod([int(size) for size in dims.split(",") if size]))
                      for dims in re.findall(r"= (?:f32|bf16)\[([\d,]*)\]\S* (?!parameter)", entry)}
    for name, quantized in convolutions.items():
        kernel = quantized["kernel_shape"]
        matrix = [kernel[0], int(np.prod(kernel[1:]))]
        kind = "s8" if quantized["bits"] == 8 else element
        stored = [matrix[0], matrix[1] // (2 if kind == "u8" else 1)]
        assert parameters[lowered.weight_names.index(name)] == (kind, ",".join(map(str, stored))), name
        assert int(np.prod(kernel)) not in floating_sizes, (name, kernel)


class WeightNormedConv(torch.nn.Module):
    """wav2vec2's positional convolution in small: a grouped conv1d under weight_norm over the
    kernel dim, whose weight the program computes from g and v."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(32, 32, 8, padding=4, groups=2), dim=2)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.conv(x)[..., :-1])


@pytest.mark.parametrize("mode", ["int8-weight-only", "int4-weight-only"])
def test_weight_normed_convolution_quantizes_its_direction(mode):
    torch.manual_seed(0)
    model = WeightNormedConv().eval()
    captured = export_stage.capture(export_stage.LoadedSource(model, (torch.randn(2, 32, 24),), None, None, export_stage.SourceInfo("api")))
    scheme = check_scheme(mode, GROUP)
    lowered = lower_stage.lower(captured.program, captured.signature, weight_only=scheme)
    # v is the integers (one scale per output channel); g, one value per kernel position, stays float.
    assert sorted(lowered.quantized) == ["conv.parametrizations.weight.original1"]
    entry = lowered.quantized["conv.parametrizations.weight.original1"]
    assert entry["kernel_shape"] == [32, 16, 8] and entry["bits"] == scheme.bits and entry["group_size"] == 128
    tolerances = verify_stage.default_tolerances("f32", "default", quantized=False)
    reference = DequantizedReference(captured.reference, lowered.quantized_state_axes, scheme)
    report = verify_stage.verify(lowered, reference, captured.example_inputs, tolerances, budget_flops=0)
    assert report.passed
    [floating] = eager_outputs(captured.reference, captured.example_inputs)
    [expected] = eager_outputs(reference, captured.example_inputs)
    assert not np.allclose(expected, floating, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["bf16", "bf16-mixed"])
def test_convolution_weights_in_bfloat16_programs_verified(tmp_path, conv_checkpoint, precision):
    """The convolution's operands in the dtype the precision computes it in (bf16 weights, or f32
    weights with bf16 convolution operands), its integers converted to it."""
    model = TinyConvNet().eval()
    model.load_state_dict(conv_checkpoint[0].state_dict())  # a copy: the fixture's model stays f32
    args = (images(),)
    if precision == "bf16":
        model, args = model.to(torch.bfloat16), (args[0].to(torch.bfloat16),)
    artifact = tpuexport.convert(model, args, None, out=tmp_path / "m.tpu", quantize="int4-weight-only", group_size=GROUP,
                                 precision=precision, saved_model=False)
    assert artifact.manifest["verification"]["passed"]
    assert artifact.manifest["quantization"]["weights"]["point.weight"]["bits"] == 4
