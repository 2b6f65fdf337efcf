"""Integrity on load: `tpuexport.load` / `Artifact.run` refuse damaged files and manifest paths that
leave the artifact directory, before any output (copies of a real converted artifact)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import pytest
import torch

import tpuexport
from tpuexport.artifact import layout

# The default entry point's jax.export program.
PROGRAM = layout.entry_point_program("serving_default", layout.EXPORTED)

from test_cli import tpuexport_in_process  # the command line, in this process


@pytest.fixture
def artifact_copy(plain_mlp_artifact, tmp_path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(plain_mlp_artifact.path, tmp_path / "mlp.tpu"))


def edit_manifest(artifact: pathlib.Path, edit) -> None:
    manifest = json.loads((artifact / layout.MANIFEST).read_text())
    edit(manifest)
    (artifact / layout.MANIFEST).write_text(json.dumps(manifest))


def flip_byte(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def one_line_error(call) -> str:
    with pytest.raises(tpuexport.TpuExportError) as raised:
        call()
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_an_intact_artifact_runs_and_matches_the_converted_one(plain_mlp_artifact, artifact_copy):
    x = torch.randn(3, 32)
    torch.testing.assert_close(tpuexport.load(artifact_copy).run(x), plain_mlp_artifact.run(x), rtol=0, atol=0)


@pytest.mark.parametrize("damage", [flip_byte, truncate], ids=["bit-flipped", "truncated"])
@pytest.mark.parametrize("relative", [layout.WEIGHTS, PROGRAM], ids=["weights", "program"])
def test_damaged_weights_or_program_are_refused_before_any_output(artifact_copy, relative, damage):
    damage(artifact_copy / relative)
    artifact = tpuexport.load(artifact_copy)  # the manifest alone is read here
    message = one_line_error(lambda: artifact.run(torch.randn(2, 32)))
    assert f"{relative} does not match its sha256 in the manifest" in message and "convert again" in message


def test_damaged_golden_data_is_refused(artifact_copy):
    flip_byte(artifact_copy / layout.GOLDEN)
    message = one_line_error(tpuexport.load(artifact_copy).golden_cases)
    assert f"{layout.GOLDEN} does not match its sha256" in message


def test_a_missing_weights_file_is_refused(artifact_copy):
    (artifact_copy / layout.WEIGHTS).unlink()
    assert f"{layout.WEIGHTS} is missing" in one_line_error(lambda: tpuexport.load(artifact_copy).run(torch.randn(2, 32)))


def test_the_weights_are_hashed_once_per_load(artifact_copy):
    """Damage after the first run is not seen again by the same Artifact (hashed once, then mapped);
    a fresh load sees it."""
    artifact = tpuexport.load(artifact_copy)
    first = artifact.run(torch.ones(2, 32))
    weights = artifact_copy / layout.WEIGHTS
    os.utime(weights)  # touched, not changed: a fresh load hashes and accepts it
    torch.testing.assert_close(tpuexport.load(artifact_copy).run(torch.ones(2, 32)), first, rtol=0, atol=0)
    truncate(artifact_copy / PROGRAM)
    torch.testing.assert_close(artifact.run(torch.ones(2, 32)), first, rtol=0, atol=0)
    one_line_error(lambda: tpuexport.load(artifact_copy).run(torch.ones(2, 32)))


@pytest.mark.parametrize("named", ["/etc/passwd", "../outside.safetensors", "weights/../../outside.safetensors", ""],
                         ids=["absolute", "dotdot", "nested-dotdot", "empty"])
def test_a_manifest_path_leaving_the_artifact_is_refused_on_load(artifact_copy, named):
    def point_weights_outside(manifest):
        manifest["program"]["weights"] = named
        manifest["files"][named] = manifest["files"].pop(layout.WEIGHTS)

    edit_manifest(artifact_copy, point_weights_outside)
    message = one_line_error(lambda: tpuexport.load(artifact_copy))
    assert "leaves the artifact directory" in message and repr(named) in message


def test_a_symlink_out_of_the_artifact_is_refused_even_with_the_right_hash(artifact_copy, tmp_path):
    """The weights replaced by a symlink to an identical file outside: the hash matches, the path does not."""
    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(artifact_copy / layout.WEIGHTS, outside)
    (artifact_copy / layout.WEIGHTS).unlink()
    (artifact_copy / layout.WEIGHTS).symlink_to(outside)
    assert "leaves the artifact directory" in one_line_error(lambda: tpuexport.load(artifact_copy))


def test_an_executable_path_leaving_the_artifact_is_refused(artifact_copy):
    edit_manifest(artifact_copy, lambda m: m["targets"]["v5e"]["buckets"][0].update(executable="../../x.pjrt"))
    assert "'../../x.pjrt'" in one_line_error(lambda: tpuexport.load(artifact_copy))


def test_cli_verify_refuses_a_traversal_manifest_with_one_line(artifact_copy):
    edit_manifest(artifact_copy, lambda m: m["entry_points"]["serving_default"].update(exported="../../../etc/hostname"))
    result = tpuexport_in_process("verify", artifact_copy)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "leaves the artifact directory" in lines[0] and "Traceback" not in result.stderr
