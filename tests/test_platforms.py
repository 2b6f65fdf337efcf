"""Platform by role (tpuexport/devices.py): importing tpuexport leaves JAX's configuration alone,
conversions compute on the host CPU whatever the process chose, the runtime runs on the devices JAX
sees, compiles nothing at start (counted), and refuses a target whose devices differ in one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from click.testing import CliRunner

import tpuexport
from conftest import EXAMPLES, ROOT
from tpuexport.artifact import layout
from tpuexport.cli import main

# libtpu's start-up complaints when it probes for a TPU that is not there (STACK.md).
PROBE_WARNINGS = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")


def run_python(script: str, extra_env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter, JAX_PLATFORMS unset unless `extra_env` sets it."""
    env = {name: value for name, value in os.environ.items() if name != "JAX_PLATFORMS"}
    env.update({"PYTHONPATH": str(ROOT), **(extra_env or {})})
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_importing_tpuexport_changes_no_jax_setting_and_starts_no_backend():
    result = run_python(
        "import json, os, jax, torch\n"
        "from jax._src import xla_bridge\n"
        "environment = dict(os.environ)\n"
        "import tpuexport, tpuexport.cli, tpuexport.serve, tpuexport.runtime\n"
        "print(json.dumps({'platforms': jax.config.jax_platforms, 'started': xla_bridge.backends_are_initialized(),\n"
        "                  'environment_changed': sorted(set(os.environ.items()) ^ set(environment.items()))}))\n")
    state = json.loads(result.stdout.splitlines()[-1])

    assert state == {"platforms": None, "started": False, "environment_changed": []}


def test_importing_tpuexport_or_its_command_line_imports_no_framework_until_a_name_is_used():
    # `tpuexport --help` and click's bad-option errors answer in a tenth of a second, not after torch's
    # and jax's imports (about 4 s); the public names import their modules on first use.
    result = run_python(
        "import json, sys\n"
        "import tpuexport, tpuexport.cli\n"
        "heavy = lambda: sorted(name for name in ('torch', 'jax', 'tensorflow', 'transformers') if name in sys.modules)\n"
        "before = heavy()\n"
        "from tpuexport import Artifact, convert, runner\n"
        "print(json.dumps({'before': before, 'after': heavy(), 'convert': convert.__module__, 'runner': runner.__name__,\n"
        "                  'listed': all(name in dir(tpuexport) for name in tpuexport.__all__)}))\n")
    state = json.loads(result.stdout.splitlines()[-1])
    assert state == {"before": [], "after": ["jax", "torch"], "convert": "tpuexport.api", "runner": "open_runner",
                     "listed": True}
    try:
        tpuexport.no_such_name
    except AttributeError as error:
        assert "no attribute 'no_such_name'" in str(error)
    else:
        raise AssertionError("an unknown name resolved")


def test_a_process_that_chose_its_platform_keeps_it_and_still_converts(tmp_path):
    # Two CPU devices, the second chosen as JAX's default device, all before tpuexport is imported.
    result = run_python(
        "import json, sys, jax\n"
        "jax.config.update('jax_platforms', 'cpu')\n"
        "jax.config.update('jax_default_device', jax.devices()[1])\n"
        "import numpy as np, torch, tpuexport\n"
        f"sys.path.insert(0, {str(EXAMPLES)!r})\n"
        "import mlp\n"
        "built = mlp.build()\n"
        f"artifact = tpuexport.convert(built['model'], built['args'], built['dynamic_shapes'], target='cpu', saved_model=False, "
        f"out={str(tmp_path / 'mlp.tpu')!r})\n"
        "x = np.ones((3, 32), np.float32)\n"
        "runner = tpuexport.runner(artifact.path)\n"
        "expected = built['model'](torch.from_numpy(x)).detach().numpy()\n"
        "print(json.dumps({'platforms': jax.config.jax_platforms, 'default_device': jax.config.jax_default_device.id,\n"
        "                  'devices': len(jax.devices()), 'runner_error': float(np.abs(runner.run({'x': x})['output_0'] - expected).max()),\n"
        "                  'cpu_run_error': float(np.abs(artifact.run(torch.from_numpy(x)).numpy() - expected).max())}))\n",
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    state = json.loads(result.stdout.splitlines()[-1])

    assert state["platforms"] == "cpu" and state["default_device"] == 1 and state["devices"] == 2
    assert state["runner_error"] < 1e-4 and state["cpu_run_error"] < 1e-4


def test_the_runtime_in_a_fresh_process_runs_on_the_cpu_without_probing_for_a_tpu_compiling_or_importing_torch(mlp_cpu_artifact):
    result = run_python(
        "import json, sys, numpy as np, jax, tpuexport, tpuexport.serve.server\n"
        f"runner = tpuexport.runner({str(mlp_cpu_artifact.path)!r})\n"
        "runner.run({'x': np.ones((2, 32), np.float32)})\n"
        "print(json.dumps({'platform': runner.devices[0].platform, 'compilations': runner.compilations_at_start,\n"
        "                  'describe': runner.describe(),\n"
        "                  'frameworks': sorted(name for name in ('torch', 'tensorflow', 'transformers') if name in sys.modules)}))\n")
    state = json.loads(result.stdout.splitlines()[-1])

    assert state["platform"] == "cpu" and state["compilations"] == 0
    # Serving a forward model imports no torch (about 2 s and 400 MB at every start): the runtime reads
    # the artifact with what lazy.py, lower/lowered.py and export/cache_specs.py keep apart from torch.
    assert state["frameworks"] == []
    assert "compilations_at_start: 0" in state["describe"] and "on 1 cpu device" in state["describe"]
    assert not [line for line in result.stderr.splitlines() if any(warning in line for warning in PROBE_WARNINGS)], result.stderr


def test_compilations_at_start_counts_what_the_runner_compiles(mlp_cpu_artifact, tmp_path):
    loaded = tpuexport.runner(mlp_cpu_artifact.path)
    assert loaded.compilations_at_start == 0 and loaded.compiled_here is None

    # The same executables with a compile key naming another jaxlib: compiled here, one per bucket.
    copy = tmp_path / "mlp.tpu"
    shutil.copytree(mlp_cpu_artifact.path, copy)
    manifest = json.loads((copy / layout.MANIFEST).read_text())
    manifest["targets"]["cpu"]["compile_key"]["versions"]["jaxlib"] = "0.4.1"
    (copy / layout.MANIFEST).write_text(json.dumps(manifest))
    recompiled = tpuexport.runner(copy, allow_recompile=True)

    assert recompiled.compiled_here and recompiled.compilations_at_start >= len(manifest["targets"]["cpu"]["buckets"])
    assert f"compilations_at_start: {recompiled.compilations_at_start}" in recompiled.describe()


def test_a_target_whose_devices_do_not_match_is_refused_in_one_line_with_exit_2(mlp_cpu_artifact, plain_mlp_artifact, tmp_path):
    eight = tmp_path / "eight.tpu"
    shutil.copytree(mlp_cpu_artifact.path, eight)
    manifest = json.loads((eight / layout.MANIFEST).read_text())
    manifest["targets"]["cpu"]["compile_key"]["devices"] = 8
    (eight / layout.MANIFEST).write_text(json.dumps(manifest))
    cases = {
        "another chip": (["serve", str(plain_mlp_artifact.path)], "no target matches this host's 1 cpu device(s)"),
        "a target the artifact lacks": (["serve", str(mlp_cpu_artifact.path), "--target", "v5e"], "the artifact has no target 'v5e'"),
        "another device count": (["serve", str(eight)], "devices 8 (artifact) vs 1 (host)"),
    }
    for arguments, message in cases.values():
        result = CliRunner().invoke(main, arguments)

        assert result.exit_code == 2, result.output
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_a_platform_chosen_that_does_not_start_is_refused_in_one_line(mlp_cpu_artifact):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "nosuch"}
    result = subprocess.run([sys.executable, "-m", "tpuexport.cli", "serve", str(mlp_cpu_artifact.path), "--port", "0", "--grpc-port", "0"],
                            capture_output=True, text=True, env=env, timeout=300)

    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "JAX could not start the platform this process chose (JAX_PLATFORMS=nosuch): Unable to initialize backend 'nosuch'" in result.stderr
