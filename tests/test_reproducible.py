"""Converting the same source twice gives the same bytes: program, weights, executables, golden data and
report, and manifests that differ only under "build" (creation time and stage seconds).

Two exceptions, both outside tpuexport's control (measured, not asserted, for the first):
  - XLA numbers HLO computations from a process-wide counter and the serialized executable embeds
    those ids, so a compiler process kept between conversions (tpuexport.kept_compilers(), as this
    suite's test processes do) writes executables that differ in a few bytes from a new process's.
    Their compiled HLO (the manifest's fingerprint) is identical (tests/test_kept_compilers.py), and
    conversions with compiler processes of their own (the CLI) write identical executables.
  - TensorFlow writes a random uuid into the SavedModel's fingerprint.pb on every save. Its other
    fields are hashes of saved_model.pb and the variables, which are compared byte for byte.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

from tpuexport.artifact import layout
from tpuexport.artifact.tf_serving.saved_model import PER_SAVE_METADATA as TF_RANDOM_UUID_FILE

from conftest import EXAMPLES



def artifact_files(root: pathlib.Path) -> dict[str, bytes]:
    """Every file but the manifest and TensorFlow's fingerprint.pb, keyed by relative path."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and p.name not in (layout.MANIFEST, TF_RANDOM_UUID_FILE)
    }


def differing_files(first: pathlib.Path, second: pathlib.Path) -> list[str]:
    """Relative paths present in only one artifact or with different bytes (see artifact_files)."""
    ours, theirs = artifact_files(first), artifact_files(second)
    return sorted(name for name in ours.keys() | theirs.keys() if ours.get(name) != theirs.get(name))


def manifest_without_build(artifact: pathlib.Path) -> dict:
    """The manifest minus its "build" section and fingerprint.pb's hash."""
    manifest = json.loads((artifact / layout.MANIFEST).read_text())
    assert "created_at" in manifest.pop("build")
    manifest["files"] = {name: digest for name, digest in manifest["files"].items() if not name.endswith(TF_RANDOM_UUID_FILE)}
    return manifest


def convert_from_two_checkouts(tmp_path: pathlib.Path, *options: str) -> list[pathlib.Path]:
    """Converts examples/mlp.py from two copies in different directories, each in a fresh process.

    Args:
      tmp_path: where the checkouts and artifacts go.
      *options: extra `tpuexport convert` options.
    Returns:
      The two artifact directories. Both are written at the same path (the first is moved aside
      afterwards), since TF Serving's models.config must hold the artifact's absolute path.
    """
    out = tmp_path / "out" / "mlp.tpu"
    out.parent.mkdir()
    artifacts = []
    for index, checkout in enumerate(("checkout-a", "nested/checkout-b")):
        source_dir = tmp_path / checkout / "examples"
        source_dir.mkdir(parents=True)
        shutil.copy(EXAMPLES / "mlp.py", source_dir / "mlp.py")
        # One names the source relative to its working directory, the other absolutely.
        reference = "examples/mlp.py:build" if index == 0 else f"{source_dir / 'mlp.py'}:build"
        command = [str(pathlib.Path(sys.executable).parent / "tpuexport"), "convert", reference, "-o", str(out), *options]
        # Without the run's shared compilation cache (conftest.py): the second conversion must compile
        # its executables again, not read the first one's back.
        env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"}
        completed = subprocess.run(command, cwd=source_dir.parent, capture_output=True, text=True, timeout=600, env=env)
        assert completed.returncode == 0, completed.stderr
        artifacts.append(out.rename(tmp_path / f"artifact-{index}.tpu"))
    return artifacts


def test_program_weights_executables_and_saved_model_are_byte_identical(tmp_path):
    # One pair of conversions for every file kind (each conversion is a fresh CLI process).
    first, second = convert_from_two_checkouts(tmp_path, "--bucket", "batch=1,8")

    assert differing_files(first, second) == []
    assert {name.split("/")[0] for name in artifact_files(first)} >= {"program", "weights", "executables", "tf_serving", "verification"}
    assert manifest_without_build(first) == manifest_without_build(second)
    assert manifest_without_build(first)["source"]["reference"] == "mlp.py:build"
