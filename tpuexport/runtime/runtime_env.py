"""`tpuexport verify ARTIFACT --runtime-env PYTHON`: does a serving environment load this artifact?

The environment (its interpreter; it needs jax, jaxlib, numpy, flatbuffers and, for TPUs, libtpu,
not tpuexport) is probed (compile/compile_envs.py: its versions and devices), the executables it
would load are chosen by the runtime's rules (selection.py), checked here (sha256, the globals their
pickles name) and deserialized there by load_child.py with no compilation and no model run. Where
no version set matches, its jax deserializes the artifact's StableHLO programs instead and lowers
them at the target's buckets (no compilation), with a warning: the server would compile at start.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess

from tpuexport.artifact import Artifact, load
from tpuexport.artifact.manifest import sha256_file
from tpuexport.compile.compile_envs import describe_versions, environment_for, probe
from tpuexport.devices import tpu_chips_on_this_machine
from tpuexport.errors import TpuExportError
from tpuexport.runtime.executables import check_pickle
from tpuexport.runtime.selection import choose, own_version_set

LOAD_SCRIPT = pathlib.Path(__file__).with_name("load_child.py")
LOAD_TIMEOUT_SECONDS = 600.0


@dataclasses.dataclass(frozen=True)
class ProbedDevice:
    """A device of the probed environment, as the runtime's selection reads it (like a jax.Device)."""

    platform: str
    device_kind: str
    id: int
    process_index: int


@dataclasses.dataclass(frozen=True)
class RuntimeEnvCheck:
    """What `verify --runtime-env` found.

    Attributes:
      loads: "executables" (loaded with 0 compilations) or "stablehlo" (no version set matches:
        its programs deserialize, a warning).
      message: the one line to print.
      target: the target chosen; version_set: its version set (None: the target's own).
      loaded: executables (or programs) deserialized; seconds: the child's load time.
      compilations: XLA compilations while loading (0 for executables).
    """

    loads: str
    message: str
    target: str
    version_set: str | None
    loaded: int
    seconds: float
    compilations: int


def check_runtime_env(path, python: str, target: str | None = None) -> RuntimeEnvCheck:
    """Checks that the environment of `python` loads the artifact (see the module docstring).

    Args:
      path: the artifact directory (or an opened Artifact).
      python: the serving environment's interpreter.
      target: the target to load, or None for the one matching that environment's devices.
    Returns:
      The RuntimeEnvCheck (executables loaded, or the StableHLO with a warning).
    Raises:
      TpuExportError: one line when the environment does not run, loads neither the executables nor
        the StableHLO, compiles while loading, or a file differs from its sha256.
    """
    artifact = path if isinstance(path, Artifact) else load(path)
    environment = environment_for()
    if not environment.get("JAX_PLATFORMS") and tpu_chips_on_this_machine() == 0:
        # The environment's runtime would pick the CPU here (devices.start_backends); without a TPU,
        # JAX would otherwise try libtpu first, slowly and noisily.
        environment["JAX_PLATFORMS"] = "cpu"
    host = probe(python, devices=True, environment=environment, option="--runtime-env")
    devices = [ProbedDevice(**device) for device in host.devices]
    choice = choose(artifact.manifest, target, devices, host)
    where = f"--runtime-env {python} ({describe_versions(host.versions)})"
    records = artifact.records
    if not choice.difference:
        request = {"executables": _executables(artifact, choice.target, choice.version_set), "programs": []}
    else:
        request = {"executables": [], "programs": [
            {"path": str(_checked(artifact, entry.exported)), "weights": len(records.program.names),
             "buckets": [[[list(spec.concrete_shape(bucket.sizes)), spec.dtype] for spec in entry.signature.inputs]
                         for bucket in records.buckets(choice.target, name)]}
            for name, entry in records.entry_points.items()]}
    answer = _run(python, request, environment, where)
    version_set = choice.version_set or own_version_set(artifact.manifest)
    if "error" in answer and choice.difference:
        raise TpuExportError(f"{where} has no executables here ({choice.target}: {choice.difference}) and its jax cannot load the "
                             f"artifact's StableHLO ({answer['error']}): serve it with a jax that can (a newer release), or convert "
                             "with the serving image's jax")
    if "error" in answer:
        raise TpuExportError(f"{where} cannot load the executables of {choice.target} ({version_set}): {answer['error']}; convert "
                             "again with --compile-env naming that Python")
    if not choice.difference:
        if answer["compilations"] or not answer["counter_works"]:
            raise TpuExportError(f"{where} loaded {choice.target} ({version_set}) but ran {answer['compilations']} compilation(s) "
                                 f"(the count {'works' if answer['counter_works'] else 'did not register a compilation'}); "
                                 "its executables do not load as built: convert with --compile-env naming that Python")
        return RuntimeEnvCheck("executables", f"{where} loads {answer['loaded']} executable(s) of {choice.target} (version set "
                               f"{version_set}) with 0 compilations in {answer['seconds']:.2f} s", choice.target, choice.version_set,
                               answer["loaded"], answer["seconds"], 0)
    return RuntimeEnvCheck("stablehlo", f"warning: {where} has no executables here ({choice.target}: {choice.difference}); its jax "
                           f"loads and lowers the StableHLO ({answer['programs']} program(s) at the target's buckets, "
                           f"{answer['seconds']:.2f} s) and would compile at start: convert with --compile-env naming that Python", choice.target, None, answer["programs"],
                           answer["seconds"], answer["compilations"])


def _checked(artifact: Artifact, relative: str) -> pathlib.Path:
    """The file's path, after it matched its sha256 in the manifest (damaged bytes never reach XLA's parsers)."""
    path = artifact.path / relative
    if not path.is_file() or artifact.manifest["files"].get(relative) != sha256_file(path):
        raise TpuExportError(f"{relative} is missing or differs from its sha256 in the manifest; the artifact is damaged, convert again")
    return path.resolve()


def _executables(artifact: Artifact, target: str, version_set: str | None) -> list[dict]:
    """The load child's request for every executable of the target's version set (each file checked here)."""
    records = artifact.records
    record = records.targets[target]
    devices = (record.compile_key if version_set is None else record.version_sets[version_set].compile_key).get("devices", 1)
    request = []
    for name, entry in records.entry_points.items():
        for bucket in records.buckets(target, name, version_set):
            path = _checked(artifact, bucket.executable)
            check_pickle(path.read_bytes(), bucket.executable)
            request.append({"path": str(path), "weights": len(records.program.names), "inputs": len(entry.signature.inputs),
                            "outputs": len(entry.signature.outputs), "devices": devices})
    return request


def _run(python: str, request: dict, environment: dict, where: str) -> dict:
    try:
        done = subprocess.run([python, "-I", str(LOAD_SCRIPT)], input=json.dumps(request), capture_output=True, text=True,
                              timeout=LOAD_TIMEOUT_SECONDS, env=environment)
    except subprocess.TimeoutExpired:
        raise TpuExportError(f"{where} took more than {LOAD_TIMEOUT_SECONDS:g} s to load the artifact; check that environment") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        last = " ".join((done.stderr.strip().splitlines() or ["no output"])[-1:])[:200]
        raise TpuExportError(f"{where} crashed loading the artifact (exit code {done.returncode}: {last}); check that environment's jax")
    return json.loads(lines[-1])
