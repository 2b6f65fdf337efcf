"""Prints what checking an artifact's files on load costs: the first `Artifact.run` hashes the
program and the weights (once per load), later runs do not.

    python benchmarks/studies/load_integrity.py [--megabytes 256]

Converts a one-layer model whose weights take about --megabytes (f32, --no-saved-model, v5e), then
in this process: `tpuexport.load` (the manifest and path checks), the first run (hashing, XLA:CPU
compile, run) and a second run; and sha256's throughput on the weights file alone.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402
import tpuexport  # noqa: E402
from tpuexport.artifact import layout  # noqa: E402
from tpuexport.artifact.manifest import sha256_file  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=256, help="weights size to convert")
    args = parser.parse_args()
    features = int((args.megabytes * 2**20 / 4) ** 0.5)
    model = torch.nn.Linear(features, features, bias=False).eval()
    batch = torch.export.Dim("batch", min=1, max=8)
    with tempfile.TemporaryDirectory() as scratch:
        out = pathlib.Path(scratch) / "big.tpu"
        tpuexport.convert(model, (torch.randn(2, features),), {"input": {0: batch}}, out=out, saved_model=False,
                          verify_budget_flops=1e9)
        weights = out / layout.WEIGHTS
        size_mb = weights.stat().st_size / 2**20
        start = time.perf_counter()
        sha256_file(weights)
        hash_seconds = time.perf_counter() - start
        start = time.perf_counter()
        artifact = tpuexport.load(out)
        load_seconds = time.perf_counter() - start
        x = torch.randn(2, features)
        start = time.perf_counter()
        artifact.run(x)
        first = time.perf_counter() - start
        start = time.perf_counter()
        artifact.run(x)
        second = time.perf_counter() - start
    print(f"weights file              {size_mb:8.1f} MiB")
    print(f"sha256 of the weights     {hash_seconds:8.3f} s  ({size_mb / hash_seconds:.0f} MiB/s)")
    print(f"load (manifest, paths)    {load_seconds:8.3f} s")
    print(f"first run (hash+compile)  {first:8.3f} s")
    print(f"second run                {second:8.3f} s")


if __name__ == "__main__":
    main()
