"""The Python API end to end: convert, run, load, on the examples (real torch, jax, libtpu)."""

from __future__ import annotations

import importlib.metadata
import json

import jax
import numpy as np
import pytest
import torch

import tpuexport
from conftest import build_example, convert_example
from tpuexport.verify import default_tolerances


def eager(model, *inputs):
    with torch.no_grad():
        return model.eval()(*inputs)


def test_mlp_artifact_runs_at_a_new_batch_size(mlp_artifact):
    built = build_example("mlp")
    x = torch.randn(13, 32)
    np.testing.assert_allclose(mlp_artifact.run(x).numpy(), eager(built["model"], x).numpy(), atol=1e-5, rtol=1e-5)


def test_manifest_records_versions_signature_hashes_and_figures(mlp_artifact):
    manifest = mlp_artifact.manifest
    assert manifest["format_version"] == 3
    assert {"tpuexport", "torch", "jax", "jaxlib", "libtpu", "torchax"} <= set(manifest["versions"])
    assert manifest["versions"]["torch"] == importlib.metadata.version("torch")
    assert manifest["entry_points"]["serving_default"]["signature"]["inputs"] == [{"name": "x", "shape": ["batch", 32], "dtype": "float32", "torch_dtype": "float32"}]
    assert manifest["entry_points"]["serving_default"]["signature"]["dims"] == [{"name": "batch", "min": 1, "max": 256, "example": 4}]
    files = manifest["files"]
    on_disk = sorted(p.relative_to(mlp_artifact.path).as_posix() for p in mlp_artifact.path.rglob("*") if p.is_file())
    assert sorted([*files, "manifest.json"]) == on_disk
    buckets = manifest["targets"]["v5e"]["buckets"]
    assert [b["sizes"] for b in buckets] == [{"batch": 1}, {"batch": 8}]
    for bucket in buckets:
        assert (mlp_artifact.path / bucket["executable"]).stat().st_size > 10_000
        assert bucket["fits_in_hbm"] and 0 < bucket["memory"]["total_bytes"] < manifest["targets"]["v5e"]["hbm_bytes"]
        assert bucket["cost"]["flops"] > 0 and bucket["cost"]["optimal_seconds"] > 0
    # flops grow with the batch: the two executables really are different programs
    assert buckets[1]["cost"]["flops"] > 4 * buckets[0]["cost"]["flops"]
    assert buckets[1]["program_matmul_flops"] == 8 * buckets[0]["program_matmul_flops"] > 0  # batch 8 vs 1


def test_verification_covers_several_sizes_and_stores_golden_data(mlp_artifact):
    cases = mlp_artifact.manifest["verification"]["cases"]
    assert len({c["sizes"]["batch"] for c in cases}) >= 2
    assert {1, 4, 256} <= {c["sizes"]["batch"] for c in cases}
    report = json.loads((mlp_artifact.path / "verification/report.json").read_text())
    assert report["passed"] and report["tolerances"] == default_tolerances("f32", "default", quantized=False).to_json()
    assert [case["reason"] for case in report["cases"]][:2] == ["always", "always"]
    for case in report["cases"]:  # both runs of every case are reported, the TPU's rounding visibly larger
        tpu, cpu = case["runs"]["tpu"][0], case["runs"]["cpu"][0]
        assert tpu["passed"] and cpu["passed"] and tpu["relative_rms_error"] > 10 * cpu["relative_rms_error"]
    golden = mlp_artifact.golden_cases()
    assert golden, "golden data must be stored"
    for sizes, inputs, outputs in golden:
        np.testing.assert_allclose(mlp_artifact.program.run(inputs)[0], outputs[0], atol=1e-4, rtol=1e-4)
        assert inputs[0].shape[0] == sizes["batch"]


def test_load_gives_the_same_artifact(mlp_artifact):
    loaded = tpuexport.load(mlp_artifact.path)
    x = torch.randn(3, 32)
    assert isinstance(loaded, tpuexport.Artifact)
    assert loaded.manifest == mlp_artifact.manifest
    torch.testing.assert_close(loaded.run(x), mlp_artifact.run(x))


def test_transformer_shares_batch_and_seq_across_tokens_and_mask(transformer_artifact):
    built = build_example("transformer")
    model = built["model"]
    signature = transformer_artifact.manifest["entry_points"]["serving_default"]["signature"]
    assert [i["shape"] for i in signature["inputs"]] == [["batch", "seq"], ["batch", "seq"]]
    assert [i["torch_dtype"] for i in signature["inputs"]] == ["int64", "bool"]
    assert set(transformer_artifact.manifest["targets"]) == {"v5e", "v6e"}
    tokens = torch.randint(0, 1000, (3, 37))
    mask = torch.ones(3, 37, dtype=torch.bool)
    mask[0, 30:] = False
    result = transformer_artifact.run(tokens, mask)
    expected = eager(model, tokens, mask)
    assert set(result) == {"logits", "hidden"}
    for name in result:
        torch.testing.assert_close(result[name], expected[name], atol=1e-4, rtol=1e-4)


def test_mlir_text_keeps_dim_names_and_shape_assertions(transformer_artifact):
    mlir = (transformer_artifact.path / transformer_artifact.manifest["entry_points"]["serving_default"]["mlir_text"]).read_text()
    assert "shape_assertion" in mlir
    assert "seq" in mlir and "batch" in mlir
    exported = transformer_artifact.program.exported
    assert "batch" in str(exported.in_avals[-1].shape) and "seq" in str(exported.in_avals[-1].shape)
    assert tuple(exported.platforms) == ("cpu", "tpu")


def test_out_of_range_sizes_fail_with_the_dim_named(transformer_artifact):
    tokens = torch.zeros(2, 1, dtype=torch.int64)  # seq must be >= 2
    with pytest.raises(tpuexport.TpuExportError, match=r"seq=1 is out of range: seq accepts 2..256"):
        transformer_artifact.run(tokens, torch.ones(2, 1, dtype=torch.bool))
    with pytest.raises(tpuexport.TpuExportError, match=r"batch=33 is out of range: batch accepts 1..32"):
        transformer_artifact.run(torch.zeros(33, 4, dtype=torch.int64), torch.ones(33, 4, dtype=torch.bool))


def test_the_serialized_program_enforces_the_ranges_itself(mlp_artifact):
    """Any consumer of the artifact (not only Artifact.run) gets the shape assertion."""
    program = mlp_artifact.program
    weights = [jax.numpy.asarray(w) for w in program.weights]
    with pytest.raises(ValueError) as caught:
        program.exported.call(weights, [jax.numpy.zeros((257, 32))])
    # JAX reports "Error refining shapes" and keeps the module's assertion message as the cause.
    causes, error = [], caught.value
    while error is not None:
        causes.append(str(error))
        error = error.__cause__
    assert any("symbolic shape constraint batch <= 256" in text for text in causes), causes


def test_int64_inputs_that_do_not_fit_int32_are_refused_not_wrapped(transformer_artifact):
    tokens = torch.full((2, 4), 2**31, dtype=torch.int64)
    with pytest.raises(tpuexport.TpuExportError, match=r"input 'tokens' holds values 2147483648..2147483648, outside int32"):
        transformer_artifact.run(tokens, torch.ones(2, 4, dtype=torch.bool))


def test_mismatched_sizes_between_inputs_sharing_a_dim_fail(transformer_artifact):
    with pytest.raises(tpuexport.TpuExportError, match="input 'mask' axis 1 is 9 but seq is 8 in another input"):
        transformer_artifact.run(torch.zeros(2, 8, dtype=torch.int64), torch.ones(2, 9, dtype=torch.bool))


def test_exported_program_is_accepted_as_model(tmp_path):
    built = build_example("cnn")
    program = torch.export.export(built["model"].eval(), built["args"], dynamic_shapes=built["dynamic_shapes"])
    artifact = tpuexport.convert(program, out=tmp_path / "cnn.tpu", target=["v5e", "v6e"], saved_model=False)  # SavedModels: test_saved_model.py
    assert list(artifact.manifest["targets"]) == ["v5e", "v6e"]
    image = torch.randn(5, 3, 32, 32)
    torch.testing.assert_close(artifact.run(image), eager(built["model"], image), atol=1e-4, rtol=1e-4)
    assert artifact.manifest["entry_points"]["serving_default"]["signature"]["dims"][0]["name"] == "batch"


def test_bf16_keeps_weights_in_bfloat16_and_outputs_in_float32(tmp_path):
    # (The bf16 CNN's SavedModel: test_saved_model.py's test_cli_names_the_model_and_keeps_bf16_weights.)
    artifact = convert_example("cnn", tmp_path / "cnn_bf16.tpu", target="v5e", precision="bf16", saved_model=False)
    assert artifact.manifest["precision"] == "bf16"
    assert {str(w.dtype) for w in artifact.program.weights if w.ndim > 1} == {"bfloat16"}
    tolerances = artifact.manifest["verification"]["tolerances"]
    assert tolerances["tpu"] == tolerances["cpu"] == default_tolerances("bf16", "default", quantized=False).to_json()["tpu"]
    mlir = (artifact.path / artifact.manifest["entry_points"]["serving_default"]["mlir_text"]).read_text()
    assert "stablehlo.convolution" in mlir and "bf16" in mlir
    image = torch.randn(3, 3, 32, 32)
    result = artifact.run(image)
    assert result.dtype == torch.float32
    torch.testing.assert_close(result, eager(build_example("cnn")["model"], image), atol=5e-2, rtol=5e-2)
    f32_bytes = sum(w.nbytes for w in artifact.program.weights) * 2
    assert artifact.manifest["program"]["weight_bytes"] * 2 == f32_bytes


def test_verification_failure_raises_and_leaves_only_the_report(tmp_path):
    out = tmp_path / "mlp.tpu"
    with pytest.raises(tpuexport.VerificationError) as caught:
        convert_example("mlp", out, precision="bf16", tolerances={"atol": 0.0, "rtol": 0.0, "scale_tol": 0.0})
    assert "output 'output_0'" in str(caught.value) and "max abs error" in str(caught.value)
    assert not out.exists()
    report = json.loads((tmp_path / "mlp.tpu.verification-report.json").read_text())
    assert report["passed"] is False
    assert [p.name for p in tmp_path.iterdir()] == ["mlp.tpu.verification-report.json"]
