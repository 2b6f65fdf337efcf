"""Llama-3-8B's shapes planned for one v5e chip with weight-only int4 (and int8, bf16 for comparison).

    nice -n 10 python benchmarks/studies/weight_only_plan.py [--modes int4-weight-only,int8-weight-only,none] [--batches 1,2]

transformers' LlamaForCausalLM with Llama 3 8B's shapes (families.bf16_llama, built on the meta
device: no weight exists, nothing is downloaded) is planned with `tpuexport.plan` for `v5e` at
batch B x seq 2 (a step that reads every weight once, as a decode step does; no KV cache in this
program) and B x seq 2048 (a 2048-token context). Printed per mode and bucket: XLA's per-chip
argument bytes (the weights and inputs), temporaries, output and total against the chip's 16 GiB,
XLA's bytes accessed, and the program's weight bytes. Each mode runs in its own process.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402

LLAMA_3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False)


def plan_one(mode: str, batches: list[int], out: pathlib.Path) -> None:
    """Plans the 8B for v5e in this process and prints its figures."""
    import tpuexport
    from families import bf16_llama

    model, args, shapes = bf16_llama(LLAMA_3_8B, device="meta")
    start = time.perf_counter()
    artifact = tpuexport.plan(model, args, shapes, target="v5e", out=out, buckets={"batch": batches, "seq": [2, 2048]},
                              quantize=None if mode == "none" else mode, group_size=128)
    manifest = artifact.manifest
    gib = 2 ** 30
    print(f"{mode}: weights {manifest['program']['weight_bytes'] / gib:.2f} GiB; planned in {time.perf_counter() - start:.0f} s", flush=True)
    for bucket in manifest["targets"]["v5e"]["buckets"]:
        memory, cost = bucket["memory"], bucket["cost"]
        accessed = cost.get("bytes_accessed")
        print(f"  {bucket['name']:<16} arguments {memory['argument_bytes'] / gib:6.2f} GiB, temporaries {memory['temp_bytes'] / gib:6.2f} GiB, "
              f"output {memory['output_bytes'] / gib:5.2f} GiB, total {memory['total_bytes'] / gib:6.2f} GiB "
              f"({bucket['hbm_utilization']:.0%} of HBM); XLA bytes accessed "
              f"{'unknown' if accessed is None else f'{accessed / gib:.2f} GiB'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="int4-weight-only,int8-weight-only,none")
    parser.add_argument("--batches", default="1,2")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    options = parser.parse_args()
    batches = [int(size) for size in options.batches.split(",")]
    if options.one:
        with tempfile.TemporaryDirectory() as directory:
            plan_one(options.one, batches, pathlib.Path(directory) / "plan.tpu")
        return
    for mode in options.modes.split(","):
        result = subprocess.run([sys.executable, __file__, "--one", mode, "--batches", options.batches], capture_output=True, text=True)
        print(result.stdout, end="", flush=True)
        if result.returncode:
            print(f"{mode}: failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}", flush=True)


if __name__ == "__main__":
    main()
