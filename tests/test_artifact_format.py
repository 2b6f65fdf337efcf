"""The artifact format: every artifact is entry points over one set of weights, its manifest typed
records that read back to the same JSON, and artifacts of the previous format (version 2, written by
tpuexport before entry points were universal: tests/fixtures/format_v2) still load, run and verify."""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import shutil

import numpy as np
import pytest

import tpuexport
from tpuexport.artifact import layout
from tpuexport.artifact.records import Manifest
from tpuexport.errors import TpuExportError
from test_cli import tpuexport_in_process  # the command line, in this process

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "format_v2"


def test_records_read_back_to_the_manifest_written(plain_mlp_artifact):
    manifest = json.loads((plain_mlp_artifact.path / layout.MANIFEST).read_text())
    assert manifest["format_version"] == layout.FORMAT_VERSION == 3
    assert list(manifest["entry_points"]) == ["serving_default"] and manifest["task"] == "forward"
    assert json.loads(json.dumps(Manifest.from_json(manifest).to_json())) == manifest


def test_a_version_2_forward_artifact_loads_runs_and_verifies():
    artifact = tpuexport.load(FIXTURES / "mlp.tpu")
    assert artifact.manifest["format_version"] == 3  # upgraded in memory; the files stay where version 2 put them
    entry = artifact.records.entry_points["serving_default"]
    assert entry.exported == "program/exported.jaxexport" and entry.padded_dim == "batch"
    assert [bucket.entry_point for bucket in artifact.records.targets["cpu"].buckets] == ["serving_default"] * 2
    assert artifact.records.stage_memory == {}  # built before peak memory was recorded
    sizes, inputs, expected = artifact.golden_cases()[0]
    np.testing.assert_allclose(artifact.run(*inputs).numpy(), expected[0], rtol=1e-5, atol=1e-5)
    report = tpuexport.verify_artifact(FIXTURES / "mlp.tpu")
    assert report.passed, [check.message for check in report.failures()]


def test_a_version_2_generation_artifact_generates_its_golden_tokens():
    artifact = tpuexport.load(FIXTURES / "tiny_llama.tpu")
    assert list(artifact.records.entry_points) == ["prefill", "decode"]
    assert artifact.records.entry_points["decode"].state == ("cache_k", "cache_v")
    checks = {check.name: check for check in tpuexport.verify_artifact(FIXTURES / "tiny_llama.tpu").checks}
    assert checks["golden"].status == "passed", checks["golden"].message
    # Converted before artifacts had a sample entry point: it samples on the host, with the same sampler.
    sampling = tpuexport.Sampling(temperature=0.8, top_p=0.9, seed=3)
    sampled = artifact.generate([[5, 17, 42]], 6, sampling=sampling)
    assert sampled == artifact.generate([[5, 17, 42]], 6, sampling=sampling) != artifact.generate([[5, 17, 42]], 6)


def test_the_runtime_loads_version_2_executables_where_they_were_built_for():
    """Executables load only with the jax/jaxlib that compiled them: with those, no compilation;
    with others, one line naming what differs."""
    artifact = tpuexport.load(FIXTURES / "mlp.tpu")
    built_with = artifact.manifest["versions"]["jaxlib"]
    if built_with == importlib.metadata.version("jaxlib"):
        runner = tpuexport.runner(artifact, target="cpu")
        assert runner.compiled_here is None
        assert runner.run({"x": np.ones((3, 32), np.float32)})["output_0"].shape == (3, 10)
    else:
        with pytest.raises(TpuExportError, match=f"compiled for another host: .*jaxlib {built_with}"):
            tpuexport.runner(artifact, target="cpu")


def test_inspect_reads_a_version_2_artifact():
    shown = tpuexport_in_process("inspect", FIXTURES / "tiny_llama.tpu", "--json")
    assert shown.returncode == 0, shown.stderr
    summary = json.loads(shown.stdout)
    assert summary["format_version"] == 3 and set(summary["entry_points"]) == {"prefill", "decode"}


@pytest.mark.parametrize("version", [1, 4, "2"])
def test_a_format_version_this_tpuexport_does_not_read_is_one_line(tmp_path, version):
    copy = tmp_path / "mlp.tpu"
    shutil.copytree(FIXTURES / "mlp.tpu", copy)
    manifest = json.loads((copy / layout.MANIFEST).read_text())
    (copy / layout.MANIFEST).write_text(json.dumps({**manifest, "format_version": version}))
    with pytest.raises(TpuExportError, match=f"artifact format version {version!r} is not one this tpuexport reads"):
        tpuexport.load(copy)


def test_a_damaged_version_2_manifest_is_refused_in_one_line(tmp_path):
    copy = tmp_path / "mlp.tpu"
    shutil.copytree(FIXTURES / "mlp.tpu", copy)
    manifest = json.loads((copy / layout.MANIFEST).read_text())
    del manifest["signature"]
    (copy / layout.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(TpuExportError, match="incomplete version 2 manifest; the artifact is damaged"):
        tpuexport.load(copy)
