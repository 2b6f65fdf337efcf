"""manifest.json: what an artifact is, what built it, and the sha256 of every other file.

Everything that changes from one run to the next (creation time, stage and compile seconds) is
under the single "build" key, so two conversions of the same source give manifests that differ
only there.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import pathlib
import platform

from tpuexport.artifact import layout
from tpuexport.compile import installed_versions

VERSIONED_PACKAGES = ("tpuexport", "torch", "jax", "jaxlib", "libtpu", "torchax", "torchao", "tensorflow-cpu", "numpy")


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages that shape an artifact (None where absent)."""
    return {"python": platform.python_version(), **installed_versions(VERSIONED_PACKAGES)}


def sha256_file(path: pathlib.Path) -> str:
    """sha256 of a file, read in blocks (weights files can be larger than memory)."""
    with open(path, "rb") as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()


def hash_tree(root: pathlib.Path) -> dict[str, str]:
    """sha256 of every file under root except the manifest, keyed by POSIX relative path, sorted."""
    hashes = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        relative = path.relative_to(root).as_posix()
        if relative != layout.MANIFEST:
            hashes[relative] = sha256_file(path)
    return hashes


def build_section(stage_seconds: dict[str, float]) -> dict:
    return {
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "stage_seconds": {name: round(seconds, 3) for name, seconds in stage_seconds.items()},
    }


def dumps(manifest: dict) -> str:
    return json.dumps(manifest, indent=2, sort_keys=False) + "\n"
