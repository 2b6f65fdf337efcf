"""The TF Serving SavedModel of an artifact (real TensorFlow and TF Serving protos; no mocks)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys

import numpy as np
import torch
import pytest
from click.testing import CliRunner

import tpuexport
from conftest import EXAMPLES, build_example
from tpuexport.artifact import write_artifact
from tpuexport.cli import main
from tpuexport.compile import Bucket, CompileReport
from tpuexport.export import SourceInfo
from tpuexport.lower.program import DEFAULT_ENTRY_POINT, Program
from tpuexport.artifact.tf_serving import SavedModelBuild, SavedModelMismatch, TensorFlowProcess, TfServingExport
from tpuexport.verify import verify
from tpuexport.artifact.tf_serving import check_saved_model


@pytest.fixture(scope="module")
def tf():
    """TensorFlow, imported only by the tests that need it in this process (it takes seconds)."""
    import tensorflow

    return tensorflow


def saved_model_dir(artifact) -> pathlib.Path:
    return artifact.path / artifact.manifest["tf_serving"]["saved_model"]


def test_serving_signature_has_the_input_and_output_names_dtypes_and_none_for_dims(transformer_artifact, tf):
    serve = tf.saved_model.load(str(saved_model_dir(transformer_artifact))).signatures["serving_default"]
    inputs = serve.structured_input_signature[1]
    assert {name: (spec.dtype, spec.shape.as_list()) for name, spec in inputs.items()} == {
        "tokens": (tf.int32, [None, None]),  # torch int64 -> the artifact's int32
        "mask": (tf.bool, [None, None]),
    }
    outputs = serve.structured_outputs
    assert {name: (spec.dtype, spec.shape.as_list()) for name, spec in outputs.items()} == {
        "logits": (tf.float32, [None, 3]),
        "hidden": (tf.float32, [None, None, 64]),
    }


def test_out_of_range_batch_fails_with_tensorflows_shape_assertion(transformer_artifact, tf):
    serve = tf.saved_model.load(str(saved_model_dir(transformer_artifact))).signatures["serving_default"]
    with pytest.raises(tf.errors.InvalidArgumentError, match="symbolic shape constraint batch <= 32"):
        serve(tokens=tf.zeros([33, 8], tf.int32), mask=tf.ones([33, 8], tf.bool))
    assert transformer_artifact.manifest["verification"]["saved_model"]["out_of_range"] == {
        "sizes": {"batch": 33, "seq": 16},
        "rejected": True,
        "error": "Input shapes do not match the symbolic shape constraint batch <= 32",
    }


def test_saved_model_check_ran_tensorflow_alone_at_every_golden_size(mlp_artifact):
    report = json.loads((mlp_artifact.path / "verification/report.json").read_text())
    check = report["saved_model"]
    assert report["passed"] and check["passed"] and not check["jax_or_torch_loaded"]
    golden_sizes = [case["sizes"] for case in mlp_artifact.manifest["verification"]["cases"] if case["golden"]]
    assert [case["sizes"] for case in check["cases"]] == golden_sizes
    assert len({sizes["batch"] for sizes in golden_sizes}) >= 2
    for case in check["cases"]:
        assert case["passed"] and case["outputs"][0]["max_abs_error"] < 1e-4
    summary = mlp_artifact.manifest["verification"]["saved_model"]
    assert summary["passed"] and summary["cases"] == [
        {"label": c["label"], "sizes": c["sizes"], "passed": True} for c in check["cases"]
    ]
    section = mlp_artifact.manifest["tf_serving"]
    assert section["saved_model"] == "tf_serving/mlp/1" and section["saved_model_bytes"] > 10_000
    # timings vary from run to run, so they are under "build" only
    assert set(mlp_artifact.manifest["build"]["tf_serving_seconds"]) == {"build", "check", "tf_import", "tf_load", "tf_run"}
    assert "seconds" not in check and "tf_seconds" not in check
    assert "tf_serving/mlp/1/saved_model.pb" in mlp_artifact.manifest["files"]


def test_check_saved_model_reports_outputs_outside_tolerance(transformer_artifact):
    verification = transformer_artifact.manifest["verification"]
    exact = {
        **verification,
        "tolerances": {**verification["tolerances"], "cpu": {"atol": 0.0, "rtol": 0.0}},
        "cases": [{**case, "golden": index == 0} for index, case in enumerate(verification["cases"])],  # quicker
    }
    result = check_saved_model(transformer_artifact.path, {**transformer_artifact.manifest, "verification": exact})
    assert result["passed"] is False and result["seconds"] > 0
    (case,) = result["cases"]
    hidden = next(o for o in case["outputs"] if o["name"] == "hidden")
    assert case["sizes"] == {"batch": 2, "seq": 16} and 0 < hidden["max_abs_error"] < 1e-4 and not hidden["passed"]


def test_warmup_requests_hold_the_golden_inputs_of_each_bucket(mlp_artifact, tf):
    from tensorflow_serving.apis import prediction_log_pb2

    path = saved_model_dir(mlp_artifact) / "assets.extra/tf_serving_warmup_requests"
    logs = [prediction_log_pb2.PredictionLog.FromString(record.numpy()) for record in tf.data.TFRecordDataset(str(path))]
    requests = [log.predict_log.request for log in logs]
    assert [(r.model_spec.name, r.model_spec.signature_name) for r in requests] == [("mlp", "serving_default")] * 2
    batch_one, batch_eight = (tf.make_ndarray(r.inputs["x"]) for r in requests)
    # buckets batch=1,8: the "min" case is golden at batch 1; batch 8 gets random inputs of its shape
    golden = {sizes["batch"]: inputs for sizes, inputs, _ in mlp_artifact.golden_cases()}
    np.testing.assert_array_equal(batch_one, golden[1][0])
    assert batch_eight.shape == (8, 32) and batch_eight.dtype == np.float32


def test_warmup_inputs_are_in_the_artifact_dtypes(transformer_artifact, tf):
    from tensorflow_serving.apis import prediction_log_pb2

    path = saved_model_dir(transformer_artifact) / "assets.extra/tf_serving_warmup_requests"
    (record,) = tf.data.TFRecordDataset(str(path))  # one bucket, compiled for both targets
    inputs = prediction_log_pb2.PredictionLog.FromString(record.numpy()).predict_log.request.inputs
    _, (tokens, mask), _ = transformer_artifact.golden_cases()[0]
    np.testing.assert_array_equal(tf.make_ndarray(inputs["tokens"]), tokens.astype(np.int32))
    np.testing.assert_array_equal(tf.make_ndarray(inputs["mask"]), mask)
    assert tf.make_ndarray(inputs["tokens"]).dtype == np.int32


def test_batching_parameters_and_models_config(mlp_artifact):
    serving = mlp_artifact.path / "tf_serving"
    lines = [line for line in (serving / "batching_parameters.txt").read_text().splitlines() if not line.startswith("#")]
    assert lines == [
        "max_batch_size { value: 8 }",
        "batch_timeout_micros { value: 1000 }",
        "num_batch_threads { value: 4 }",
        "max_enqueued_batches { value: 100 }",
        "allowed_batch_sizes: 1",
        "allowed_batch_sizes: 8",
    ]
    base_path = mlp_artifact.path.resolve() / "tf_serving/mlp"
    assert (serving / "models.config").read_text() == (
        "model_config_list {\n  config {\n    name: \"mlp\"\n"
        f"    base_path: \"{base_path}\"\n    model_platform: \"tensorflow\"\n"
        "    model_version_policy { specific { versions: 1 } }\n  }\n}\n"
    )
    section = mlp_artifact.manifest["tf_serving"]
    assert section["allowed_batch_sizes"] == [1, 8]
    assert f"--model_base_path={base_path} --enable_batching" in section["server_command"]


def test_saved_model_cli_lists_the_serving_signature(transformer_artifact):
    cli = pathlib.Path(sys.executable).with_name("saved_model_cli")
    shown = subprocess.run([str(cli), "show", "--all", "--dir", str(saved_model_dir(transformer_artifact))],
                           capture_output=True, text=True, check=True).stdout
    assert "signature_def['serving_default']" in shown
    assert "inputs['tokens'] tensor_info:\n        dtype: DT_INT32\n        shape: (-1, -1)" in shown
    assert "outputs['logits'] tensor_info:\n        dtype: DT_FLOAT\n        shape: (-1, 3)" in shown
    assert "XlaCallModule" in shown and "ReadVariableOp" in shown  # weights are variables, not constants


def test_cli_names_the_model_and_keeps_bf16_weights(tmp_path, tf):
    out = tmp_path / "cnn.tpu"
    result = CliRunner().invoke(main, ["convert", f"{EXAMPLES / 'cnn.py'}:build", "-o", str(out), "--precision", "bf16",
                                       "--name", "vision", "--version", "7"])
    assert result.exit_code == 0, result.output
    manifest = tpuexport.load(out).manifest
    assert manifest["tf_serving"]["saved_model"] == "tf_serving/vision/7"
    assert manifest["verification"]["saved_model"]["passed"]
    loaded = tf.saved_model.load(str(out / "tf_serving/vision/7"))
    assert {v.dtype for v in loaded.weights if v.dtype.is_floating} == {tf.bfloat16}  # BatchNorm's counter stays int32


def test_no_saved_model_leaves_no_tf_serving_directory(tmp_path):
    out = tmp_path / "mlp.tpu"
    result = CliRunner().invoke(main, ["convert", f"{EXAMPLES / 'mlp.py'}:build", "-o", str(out), "--no-saved-model"])
    assert result.exit_code == 0, result.output
    manifest = tpuexport.load(out).manifest
    assert not (out / "tf_serving").exists()
    assert "tf_serving" not in manifest and "saved_model" not in manifest["verification"]


def test_a_saved_model_mismatch_stops_the_write_and_leaves_nothing(mlp_artifact, tmp_path, tmp_path_factory):
    built = build_example("mlp")
    report = verify(mlp_artifact.program, built["model"], built["args"])
    # Eager outputs moved by 1: the SavedModel, which is right, no longer matches them.
    shifted = dataclasses.replace(report, golden={k: v + 1 if "/output/" in k else v for k, v in report.golden.items()})
    out, scratch = tmp_path / "mlp.tpu", tmp_path_factory.mktemp("scratch")
    with TensorFlowProcess() as tensorflow:
        build = SavedModelBuild(mlp_artifact.program, tensorflow, scratch)
        writer = TfServingExport(mlp_artifact.program, shifted, [Bucket((("batch", 4),))], "mlp", 1, out, build, scratch)
        with pytest.raises(SavedModelMismatch) as caught:
            write_artifact(out, source=SourceInfo("api"), task="feature-extraction", program=Program.forward(mlp_artifact.program),
                           compiled=lambda: {DEFAULT_ENTRY_POINT: CompileReport(())},
                           verification=shifted, stage_seconds={}, extra_writers=(writer,))
    assert "TF SavedModel output 'output_0' at batch=4: max abs error 1" in caught.value.summary
    assert caught.value.report["passed"] is False and caught.value.report["saved_model"]["out_of_range"]["rejected"]
    assert list(tmp_path.iterdir()) == []


def test_bad_model_name_is_refused_before_any_work(tmp_path):
    built = build_example("mlp")
    with pytest.raises(tpuexport.TpuExportError, match="model name 'my model' is not usable by TF Serving; pass --name"):
        tpuexport.convert(built["model"], built["args"], built["dynamic_shapes"], out=tmp_path / "m.tpu", model_name="my model")


class ShiftedLinear(torch.nn.Module):
    """A buffer whose name starts with "_", which TensorFlow refuses as a variable name."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)
        self.register_buffer("_offset", torch.full((4,), 0.5))

    def forward(self, x):
        return self.linear(x) + self._offset


def test_weights_named_with_a_leading_underscore_still_make_a_saved_model(tmp_path):
    batch = torch.export.Dim("batch", min=1, max=16)
    artifact = tpuexport.convert(ShiftedLinear().eval(), (torch.randn(2, 8),), {"x": {0: batch}}, out=tmp_path / "shifted.tpu")
    assert "_offset" in artifact.manifest["program"]["weight_names"]
    assert artifact.manifest["verification"]["saved_model"]["passed"]
