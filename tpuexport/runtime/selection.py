"""Which of an artifact's executables a host loads: the target matching its devices, and among that
target's version sets (its own executables, and those of each compile environment,
compile/compile_envs.py) the one whose compile key matches the host's jax/jaxlib/libtpu.

The host is this process (its devices and installed versions) or another Python environment as its
probe found it (`tpuexport verify --runtime-env`): the same rules pick for both.
"""

from __future__ import annotations

import dataclasses

import jax

from tpuexport.compile.compile_envs import CompileEnv, describe_versions, installed_versions, version_set_name
from tpuexport.compile.compile_key import compile_key, key_difference
from tpuexport.compile.slices import resolve_targets
from tpuexport.errors import TpuExportError


@dataclasses.dataclass(frozen=True)
class Choice:
    """The executables a host loads, or why none.

    Attributes:
      target: the target chosen (matching the host, or the one that says best what differs).
      version_set: the version set whose executables load: None for the target's own (the
        converting interpreter's), else a compile environment's name (manifest "version_sets").
      difference: "" when they load, else why not (one line: each version set and what differs).
    """

    target: str
    version_set: str | None
    difference: str


def refusal(path, manifest: dict, choice: Choice, device_count: int) -> str:
    """The one line the runtime refuses a host with when `choice` has a difference (what differs, per
    version set when the target has several, and the fixes)."""
    recorded = manifest["targets"][choice.target].get("compile_key") or {}
    forced = (f"run it with XLA_FLAGS=--xla_force_host_platform_device_count={recorded['devices']} (a CPU twin's devices), "
              if recorded.get("platform") == "cpu" and recorded.get("devices", 1) > device_count else "")
    return (f"{path} target {choice.target} was compiled for another host: {choice.difference}; {forced}convert with --target for "
            f"this host (and --compile-env with its Python for its jax/libtpu versions), or pass --allow-recompile "
            f"(allow_recompile=True) to compile its StableHLO here")


def host_key(recorded: dict, devices: list, host: CompileEnv | None = None) -> dict:
    """The compile key executables compiled on this host for `recorded`'s target would have.

    Args:
      recorded: the target's compile key in the manifest.
      devices: the host's devices (jax devices, or objects with platform, device_kind, process_index).
      host: the host's environment as probed (compile_envs.probe), or None for this process.
    Returns:
      The key; compiler options are the recorded ones (they shaped the executables, the host
      has none of its own), device count the recorded one when the host has that many.
    """
    platform = devices[0].platform
    count = recorded.get("devices", 1) if len(devices) >= recorded.get("devices", 1) else len(devices)
    # XLA:CPU names devices by their process: a CPU executable loads only in as many processes as it was compiled for.
    processes = len({device.process_index for device in devices}) if platform == "cpu" else 1
    convention = recorded.get("calling_convention_version")
    lowest, highest = host.calling_conventions if host else (jax.export.minimum_supported_calling_convention_version,
                                                             jax.export.maximum_supported_calling_convention_version)
    supported = lowest <= (convention or 0) <= highest
    return compile_key(platform if platform in ("tpu", "cpu") else "cpu", devices[0].device_kind, count, recorded.get("topology"),
                       recorded.get("compiler_options", {}), convention if supported else f"{highest} at most", processes,
                       host.versions if host else None, host.serialization_version if host else None)


def own_version_set(manifest: dict) -> str:
    """The name of the version set a target's own executables were compiled with (the converting interpreter's)."""
    listed = manifest.get("version_sets")
    return next(iter(listed)) if isinstance(listed, dict) and listed else version_set_name(manifest.get("versions", {}))


def _match(manifest: dict, name: str, devices: list, host: CompileEnv | None) -> tuple[str | None, str]:
    """(the version set of target `name` that loads here, "") or (None, what differs: per version set when it has several)."""
    record = manifest["targets"][name]
    sets = {None: record.get("compile_key"), **{set_name: (executables or {}).get("compile_key")
                                                for set_name, executables in (record.get("version_sets") or {}).items()}}
    differences = {}
    for set_name, recorded in sets.items():
        if recorded is None:
            differences[set_name] = "the artifact records no compile key (converted before tpuexport recorded one)"
            continue
        difference = key_difference(recorded, host_key(recorded, devices, host))
        if not difference:
            return set_name, ""
        differences[set_name] = difference
    if len(differences) == 1:
        return None, differences[None]
    versions = host.versions if host else installed_versions()
    listed = " | ".join(f"{set_name or own_version_set(manifest)}: {difference}" for set_name, difference in differences.items())
    return None, f"this host ({describe_versions(versions)}) matches none of its {len(differences)} version sets: {listed}"


def choose(manifest: dict, requested: str | None, devices: list, host: CompileEnv | None = None) -> Choice:
    """The target and version set to run on `devices` (see the module docstring).

    Args:
      manifest: the artifact's manifest (current format).
      requested: the target asked for ("cpu", "v5e", ...), or None for the one matching the devices.
      devices: the host's devices.
      host: the host's probed environment, or None for this process.
    Returns:
      The Choice (its difference non-empty when nothing loads here).
    Raises:
      TpuExportError: an unknown requested target, or none at all in the artifact.
    """
    targets = manifest["targets"]
    if not targets:
        raise TpuExportError("the artifact has no executables; convert it with a --target")
    if requested is not None:
        name = resolve_targets([requested])[0].name
        if name not in targets:
            raise TpuExportError(f"the artifact has no target {requested!r}; it has {', '.join(targets)}")
        return Choice(name, *_match(manifest, name, devices, host))
    differences = {}
    # A target spanning every local device first (cpu-8 before cpu on eight CPU devices), then the others.
    spans_all = sorted(targets, key=lambda name: (targets[name].get("compile_key") or {}).get("devices") != len(devices))
    for name in spans_all:
        version_set, difference = _match(manifest, name, devices, host)
        if not difference:
            return Choice(name, version_set, "")
        differences[name] = difference
    # None loads here: the target of this host's kind, if any, says best what differs.
    platform, kind = devices[0].platform, devices[0].device_kind
    same_kind = [name for name, entry in targets.items()
                 if (entry.get("compile_key") or {}).get("platform") == platform and entry["compile_key"].get("device_kind") == kind]
    name = (same_kind or list(targets))[0]
    if not same_kind:
        return Choice(name, None, f"no target matches this host's {len(devices)} {kind} device(s) (the artifact has "
                                  f"{', '.join(targets)}); {name}: {differences[name]}")
    return Choice(name, None, differences[name])
