"""Multi-host slices on one machine: a `cpu-2x2` twin (2 processes x 2 CPU devices) run by two real
processes under jax.distributed on loopback (gloo collectives), each loading the executables without
compiling and placing its own weight shards; outputs and greedy tokens equal one device's; a wrong
process count or device order is refused in one line; a killed follower, or one hung inside a step,
turns the leader's answers and /readyz to 503 within the timeout."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import requests

import tpuexport
from conftest import ROOT, convert_example, free_port
from test_generation_slices import COMMON, tiny_llama
from tpuexport.artifact import layout

PROCESSES, PER_PROCESS = 2, 2
TARGET = f"cpu-{PROCESSES}x{PER_PROCESS}"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": f"--xla_force_host_platform_device_count={PER_PROCESS}"}
# A tensor-parallel split of the example MLP's first two layers, with the batch over data.
RULES = [r"layers\.0\.weight=model,None", r"layers\.0\.bias=model", r"layers\.2\.weight=None,model"]
PROMPTS = [[5, 17, 42, 7, 9], [3, 1]]
TIMEOUT = 12


@pytest.fixture(scope="module")
def mlp(tmp_path_factory) -> tpuexport.Artifact:
    """examples/mlp.py for cpu and cpu-2x2 (mesh data=2,model=2 over the two processes' devices)."""
    return convert_example("mlp", tmp_path_factory.mktemp("multihost") / "mlp.tpu", target=["cpu", TARGET], buckets={"batch": [2, 4]},
                           mesh="data=2,model=2", rules=RULES, saved_model=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tpuexport.Artifact:
    """The tiny GQA Llama of test_generation_slices, tensor-parallel, for cpu-2x2 (its single-device
    tokens come from Artifact.generate, the lowered program on one CPU device)."""
    return tpuexport.convert(tiny_llama(), **{**COMMON, "target": [TARGET]}, sharding="tensor-parallel", mesh="model=2,data=2",
                             out=tmp_path_factory.mktemp("multihost") / "tp.tpu")


def run_processes(commands: list[list[str]], timeout: float = 120, env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """Runs one command per process at once (followers first), each with 2 forced CPU devices (and `env`'s variables)."""
    started = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**ENV, **(env or {})})
               for command in reversed(commands)]
    try:
        finished = [(process.communicate(timeout=timeout), process.returncode) for process in started]
    finally:
        for process in started:
            process.kill()
    return list(reversed([subprocess.CompletedProcess(command, code, out, err)
                          for command, ((out, err), code) in zip(reversed(commands), finished)]))


def cluster_flags(port: int, process_id: int, processes: int = PROCESSES) -> list[str]:
    return ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes), "--process-id", str(process_id),
            "--process-timeout", str(TIMEOUT)]


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    """The lines tpuexport printed on stderr (JAX's own logging, gloo's and absl's lines left out)."""
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


RUNNER_SCRIPT = """
import json, sys, numpy as np, tpuexport
from tpuexport.runtime.processes import Cluster
runner = tpuexport.runner(sys.argv[1], cluster=Cluster(sys.argv[2], 2, int(sys.argv[3]), 20))
state = {'target': runner.target, 'compilations': runner.compilations_at_start,
         'shards': sorted({shard.device.id for weight in runner.weights for shard in weight.addressable_shards})}
if runner.mirror.leader:
    x = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
    state['output'] = runner.run({'x': x})['output_0'].tolist()
    runner.close()
else:
    state['calls'] = runner.follow()
print(json.dumps(state))
"""


def test_two_processes_run_the_forward_twin_as_one_device_does(mlp):
    port = free_port()
    results = run_processes([[sys.executable, "-c", RUNNER_SCRIPT, str(mlp.path), f"127.0.0.1:{port}", str(index)]
                             for index in range(PROCESSES)])
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    leader, follower = (json.loads(result.stdout.splitlines()[-1]) for result in results)
    x = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)

    assert leader["target"] == follower["target"] == TARGET
    assert leader["compilations"] == follower["compilations"] == 0  # loaded, not compiled, in each process
    # Each process placed the weights on its own two devices only (process 1's are ids 2048 and 2049).
    assert leader["shards"] == [0, 1] and follower["shards"] == [2048, 2049]
    assert follower["calls"] == 1
    expected = tpuexport.runner(mlp.path, target="cpu").run({"x": x})["output_0"]
    np.testing.assert_allclose(np.asarray(leader["output"], np.float32), expected, atol=1e-5)


def compiled(result: subprocess.CompletedProcess) -> list[str]:
    """What a process run with JAX_LOG_COMPILES=1 compiled (JAX logs each compilation it starts)."""
    return [line for line in result.stderr.splitlines() if "Compiling " in line]


def test_two_processes_generate_the_greedy_tokens_of_one_device(llama):
    """Without compiling anything in either process, at start or while generating: the cache comes out of
    prefill and decode laid out as the next call takes it, and the logits whole into sample (before
    session 17 each process compiled two reshards, `_device_put_reshard`, in its first generation)."""
    port = free_port()
    command = [sys.executable, "-m", "tpuexport.cli", "generate", str(llama.path), "--max-new-tokens", "8", "--ignore-eos",
               *[flag for prompt in PROMPTS for flag in ("--tokens", ",".join(map(str, prompt)))]]
    leader, follower = run_processes([command + cluster_flags(port, index) for index in range(PROCESSES)], env={"JAX_LOG_COMPILES": "1"})

    assert leader.returncode == 0 and follower.returncode == 0, leader.stderr[-3000:] + follower.stderr[-3000:]
    steps = [[int(token) for token in line.split()] for line in leader.stdout.splitlines()]
    assert [list(row) for row in zip(*steps)] == llama.generate(PROMPTS, 8, ignore_eos=True)
    assert follower.stdout == ""  # the follower runs the steps and prints nothing
    assert compiled(leader) == compiled(follower) == []


def test_a_wrong_process_count_or_id_is_refused_in_one_line(mlp):
    port = free_port()
    command = [sys.executable, "-m", "tpuexport.cli", "generate", str(mlp.path), "--tokens", "1"]
    leader, follower = run_processes([command + cluster_flags(port, 0), command + cluster_flags(port, 1, processes=3)], timeout=90)

    assert leader.returncode == 2 and follower.returncode == 2
    assert error_lines(leader) == ["error: process 1 was started with --num-processes 3, this process (process 0) with 2; start every "
                                   "process with the same count"]
    assert error_lines(follower) == ["error: process 0 was started with --num-processes 2, this process (process 1) with 3; start every "
                                     "process with the same count"]
    [out_of_range] = run_processes([command + cluster_flags(free_port(), 2)])
    assert out_of_range.returncode == 2
    assert error_lines(out_of_range) == ["error: --process-id 2 is out of range for --num-processes 2; give 0 (the leader) to 1"]


def test_a_device_order_that_differs_from_the_compiled_one_is_refused_in_one_line(mlp, tmp_path):
    moved = tmp_path / "moved.tpu"
    shutil.copytree(mlp.path, moved)
    manifest = json.loads((moved / layout.MANIFEST).read_text())
    manifest["targets"][TARGET]["device_processes"] = [0, 1, 0, 1]  # as if the mesh interleaved the hosts
    (moved / layout.MANIFEST).write_text(json.dumps(manifest))
    port = free_port()
    command = [sys.executable, "-m", "tpuexport.cli", "generate", str(moved), "--tokens", "1"]
    results = run_processes([command + cluster_flags(port, index) for index in range(PROCESSES)], timeout=90)

    for result in results:
        assert result.returncode == 2
        assert error_lines(result) == [
            f"error: {moved} target {TARGET} was compiled over devices [0, 1, 2048, 2049] (mesh order), and mesh position 1, device 1, "
            "was in process 1 at compile time, is in process 0 here: run it on the slice it was built for (every host, with its "
            "--process-id), or convert for these devices"]


# The program of a follower that stops itself (SIGSTOP) right after taking a step, once the file named
# in place of {stop_file} exists: the leader's call of that step then waits in its collectives (a
# tensor-parallel step all-reduces across the processes) for a process that never arrives.
STOPS_INSIDE_A_STEP = """
import os, signal
from tpuexport import cli
from tpuexport.runtime import processes
take = processes.Mirror.next_step
def next_step(mirror):
    step = take(mirror)
    if os.path.exists({stop_file!r}):
        os.kill(os.getpid(), signal.SIGSTOP)
    return step
processes.Mirror.next_step = next_step
cli.main()
"""


@contextlib.contextmanager
def served_by_two(artifact, log_dir, follower_program: tuple[str, ...] = ("-m", "tpuexport.cli")):
    """`tpuexport serve` as leader and follower on loopback (the follower's `python` arguments before
    serve's: `follower_program`); yields (base URL, leader, follower) once ready."""
    port, coordinator = free_port(), free_port()
    processes = []
    for index in reversed(range(PROCESSES)):
        log = open(log_dir / f"process{index}.log", "w")
        program = follower_program if index else ("-m", "tpuexport.cli")
        processes.append(subprocess.Popen(
            [sys.executable, *program, "serve", str(artifact), "--port", str(port), "--grpc-port", "0",
             *cluster_flags(coordinator, index)], stdout=log, stderr=subprocess.STDOUT, env=ENV))
    follower, leader = processes
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert leader.poll() is None and time.monotonic() < deadline, (log_dir / "process0.log").read_text()[-3000:]
            try:
                if requests.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                time.sleep(0.3)
        yield base, leader, follower
    finally:
        for process in processes:
            process.kill()


def test_two_processes_serve_generation_with_the_tokens_of_one_device_and_stop_together(llama, tmp_path):
    with served_by_two(llama.path, tmp_path) as (base, leader, follower):
        answer = requests.post(f"{base}/v1/models/tp:generate", json={"prompts": PROMPTS, "max_new_tokens": 6}, timeout=60)
        completion = requests.post(f"{base}/v1/completions", json={"model": "tp", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0},
                                   timeout=60)
        leader.send_signal(signal.SIGTERM)

        assert leader.wait(timeout=60) == 0 and follower.wait(timeout=60) == 0  # the follower stops with the leader
    expected = llama.generate(PROMPTS, 6, ignore_eos=True)
    assert answer.status_code == 200 and json.loads(answer.text.splitlines()[-1]) == {"generated": expected}
    assert completion.json()["choices"][0]["token_ids"] == expected[0]
    assert "stopped after" in (tmp_path / "process1.log").read_text()


def test_the_leader_serves_and_a_killed_follower_turns_it_unavailable(mlp, tmp_path):
    x = np.random.default_rng(1).standard_normal((2, 32)).astype(np.float32)
    expected = tpuexport.runner(mlp.path, target="cpu").run({"x": x})["output_0"]
    with served_by_two(mlp.path, tmp_path) as (base, leader, follower):
        answer = requests.post(f"{base}/v1/models/mlp:predict", json={"instances": x.tolist()}, timeout=60)
        assert answer.status_code == 200
        np.testing.assert_allclose(np.asarray(answer.json()["predictions"], np.float32), expected, atol=1e-5)

        follower.send_signal(signal.SIGKILL)
        follower.wait()
        start = time.monotonic()
        lost = requests.post(f"{base}/v1/models/mlp:predict", json={"instances": x.tolist()}, timeout=TIMEOUT + 30)
        waited = time.monotonic() - start

        assert lost.status_code == 503 and "process 1 did not take step 2" in lost.json()["error"]
        assert waited < TIMEOUT + 10
        assert requests.get(f"{base}/readyz", timeout=5).status_code == 503
        assert leader.poll() is None  # the leader lives on, answering
    log = (tmp_path / "process0.log").read_text()
    assert f"target {TARGET} on 4 cpu devices in 2 processes (this is process 0), loaded without compiling" in log
    assert "compilations_at_start: 0" in log


def test_a_follower_hung_inside_a_step_turns_the_leader_unavailable_within_the_timeout(llama, tmp_path):
    stop_file = tmp_path / "stop"
    request = {"prompts": PROMPTS, "max_new_tokens": 2}
    program = ("-c", STOPS_INSIDE_A_STEP.format(stop_file=str(stop_file)))
    with served_by_two(llama.path, tmp_path, follower_program=program) as (base, leader, follower):
        assert requests.post(f"{base}/v1/models/tp:generate", json=request, timeout=60).status_code == 200
        stop_file.touch()
        start = time.monotonic()
        lost = requests.post(f"{base}/v1/models/tp:generate", json=request, timeout=TIMEOUT + 30)
        waited = time.monotonic() - start

        assert "did not end within" in lost.text and TIMEOUT - 1 < waited < TIMEOUT + 10, lost.text
        assert requests.get(f"{base}/readyz", timeout=5).status_code == 503
        assert requests.post(f"{base}/v1/models/tp:generate", json=request, timeout=5).status_code == 503  # at once
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(timeout=30) == 2  # it stops as a lost run does, its hung call left behind
    log = (tmp_path / "process0.log").read_text()
    assert "stopped" in log and "terminate called" not in log
