"""Compile environments with two real Python environments: this one (the pinned jax/jaxlib/libtpu)
and a second virtualenv with the previous jax/jaxlib/libtpu pair, built from the package registry
on first use and cached per user (keyed by its pins). A tiny model (examples/cnn.py; examples/mlp.py's
GELU is what jax 0.11.2 cannot compile from a jax 0.12 program) is converted for the cpu target
with `--compile-env` naming the second environment: each environment loads its own executables
with 0 compilations, a host matching neither version set is refused in one line listing them, and
bad environments are refused in one line before anything is written."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest

import tpuexport
from conftest import EXAMPLES, build_example, convert_example
from tpuexport.compile import installed_versions, version_set_name
from tpuexport.compile import resolve_targets
from tpuexport.compile.compile_envs import probe
from tpuexport.errors import TpuExportError
from tpuexport.runtime.runtime_env import ProbedDevice, check_runtime_env
from tpuexport.runtime.selection import choose, refusal

# The pair before the pinned jax 0.12.0.1 / libtpu 0.0.50.1 that runs here ("jax[tpu]==0.11.2"
# resolves libtpu 0.0.48.1), with what jax needs to deserialize a program (flatbuffers) and the
# pinned set's numpy stack: nothing else (no torch, no tpuexport).
SECOND_ENV_PINS = ("jax==0.11.2", "jaxlib==0.11.2", "libtpu==0.0.48.1", "flatbuffers==25.12.19", "numpy==2.5.5", "ml_dtypes==0.6.0",
                   "scipy==1.18.1", "opt_einsum==3.4.0")
SECOND_SET = version_set_name({"jax": "0.11.2", "jaxlib": "0.11.2", "libtpu": "0.0.48.1"})
OWN_SET = version_set_name(installed_versions())


# An environment outside jax.export's window of this jax: the previously pinned jax 0.10.2 (June 2026),
# without libtpu. It reads a jax 0.12 program's envelope but not the StableHLO inside.
OLD_ENV_PINS = ("jax==0.10.2", "jaxlib==0.10.2", *SECOND_ENV_PINS[3:])


def cached_environment(pins: tuple[str, ...]) -> pathlib.Path:
    """The interpreter of a virtualenv with `pins` installed: ~/.cache/tpuexport-tests/compile-env-<hash of the
    pins and this Python>, built once (the second environment: about 80 s, 1.3 GB) in a temporary sibling and
    renamed into place, so that parallel test workers never see half of one (the one that renames second keeps
    the first's)."""
    key = hashlib.sha256("\n".join((sys.version, *pins)).encode()).hexdigest()[:12]
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "tpuexport-tests" / f"compile-env-{key}"
    python = cache / "bin" / "python"
    if python.exists():
        return python
    cache.parent.mkdir(parents=True, exist_ok=True)
    building = pathlib.Path(tempfile.mkdtemp(prefix=f".{cache.name}-", dir=cache.parent))
    try:
        # The base interpreter, not this virtualenv's: the new one must not see this one's packages.
        subprocess.run([sys.executable, "-m", "venv", "--clear", building], check=True, capture_output=True)
        installed = subprocess.run([building / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                    *pins], capture_output=True, text=True, timeout=1800)
        if installed.returncode != 0:
            pytest.fail(f"building the environment with {' '.join(pins[:2])} failed: {installed.stderr.strip().splitlines()[-1:]}")
        try:
            os.rename(building, cache)
        except OSError:  # another worker renamed its copy first
            if not python.exists():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return python


@pytest.fixture(scope="module")
def second_python() -> pathlib.Path:
    return cached_environment(SECOND_ENV_PINS)


@pytest.fixture(scope="module")
def two_set_artifact(second_python, tmp_path_factory) -> tpuexport.Artifact:
    """examples/cnn.py for the cpu target, compiled here and under the second environment."""
    return convert_example("cnn", tmp_path_factory.mktemp("two_sets") / "cnn.tpu", target="cpu", saved_model=False,
                           verify_budget_flops=0, compile_envs=[second_python])


def cli(*args) -> tuple[int, str, str]:
    """The command through click's runner in this process: (exit code, stderr, stdout)."""
    from click.testing import CliRunner

    from tpuexport.cli import main

    result = CliRunner().invoke(main, list(map(str, args)))
    return result.exit_code, result.stderr, result.stdout


def verify_cli(*args) -> tuple[int, str]:
    """`tpuexport verify ...`: (exit code, stderr)."""
    return cli("verify", *args)[:2]


def test_the_artifact_carries_executables_per_version_set(two_set_artifact):
    manifest = two_set_artifact.manifest
    assert list(manifest["version_sets"]) == [OWN_SET, SECOND_SET]
    assert manifest["version_sets"][SECOND_SET] == {"jax": "0.11.2", "jaxlib": "0.11.2", "libtpu": "0.0.48.1"}
    cpu = manifest["targets"]["cpu"]
    assert cpu["compile_key"]["versions"] == {"jax": jax.__version__, "jaxlib": installed_versions()["jaxlib"]}
    second = cpu["version_sets"][SECOND_SET]
    assert second["compile_key"]["versions"] == {"jax": "0.11.2", "jaxlib": "0.11.2"}
    assert [bucket["name"] for bucket in second["buckets"]] == [bucket["name"] for bucket in cpu["buckets"]]
    for own, theirs in zip(cpu["buckets"], second["buckets"]):
        assert theirs["executable"] == f"executables/cpu@{SECOND_SET}/serving_default/{own['name']}.pjrt"
        assert manifest["files"][theirs["executable"]] != manifest["files"][own["executable"]]
    assert f"cpu@{SECOND_SET}/serving_default/batch2" in manifest["build"]["compile_seconds"]
    code, _, out = cli("inspect", two_set_artifact.path)
    assert code == 0 and f"version sets: {OWN_SET}, {SECOND_SET}" in out and f"cpu@{SECOND_SET}" in out


def test_this_environment_loads_its_own_set_with_no_compilation(two_set_artifact):
    runner = tpuexport.runner(two_set_artifact.path)
    assert (runner.target, runner.version_set, runner.compilations_at_start) == ("cpu", None, 0)
    image = np.random.default_rng(0).standard_normal((2, 3, 32, 32), dtype=np.float32)
    expected = two_set_artifact.run(image).numpy()  # the StableHLO on CPU
    np.testing.assert_allclose(runner.run({"image": image})["output_0"], expected, rtol=1e-5, atol=1e-5)


def test_the_second_environment_loads_its_set_with_no_compilation(two_set_artifact, second_python):
    checked = check_runtime_env(two_set_artifact.path, str(second_python))
    assert (checked.loads, checked.target, checked.version_set, checked.compilations) == ("executables", "cpu", SECOND_SET, 0)
    assert checked.loaded == len(two_set_artifact.manifest["targets"]["cpu"]["buckets"])
    assert "with 0 compilations" in checked.message


def test_a_host_matching_no_version_set_is_refused_in_one_line_listing_them(two_set_artifact, second_python):
    # A third version set: the second environment as probed, with versions neither set has.
    third = dataclasses.replace(probe(str(second_python), devices=True, environment={**os.environ, "JAX_PLATFORMS": "cpu"}),
                                versions={"jax": "0.10.2", "jaxlib": "0.10.2", "libtpu": "0.0.42.1"})
    devices = [ProbedDevice(**device) for device in third.devices]
    choice = choose(two_set_artifact.manifest, None, devices, third)
    assert choice.version_set is None and choice.difference
    line = refusal(two_set_artifact.path, two_set_artifact.manifest, choice, len(devices))
    assert "\n" not in line
    assert "this host (jax 0.10.2, jaxlib 0.10.2, libtpu 0.0.42.1) matches none of its 2 version sets" in line
    assert f"{OWN_SET}: jax {jax.__version__} (artifact) vs 0.10.2 (host)" in line
    assert f"{SECOND_SET}: jax 0.11.2 (artifact) vs 0.10.2 (host)" in line


def test_verify_runtime_env_gates_on_the_serving_environment(two_set_artifact, second_python, tmp_path):
    code, stderr = verify_cli(two_set_artifact.path, "--runtime-env", second_python)
    assert code == 0 and stderr.startswith("verify passed") and f"(version set {SECOND_SET}) with 0 compilations" in stderr, stderr
    # An artifact without the second environment's set: its StableHLO loads there, with a warning.
    one_set = convert_example("cnn", tmp_path / "cnn.tpu", target="cpu", saved_model=False, verify_budget_flops=0)
    code, stderr = verify_cli(one_set.path, "--runtime-env", second_python)
    assert code == 0 and stderr.startswith("warning:") and "would compile at start" in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1


def test_a_version_set_s_damaged_executable_or_escaping_path_is_refused(two_set_artifact, second_python, tmp_path):
    copy = pathlib.Path(shutil.copytree(two_set_artifact.path, tmp_path / "cnn.tpu"))
    executable = copy / two_set_artifact.manifest["targets"]["cpu"]["version_sets"][SECOND_SET]["buckets"][0]["executable"]
    executable.write_bytes(executable.read_bytes()[:-8] + b"damaged!")
    with pytest.raises(TpuExportError, match="differs from its sha256 in the manifest"):
        check_runtime_env(copy, str(second_python))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["targets"]["cpu"]["version_sets"][SECOND_SET]["buckets"][0]["executable"] = "../../outside.pjrt"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TpuExportError, match="which leaves the artifact directory"):
        tpuexport.load(copy)


def test_bad_environments_are_refused_in_one_line(two_set_artifact, tmp_path):
    code, stderr = verify_cli(two_set_artifact.path, "--runtime-env", tmp_path / "no-such" / "python")
    assert code == 2 and "no such Python interpreter" in stderr and len(stderr.strip().splitlines()) == 1, stderr
    # A Python without jax: a virtualenv of this interpreter's base Python with nothing installed.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", tmp_path / "bare"], check=True)
    code, stderr = verify_cli(two_set_artifact.path, "--runtime-env", tmp_path / "bare" / "bin" / "python")
    assert code == 2 and "cannot import jax" in stderr and len(stderr.strip().splitlines()) == 1, stderr
    built = build_example("mlp")
    for python, expected in ((tmp_path / "no-such" / "python", "--compile-env"), (tmp_path / "bare" / "bin" / "python", "cannot import jax")):
        out = tmp_path / "mlp.tpu"
        with pytest.raises(TpuExportError, match=expected):
            tpuexport.convert(built["model"], built["args"], built["dynamic_shapes"], out=out, target="cpu", saved_model=False,
                              compile_envs=[python])
        assert not out.exists() and not list(tmp_path.glob(".mlp.tpu*"))


def test_the_second_environment_compiles_with_its_own_libtpu(second_python, tmp_path):
    # Importing jax here exported this environment's libtpu as TPU_LIBRARY_PATH (libtpu's __init__ does), which
    # the second environment's jax would load before its own: its processes run without it, and a libtpu that
    # is not the environment's own is refused.
    ours = pathlib.Path(os.environ["TPU_LIBRARY_PATH"])
    assert ours.parent.name == "libtpu" and ours.is_relative_to(sys.prefix)
    assert probe(str(second_python), targets=resolve_targets(["v5e"])).versions["libtpu"] == "0.0.48.1"
    elsewhere = tmp_path / "libtpu.so"
    elsewhere.symlink_to(ours)
    with pytest.raises(TpuExportError, match=rf"would load the libtpu at {elsewhere} \(TPU_LIBRARY_PATH\), not its own libtpu 0.0.48.1"):
        probe(str(second_python), targets=resolve_targets(["v5e"]), environment={**os.environ, "TPU_LIBRARY_PATH": str(elsewhere)})


def test_a_program_the_second_jax_cannot_compile_is_refused_naming_it(second_python, tmp_path):
    # examples/mlp.py's GELU: jax 0.12 serializes erfc as a stablehlo.composite that jax 0.11.2 deserializes
    # but cannot refine to static shapes when it compiles. A plan (no weights) compiles without verifying.
    out = tmp_path / "mlp.tpu"
    with pytest.raises(TpuExportError, match=rf"the jax of --compile-env {second_python} \(jax 0.11.2, .*could not compile cpu bucket") as refused:
        convert_example("mlp", out, target="cpu", weights=False, saved_model=False, compile_envs=[second_python])
    assert not out.exists() and not list(tmp_path.glob(".mlp.tpu*")) and "\n" not in str(refused.value)


def test_an_environment_outside_the_export_window_is_refused_before_anything_compiles(tmp_path):
    # jax 0.10.2 deserializes a jax 0.12 program's envelope, but not its StableHLO (an op version it does
    # not know): the probe reads both, so `plan` stops at the probe, before any compiler runs.
    old_python = cached_environment(OLD_ENV_PINS)
    out = tmp_path / "cnn.tpu"
    code, stderr, stdout = cli("plan", f"{EXAMPLES / 'cnn.py'}:build", "--target", "cpu", "--compile-env", old_python, "-o", out)
    refusal_line = stderr.strip().splitlines()[-1]  # after the stage lines of export and lower
    assert code == 2 and refusal_line.startswith("error:") and stderr.count("error:") == 1, stderr
    assert f"--compile-env {old_python} (jax 0.10.2, jaxlib 0.10.2, no libtpu): its jax cannot deserialize" in stderr
    assert "6 months newer" in refusal_line and "Failed to deserialize StableHLO" in refusal_line
    assert "compile cpu" not in stdout + stderr and not out.exists() and not list(tmp_path.glob(".cnn.tpu*"))
    # Without libtpu it cannot compile for a TPU chip either, which the same probe names before compiling.
    with pytest.raises(TpuExportError, match=r"its libtpu cannot compile for v5e .*install the libtpu that pairs with its jax") as refused:
        probe(str(old_python), targets=resolve_targets(["v5e"]))
    assert "\n" not in str(refused.value)
