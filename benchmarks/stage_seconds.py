"""Prints per-stage wall seconds (export, lower, verify, compile per bucket, write) for the examples.

    python benchmarks/stage_seconds.py [--target v5e] [--bucket batch=1,8] [--precision bf16] [EXAMPLE ...]

Each example is converted in this process, one after another; the first conversion also pays
for importing torchax and loading libtpu (reported separately as "warm-up").
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time
import warnings

import _common


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples", nargs="*", default=["mlp", "cnn", "transformer"])
    parser.add_argument("--target", action="append", default=None)
    parser.add_argument("--bucket", action="append", default=[])
    parser.add_argument("--precision", default="f32")
    options = parser.parse_args()
    warnings.filterwarnings("ignore")

    start = time.perf_counter()
    import tpuexport  # noqa: F401  (the imports below bring torch, jax and torchax)
    from tpuexport.compile import parse_bucket_options
    from tpuexport.export import load_source
    from tpuexport.lower.torchax_import import import_torchax
    from tpuexport.pipeline import ConversionOptions, run_conversion

    import_torchax()
    print(f"warm-up (imports)            {time.perf_counter() - start:7.2f} s")
    targets = tuple(options.target or ["v5e", "v6e"])
    for example in options.examples:
        print(f"\n{example} ({', '.join(targets)}, {options.precision})")
        with tempfile.TemporaryDirectory() as scratch:
            source = load_source(f"{_common.EXAMPLES / example}.py:build")
            conversion = ConversionOptions(targets, pathlib.Path(scratch) / f"{example}.tpu",
                                           parse_bucket_options(options.bucket) or None, options.precision)
            total = time.perf_counter()
            artifact = run_conversion(source, conversion, progress=lambda stage, s, _: print(f"  {stage:<28} {s:7.2f} s"))
            print(f"  {'total':<28} {time.perf_counter() - total:7.2f} s")
            size = sum(p.stat().st_size for p in artifact.path.rglob("*") if p.is_file())
            print(f"  artifact size                {size / 2**20:7.2f} MiB")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
