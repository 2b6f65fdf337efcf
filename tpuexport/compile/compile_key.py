"""What an executable was compiled for and with: its compile key, and how long jax.export keeps
loading the program it was compiled from.

A serialized PJRT executable loads only where everything that shaped it is the same: the
jax/jaxlib (and, for TPUs, libtpu) versions, the platform and device kind, the number of devices,
the compile options, and for XLA:CPU the host's instruction set (its code is generated for the
build host's CPU features). The manifest records this key per target; the runtime compares it
with the host before loading and names what differs.

jax.export promises six months of backward compatibility: JAX releases up to six months newer than
the one that wrote a serialization load it; later ones may refuse it (jax 0.11.1 refused those
written before January 15th, 2026, the date of serialization version 6). The window counts from
the release date of the JAX that wrote the program; for a JAX release missing from
JAX_RELEASE_DATES, from the date its serialization version was introduced (no later than the
release), so loadable_until is never later than the day a newer JAX may stop loading the program.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import sys

from jax._src.export import serialization as jax_export_serialization

# jax.export's serialization versions and the dates they were introduced, as
# jax/_src/export/serialization.py records them (the versions jax releases since 0.9 write).
SERIALIZATION_VERSION_DATES = {
    6: datetime.date(2026, 1, 15),
    8: datetime.date(2026, 3, 12),
    9: datetime.date(2026, 3, 17),
    10: datetime.date(2026, 4, 4),
    11: datetime.date(2026, 5, 15),
    12: datetime.date(2026, 7, 29),
}
# Release dates of the JAX versions tpuexport was pinned to or tested with (JAX's changelog; the
# build date of the PyPI wheel for those the changelog did not yet list).
JAX_RELEASE_DATES = {
    "0.10.2": datetime.date(2026, 6, 17),
    "0.11.0": datetime.date(2026, 7, 16),
    "0.11.1": datetime.date(2026, 8, 17),
    "0.11.2": datetime.date(2026, 9, 17),
    "0.12.0": datetime.date(2026, 10, 16),
    "0.12.0.1": datetime.date(2026, 10, 20),
}
COMPATIBILITY_MONTHS = 6
# Versions that must match the host for an executable to load.
KEY_PACKAGES = {"tpu": ("jax", "jaxlib", "libtpu"), "cpu": ("jax", "jaxlib")}
# CPU flags (as /proc/cpuinfo names them) that name instruction sets code generation may use;
# other flags (hypervisor, constant_tsc, ...) differ between hosts without changing what runs.
ISA_FLAG_PREFIXES = ("sse", "ssse", "avx", "fma", "f16c", "bmi", "popcnt", "abm", "lzcnt", "movbe", "aes", "pclmul", "vpclmul",
                     "sha", "vaes", "gfni", "adx", "amx", "asimd", "sve", "fp", "neon")


def serialization_version() -> int | None:
    """The jax.export serialization version the installed JAX writes (None if JAX no longer says)."""
    return getattr(jax_export_serialization, "_SERIALIZATION_VERSION", None)


def export_compatibility(written_on: datetime.date | None = None) -> dict:
    """The manifest's record of how long newer JAX releases keep loading the program.

    Args:
      written_on: the conversion's date (today by default); the window's start when neither the
        installed JAX nor its serialization version has a known date.
    Returns:
      {"serialization_version", "version_date", "jax_version", "jax_release_date" (None when
      unknown), "loadable_until" (ISO dates), "window_months", "rule"}.
    """
    version, jax_version = serialization_version(), _version("jax")
    version_date = SERIALIZATION_VERSION_DATES.get(version)
    release_date = JAX_RELEASE_DATES.get(jax_version)
    start = release_date or version_date or written_on or datetime.date.today()
    return {
        "serialization_version": version,
        "version_date": (version_date or start).isoformat(),
        "jax_version": jax_version,
        "jax_release_date": release_date.isoformat() if release_date else None,
        "loadable_until": _add_months(start, COMPATIBILITY_MONTHS).isoformat(),
        "window_months": COMPATIBILITY_MONTHS,
        "rule": "JAX loads a jax.export serialization for 6 months after the JAX release that wrote it (its release "
                "date, or when unknown the serialization version's date, which is no later), so newer JAX may refuse "
                "it after loadable_until",
    }


def _add_months(day: datetime.date, months: int) -> datetime.date:
    month = day.month - 1 + months
    year, month = day.year + month // 12, month % 12 + 1
    return datetime.date(year, month, min(day.day, 28))


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def host_cpu() -> dict:
    """The build or serving host's CPU: architecture and instruction-set features.

    Returns:
      {"machine": e.g. "x86_64", "features": the instruction-set flags of /proc/cpuinfo, sorted
      (empty where the system does not list them)}.
    """
    features: list[str] = []
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/cpuinfo") as cpuinfo:
                for line in cpuinfo:
                    if line.startswith(("flags", "Features")):
                        features = sorted({flag for flag in line.partition(":")[2].split() if flag.startswith(ISA_FLAG_PREFIXES)})
                        break
        except OSError:
            pass
    return {"machine": platform.machine(), "features": features}


def compile_key(platform_name: str, device_kind: str, devices: int, topology: str | None, compiler_options: dict,
                calling_convention_version: int, processes: int = 1, versions: dict | None = None,
                serialization: int | None = None) -> dict:
    """The key of executables compiled here for one target.

    Args:
      platform_name: "tpu" or "cpu".
      device_kind: the devices' kind as JAX names it ("TPU v5 lite", "cpu").
      devices: how many devices the executable spans.
      topology: the TPU topology name, or None for XLA:CPU.
      compiler_options: the XLA options the executables were compiled with.
      calling_convention_version: the jax.export calling convention of the program.
      processes: the processes a CPU twin's executables span (`cpu-PxK`); recorded only when more
        than one, since XLA:CPU names a device by its process (a TPU slice's hosts are target facts).
      versions: the jax/jaxlib/libtpu versions of the environment that compiles or loads
        (compile_envs.CompileEnv); None for this process's installed ones.
      serialization: that environment's jax.export serialization version (with `versions`).
    Returns:
      The key, JSON-ready.
    """
    key = {
        "platform": platform_name,
        "device_kind": device_kind,
        "devices": devices,
        "topology": topology,
        "versions": {package: versions.get(package) if versions is not None else _version(package)
                     for package in KEY_PACKAGES[platform_name]},
        "compiler_options": dict(sorted(compiler_options.items())),
        "serialization_version": serialization if versions is not None else serialization_version(),
        "calling_convention_version": calling_convention_version,
    }
    if processes > 1:
        key["processes"] = processes
    if platform_name == "cpu":
        key["cpu"] = host_cpu()
    return key


def key_difference(recorded: dict, host: dict) -> str:
    """What stops executables with the `recorded` key from loading on a host with key `host`.

    Args:
      recorded: the manifest's compile key of a target.
      host: the key executables compiled on this host would have (compile_key for its devices,
        with the artifact's compiler options and calling convention).
    Returns:
      "" when they load, else one clause per difference ("jaxlib 0.10.2 (artifact) vs 0.10.3 (host)").
    """
    clauses = []
    for field in ("platform", "device_kind", "devices", "serialization_version", "calling_convention_version"):
        if recorded.get(field) != host.get(field):
            clauses.append(f"{field.replace('_', ' ')} {recorded.get(field)} (artifact) vs {host.get(field)} (host)")
    if recorded.get("processes", 1) != host.get("processes", 1):
        clauses.append(f"processes {recorded.get('processes', 1)} (artifact) vs {host.get('processes', 1)} (host)")
    for package, version in recorded.get("versions", {}).items():
        if version != host.get("versions", {}).get(package):
            clauses.append(f"{package} {version} (artifact) vs {host.get('versions', {}).get(package)} (host)")
    if recorded.get("compiler_options") != host.get("compiler_options"):
        clauses.append(f"compiler options {recorded.get('compiler_options')} (artifact) vs {host.get('compiler_options')} (host)")
    if "cpu" in recorded:
        theirs, ours = recorded["cpu"], host.get("cpu", {})
        if theirs["machine"] != ours.get("machine"):
            clauses.append(f"CPU {theirs['machine']} (artifact) vs {ours.get('machine')} (host)")
        else:
            missing = sorted(set(theirs["features"]) - set(ours.get("features", ())))
            if missing:
                clauses.append(f"the host CPU lacks {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} "
                               "that the artifact's CPU code may use")
    return "; ".join(clauses)
