"""The cpu target and the runtime: XLA:CPU executables compiled like the TPU ones, their compile key,
loaded without compiling in a fresh process, padded to buckets, and refused on a mismatched key."""

from __future__ import annotations

import datetime
import json
import os
import pickle
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

import tpuexport
from conftest import ROOT
from tpuexport.artifact import layout
from tpuexport.artifact.manifest import sha256_file
from tpuexport.errors import TpuExportError
from tpuexport.compile.compile_key import compile_key, host_cpu, key_difference
from tpuexport.gate import WARNING, PASSED, check_compatibility


def test_cpu_target_compiles_every_bucket_with_figures_and_a_compile_key(mlp_cpu_artifact):
    entry = mlp_cpu_artifact.manifest["targets"]["cpu"]

    assert entry["platform"] == "cpu"
    assert [bucket["name"] for bucket in entry["buckets"]] == ["batch1", "batch4", "batch8"]
    for bucket in entry["buckets"]:
        assert (mlp_cpu_artifact.path / bucket["executable"]).stat().st_size > 0
        assert bucket["memory"]["argument_bytes"] > 0 and bucket["cost"]["flops"] > 0
    # More rows, more FLOPs: the figures are XLA's for each bucket.
    assert entry["buckets"][0]["cost"]["flops"] < entry["buckets"][2]["cost"]["flops"]
    key = entry["compile_key"]
    assert key["platform"] == "cpu" and key["device_kind"] == "cpu" and key["devices"] == 1
    assert key["versions"]["jaxlib"] and key["compiler_options"]
    assert key["serialization_version"] == mlp_cpu_artifact.manifest["program"]["serialization"]["serialization_version"]
    assert key["cpu"] == host_cpu() and key["cpu"]["features"]


def test_key_difference_names_each_field_that_differs(mlp_cpu_artifact):
    recorded = mlp_cpu_artifact.manifest["targets"]["cpu"]["compile_key"]
    host = compile_key("cpu", "cpu", 1, None, recorded["compiler_options"], recorded["calling_convention_version"])

    assert key_difference(recorded, host) == ""
    older = json.loads(json.dumps(recorded))
    older["versions"]["jaxlib"] = "0.4.1"
    older["cpu"]["features"].append("avx10_2")
    difference = key_difference(older, host)
    assert f"jaxlib 0.4.1 (artifact) vs {recorded['versions']['jaxlib']} (host)" in difference
    assert "lacks avx10_2" in difference


def test_compatibility_warns_when_the_jax_export_window_is_near_or_past(mlp_cpu_artifact):
    recorded = mlp_cpu_artifact.manifest["program"]["serialization"]
    until = datetime.date.fromisoformat(recorded["loadable_until"])
    assert until > datetime.date.fromisoformat(recorded["version_date"])

    early = check_compatibility(mlp_cpu_artifact, today=until - datetime.timedelta(days=200))
    near = check_compatibility(mlp_cpu_artifact, today=until - datetime.timedelta(days=10))
    past = check_compatibility(mlp_cpu_artifact, today=until + datetime.timedelta(days=3))

    assert early.status == PASSED and "200 days left" in early.message
    assert near.status == WARNING and "in 10 days" in near.message and str(until) in near.message
    assert past.status == WARNING and "3 days ago" in past.message and "convert again" in past.message


# Run in a fresh process: opens the runner, counts XLA compilations, runs the golden cases that fit a
# bucket and padded slices of the largest one, and prints what it saw as JSON.
FRESH_PROCESS_SCRIPT = """
import json, sys
import jax
compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kwargs: compiles.append(event) if event.endswith("backend_compile_duration") else None)
import ml_dtypes
import numpy as np
import tpuexport
runner = tpuexport.runner(sys.argv[1])
seen = {"compiled_here": runner.compiled_here, "target": runner.target, "cases": []}
for sizes, inputs, outputs in runner.artifact.golden_cases():
    rows = [r for r in (sizes["batch"], 2, 5) if r <= 8] if sizes["batch"] >= 5 else [sizes["batch"]]
    for count in rows:
        execution = runner.execute(runner.prepare({"x": inputs[0][:count]}))
        error = float(np.abs(execution.outputs["output_0"] - outputs[0][:count]).max())
        seen["cases"].append({"rows": count, "bucket": execution.bucket.name, "shape": list(execution.outputs["output_0"].shape),
                              "max_abs_error": error})
seen["compiles"] = len(compiles)
print(json.dumps(seen))
"""


def run_fresh(artifact_path) -> dict:
    result = subprocess.run([sys.executable, "-c", FRESH_PROCESS_SCRIPT, str(artifact_path)], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_cpu_executables_load_without_compiling_and_match_golden_in_a_fresh_process(mlp_cpu_artifact):
    seen = run_fresh(mlp_cpu_artifact.path)

    assert seen["target"] == "cpu" and seen["compiled_here"] is None
    assert seen["compiles"] == 0
    by_rows = {case["rows"]: case for case in seen["cases"]}
    # The example (4 rows) runs exactly; 1 row too; 2 rows pad to 4, 5 rows pad to 8, and the
    # padding rows are sliced off.
    assert {rows: (case["bucket"], case["shape"]) for rows, case in by_rows.items()} == {
        1: ("batch1", [1, 10]), 2: ("batch4", [2, 10]), 4: ("batch4", [4, 10]), 5: ("batch8", [5, 10]),
    }
    # XLA:CPU runs the program in plain f32, as eager PyTorch does.
    assert all(case["max_abs_error"] < 1e-5 for case in seen["cases"]), seen["cases"]


def test_padding_was_verified_at_convert_time(mlp_cpu_artifact):
    padding = mlp_cpu_artifact.manifest["padding"]

    assert padding["passed"] and padding["dim"] == "batch" and padding["pad_value"] == 0
    # The fewest rows a server routes to the largest bucket: one more than the next smaller bucket.
    assert padding["rows"] == 5 and padding["bucket"] == {"batch": 8}
    assert {run for run in padding["outputs"]} == {"tpu", "cpu"}


def test_a_mismatched_compile_key_is_refused_in_one_line_or_recompiled_when_allowed(mlp_cpu_artifact, tmp_path):
    copy = tmp_path / "mlp.tpu"
    shutil.copytree(mlp_cpu_artifact.path, copy)
    manifest = json.loads((copy / layout.MANIFEST).read_text())
    installed = manifest["targets"]["cpu"]["compile_key"]["versions"]["jaxlib"]
    manifest["targets"]["cpu"]["compile_key"]["versions"]["jaxlib"] = "0.4.1"
    (copy / layout.MANIFEST).write_text(json.dumps(manifest))

    with pytest.raises(TpuExportError) as refused:
        tpuexport.runner(copy)
    message = str(refused.value)
    assert "\n" not in message and f"jaxlib 0.4.1 (artifact) vs {installed} (host)" in message and "--allow-recompile" in message

    recompiled = tpuexport.runner(copy, allow_recompile=True)
    assert "jaxlib 0.4.1" in recompiled.compiled_here
    sizes, inputs, outputs = mlp_cpu_artifact.golden_cases()[0]
    np.testing.assert_allclose(recompiled.run({"x": inputs[0]})["output_0"], outputs[0], atol=1e-5)


def test_requests_that_fit_no_bucket_are_refused_naming_the_buckets(mlp_cpu_artifact):
    runner = tpuexport.runner(mlp_cpu_artifact.path)

    with pytest.raises(TpuExportError, match=r"batch=9 is outside every compiled bucket \(batch=1; batch=4; batch=8"):
        runner.run({"x": np.zeros((9, 32), np.float32)})
    with pytest.raises(TpuExportError, match="input 'x' has dtype <U1, the model takes float32"):
        runner.run({"x": np.full((2, 32), "a")})


class RunsCommand:
    """A pickle that runs a shell command when loaded."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_an_executable_whose_pickle_names_other_globals_is_refused_without_running_it(mlp_cpu_artifact, tmp_path):
    copy = tmp_path / "mlp.tpu"
    shutil.copytree(mlp_cpu_artifact.path, copy)
    marker = tmp_path / "ran"
    relative = mlp_cpu_artifact.manifest["targets"]["cpu"]["buckets"][0]["executable"]
    (copy / relative).write_bytes(pickle.dumps(RunsCommand(f"touch {marker}")))
    manifest = json.loads((copy / layout.MANIFEST).read_text())
    manifest["files"][relative] = sha256_file(copy / relative)  # a consistent but malicious artifact
    (copy / layout.MANIFEST).write_text(json.dumps(manifest))

    with pytest.raises(TpuExportError, match=rf"{relative} asks to load posix.system, which a serialized executable never does"):
        tpuexport.runner(copy)
    assert not marker.exists()


class MixesRows(torch.nn.Module):
    """Centres each column over the batch: a row's output depends on the other rows (and on padding)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.linear(x - x.mean(dim=0, keepdim=True))


def test_a_model_that_mixes_rows_fails_the_padding_check_and_runs_exact_buckets_only(tmp_path):
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=1, max=16)
    artifact = tpuexport.convert(MixesRows().eval(), (torch.randn(4, 8),), {"x": {0: batch}}, target="cpu", out=tmp_path / "mix.tpu",
                                 buckets={"batch": [1, 4]}, saved_model=False)
    padding = artifact.manifest["padding"]
    assert not padding["passed"] and padding["rows"] == 2 and padding["bucket"] == {"batch": 4}

    runner = tpuexport.runner(artifact.path)
    rows = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_allclose(runner.run({"x": rows})["output_0"], artifact.run(rows).numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(TpuExportError, match="batch=2 is outside every compiled bucket .*exact sizes only: padding the batch dim failed"):
        runner.run({"x": rows[:2]})


def test_a_bf16_models_executables_load_and_run(tmp_path):
    """A bfloat16 model's executables name ml_dtypes.bfloat16 in their pickle (the dtype of their
    arguments); the loader's check lets numpy scalar types through and nothing else of ml_dtypes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval().to(torch.bfloat16)
    batch = torch.export.Dim("batch", min=1, max=8)
    artifact = tpuexport.convert(model, (torch.randn(2, 8, dtype=torch.bfloat16),), {"input": {0: batch}}, target="cpu",
                                 out=tmp_path / "bf16.tpu", buckets={"batch": [2]}, saved_model=False)

    runner = tpuexport.runner(artifact.path)
    rows = np.random.default_rng(0).standard_normal((2, 8)).astype(ml_dtypes.bfloat16)
    output = runner.run({"input": rows})["output_0"]
    assert output.dtype == ml_dtypes.bfloat16 and runner.compiled_here is None
    np.testing.assert_array_equal(output.view(np.uint16), artifact.run(rows).to(torch.float32).numpy().astype(ml_dtypes.bfloat16).view(np.uint16))
