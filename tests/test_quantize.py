"""PT2E int8 quantization: integer ops in the compiled TPU HLO, artifact size, the three modes from
the API and the CLI, and one-line errors for bad calibration data."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import EXAMPLES, build_example
from planted_bugs import INT8_BUGS

import tpuexport
from tpuexport import compile as compile_stage
from tpuexport import export as export_stage
from tpuexport import lower as lower_stage
from tpuexport import verify as verify_stage
from tpuexport.cli import main
from tpuexport.compile.hlo import matmul_ops
from tpuexport.errors import EXIT_BAD_INPUT, TpuExportError
from tpuexport.quantize import quantize

def captured_example(name: str) -> export_stage.CapturedModel:
    built = build_example(name)
    loaded = export_stage.LoadedSource(built["model"], built["args"], built["dynamic_shapes"], built["calibration"],
                                       export_stage.SourceInfo("api"))
    return export_stage.capture(loaded)


# (example, number of dots/convolutions that must run as int8 x int8 -> int32 on the TPU); the
# transformer's 13 are its 9 linears and Q·Kᵀ, P·V of both attention layers.
INTEGER_LAYERS = {"mlp": 3, "cnn": 3, "transformer": 13}


@pytest.fixture(scope="module")
def quantized_examples():
    """name -> (the example captured, quantized with static int8 (its calibration), the quantized program lowered),
    each made once for this module's tests."""
    made = {}

    def quantized_example(name: str):
        if name not in made:
            captured = captured_example(name)
            quantized = quantize(captured, "int8")
            made[name] = captured, quantized, lower_stage.lower(quantized.captured.program, quantized.captured.signature)
        return made[name]

    return quantized_example


@pytest.mark.parametrize("name", sorted(INTEGER_LAYERS))
def test_static_int8_compiles_to_s8_dots_and_shrinks_weights(quantized_examples, name):
    captured, quantized, lowered = quantized_examples(name)
    [target] = compile_stage.resolve_targets(["v5e"])
    [compiled] = compile_stage.compile_program(lowered, [target], compile_stage.make_buckets(lowered.signature, None)).results

    operations = [op.types for op in matmul_ops(compiled.hlo_text)]
    integer = [types for types in operations if types == "s8xs8->s32"]
    assert len(integer) == INTEGER_LAYERS[name] == len(operations), operations
    assert quantized.captured.signature.dims == captured.signature.dims  # symbolic dims survive

    float_bytes = sum(w.nbytes for w in lower_stage.lower(captured.program, captured.signature).weights)
    quantized_bytes = sum(w.nbytes for w in lowered.weights)
    assert quantized_bytes <= 0.3 * float_bytes
    assert {w.dtype for w in lowered.weights} == {np.dtype(np.int8), np.dtype(np.float32)}


class StringPaddedConvs(torch.nn.Module):
    """Convolutions with padding="same"/"valid" (aten.conv*d.padding), as EfficientNet's all are;
    the even kernel's "same" pads one side more and stays float."""

    def __init__(self):
        super().__init__()
        self.same = torch.nn.Conv2d(3, 8, 3, padding="same")
        self.valid = torch.nn.Conv2d(8, 8, 3, stride=2, padding="valid")
        self.uneven = torch.nn.Conv2d(8, 8, 2, padding="same")
        self.same_1d = torch.nn.Conv1d(8, 4, 3, padding="same")

    def forward(self, x):
        y = self.uneven(self.valid(torch.relu(self.same(x))))
        return self.same_1d(y.flatten(2))


def test_convolutions_with_string_padding_run_as_int8():
    torch.manual_seed(0)
    model = StringPaddedConvs().eval()
    x = torch.randn(2, 3, 16, 16)
    loaded = export_stage.LoadedSource(model, (x,), None, [(torch.randn(2, 3, 16, 16),) for _ in range(4)],
                                       export_stage.SourceInfo("api"))
    captured = export_stage.capture(loaded)
    quantized = quantize(captured, "int8")
    lowered = lower_stage.lower(quantized.captured.program, quantized.captured.signature)
    [target] = compile_stage.resolve_targets(["v5e"])
    [compiled] = compile_stage.compile_program(lowered, [target], compile_stage.make_buckets(lowered.signature, None)).results
    operations = [op.types for op in matmul_ops(compiled.hlo_text)]
    assert len(operations) == 4 and operations.count("s8xs8->s32") == 3, operations  # the uneven one stays float
    report = verify_stage.verify(lowered, quantized.captured.reference, quantized.captured.example_inputs,
                                 verify_stage.default_tolerances("f32", "default", True))
    assert report.passed, report.to_json()


class MatmulModel(torch.nn.Module):
    """Two activations multiplied (matmul and bmm), as in attention scores."""

    def __init__(self):
        super().__init__()
        self.query = torch.nn.Linear(8, 8)

    def forward(self, x):
        scores = torch.matmul(self.query(x), x.transpose(1, 2))
        return torch.bmm(scores, x)


def test_matmul_and_bmm_of_activations_run_as_int8(tmp_path):
    batch = torch.export.Dim("batch", min=1, max=16)
    samples = [(torch.randn(3, 5, 8),) for _ in range(4)]
    artifact = tpuexport.convert(
        MatmulModel(), (torch.randn(2, 5, 8),), {"x": {0: batch}}, out=tmp_path / "matmul.tpu",
        quantize="int8", calibration=samples, saved_model=False,
    )
    report = json.loads((artifact.path / "quantization" / "report.json").read_text())
    assert [(layer["op"], layer["integer"]) for layer in report["layers"]] == [("linear", True), ("matmul", True), ("bmm", True)]
    assert artifact.manifest["verification"]["passed"]
    assert len(artifact.manifest["verification"]["cases"]) >= 3  # several batch sizes verified


def quantized_mlp(out: pathlib.Path, mode: str, **options) -> tpuexport.Artifact:
    """examples/mlp.py quantized in `mode` with its calibration samples, without the SavedModel."""
    built = build_example("mlp")
    return tpuexport.convert(built["model"], built["args"], built["dynamic_shapes"], out=out, quantize=mode,
                             calibration=built["calibration"], saved_model=False, **options)


@pytest.fixture(scope="module")
def static_int8_mlp(tmp_path_factory) -> tpuexport.Artifact:
    """quantized_mlp in static int8, converted once for the two tests that read it."""
    return quantized_mlp(tmp_path_factory.mktemp("int8_mlp") / "mlp.tpu", "int8")


@pytest.mark.parametrize("mode", ["int8", "int8-dynamic"])  # weight-only modes: tests/test_weight_only.py
def test_api_modes_write_report_and_chart(tmp_path, mode, request):
    artifact = request.getfixturevalue("static_int8_mlp") if mode == "int8" else quantized_mlp(tmp_path / "mlp.tpu", mode)
    manifest = artifact.manifest
    report = json.loads((artifact.path / manifest["quantization"]["report"]).read_text())
    assert report["mode"] == mode and not report["warnings"]
    assert report["outputs"][0]["sqnr_db"] > 25
    assert all(layer["integer"] for layer in report["layers"])
    assert (artifact.path / manifest["quantization"]["chart"]).read_bytes().startswith(b"\x89PNG")
    assert manifest["verification"]["against"] == "the PT2E-converted model, eager PyTorch"
    assert report["weight_bytes"]["ratio"] <= 0.3
    assert artifact.run(torch.randn(7, 32)).shape == (7, 10)


def test_static_int8_needs_calibration_unless_random_is_asked_for(tmp_path):
    built = build_example("mlp")
    with pytest.raises(TpuExportError, match="needs calibration data"):
        tpuexport.convert(built["model"], built["args"], built["dynamic_shapes"], out=tmp_path / "a.tpu", quantize="int8",
                          saved_model=False)
    artifact = tpuexport.convert(built["model"], built["args"], built["dynamic_shapes"], out=tmp_path / "b.tpu",
                                 quantize="int8", random_calibration=True, saved_model=False)
    assert "RANDOM" in artifact.manifest["quantization"]["warnings"][0]


@pytest.mark.parametrize("mode", ["int8", "int8-dynamic", "int8-weight-only"])
def test_cli_modes(tmp_path, mode):
    calibration = tmp_path / "calibration.npz"
    np.savez(calibration, x=np.random.default_rng(0).normal(size=(8, 16, 32)).astype(np.float32))
    extra = ["--calibration", str(calibration)] if mode == "int8" else []
    result = CliRunner().invoke(main, [
        "convert", f"{EXAMPLES}/mlp.py:build", "--quantize", mode, *extra, "--no-saved-model", "-o", str(tmp_path / "m.tpu"), "--json",
    ])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["quantization"]["mode"] == mode


def _write_npz(path, **arrays):
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("case, message", [
    ("wrong_name", "holds arrays ['y'] but the model's inputs are ['x']"),
    ("wrong_shape", "axis 1 is 31, expected 32"),
    ("wrong_dtype", "is float32 but its array is int64"),
    ("empty", "sample counts"),
    ("missing", "does not exist"),
    ("not_an_archive", "cannot read calibration file"),
])
def test_cli_bad_calibration_files_give_one_line_errors(tmp_path, case, message):
    files = {
        "wrong_name": lambda p: _write_npz(p, y=np.zeros((2, 4, 32), np.float32)),
        "wrong_shape": lambda p: _write_npz(p, x=np.zeros((2, 4, 31), np.float32)),
        "wrong_dtype": lambda p: _write_npz(p, x=np.zeros((2, 4, 32), np.int64)),
        "empty": lambda p: _write_npz(p, x=np.zeros((0, 4, 32), np.float32)),
        "missing": lambda p: p,
        "not_an_archive": lambda p: p.write_bytes(b"not a zip") and p,
    }
    path = files[case](tmp_path / "calibration.npz")
    result = CliRunner().invoke(main, [
        "convert", f"{EXAMPLES}/mlp.py:build", "--quantize", "int8", "--calibration", str(path), "--no-saved-model",
        "-o", str(tmp_path / "m.tpu"),
    ])
    assert result.exit_code == EXIT_BAD_INPUT
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and message in " ".join(result.stderr.split()), result.stderr
    assert not (tmp_path / "m.tpu").exists()


@pytest.mark.parametrize("mode", ["int8", "int4-weight-only"])
def test_gate_against_the_float_source_checks_quantized_sqnr(tmp_path, mode, request):
    """`verify --against` on a quantized artifact compares SQNR vs the float model with convert
    time's, and names the artifact's quantization mode."""
    if mode == "int8":  # a copy: its manifest is edited below (group_size is int4's only)
        artifact = tpuexport.load(shutil.copytree(request.getfixturevalue("static_int8_mlp").path, tmp_path / "mlp.tpu"))
    else:
        artifact = quantized_mlp(tmp_path / "mlp.tpu", mode, group_size=32)
    source = f"{EXAMPLES / 'mlp.py'}:build"
    report = tpuexport.verify_artifact(artifact.path, against=source)
    against = next(c for c in report.checks if c.name == "against")
    assert report.passed and against.status == "passed", against.message
    recorded = artifact.manifest["quantization"]["outputs"][0]["sqnr_db"]
    assert abs(against.details["sqnr_db"]["output_0"] - recorded) < 3.0

    # An artifact that had been far closer to the float model at convert time has drifted.
    manifest_path = artifact.path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["quantization"]["outputs"][0]["sqnr_db"] = recorded + 10
    manifest_path.write_text(json.dumps(manifest))
    drifted = next(c for c in tpuexport.verify_artifact(artifact.path, against=source).checks if c.name == "against")
    assert drifted.status == "failed" and f"{mode} artifact drifted" in drifted.message and "output_0" in drifted.message


class PairedLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, a, b):
        return self.linear(a).sum(1) + self.linear(b).sum(1)


def test_derived_dims_survive_quantization(tmp_path):
    """b's sequence is 2*seq: the quantized re-export must rebuild that relation, not specialize it."""
    seq = torch.export.Dim("seq", min=2, max=32)
    artifact = tpuexport.convert(PairedLinear().eval(), (torch.randn(2, 4, 3), torch.randn(2, 8, 3)),
                                 {"a": {1: seq}, "b": {1: 2 * seq}}, out=tmp_path / "paired.tpu",
                                 quantize="int8", random_calibration=True, saved_model=False)
    assert [spec["shape"] for spec in artifact.manifest["entry_points"]["serving_default"]["signature"]["inputs"]] == [[2, "seq", 3], [2, "2*seq", 3]]
    assert artifact.run(torch.randn(2, 5, 3), torch.randn(2, 10, 3)).shape == (2, 3)
    with pytest.raises(TpuExportError, match=r"expected 2\*seq = 10"):
        artifact.run(torch.randn(2, 5, 3), torch.randn(2, 9, 3))


def test_the_int8_cnn_passes_verification_op_by_op(quantized_examples):
    """The control for the planted bugs below: the same program, lowered without a bug, conforms op by op."""
    captured, quantized, lowered = quantized_examples("cnn")
    tolerances = verify_stage.default_tolerances("f32", "default", quantized=True)
    correct = verify_stage.verify(lowered, quantized.captured.reference, captured.example_inputs, tolerances, check_op_by_op=True)
    assert correct.passed and correct.conformance.ops > 10 and correct.conformance.worst_float_error < 1e-5


@pytest.mark.parametrize("bug", sorted(INT8_BUGS))
def test_planted_int8_bugs_fail_verification_op_by_op(quantized_examples, bug):
    captured, quantized, _ = quantized_examples("cnn")
    program, signature = quantized.captured.program, quantized.captured.signature
    tolerances = verify_stage.default_tolerances("f32", "default", quantized=True)
    # The op-by-op check runs the lowerings the program was traced with: the planted bug stays in
    # place for it too.
    with INT8_BUGS[bug]():
        lowered = lower_stage.lower(program, signature)
        report = verify_stage.verify(lowered, quantized.captured.reference, captured.example_inputs, tolerances, check_op_by_op=True)
    assert not report.passed and not report.conformance.passed
    assert "do not reproduce the reference given its own inputs" in report.failure_summary()
