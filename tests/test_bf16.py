"""bf16 models as users bring them: `--precision auto` (the default) keeps the model's own dtypes
tensor by tensor, bf16 inputs and outputs run end to end, and state kept in f32 stays f32."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn

import tpuexport
from families import Outputs
from tpuexport import export as export_stage
from tpuexport import lower as lower_stage
from tpuexport.export import LoadedSource, SourceInfo
from tpuexport.gate import verify_artifact
from tpuexport.verify import default_tolerances, verify

ROTARY = "model.model.rotary_emb.inv_freq"


def tiny_llama(dtype: torch.dtype, max_positions: int = 64) -> nn.Module:
    """A 2-layer LlamaForCausalLM built as `from_pretrained(..., dtype=dtype)` builds it: under that
    default dtype, so its parameters are `dtype` and its rotary `inv_freq` (computed in f32 on
    purpose) stays f32; wrapped to take input_ids and return {"logits"}."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128, max_position_embeddings=max_positions)
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    try:
        model = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    return Outputs(model, ("input_ids",), ("logits",), use_cache=False)


def token_dims(max_seq: int) -> dict:
    return {"input_ids": {0: torch.export.Dim("batch", min=1, max=2), 1: torch.export.Dim("seq", min=2, max=max_seq)}}


@pytest.fixture(scope="module")
def bf16_llama_artifact(tmp_path_factory):
    """The bf16 Llama converted with no precision options, for v5e, verified at its example, minimum and
    positions cases only (no optional sizes: no test here reads them), without the SavedModel: (model, artifact)."""
    model = tiny_llama(torch.bfloat16)
    artifact = tpuexport.convert(model, (torch.randint(0, 128, (2, 16)),), token_dims(32), out=tmp_path_factory.mktemp("bf16") / "llama.tpu",
                                 saved_model=False, verify_budget_flops=0)
    return model, artifact


def test_bf16_llama_converts_with_no_options_in_its_own_dtypes(bf16_llama_artifact):
    model, artifact = bf16_llama_artifact
    assert artifact.manifest["precision"] == "auto" and artifact.manifest["resolved_precision"] == "bf16"
    # The tolerances of what the program computes in: bf16's, not the f32 ones that failed it.
    assert artifact.manifest["verification"]["tolerances"] == default_tolerances("bf16", "default", quantized=False).to_json()
    dtypes = dict(zip(artifact.program.weight_names, (str(spec.dtype) for spec in artifact.program.weight_specs)))
    assert dtypes[ROTARY] == "float32"  # the rotary table stays f32, as the eager model keeps it
    assert {dtype for name, dtype in dtypes.items() if "inv_freq" not in name} == {"bfloat16"}
    # ...in the program itself: its argument for the table is f32, and the weights file holds f32 values.
    exported = artifact.program.exported
    assert str(exported.in_avals[artifact.program.weight_names.index(ROTARY)].dtype) == "float32"
    np.testing.assert_array_equal(artifact.program.weights[artifact.program.weight_names.index(ROTARY)],
                                  model.model.model.rotary_emb.inv_freq.numpy())


def test_position_tables_are_verified_at_the_longest_sequence(bf16_llama_artifact):
    _, artifact = bf16_llama_artifact
    positions = [case for case in artifact.manifest["verification"]["cases"] if case["label"] == "positions"]
    assert [case["sizes"] for case in positions] == [{"batch": 2, "seq": 32}]  # every dim at its largest size


def test_a_rotary_table_rounded_to_bf16_fails_verification_at_long_positions():
    """The planted bug: the artifact's rotary inv_freq rounded to bfloat16 (as --precision bf16 did).
    The model's logits hide it (both full-model cases pass); its rotary tables at position 2047 do not."""
    model = tiny_llama(torch.bfloat16, max_positions=2048)
    captured = export_stage.capture(LoadedSource(model, (torch.randint(0, 128, (2, 16)),), token_dims(2048), None, SourceInfo("api")))
    program = lower_stage.lower(captured.program, captured.signature)
    weights = list(program.weights)
    index = program.weight_names.index(ROTARY)
    weights[index] = weights[index].astype(ml_dtypes.bfloat16).astype(np.float32)
    bugged = dataclasses.replace(program, weights=tuple(weights))

    report = verify(bugged, captured.reference, captured.example_inputs, budget_flops=0)
    assert not report.passed
    assert [(case.label, case.passed) for case in report.cases] == [("example", True), ("min", True), ("positions", False)]
    positions = report.cases[-1]
    assert positions.sizes == {"batch": 2, "seq": 2048}
    failed = [output for output in positions.runs["cpu"] if not output.passed]
    assert failed and all("self_attn" in output.name for output in failed)  # the cos/sin each attention layer reads
    assert "at batch=2,seq=2048 (cpu run)" in report.failure_summary()


class KeysInHalves(nn.Module):
    """DeepSeek-V3's keys (transformers' expand_kv): memory allocated from the sizes alone, then its two
    halves copied in, one of them a position table (sin(position) * w)."""

    def __init__(self):
        super().__init__()
        self.nope = nn.Linear(4, 4)
        self.rope = nn.Parameter(torch.linspace(0.5, 2.0, 4))

    def forward(self, x):
        keys = x.new_empty(x.shape[0], 8)
        keys[:, :4].copy_(self.nope(x))
        keys[:, 4:].copy_(torch.sin(torch.arange(x.shape[0], dtype=x.dtype)[:, None] * self.rope))
        return keys


def test_uninitialized_memory_is_no_position_table():
    """The "positions" case compares values computed from sizes alone; an allocation whose values a
    later op writes is one too by that rule, and its bytes (whatever the allocator left) departed between
    the runs: Kimi-K2.5's and Mistral-Large-4's tiny sweep models failed verification on them."""
    from tpuexport.verify.positions import position_tables

    seq = torch.export.Dim("seq", min=2, max=512)
    captured = export_stage.capture(LoadedSource(KeysInHalves(), (torch.randn(6, 4),), {"x": {0: seq}}, None, SourceInfo("api")))
    program = lower_stage.lower(captured.program, captured.signature)
    tables = position_tables(program.graph)
    assert tables and all("empty" not in table.name for table in tables)
    assert [table.target.overloadpacket for table in tables] == [torch.ops.aten.sin]  # the sin table stays one
    report = verify(program, captured.reference, captured.example_inputs, budget_flops=0)
    assert report.passed and "positions" in [case.label for case in report.cases]


def test_bf16_llama_artifact_runs_bf16_in_and_out(bf16_llama_artifact):
    model, artifact = bf16_llama_artifact
    ids = torch.randint(0, 128, (1, 7))
    logits = artifact.run(ids)["logits"]
    assert logits.dtype == torch.bfloat16 and logits.shape == (1, 7, 128)
    with torch.no_grad():
        expected = model(ids)["logits"].float()
    error = (logits.float() - expected).square().mean().sqrt() / expected.square().mean().sqrt()
    assert float(error) < 0.02  # bf16 rounding in another order, not a different model


def test_float_model_resolves_to_f32_with_the_f32_rule(mlp_artifact):
    assert mlp_artifact.manifest["precision"] == "auto" and mlp_artifact.manifest["resolved_precision"] == "f32"
    assert mlp_artifact.manifest["verification"]["tolerances"] == default_tolerances("f32", "default", quantized=False).to_json()


class KeepsAModuleInF32(nn.Module):
    """A model that names a module in `_keep_in_fp32_modules`, as T5 names its `wo`."""

    _keep_in_fp32_modules = ["wo"]

    def __init__(self):
        super().__init__()
        self.wi = nn.Linear(8, 16)
        self.wo = nn.Linear(16, 8)

    def forward(self, x):
        return self.wo(torch.relu(self.wi(x)))


def lowered(model: nn.Module, args: tuple, dynamic_shapes, precision: str) -> lower_stage.LoweredProgram:
    captured = export_stage.capture(LoadedSource(model, args, dynamic_shapes, None, SourceInfo("api")))
    return lower_stage.lower(captured.program, captured.signature, precision, keep_f32=captured.keep_f32)


def test_bf16_keeps_what_the_model_keeps_in_f32():
    """--precision bf16 casts the weights to bfloat16, but not non-persistent f32 buffers (rotary
    `inv_freq`) nor the modules named in `_keep_in_fp32_modules`; rotary angles are computed in f32."""
    program = lowered(tiny_llama(torch.float32), (torch.randint(0, 128, (2, 16)),), token_dims(64), "bf16")
    dtypes = dict(zip(program.weight_names, (str(spec.dtype) for spec in program.weight_specs)))
    assert dtypes[ROTARY] == "float32" and dtypes["model.model.embed_tokens.weight"] == "bfloat16"
    text = program.exported.mlir_module()
    assert any("stablehlo.cosine" in line and "xf32>" in line for line in text.splitlines()), "rotary angles must be f32"
    kept = lowered(KeepsAModuleInF32(), (torch.randn(2, 8),), None, "bf16")
    dtypes = dict(zip(kept.weight_names, (str(spec.dtype) for spec in kept.weight_specs)))
    assert dtypes == {"wi.weight": "bfloat16", "wi.bias": "bfloat16", "wo.weight": "float32", "wo.bias": "float32"}


def test_bf16_inputs_and_outputs_through_run_golden_data_and_the_saved_model(tmp_path):
    """A model taking and returning bfloat16: converted with no options (TF SavedModel checked on
    its bf16 signature), run with torch bf16 tensors, and `tpuexport verify` passes on its golden data."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).to(torch.bfloat16).eval()
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    artifact = tpuexport.convert(model, (x,), {"input": {0: torch.export.Dim("batch", min=1, max=16)}}, out=tmp_path / "bf16.tpu")
    assert artifact.manifest["entry_points"]["serving_default"]["signature"]["inputs"][0]["dtype"] == "bfloat16"
    assert artifact.manifest["resolved_precision"] == "bf16"
    y = artifact.run(torch.randn(3, 16, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (3, 8)
    assert artifact.manifest["verification"]["saved_model"]["passed"]  # TensorFlow ran it on the bf16 golden inputs
    gate = verify_artifact(artifact.path)
    assert gate.passed, gate


def test_optimal_seconds_adds_back_the_second_each_concat_bitcast_subtracts():
    """XLA's TPU cost model counts each internal ConcatBitcast call as -1 s (BERT-base unrolled: 68
    calls, -67.997 s; benchmarks/studies/optimal_seconds.py). The manifest records the estimate with them
    added back, and None (unknown) rather than a negative figure."""
    from tpuexport.compile.compile_child import optimal_seconds

    calls = '%c = f32[8] custom-call(%a), custom_call_target="ConcatBitcast"\n' * 68
    assert optimal_seconds({"optimal_seconds": -67.99732}, calls) == pytest.approx(0.00268, abs=1e-6)
    assert optimal_seconds({"optimal_seconds": 1.5e-5}, "no such call") == 1.5e-5
    assert optimal_seconds({"optimal_seconds": -3.0}, calls[: len(calls) // 68]) is None
    assert optimal_seconds({}, calls) is None


def test_no_figure_in_the_manifest_is_negative(bf16_llama_artifact):
    _, artifact = bf16_llama_artifact
    for target in artifact.manifest["targets"].values():
        for bucket in target["buckets"]:
            assert bucket["cost"]["optimal_seconds"] is None or bucket["cost"]["optimal_seconds"] >= 0
            assert all(value >= 0 for value in bucket["memory"].values())


def test_the_coverage_benchmark_writes_bf16_checkpoints_that_load_as_users_load_them(tmp_path):
    """benchmarks/coverage.py --modes bf16-checkpoint: the family's directory holds bfloat16 tensors
    and says so in config.json; loaded as `tpuexport convert DIR` loads it, its parameters are
    bfloat16 and its rotary table (not in a checkpoint, computed by the model) f32."""
    from families import FAMILIES

    from tpuexport.safetensors_files import read_safetensors_header
    from tpuexport.export import load_source

    FAMILIES["llama"].save(tmp_path / "llama", torch.bfloat16)
    header, _ = read_safetensors_header(next((tmp_path / "llama").glob("*.safetensors")))
    assert {entry["dtype"] for entry in header.values()} == {"BF16"}
    loaded = load_source(str(tmp_path / "llama"))
    assert {parameter.dtype for parameter in loaded.model.parameters()} == {torch.bfloat16}
    assert {name: buffer.dtype for name, buffer in loaded.model.named_buffers()}["model.rotary_emb.inv_freq"] == torch.float32
