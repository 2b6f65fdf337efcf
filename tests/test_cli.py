"""The command line in a subprocess, as users and CI run it: every source kind, inspect, targets,
exit codes, and bad input (one line, exit 2, no traceback, nothing left on disk). The bad-input
table runs in this process through click's runner (a subprocess costs seconds of imports per case);
one of its cases runs in a subprocess, for the real process's exit code and stderr (test_faults.py's full
disk, racing conversions and killed compilers, and the crashed compiler below, are real processes' exit 2 too)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import tpuexport as tpuexport_api
from conftest import EXAMPLES, build_example


def tpuexport(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpuexport.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=600)


def tpuexport_in_process(*args, cwd=None) -> subprocess.CompletedProcess:
    """The command run by click's test runner in this process, in `cwd` (None: the current directory), as a
    CompletedProcess: the code `tpuexport` runs, without a new interpreter's imports (about 4 CPU-s)."""
    from click.testing import CliRunner

    from tpuexport.cli import main

    with contextlib.chdir(cwd or pathlib.Path.cwd()):
        result = CliRunner().invoke(main, list(map(str, args)))
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def assert_clean_bad_input(result, directory: pathlib.Path, expected: str, before: set[str]):
    """Exit 2, one error line naming the problem (after any finished-stage progress lines), no
    traceback, no new files."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert all(line.lstrip().startswith("✓ ") for line in lines[:-1]), result.stderr
    assert expected in errors[0], errors[0]
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert {p.name for p in directory.iterdir()} == before


def test_convert_factory_source_with_buckets_and_json(tmp_path):
    out = tmp_path / "mlp.tpu"
    result = tpuexport("convert", f"{EXAMPLES / 'mlp.py'}:build", "--target", "v5e", "--target", "v6e",
                       "--bucket", "batch=1,16", "-o", out, "--json", "--no-saved-model")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["artifact"] == str(out)
    assert {name: [b["sizes"] for b in buckets] for name, buckets in summary["targets"].items()} == {
        "v5e": [{"batch": 1}, {"batch": 16}], "v6e": [{"batch": 1}, {"batch": 16}]}
    for stage in ("export", "lower", "verify", "compile v5e batch16", "compile v6e batch1", "write"):
        assert stage in result.stderr
    # libtpu's start-up warnings never reach the user
    assert "TPU_ACCELERATOR_TYPE" not in result.stderr and "TPU_WORKER_HOSTNAMES" not in result.stderr
    # Every stage run has its peak memory in the manifest (the writer's own up to the manifest), and the summary prints the largest.
    build = summary["build"]
    assert set(build["stage_seconds"]) | {"write"} == set(build["stage_memory"])
    for stage, peak in build["stage_memory"].items():
        assert peak["process_bytes"] >= peak["anonymous_bytes"] > 0 and peak["mapped_bytes"] > 0, stage
    assert build["stage_memory"]["compile"]["child_bytes"] > 50 * 2**20  # the TPU compiler's own process
    stage, peak = max(build["stage_memory"].items(), key=lambda item: item[1]["process_bytes"])
    child = build["stage_memory"]["compile"]["child_bytes"]
    assert (f"peak memory {peak['process_bytes'] / 2**30:.2f} GiB in {stage} (anonymous {peak['anonymous_bytes'] / 2**30:.2f} GiB, "
            f"mapped {peak['mapped_bytes'] / 2**30:.2f} GiB); largest child process") in result.stderr
    assert max(peak["child_bytes"] for peak in build["stage_memory"].values()) >= child

    inspected = tpuexport_in_process("inspect", out)
    assert inspected.returncode == 0 and "batch: 1..256" in inspected.stdout and "batch16" in inspected.stdout
    inspected_json = json.loads(tpuexport_in_process("inspect", out, "--json").stdout)
    assert inspected_json["targets"] == summary["targets"]


NEW_SIZE_INPUTS = {
    "mlp": lambda: (torch.randn(7, 32),),
    "cnn": lambda: (torch.randn(5, 3, 32, 32),),
    "transformer": lambda: (torch.randint(0, 1000, (3, 41)), torch.ones(3, 41, dtype=torch.bool)),
}


@pytest.mark.parametrize("example", list(NEW_SIZE_INPUTS))
def test_every_example_converts_for_v5e_and_v6e_and_runs_at_a_new_size(example, tmp_path, request):
    """The CNN through the command line (in this process); the MLP and the transformer are the session's shared
    conversions of the same examples for the same targets (tests/conftest.py). Nothing here reads the
    CNN's SavedModel (test_saved_model.py converts the CNN with one through the command line)."""
    if example == "cnn":
        out = tmp_path / f"{example}.tpu"
        result = tpuexport_in_process("convert", f"{EXAMPLES / example}.py:build", "--target", "v5e", "--target", "v6e", "-o", out,
                                      "--no-saved-model")
        assert result.returncode == 0, result.stderr
        artifact = tpuexport_api.load(out)
    else:
        artifact = request.getfixturevalue(f"{example}_artifact")
    assert list(artifact.manifest["targets"]) == ["v5e", "v6e"]
    inputs = NEW_SIZE_INPUTS[example]()
    with torch.no_grad():
        expected = build_example(example)["model"].eval()(*inputs)
    torch.testing.assert_close(artifact.run(*inputs), expected, atol=1e-4, rtol=1e-4)


def test_convert_pt2_source_keeps_its_dims(tmp_path):
    built = build_example("transformer")
    program = torch.export.export(built["model"].eval(), built["args"], dynamic_shapes=built["dynamic_shapes"])
    torch.export.save(program, tmp_path / "encoder.pt2")
    result = tpuexport_in_process("convert", tmp_path / "encoder.pt2", "--target", "v6e", "--json", "--no-saved-model", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["artifact"] == "encoder.tpu" and (tmp_path / "encoder.tpu/manifest.json").is_file()
    assert summary["source"]["kind"] == "pt2" and len(summary["source"]["sha256"]) == 64
    dims = {d["name"]: (d["min"], d["max"]) for d in summary["entry_points"]["serving_default"]["dims"]}
    assert dims == {"tokens_dim0": (1, 32), "tokens_dim1": (2, 256)}


def test_pickle_is_refused_without_opt_in_and_converted_with_it(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    torch.save(model, tmp_path / "mlp.pt")
    before = {p.name for p in tmp_path.iterdir()}
    refused = tpuexport_in_process("convert", tmp_path / "mlp.pt", "--input", "features:B,32", "--dim", "B=1:64", cwd=tmp_path)
    assert_clean_bad_input(refused, tmp_path, "pickles run arbitrary code", before)
    assert "--trust-pickle" in refused.stderr

    accepted = tpuexport_in_process("convert", tmp_path / "mlp.pt", "--trust-pickle", "--input", "features:B,32:float32",
                         "--dim", "B=1:64", "-o", tmp_path / "mlp.tpu", "--json", "--no-saved-model")
    assert accepted.returncode == 0, accepted.stderr
    signature = json.loads(accepted.stdout)["entry_points"]["serving_default"]
    assert signature["inputs"][0]["name"] == "features" and signature["inputs"][0]["shape"] == ["B", 32]
    assert signature["dims"] == [{"name": "B", "min": 1, "max": 64, "example": 2}]


def test_targets_lists_every_generation_with_its_hbm():
    result = tpuexport_in_process("targets", "--json")
    assert result.returncode == 0
    targets = {t["name"]: t for t in json.loads(result.stdout) if t["chips"] == 1}  # slices: tests/test_slices.py
    assert list(targets) == ["v4", "v5e", "v5p", "v6e", "7x"]
    assert targets["v5e"]["hbm_bytes"] == 16 * 2**30 and targets["7x"]["hbm_bytes"] == 192 * 2**30
    assert all(t["source"].startswith("https://cloud.google.com/tpu/docs/") for t in targets.values())


def test_verification_failure_exits_1_and_keeps_only_the_report(tmp_path):
    result = tpuexport_in_process("convert", f"{EXAMPLES / 'mlp.py'}:build", "--precision", "bf16", "--atol", "0", "--rtol", "0", "--scale-tol", "0",
                       "-o", tmp_path / "mlp.tpu", "--no-saved-model")
    assert result.returncode == 1, result.stderr
    assert "output 'output_0'" in result.stderr and "mlp.tpu.verification-report.json" in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["mlp.tpu.verification-report.json"]


UNSUPPORTED_FACTORY = '''
import torch

class Model(torch.nn.Module):
    def forward(self, x):
        return torch.linalg.det(x) + torch.special.airy_ai(x).sum((1, 2))

def build():
    return Model(), (torch.randn(2, 3, 3),)
'''

TOO_BIG_FACTORY = '''
import torch

def build():
    batch = torch.export.Dim("batch", max=2**31 - 2)
    return torch.nn.Linear(256, 256), (torch.randn(4, 256),), {"input": {0: batch}}
'''

RAISING_FACTORY = '''
def build():
    raise RuntimeError("weights file not found")
'''

BAD_DIM_FACTORY = '''
import torch

def build():
    return torch.nn.Linear(4, 4), (torch.randn(8, 4),), {"input": {0: torch.export.Dim("batch", max=4)}}
'''

# Model code that cannot run at every declared seq: torch.export narrows the range, fixes the size or
# needs a multiple of 2, and the error names the line and the declaration that would export.
NARROWING_FACTORY = '''
import torch

def seq(model):
    return model, (torch.randn(2, 6),), ({1: torch.export.Dim("seq", min=2, max=16)},)

class Branch(torch.nn.Module):
    def forward(self, x):
        return x * 2 if x.shape[1] > 4 else x

class Pool(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.max_pool1d(x[:, None], 2, 2, ceil_mode=True)

class Pairs(torch.nn.Module):
    def forward(self, x):
        return x.reshape(x.shape[0], -1, 2)

branch, pool, pairs = (lambda: seq(Branch()), lambda: seq(Pool()), lambda: seq(Pairs()))

def halved():  # torch.export fixes a derived dim without suggesting a declaration
    k = torch.export.Dim("k", min=2, max=6)
    return Pool(), (torch.randn(2, 8),), ({1: 2 * k},)
'''


def write(directory: pathlib.Path, name: str, text: str) -> pathlib.Path:
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return path


MLP = f"{EXAMPLES / 'mlp.py'}:build"

BAD_INPUTS = {
    "missing file": (["convert", "nowhere/model.pt2"], "does not exist"),
    "unknown target": (["convert", MLP, "--target", "v9z"], "unknown target 'v9z'"),
    "malformed dim": (["convert", "model.pt", "--dim", "B=64", "--input", "x:B,3"], "malformed --dim 'B=64'"),
    "empty dim range": (["convert", "model.pt", "--dim", "B=8:2", "--input", "x:B,3"], "empty range"),
    "input with unknown dim": (["convert", "model.pt", "--input", "x:B,3"], "add --dim B=MIN:MAX"),
    "unknown dtype": (["convert", "model.pt", "--input", "x:4,3:float99"], "unknown dtype 'float99'"),
    "unknown source kind": (["convert", "model.onnx"], "unknown kind '.onnx'"),
    "refused pickle": (["convert", "model.pt", "--input", "x:4,3"], "pickles run arbitrary code"),
    "state_dict pickle": (["convert", "weights.pt", "--trust-pickle", "--input", "x:4,3"], "not a whole nn.Module"),
    "factory not found": (["convert", f"{EXAMPLES / 'mlp.py'}:nothing"], "has no function 'nothing'"),
    "factory raises": (["convert", "raising.py:build"], "weights file not found"),
    "unsupported operators": (["convert", "unsupported.py:build"], "2 operator(s) have no TPU lowering"),
    "bucket out of range": (["convert", MLP, "--bucket", "batch=512"], "bucket batch=512 is out of range"),
    "bucket of unknown dim": (["convert", MLP, "--bucket", "seq=8"], "unknown dim 'seq'"),
    "malformed bucket": (["convert", MLP, "--bucket", "batch:8"], "malformed --bucket"),
    "example outside dim range": (["convert", "bad_dim.py:build"], "torch.export failed"),
    "dim range the model narrows": (["convert", "narrowing.py:branch"], "needs seq in 5..16, at "),
    "dim the model fixes": (["convert", "narrowing.py:pool"], "fixes seq at 6, at "),
    "dim the model needs a multiple of": (["convert", "narrowing.py:pairs"], "needs seq = 2*_seq with _seq in 1..8, at "),
    "derived dim the model fixes": (["convert", "narrowing.py:halved"], "fixes 2*k at 8, at "),
    "does not fit in HBM": (["convert", "too_big.py:build", "--bucket", "batch=2147483646"], "does not fit in HBM"),
    "output exists": (["convert", MLP, "-o", "existing.tpu"], "already exists; pass --force"),
    "inspect a non-artifact": (["inspect", "raising.py"], "is not a tpuexport artifact"),
}


IN_A_SUBPROCESS = {"unknown target"}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gets_one_line_and_exit_2(case, tmp_path):
    write(tmp_path, "unsupported.py", UNSUPPORTED_FACTORY)
    write(tmp_path, "too_big.py", TOO_BIG_FACTORY)
    write(tmp_path, "raising.py", RAISING_FACTORY)
    write(tmp_path, "bad_dim.py", BAD_DIM_FACTORY)
    write(tmp_path, "narrowing.py", NARROWING_FACTORY)
    torch.save(torch.nn.Linear(3, 3), tmp_path / "model.pt")
    torch.save(torch.nn.Linear(3, 3).state_dict(), tmp_path / "weights.pt")
    (tmp_path / "model.onnx").write_bytes(b"not a torch file")
    (tmp_path / "existing.tpu").mkdir()
    (tmp_path / "existing.tpu" / "manifest.json").write_text("{}")
    args, expected = BAD_INPUTS[case]
    before = {p.name for p in tmp_path.iterdir()}
    run = tpuexport if case in IN_A_SUBPROCESS else tpuexport_in_process
    result = run(*args, cwd=tmp_path)
    assert_clean_bad_input(result, tmp_path, expected, before)


def test_a_dim_the_models_code_narrows_names_the_line_and_the_declaration_that_exports(tmp_path):
    write(tmp_path, "narrowing.py", NARROWING_FACTORY)
    branch = tpuexport_in_process("convert", "narrowing.py:branch", cwd=tmp_path)
    assert "narrowing.py:9 (return x * 2 if x.shape[1] > 4 else x); declare seq that range (--dim seq=5:16" in branch.stderr
    pool = tpuexport_in_process("convert", "narrowing.py:pool", cwd=tmp_path)
    assert "narrowing.py:13 (return torch.nn.functional.max_pool1d(x[:, None], 2, 2, ceil_mode=True)); declare seq static" in pool.stderr


def test_unsupported_operators_name_the_user_source_lines(tmp_path):
    write(tmp_path, "unsupported.py", UNSUPPORTED_FACTORY)
    result = tpuexport_in_process("convert", "unsupported.py:build", cwd=tmp_path)
    assert result.returncode == 2
    assert "aten._linalg_det.default at " in result.stderr and "aten.special_airy_ai.default at " in result.stderr
    assert "unsupported.py:6 (return torch.linalg.det(x) + torch.special.airy_ai(x).sum((1, 2)))" in result.stderr


def test_a_crashed_compiler_process_is_one_error_line(tmp_path):
    """A compiler process that dies (a libtpu segfault, the kernel's OOM killer) becomes one error
    naming the target, exit 2, nothing written. The crash is real: the test sends SIGSEGV to the
    conversion's compile process once it runs. (libtpu 0.0.42.1 used to segfault by itself on the
    example transformer for 7x at batch 8 x seq 256; the lowering's rank-4 attention matmuls no
    longer trigger it.)"""
    command = [sys.executable, "-m", "tpuexport.cli", "convert", MLP, "--target", "v5e", "--no-saved-model"]
    conversion = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    compiler = None
    while compiler is None and conversion.poll() is None:
        compiler = next((pid for pid in _children(conversion.pid) if b"compile_child.py" in _cmdline(pid)), None)
        time.sleep(0.02)
    assert compiler is not None, "the conversion ended before its compile process started"
    os.kill(compiler, signal.SIGSEGV)
    stdout, stderr = conversion.communicate(timeout=600)
    result = subprocess.CompletedProcess(command, conversion.returncode, stdout, stderr)
    assert "(signal SIGSEGV" in stderr and "v5e" in stderr.strip().splitlines()[-1], stderr
    assert_clean_bad_input(result, tmp_path, "error: ", set())


def _children(pid: int) -> list[int]:
    children = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _cmdline(pid: int) -> bytes:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_a_factory_file_may_define_dataclasses(tmp_path):
    """The factory's file runs as an imported module would (dataclasses look their module up in
    sys.modules), and is not left registered afterwards."""
    source = tmp_path / "configured.py"
    source.write_text(textwrap.dedent('''
        from __future__ import annotations
        import dataclasses
        import torch

        @dataclasses.dataclass(frozen=True)
        class Size:
            width: int

        def build():
            return torch.nn.Linear(Size(4).width, 2), (torch.randn(3, 4),)
    '''))
    before = set(sys.modules)
    loaded = tpuexport_api.export.load_source(f"{source}:build")
    assert isinstance(loaded.model, torch.nn.Linear) and loaded.args[0].shape == (3, 4)
    assert set(sys.modules) - before == set()
