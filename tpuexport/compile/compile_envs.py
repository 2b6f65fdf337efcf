"""Compile environments (`--compile-env PYTHON`): other Python environments, with the serving image's
jax/jaxlib/libtpu, that the compiler process (compile_child.py) also runs under, so that the artifact
carries executables for those versions too (a "version set": the jax, jaxlib and libtpu versions
executables are compiled with; the runtime loads the set whose compile key matches its host).

Before anything compiles, each environment is probed in one cheap process (env_probe_child.py): its
versions, whether its jax deserializes this conversion's jax.export programs (jax.export reads
serializations for six months after the writing release, older releases may not read newer ones)
and whether its libtpu knows the targets' chips. A bad environment is refused in one line naming it,
its versions and the fix.

Every process run under another environment's Python gets environment_for's variables: importing
libtpu here exported this environment's libtpu as TPU_LIBRARY_PATH (libtpu's __init__ does), which
jax loads before its own libtpu package; inherited, the other environment would compile with this
libtpu under its own libtpu's version.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import subprocess

from tpuexport.compile.targets import Target
from tpuexport.errors import TpuExportError

PROBE_SCRIPT = pathlib.Path(__file__).with_name("env_probe_child.py")
VERSION_SET_PACKAGES = ("jax", "jaxlib", "libtpu")
# Importing jax and loading libtpu takes seconds; a probe that takes minutes is a broken environment.
PROBE_TIMEOUT_SECONDS = 300.0
INSTALL_HINT = "pip install jax==V jaxlib==V libtpu==W flatbuffers numpy"


def version_set_name(versions: dict) -> str:
    """A version set's name, safe as a path component: "jax0.11.2-jaxlib0.11.2-libtpu0.0.48.1" (absent packages left out)."""
    name = "-".join(f"{package}{versions[package]}" for package in VERSION_SET_PACKAGES if versions.get(package))
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "unknown"


def installed_versions(packages: tuple[str, ...] = VERSION_SET_PACKAGES) -> dict:
    """This interpreter's versions of `packages` (by default its version set: "jax", "jaxlib",
    "libtpu"): {package: version, or None where not installed}."""
    versions = {}
    for package in packages:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def describe_versions(versions: dict) -> str:
    """"jax 0.11.2, jaxlib 0.11.2, libtpu 0.0.48.1" (an absent package as "no libtpu")."""
    return ", ".join(f"{package} {versions[package]}" if versions.get(package) else f"no {package}" for package in VERSION_SET_PACKAGES)


@dataclasses.dataclass(frozen=True)
class CompileEnv:
    """A Python environment the compiler process runs under, as its probe found it.

    Attributes:
      python: the interpreter, as the user gave it.
      versions: {"jax", "jaxlib", "libtpu": version, or None where not installed}.
      serialization_version: the jax.export serialization version its jax writes (None if unknown).
      calling_conventions: (min, max) jax.export calling convention versions its jax loads.
      devices: its default backend's devices as {"platform", "device_kind", "id", "process_index"}
        (asked for by the runtime check only; () otherwise).
    """

    python: str
    versions: dict
    serialization_version: int | None
    calling_conventions: tuple[int, int]
    devices: tuple[dict, ...] = ()

    @property
    def name(self) -> str:
        """Its version set's name (version_set_name)."""
        return version_set_name(self.versions)


def environment_for(environment: dict | None = None) -> dict:
    """The variables of a process under another environment's Python: `environment` (os.environ by
    default) without a TPU_LIBRARY_PATH naming this environment's libtpu (see the module docstring).
    A TPU_LIBRARY_PATH the user pointed elsewhere stays (the probe checks whose libtpu it is)."""
    environment = dict(os.environ if environment is None else environment)
    spec = importlib.util.find_spec("libtpu")  # finds the package without importing it
    own = pathlib.Path(spec.origin).parent if spec is not None and spec.origin else None
    path = environment.get("TPU_LIBRARY_PATH")
    if own is not None and path and pathlib.Path(os.path.abspath(path)).parent == own:
        del environment["TPU_LIBRARY_PATH"]
    return environment


def check_interpreter(python: str, option: str = "--compile-env") -> None:
    """Refuses, before any work, an interpreter path that is not an executable file.

    Raises:
      TpuExportError: one line naming it and the fix.
    """
    path = pathlib.Path(python)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise TpuExportError(f"{option} {python}: no such Python interpreter; pass the path of the python executable of an "
                             f"environment with the serving image's jax, jaxlib and libtpu (e.g. /venv/bin/python)")


def probe(python: str, programs: list[pathlib.Path] = (), targets: list[Target] = (), devices: bool = False,
          environment: dict | None = None, option: str = "--compile-env") -> CompileEnv:
    """Probes one environment in one process (env_probe_child.py).

    Args:
      python: the environment's interpreter.
      programs: serialized jax.export programs its jax must deserialize.
      targets: targets it must know (TPU targets' topologies are asked of its libtpu).
      devices: also list its default backend's devices (the runtime check).
      environment: the process's environment variables (os.environ by default).
      option: the option that named it, for messages.
    Returns:
      The CompileEnv.
    Raises:
      TpuExportError: one line naming the environment, its versions and the fix, when it does not
        run, has no jax, cannot deserialize a program or lacks a target's chip.
    """
    check_interpreter(python, option)
    tpus = [target for target in targets if target.platform == "tpu"]
    request = {"programs": [str(path) for path in programs], "devices": devices,
               "topologies": [{"target": target.name, "topology": target.topology,
                               "host_bounds": [1, 1, 1] if not target.is_slice else list(target.host_bounds) if target.host_bounds else None}
                              for target in tpus]}
    try:
        done = subprocess.run([python, "-I", str(PROBE_SCRIPT)], input=json.dumps(request), capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_SECONDS, env=environment_for(environment))
    except subprocess.TimeoutExpired:
        raise TpuExportError(f"{option} {python}: importing its jax took more than {PROBE_TIMEOUT_SECONDS:g} s; check that "
                             "environment (python -c 'import jax') or drop it") from None
    except OSError as error:
        raise TpuExportError(f"{option} {python}: cannot run it ({error.strerror}); pass a working Python interpreter") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):
        last = " ".join((done.stderr.strip().splitlines() or ["no output"])[-1:])[:200]
        raise TpuExportError(f"{option} {python}: the environment probe failed ({last}); check that it is Python 3.10 or newer "
                             f"with jax installed") from None
    if "error" in answer:
        raise TpuExportError(f"{option} {python}: its Python cannot import jax ({answer['error']}); install the serving image's "
                             f"versions there: {INSTALL_HINT}")
    env = CompileEnv(python, answer["versions"], answer["serialization_version"], tuple(answer["calling_conventions"]),
                     tuple(answer["devices"]))
    described = describe_versions(env.versions)
    loaded = answer.get("libtpu_path")
    if env.versions.get("libtpu") and loaded and not pathlib.Path(loaded).is_relative_to(answer["prefix"]):
        raise TpuExportError(f"{option} {python} ({described}) would load the libtpu at {loaded} (TPU_LIBRARY_PATH), not its own "
                             f"libtpu {env.versions['libtpu']}: its executables would carry a version that did not compile them; "
                             "unset TPU_LIBRARY_PATH")
    unreadable = [(path, why) for path, why in answer["programs"].items() if why]
    if unreadable:
        raise TpuExportError(f"{option} {python} ({described}): its jax cannot deserialize this conversion's jax.export program "
                             f"({unreadable[0][1]}); jax.export loads a program only in jax releases from the writing one to 6 months "
                             f"newer: use a serving environment with jax within that window of the converting jax, or convert with "
                             f"the serving image's jax")
    for target in tpus:
        why = answer["topologies"].get(target.name)
        if why:
            fix = ("install the libtpu that pairs with its jax (pip install 'jax[tpu]==<its jax>')" if not env.versions.get("libtpu")
                   else f"use a libtpu that supports {target.generation}, or drop --target {target.name}")
            raise TpuExportError(f"{option} {python} ({described}): its libtpu cannot compile for {target.name} "
                                 f"(topology {target.topology}: {why}); {fix}")
    return env
