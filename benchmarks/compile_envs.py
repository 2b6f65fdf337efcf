"""A two-environment artifact (--compile-env): its size and compile seconds per version set, and the
load time with 0 compilations in each environment.

    nice -n 10 python benchmarks/compile_envs.py --compile-env PYTHON [--compile-env PYTHON ...]
                                                 [--example cnn] [--target cpu --target v5e] [--work DIR]

Converts examples/<example>.py (default cnn: examples/mlp.py's GELU does not compile under jax 0.11.2,
docs/compile-environments.md) for the targets, here and under each environment; then loads the cpu
target's executables in this process (tpuexport.runner) and in each environment (verify
--runtime-env's child, tpuexport/runtime/runtime_env.py), printing seconds and compilations. The
test suite's second environment (tests/test_compile_envs.py) is in ~/.cache/tpuexport-tests/.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import tpuexport
from tpuexport.runtime.runtime_env import check_runtime_env
from tpuexport.runtime.selection import own_version_set

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-env", action="append", required=True, metavar="PYTHON")
    parser.add_argument("--example", default="cnn")
    parser.add_argument("--target", action="append", metavar="TARGET")
    parser.add_argument("--work", type=pathlib.Path, help="where the artifact is written [default: a temporary directory]")
    args = parser.parse_args()
    targets = args.target or ["cpu", "v5e"]
    sys.path.insert(0, str(EXAMPLES))
    built = __import__(args.example).build()
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        out = pathlib.Path(work) / f"{args.example}.tpu"
        start = time.perf_counter()
        artifact = tpuexport.convert(built["model"], built["args"], built["dynamic_shapes"], out=out, target=targets, saved_model=False,
                                     verify_budget_flops=0, compile_envs=args.compile_env)
        print(f"converted {args.example} for {', '.join(targets)} and {len(args.compile_env)} compile environment(s) in "
              f"{time.perf_counter() - start:.1f} s; artifact {sum(p.stat().st_size for p in out.rglob('*') if p.is_file()) / 2**20:.2f} MiB")
        manifest = artifact.manifest
        own = own_version_set(manifest)
        seconds = manifest["build"]["compile_seconds"]
        print(f"{'version set':<44} {'target':<6} {'executables':>12} {'compile s':>10}")
        for set_name in manifest["version_sets"]:
            for target, record in manifest["targets"].items():
                buckets = record["buckets"] if set_name == own else record["version_sets"][set_name]["buckets"]
                size = sum((out / bucket["executable"]).stat().st_size for bucket in buckets)
                key = target if set_name == own else f"{target}@{set_name}"
                compiled = sum(value for name, value in seconds.items() if name.split("/")[0] == key)
                print(f"{set_name:<44} {target:<6} {size / 2**10:>9.1f} KiB {compiled:>10.2f}")
        if "cpu" in manifest["targets"]:
            runner = tpuexport.runner(out, target="cpu")
            print(f"load here ({own}): {runner.load_seconds:.3f} s (executables and weights), "
                  f"compilations {runner.compilations_at_start}")
            for python in args.compile_env:
                start = time.perf_counter()
                checked = check_runtime_env(out, python, "cpu")
                print(f"load under {python} ({checked.version_set}): {checked.seconds:.3f} s in its process (executables only), "
                      f"compilations {checked.compilations}; the whole check with its probe {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
