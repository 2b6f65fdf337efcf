"""Faults injected into real conversions of examples/mlp.py, run as the CLI in a child process:
SIGKILL at every stage boundary, a full disk, two conversions into one directory, a compiler
process killed or hung. None may leave a directory at -o that loads, and each fails with one line."""

from __future__ import annotations

import os
import pathlib
import resource
import signal
import subprocess
import sys
import threading
import time

import pytest

import tpuexport
from tpuexport.errors import EXIT_BAD_INPUT, EXIT_OK

from conftest import EXAMPLES, ROOT

SOURCE = f"{EXAMPLES / 'mlp.py'}:build"
CHILD_TIMEOUT = 300


def convert_command(out: pathlib.Path, saved_model: bool) -> list[str]:
    return [sys.executable, "-m", "tpuexport.cli", "convert", SOURCE, "--target", "v5e", "-o", str(out),
            *(() if saved_model else ("--no-saved-model",))]


def start(command: list[str], extra_env: dict | None = None, preexec_fn=None) -> subprocess.Popen:
    # Without the run's shared compilation cache (conftest.py): with its hits a small conversion's verification
    # ends before its compiler, and the kill at the compile line would find the artifact already written.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400", "JAX_ENABLE_COMPILATION_CACHE": "false", **(extra_env or {})}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=preexec_fn)


class StderrLines:
    """The lines a running process prints on stderr, collected by a thread as they come."""

    def __init__(self, process: subprocess.Popen):
        self.lines: list[str] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(process.stderr), daemon=True)
        self.thread.start()

    def text(self) -> str:
        self.thread.join(timeout=CHILD_TIMEOUT)
        return "".join(self.lines)


def wait_for(condition, process: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + CHILD_TIMEOUT
    while not condition():
        assert process.poll() is None, f"the conversion ended (exit {process.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {CHILD_TIMEOUT} s"
        time.sleep(0.005)


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    return errors[0]


def children_of(pid: int, script: str) -> list[int]:
    """Processes whose parent is `pid` and whose command line names `script` (from /proc)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid and script in command:
            found.append(int(entry.name))
    return found


def assert_nothing_loads(out: pathlib.Path) -> None:
    assert not out.exists(), sorted(p.name for p in out.parent.iterdir())
    with pytest.raises(tpuexport.TpuExportError):
        tpuexport.load(out)


@pytest.fixture(scope="module")
def killed_out(tmp_path_factory) -> pathlib.Path:
    """One -o for every killed conversion below; the last test converts into it again."""
    return tmp_path_factory.mktemp("killed") / "mlp.tpu"


# Stage boundaries: (name, with the SavedModel, progress line to kill at or None for the write). The first
# boundary (the scratch directory just made), the last before the write (the lowered program and the compiled
# executables in scratch: what a kill after lower or after a compile leaves, and more) and the write itself
# (a conversion with its SavedModel, already built: the staging directory beside the scratch one). Every
# boundary between them leaves a subset of what one of these leaves, and nothing at -o.
KILL_POINTS = [
    ("export", False, "✓ export"),
    ("verify", False, "✓ verify"),
    ("write", True, None),
]


@pytest.mark.parametrize("stage, saved_model, line", KILL_POINTS, ids=[point[0] for point in KILL_POINTS])
def test_sigkill_at_a_stage_boundary_leaves_nothing_that_loads(killed_out, stage, saved_model, line):
    earlier = set(killed_out.parent.iterdir())  # what killed conversions before this one left behind
    process = start(convert_command(killed_out, saved_model))
    stderr = StderrLines(process)
    if line is None:
        # The write stage: the artifact's staging directory exists (the TF check runs inside it).
        staging = lambda: any(p.name.startswith(f".{killed_out.name}.partial-") for p in set(killed_out.parent.iterdir()) - earlier)
        wait_for(staging, process, "staging directory")
    else:
        wait_for(lambda: any(line in text for text in stderr.lines), process, f"{line!r} on stderr")
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=CHILD_TIMEOUT)
    assert process.returncode == -signal.SIGKILL
    assert_nothing_loads(killed_out)


def test_the_same_command_run_again_after_the_kills_succeeds(killed_out):
    """Beside the directories the killed conversions left (hidden, never at -o), which it removes."""
    process = start(convert_command(killed_out, saved_model=False))
    stdout, stderr = process.communicate(timeout=CHILD_TIMEOUT)
    assert process.returncode == EXIT_OK, stderr
    report = tpuexport.verify_artifact(killed_out)
    assert report.passed, report.to_json()
    statuses = {check.name: check.status for check in report.checks}
    assert (statuses["integrity"], statuses["golden"], statuses["saved_model"]) == ("passed", "passed", "skipped")
    assert [p.name for p in killed_out.parent.iterdir()] == [killed_out.name], "the killed conversions' directories remain"


def test_a_full_disk_gives_one_line_and_no_artifact(tmp_path):
    """RLIMIT_FSIZE below the executable's size (about 140 KB): the compiler's write fails."""
    out = tmp_path / "mlp.tpu"
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    process = start(convert_command(out, saved_model=False), preexec_fn=limit)
    _, stderr = process.communicate(timeout=CHILD_TIMEOUT)
    assert process.returncode == EXIT_BAD_INPUT, stderr
    message = one_error_line(stderr)
    assert "File too large" in message and "free space" in message
    assert_nothing_loads(out)
    assert not list(tmp_path.iterdir()), "staging or scratch directories were left behind"


def test_two_conversions_into_one_directory_one_wins_and_it_verifies(tmp_path):
    out = tmp_path / "mlp.tpu"
    processes = [start(convert_command(out, saved_model=False)) for _ in range(2)]
    results = [process.communicate(timeout=CHILD_TIMEOUT) + (process.returncode,) for process in processes]
    codes = sorted(code for _, _, code in results)
    assert codes == [EXIT_OK, EXIT_BAD_INPUT], [stderr for _, stderr, _ in results]
    loser = next(stderr for _, stderr, code in results if code == EXIT_BAD_INPUT)
    message = one_error_line(loser)
    assert "already exists" in message or "appeared while converting" in message
    report = tpuexport.verify_artifact(out)
    assert report.passed, report.to_json()


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_compiler_process_killed_or_hung_is_one_line_exit_2(tmp_path, fault):
    out = tmp_path / "mlp.tpu"
    process = start(convert_command(out, saved_model=False), extra_env={"TPUEXPORT_COMPILE_TIMEOUT": "5"})
    stderr = StderrLines(process)
    found: list[int] = []
    wait_for(lambda: found.extend(children_of(process.pid, "compile_child.py")) or found, process, "a compiler process")
    os.kill(found[0], signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    process.wait(timeout=CHILD_TIMEOUT)
    assert process.returncode == EXIT_BAD_INPUT, stderr.text()
    message = one_error_line(stderr.text())
    expected = "was killed (SIGKILL" if fault == "killed" else "took more than 5 s"
    assert expected in message and "v5e" in message
    assert_nothing_loads(out)
