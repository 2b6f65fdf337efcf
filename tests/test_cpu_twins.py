"""CPU twins of slice targets (`cpu-N`): the slice's mesh and sharding plan compiled for N XLA:CPU
devices, loaded by the runtime and `serve` in processes with
XLA_FLAGS=--xla_force_host_platform_device_count=N, weights placed shard by shard, outputs equal to
the single-device executables'."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import requests

import tpuexport
from conftest import ROOT, convert_example, served
from tpuexport.artifact import layout
from tpuexport.compile import resolve_targets
from tpuexport.errors import TpuExportError

DEVICES = 2
FORCED = f"--xla_force_host_platform_device_count={DEVICES}"
# A tensor-parallel split of the example MLP's first two layers (column- then row-parallel).
RULES = [r"layers\.0\.weight=model,None", r"layers\.0\.bias=model", r"layers\.2\.weight=None,model"]


@pytest.fixture(scope="module")
def twin(tmp_path_factory) -> tpuexport.Artifact:
    """examples/mlp.py for cpu and cpu-2 (tensor-parallel over model=2 by RULES), buckets batch=2,4."""
    return convert_example("mlp", tmp_path_factory.mktemp("twin") / "mlp.tpu", target=["cpu", f"cpu-{DEVICES}"], buckets={"batch": [2, 4]},
                           mesh=f"model={DEVICES}", rules=RULES, saved_model=False)


def test_the_twin_is_compiled_with_the_plan_and_verified_sharded(twin):
    entry = twin.manifest["targets"][f"cpu-{DEVICES}"]

    assert entry["compile_key"]["platform"] == "cpu" and entry["compile_key"]["devices"] == DEVICES
    assert entry["sharding"]["serving_default"]["weights"]["layers.0.weight"] == ["model", None]
    [sharded] = twin.manifest["verification"]["sharded"]
    assert sharded["passed"] and sharded["targets"] == [f"cpu-{DEVICES}"] and sharded["devices"] == DEVICES


def test_the_runner_runs_the_twin_sharded_on_forced_cpu_devices_as_one_device_does(twin, tmp_path):
    # A copy whose mesh names a device this host lacks: refused in one line, naming both.
    elsewhere = tmp_path / "elsewhere.tpu"
    shutil.copytree(twin.path, elsewhere)
    manifest = json.loads((elsewhere / layout.MANIFEST).read_text())
    manifest["targets"][f"cpu-{DEVICES}"]["device_ids"] = [0, 7]
    (elsewhere / layout.MANIFEST).write_text(json.dumps(manifest))
    script = (
        "import json, numpy as np, tpuexport\n"
        "try:\n"
        f"    tpuexport.runner({str(elsewhere)!r}); refused = ''\n"
        "except tpuexport.TpuExportError as error:\n"
        "    refused = str(error)\n"
        f"sharded, single = tpuexport.runner({str(twin.path)!r}), tpuexport.runner({str(twin.path)!r}, target='cpu')\n"
        "x = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)\n"
        "print(json.dumps({'target': sharded.target, 'devices': len(sharded.devices), 'compilations': sharded.compilations_at_start,\n"
        "                  'refused': refused,\n"
        "                  'split': [w.addressable_shards[0].data.shape for w in sharded.weights][:2],\n"
        "                  'difference': float(np.abs(sharded.run({'x': x})['output_0'] - single.run({'x': x})['output_0']).max())}))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": FORCED})
    assert result.returncode == 0, result.stderr[-3000:]
    state = json.loads(result.stdout.splitlines()[-1])

    assert state["target"] == f"cpu-{DEVICES}" and state["devices"] == DEVICES and state["compilations"] == 0
    # layers.0.weight [64, 32] and its bias [64] split in two along the model axis: each device holds its half.
    assert state["split"] == [[64 // DEVICES, 32], [64 // DEVICES]]
    assert state["difference"] < 1e-5
    assert "was compiled over devices [0, 7] (mesh order), and mesh position 1 is device 7, which this run lacks (its devices are [0, 1])" \
        in state["refused"]
    assert "\n" not in state["refused"]


def test_without_the_forced_devices_the_twin_is_refused_naming_the_flag(twin):
    with pytest.raises(TpuExportError) as refused:
        tpuexport.runner(twin.path, target=f"cpu-{DEVICES}")

    assert f"devices {DEVICES} (artifact) vs 1 (host)" in str(refused.value) and FORCED in str(refused.value)
    assert tpuexport.runner(twin.path).target == "cpu"  # the single-device target is the one this host matches


def test_a_twin_outside_two_to_256_devices_is_refused_in_one_line():
    for name in ("cpu-1", "cpu-1024"):
        with pytest.raises(TpuExportError, match=f"^{name}: a CPU twin spans 2 to 256 devices .*; for one device use cpu$"):
            resolve_targets([name])


def test_serve_serves_the_twin_sharded(twin, tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", FORCED)  # the server's process, started below
    x = np.random.default_rng(1).standard_normal((2, 32)).astype(np.float32)
    expected = tpuexport.runner(twin.path).run({"x": x})["output_0"]
    with served(twin.path, tmp_path / "server.log") as base:
        answer = requests.post(f"{base}/v1/models/mlp:predict", json={"instances": x.tolist()}, timeout=60)

    assert answer.status_code == 200
    np.testing.assert_allclose(np.asarray(answer.json()["predictions"], np.float32), expected, atol=1e-5)
    assert f"target cpu-{DEVICES} on {DEVICES} cpu devices, loaded without compiling" in (tmp_path / "server.log").read_text()
