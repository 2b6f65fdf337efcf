"""`tpuexport verify`: the CI gate on real artifacts, damaged on purpose (copies of the session fixture)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest
from click.testing import CliRunner

import tpuexport
from tpuexport.artifact import layout
from tpuexport.cli import main
from tpuexport.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_VERIFICATION_FAILED
from tpuexport.export import LoadedSource, SourceInfo
from tpuexport.pipeline import ConversionOptions, run_conversion

from conftest import EXAMPLES, build_example

MLP_SOURCE = f"{EXAMPLES / 'mlp.py'}:build"
# One file of every kind an artifact holds; the executable is one of the two mlp buckets.
FILE_KINDS = {
    "exported program": layout.entry_point_program("serving_default", layout.EXPORTED),
    "mlir text": layout.entry_point_program("serving_default", layout.MLIR_TEXT),
    "stablehlo bytecode": layout.entry_point_program("serving_default", layout.STABLEHLO_BYTECODE),
    "weights": layout.WEIGHTS,
    "executable": layout.executable_path("v5e", "batch8", "serving_default"),
    "golden": layout.GOLDEN,
    "report": layout.VERIFICATION_REPORT,
}


@pytest.fixture(scope="module")
def plain_artifact(tmp_path_factory) -> tpuexport.Artifact:
    """examples/mlp.py for v5e, buckets batch=1,8, without the TF SavedModel: re-running that
    starts TensorFlow (seconds), and only the saved_model tests below need it."""
    built = build_example("mlp")
    loaded = LoadedSource(built["model"], built["args"], built["dynamic_shapes"], None, SourceInfo("api"))
    out = tmp_path_factory.mktemp("plain") / "mlp.tpu"
    return run_conversion(loaded, ConversionOptions(("v5e",), out, {"batch": [1, 8]}, saved_model=False))


@pytest.fixture
def artifact_copy(plain_artifact, tmp_path) -> pathlib.Path:
    """A private copy of the plain mlp artifact, safe to damage."""
    return pathlib.Path(shutil.copytree(plain_artifact.path, tmp_path / "mlp.tpu"))


def flip_byte(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def edit_manifest(artifact: pathlib.Path, edit) -> None:
    manifest = json.loads((artifact / layout.MANIFEST).read_text())
    edit(manifest)
    (artifact / layout.MANIFEST).write_text(json.dumps(manifest))


def check(report: tpuexport.GateReport, name: str) -> tpuexport.CheckResult:
    return next(c for c in report.checks if c.name == name)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The installed command in its own process, as CI runs it."""
    command = [str(pathlib.Path(sys.executable).parent / "tpuexport"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})


def test_untouched_artifact_passes(plain_artifact):
    report = tpuexport.verify_artifact(plain_artifact.path)

    assert report.passed and report.exit_code == EXIT_OK
    assert [(c.name, c.status) for c in report.checks][:3] == [
        ("integrity", "passed"), ("golden", "passed"), ("saved_model", "skipped"),
    ]
    # Passed or warned by date (jax.export's window, see test_runtime's compatibility tests).
    assert [c.name for c in report.checks][3:] == ["compatibility"]
    assert check(report, "saved_model").message == "no SavedModel in artifact"
    stored_sizes = [case["sizes"] for case in plain_artifact.manifest["verification"]["cases"] if case["golden"]]
    assert [case["sizes"] for case in check(report, "golden").details["cases"]] == stored_sizes


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_flipped_byte_fails_naming_the_file(artifact_copy, kind):
    relative = FILE_KINDS[kind]
    flip_byte(artifact_copy / relative)

    report = tpuexport.verify_artifact(artifact_copy)

    assert not report.passed and report.exit_code == EXIT_VERIFICATION_FAILED
    integrity = check(report, "integrity")
    assert integrity.status == "failed" and f"changed {relative}" in integrity.message
    assert integrity.details == {"missing": [], "extra": [], "changed": [relative]}
    reads_damaged_file = relative in (layout.entry_point_program("serving_default", layout.EXPORTED), layout.WEIGHTS, layout.GOLDEN)
    assert check(report, "golden").status == ("skipped" if reads_damaged_file else "passed")


def test_cli_flipped_weights_exit_1_with_json_and_junit(artifact_copy, tmp_path):
    flip_byte(artifact_copy / layout.WEIGHTS)
    junit = tmp_path / "reports" / "verify.xml"

    completed = run_cli("verify", str(artifact_copy), "--json", "--junit", str(junit))

    assert completed.returncode == EXIT_VERIFICATION_FAILED, completed.stderr
    report = json.loads(completed.stdout)
    assert report["passed"] is False
    assert layout.WEIGHTS in report["checks"][0]["message"]
    assert "verify failed" in completed.stderr and "integrity" in completed.stderr
    cases = ElementTree.parse(junit).getroot().findall("./testsuite/testcase")
    assert [case.get("name") for case in cases] == [c["name"] for c in report["checks"]]
    failure = cases[0].find("failure")
    assert failure is not None and layout.WEIGHTS in failure.get("message")
    assert cases[1].find("skipped") is not None  # golden reads the damaged weights


def test_cli_human_table_names_the_changed_executable(artifact_copy):
    relative = FILE_KINDS["executable"]
    flip_byte(artifact_copy / relative)

    completed = run_cli("verify", str(artifact_copy))

    assert completed.returncode == EXIT_VERIFICATION_FAILED
    assert relative in completed.stdout and "integrity" in completed.stdout


def test_deleted_file_is_missing(artifact_copy):
    (artifact_copy / layout.GOLDEN).unlink()

    report = tpuexport.verify_artifact(artifact_copy)

    assert report.exit_code == EXIT_VERIFICATION_FAILED
    assert f"missing {layout.GOLDEN}" in check(report, "integrity").message
    assert check(report, "golden").status == "skipped"


def test_added_file_is_extra(artifact_copy):
    (artifact_copy / "weights" / "notes.txt").write_text("not part of the artifact\n")

    report = tpuexport.verify_artifact(artifact_copy)

    assert report.exit_code == EXIT_VERIFICATION_FAILED
    assert "extra weights/notes.txt" in check(report, "integrity").message
    assert check(report, "golden").status == "passed"


def test_cli_corrupt_manifest_is_bad_input(artifact_copy):
    (artifact_copy / layout.MANIFEST).write_text('{"format": "tpuexport.artifact", ')

    completed = run_cli("verify", str(artifact_copy))

    assert completed.returncode == EXIT_BAD_INPUT
    assert "not valid JSON" in completed.stderr and "Traceback" not in completed.stderr


def test_unknown_format_version_is_bad_input(artifact_copy):
    edit_manifest(artifact_copy, lambda manifest: manifest.update(format_version=99))

    result = CliRunner().invoke(main, ["verify", str(artifact_copy)])

    assert result.exit_code == EXIT_BAD_INPUT
    assert "format version 99" in result.output


def test_manifest_without_file_hashes_is_bad_input(artifact_copy):
    edit_manifest(artifact_copy, lambda manifest: manifest.pop("files"))

    result = CliRunner().invoke(main, ["verify", str(artifact_copy)])

    assert result.exit_code == EXIT_BAD_INPUT
    assert "'files'" in result.output


def test_manifest_without_a_nested_entry_is_bad_input(artifact_copy):
    edit_manifest(artifact_copy, lambda manifest: manifest["entry_points"]["serving_default"].pop("exported"))

    result = CliRunner().invoke(main, ["verify", str(artifact_copy)])

    assert result.exit_code == EXIT_BAD_INPUT
    assert "has no valid 'entry_points.serving_default.exported'" in result.output


def test_missing_artifact_is_bad_input(tmp_path):
    result = CliRunner().invoke(main, ["verify", str(tmp_path / "nothing.tpu")])

    assert result.exit_code == EXIT_BAD_INPUT
    assert "not a tpuexport artifact" in result.output


def test_json_and_junit_have_one_entry_per_check(plain_artifact, tmp_path):
    junit = tmp_path / "verify.xml"

    result = CliRunner().invoke(main, ["verify", str(plain_artifact.path), "--json", "--junit", str(junit)])

    assert result.exit_code == EXIT_OK, result.output
    report = json.loads(result.stdout)
    root = ElementTree.parse(junit).getroot()
    suite = root.find("testsuite")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == [c["name"] for c in report["checks"]] == ["integrity", "golden", "saved_model",
                                                                                        "compatibility"]
    assert suite.get("tests") == "4" and suite.get("failures") == "0" and suite.get("skipped") == "1"
    assert cases[2].find("skipped").get("message") == "no SavedModel in artifact"


def test_recompile_untouched_artifact_reports_no_drift(plain_artifact, tmp_path, monkeypatch):
    # A persistent compilation cache in the environment: the recompile must neither read nor fill it.
    cache = tmp_path / "jax-cache"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(cache))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    report = tpuexport.verify_artifact(plain_artifact.path, recompile=True, strict=True)

    recompile = check(report, "recompile")
    assert report.passed and recompile.status == "passed"
    assert recompile.details["drifted"] == []
    assert set(recompile.details["fingerprints"]) == {"v5e/serving_default/batch1", "v5e/serving_default/batch8"}
    assert not cache.exists() or not any(cache.iterdir())


def test_recompile_drift_warns_and_fails_when_strict(artifact_copy):
    # A fingerprint recorded by another compiler is what drift looks like to the gate.
    edit_manifest(artifact_copy, lambda manifest: manifest["targets"]["v5e"]["buckets"][0].update(fingerprint="0" * 64))

    lenient = check(tpuexport.verify_artifact(artifact_copy, recompile=True), "recompile")
    result = CliRunner().invoke(main, ["verify", str(artifact_copy), "--recompile", "--strict", "--json"])

    assert lenient.status == "warning" and "v5e/serving_default/batch1" in lenient.message and "libtpu" in lenient.message
    assert result.exit_code == EXIT_VERIFICATION_FAILED
    strict = json.loads(result.stdout)["checks"][-1]
    assert strict["name"] == "recompile" and strict["status"] == "failed"
    assert strict["details"]["drifted"] == ["v5e/serving_default/batch1"]


def test_against_example_source_passes(plain_artifact):
    report = tpuexport.verify_artifact(plain_artifact.path, against=MLP_SOURCE)

    against = check(report, "against")
    assert report.passed and against.status == "passed", against.message
    labels = [case["label"] for case in against.details["cases"]]
    assert {"min", "mid", "max"} <= set(labels)


def test_against_changed_model_fails_naming_the_output(plain_artifact, tmp_path):
    changed = tmp_path / "mlp_retrained.py"
    changed.write_text((EXAMPLES / "mlp.py").read_text().replace("torch.manual_seed(0)", "torch.manual_seed(1)"))

    report = tpuexport.verify_artifact(plain_artifact.path, against=f"{changed}:build")

    against = check(report, "against")
    assert report.exit_code == EXIT_VERIFICATION_FAILED and against.status == "failed"
    assert "output 'output_0'" in against.message


def test_against_missing_source_is_bad_input(plain_artifact, tmp_path):
    with pytest.raises(tpuexport.TpuExportError, match="does not exist"):
        tpuexport.verify_artifact(plain_artifact.path, against=f"{tmp_path / 'gone.py'}:build")


def test_saved_model_is_rerun_in_tensorflow(mlp_artifact):
    report = tpuexport.verify_artifact(mlp_artifact.path)

    saved_model = check(report, "saved_model")
    assert report.passed and saved_model.status == "passed", saved_model.message
    assert saved_model.details["jax_or_torch_loaded"] is False
    assert len(saved_model.details["cases"]) == len(check(report, "golden").details["cases"])


def test_flipped_byte_in_saved_model_fails_naming_the_file(mlp_artifact, tmp_path):
    copy = pathlib.Path(shutil.copytree(mlp_artifact.path, tmp_path / "mlp.tpu"))
    relative = next(name for name in mlp_artifact.manifest["files"] if name.endswith("saved_model.pb"))
    flip_byte(copy / relative)

    report = tpuexport.verify_artifact(copy)

    assert report.exit_code == EXIT_VERIFICATION_FAILED
    assert f"changed {relative}" in check(report, "integrity").message
    assert check(report, "saved_model").status == "skipped"
    assert check(report, "golden").status == "passed"
