"""A Python environment's answer to "can you compile (or load) this conversion's programs?", in one cheap process.

Started by compile_envs.py as `PYTHON -I env_probe_child.py` (the environment's own interpreter) with
a JSON request on stdin: {"programs": [serialized jax.export program paths], "topologies": [{"target",
"topology", "host_bounds"}]}. It prints one JSON line:
  {"versions": {"jax", "jaxlib", "libtpu"}, "prefix": sys.prefix, "libtpu_path": the libtpu its jax loads
   (TPU_LIBRARY_PATH, which importing libtpu sets when unset; null without one),
   "serialization_version", "calling_conventions": [min, max],
   "programs": {path: null or why jax cannot deserialize it},
   "topologies": {target: null or why libtpu has no such topology},
   "devices": [{"platform", "device_kind", "id", "process_index"}] of its default backend}
or {"error": "..."} when jax does not import. Like compile_child.py it imports only jax (public APIs;
the one private attribute read is guarded), so it runs under any recent jax release.
"""

import importlib.metadata
import json
import os
import pathlib
import sys

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def version(package: str):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def one_line(error: Exception) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())[:300]


def main() -> None:
    request = json.load(sys.stdin)
    try:
        import jax
        from jax.experimental import topologies
    except Exception as error:  # no jax, or a broken one: the parent words the refusal
        print(json.dumps({"error": one_line(error)}), flush=True)
        return
    try:  # private to jax: the serialization version it writes; absent in some releases
        from jax._src.export import serialization
        serialization_version = getattr(serialization, "_SERIALIZATION_VERSION", None)
    except Exception:
        serialization_version = None
    answer = {
        "versions": {package: version(package) for package in ("jax", "jaxlib", "libtpu")},
        "python": ".".join(map(str, sys.version_info[:3])),
        "prefix": sys.prefix,
        "libtpu_path": os.environ.get("TPU_LIBRARY_PATH"),
        "serialization_version": serialization_version,
        "calling_conventions": [jax.export.minimum_supported_calling_convention_version,
                                jax.export.maximum_supported_calling_convention_version],
        "programs": {}, "topologies": {}, "devices": [],
    }
    for path in request.get("programs", ()):
        try:
            # Reading the StableHLO too: an older jax may read the envelope yet not the module's ops
            # (jax 0.10.2 reads jax 0.12's, then fails on its shape assertions when compiling).
            jax.export.deserialize(bytearray(pathlib.Path(path).read_bytes())).mlir_module()
            answer["programs"][path] = None
        except Exception as error:  # each jax release raises its own kinds for a serialization it cannot read
            answer["programs"][path] = one_line(error)
    for entry in request.get("topologies", ()):
        bounds = {"chips_per_host_bounds": tuple(entry["host_bounds"])} if entry.get("host_bounds") else {}
        try:
            topologies.get_topology_desc(topology_name=entry["topology"], platform="tpu", **bounds)
            answer["topologies"][entry["target"]] = None
        except Exception as error:  # no libtpu, or a libtpu that does not know the chip
            answer["topologies"][entry["target"]] = one_line(error)
    if request.get("devices"):
        answer["devices"] = [{"platform": device.platform, "device_kind": device.device_kind, "id": int(device.id),
                              "process_index": int(device.process_index)} for device in jax.devices()]
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
    # Its reply is flushed: leave without jax's teardown, which the parent would wait for.
    sys.stdout.flush()
    os._exit(0)
