"""Generation from a slice's CPU twin (cpu-N) vs one CPU device: start-up and step seconds (issue #37).

Converts a small Llama with random f32 weights, tensor-parallel, for `cpu` and `cpu-N` (the same
plan as a v5e-N slice would take), then in a fresh process per target with
XLA_FLAGS=--xla_force_host_platform_device_count=N opens the runtime and generates greedily:

    python benchmarks/studies/twin_generation.py [--devices 4] [--mesh model=2,data=2] [--layers 4] [--hidden 256]

Printed per target: the process's start to its first generated token (importing tpuexport, opening
the runner, prefill), the runner's load seconds and compilations at start, the first token's and
the mean decode step's seconds. N CPU "devices" share the same cores, so the twin is not expected to
be faster: the figures are recorded, not judged (2 cores shared with other jobs here).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
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
    runner = tpuexport.runner(sys.argv[1], target=sys.argv[2])
    prompts, steps = [[5, 17, 42, 7]] * int(sys.argv[3]), []
    start = time.perf_counter()
    for index, _ in enumerate(runner.stream(prompts, max_new_tokens=int(sys.argv[4]), ignore_eos=True)):
        steps.append(time.perf_counter() - start)
        if index == 0:
            first = time.perf_counter() - started
        start = time.perf_counter()
    print(json.dumps({"first_response": first, "load": runner.load_seconds, "compilations": runner.compilations_at_start,
                      "devices": len(runner.devices), "first_token": steps[0], "decode": sum(steps[1:]) / max(1, len(steps) - 1)}))
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--mesh", default="model=2,data=2")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--max-context", type=int, default=256)
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=17)
    options = parser.parse_args()
    model = _common.random_llama(options.layers, options.hidden, options.max_context)
    twin = f"cpu-{options.devices}"
    env = {**_common.child_environment(), "XLA_FLAGS": f"--xla_force_host_platform_device_count={options.devices}"}
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        artifact = tpuexport.convert(model, task="text-generation", target=["cpu", twin], max_context=options.max_context,
                                     max_batch=options.max_batch, buckets={"seq": [16], "batch": [options.max_batch]},
                                     sharding="tensor-parallel", mesh=options.mesh, out=pathlib.Path(scratch) / "llama.tpu",
                                     verify_new_tokens=4)
        converted = time.perf_counter() - start
        rows = {}
        for target in ("cpu", twin):
            result = subprocess.run([sys.executable, "-c", CHILD, str(artifact.path), target, str(options.max_batch), str(options.new_tokens)],
                                    capture_output=True, text=True, env=env, check=True)
            rows[target] = json.loads(result.stdout.splitlines()[-1])
    print(f"llama {options.layers} layers, hidden {options.hidden}, f32, cache {options.max_batch} x {options.max_context}; "
          f"tensor-parallel mesh {options.mesh}; converted for cpu and {twin} in {converted:.0f} s; "
          f"load average {' '.join(open('/proc/loadavg').read().split()[:3])} on {os.cpu_count()} cores")
    print("| target | devices | start to first token s | runner load s | compilations at start | first token s | decode step s |")
    print("|---|---|---|---|---|---|---|")
    for target, row in rows.items():
        print(f"| {target} | {row['devices']} | {row['first_response']:.2f} | {row['load']:.2f} | {row['compilations']} | "
              f"{row['first_token']:.3f} | {row['decode']:.4f} |")


if __name__ == "__main__":
    main()
