"""Text generation from a bf16 artifact's cpu-target executables: seconds per step (issue #20).

Converts a Llama of the given size with random bf16 weights for `--target cpu` (verification runs
as in any conversion), opens it with the runtime (the executables loaded, nothing compiled) and
generates greedily for a full batch of prompts:

    python benchmarks/studies/cpu_generation.py [--layers 16] [--hidden 256] [--max-context 2048] [--max-batch 8]

Printed: convert seconds, the runner's load seconds, its first token (prefill) and mean decode-step
seconds, the KV cache's bytes, and whether the executables take the cache as bit patterns
(manifest `state_as_bits`). XLA:CPU widens bfloat16 ops to f32, so an executable taking the cache
as bfloat16 passed over the whole cache once per layer and row of every step.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402

import torch

import tpuexport


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--prefill-seq", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=9)
    options = parser.parse_args()
    model = _common.random_llama(options.layers, options.hidden, options.max_context).to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        artifact = tpuexport.convert(model, task="text-generation", target="cpu", max_context=options.max_context,
                                     max_batch=options.max_batch, buckets={"seq": [options.prefill_seq]}, saved_model=False,
                                     out=pathlib.Path(scratch) / "llama.tpu", verify_new_tokens=4)
        converted = time.perf_counter() - start
        runner = tpuexport.runner(artifact.path)
        prompts = [[5, 17, 42, 7]] * options.max_batch
        times = []
        start = time.perf_counter()
        for _ in runner.stream(prompts, max_new_tokens=options.new_tokens):
            times.append(time.perf_counter() - start)
            start = time.perf_counter()
        bits = sorted({name for bucket in artifact.manifest["targets"]["cpu"]["buckets"] for name in bucket.get("state_as_bits", ())})
        spec = artifact.generation_program.spec
    print(f"llama {options.layers} layers, hidden {options.hidden}, bf16, cache {options.max_batch} x {options.max_context} "
          f"({spec.cache_bytes / 2**20:.0f} MiB keys + values); cache as bit patterns: {', '.join(bits) or 'no'}")
    print("| convert s | runner load s | first token s | decode step s (mean of %d) |" % (len(times) - 1))
    print("|---|---|---|---|")
    print(f"| {converted:.1f} | {runner.load_seconds:.2f} | {times[0]:.2f} | {sum(times[1:]) / max(1, len(times) - 1):.3f} |")


if __name__ == "__main__":
    main()
