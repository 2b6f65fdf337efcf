"""Generation from a slice's CPU twins (cpu-N, and cpu-PxK in P processes) vs one CPU device:
start-up and step seconds (issue #37).

Converts a small Llama with random f32 weights, tensor-parallel, for `cpu`, `cpu-N` (the same
plan as a v5e-N slice would take) and with --processes P also `cpu-PxK` (K = N / P: the plan over
P hosts), then in a fresh process per target with XLA_FLAGS=--xla_force_host_platform_device_count=N
(K for cpu-PxK, whose P processes join on a loopback coordinator, docs/multihost.md) opens the
runtime and generates greedily:

    python benchmarks/studies/twin_generation.py [--devices 4] [--processes 2] [--mesh model=2,data=2] [--layers 4] [--hidden 256]

Printed per target: the process's start to its first generated token (importing tpuexport, joining
the other processes, opening the runner, prefill), the runner's load seconds and compilations at
start (for cpu-PxK the leader's, and each follower's), the first token's and the mean decode step's
seconds. N CPU "devices" share the same cores, so the twins are not expected to be faster: the
figures are recorded, not judged (2 cores shared with other jobs here).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402

import tpuexport

CHILD = textwrap.dedent("""
    import time
    started = time.perf_counter()
    import json, sys
    import tpuexport
    from tpuexport.runtime.processes import Cluster
    cluster = Cluster(sys.argv[5], int(sys.argv[6]), int(sys.argv[7])) if len(sys.argv) > 5 else None
    runner = tpuexport.runner(sys.argv[1], target=sys.argv[2], cluster=cluster)
    if runner.mirror is not None and not runner.mirror.leader:
        calls = runner.follow()
        print(json.dumps({"load": runner.load_seconds, "compilations": runner.compilations_at_start, "calls": calls}))
        sys.exit()
    prompts, steps = [[5, 17, 42, 7]] * int(sys.argv[3]), []
    start = time.perf_counter()
    for index, _ in enumerate(runner.stream(prompts, max_new_tokens=int(sys.argv[4]), ignore_eos=True)):
        steps.append(time.perf_counter() - start)
        if index == 0:
            first = time.perf_counter() - started
        start = time.perf_counter()
    runner.close()
    print(json.dumps({"first_response": first, "load": runner.load_seconds, "compilations": runner.compilations_at_start,
                      "devices": len(runner.devices), "first_token": steps[0], "decode": sum(steps[1:]) / max(1, len(steps) - 1)}))
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--processes", type=int, default=0, help="also run cpu-PxK in P processes (0: not)")
    parser.add_argument("--mesh", default="model=2,data=2")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--max-context", type=int, default=256)
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=17)
    options = parser.parse_args()
    model = _common.random_llama(options.layers, options.hidden, options.max_context)
    twin = f"cpu-{options.devices}"
    hosts = f"cpu-{options.processes}x{options.devices // max(1, options.processes)}" if options.processes else None
    env = {**_common.child_environment(), "XLA_FLAGS": f"--xla_force_host_platform_device_count={options.devices}"}
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        artifact = tpuexport.convert(model, task="text-generation", target=["cpu", twin, *([hosts] if hosts else [])], max_context=options.max_context,
                                     max_batch=options.max_batch, buckets={"seq": [16], "batch": [options.max_batch]},
                                     sharding="tensor-parallel", mesh=options.mesh, out=pathlib.Path(scratch) / "llama.tpu",
                                     verify_new_tokens=4)
        converted = time.perf_counter() - start
        rows = {}
        for target in ("cpu", twin):
            result = subprocess.run([sys.executable, "-c", CHILD, str(artifact.path), target, str(options.max_batch), str(options.new_tokens)],
                                    capture_output=True, text=True, env=env, check=True)
            rows[target] = json.loads(result.stdout.splitlines()[-1])
        if hosts:
            rows[hosts] = run_processes(artifact.path, hosts, options)
    print(f"llama {options.layers} layers, hidden {options.hidden}, f32, cache {options.max_batch} x {options.max_context}; "
          f"tensor-parallel mesh {options.mesh}; converted for cpu, {twin}{f' and {hosts}' if hosts else ''} in {converted:.0f} s; "
          f"load average {' '.join(open('/proc/loadavg').read().split()[:3])} on {os.cpu_count()} cores")
    print("| target | devices | start to first token s | runner load s | compilations at start | first token s | decode step s |")
    print("|---|---|---|---|---|---|---|")
    for target, row in rows.items():
        followers = "".join(f"; follower {index + 1}: {follower['load']:.2f} s, {follower['compilations']}"
                            for index, follower in enumerate(row.get("followers", [])))
        print(f"| {target} | {row['devices']} | {row['first_response']:.2f} | {row['load']:.2f}{followers} | {row['compilations']} | "
              f"{row['first_token']:.3f} | {row['decode']:.4f} |")


def run_processes(path: pathlib.Path, target: str, options) -> dict:
    """Generation from the cpu-PxK twin in P processes on a loopback coordinator: the leader's row,
    with each follower's load seconds and compilations under "followers"."""
    per_process = options.devices // options.processes
    env = {**_common.child_environment(), "XLA_FLAGS": f"--xla_force_host_platform_device_count={per_process}"}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{probe.getsockname()[1]}"
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(path), target, str(options.max_batch), str(options.new_tokens),
                                  coordinator, str(options.processes), str(index)], stdout=subprocess.PIPE, text=True, env=env)
                for index in reversed(range(options.processes))]
    rows = [json.loads(child.communicate()[0].splitlines()[-1]) for child in children][::-1]
    return {**rows[0], "followers": rows[1:]}


if __name__ == "__main__":
    main()
