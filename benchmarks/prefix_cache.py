"""Time to first token with and without a cached prefix: `tpuexport serve` over a paged KV cache (CPU
runtime, loopback), prefix caching on (the default).

    python benchmarks/prefix_cache.py [--layers 4] [--hidden 256] [--prefix 1000] [--suffix 24] [--prefixes 5] [--budget 256]

Converts a Llama with random f32 weights for the `cpu` target with `--kv-cache paged` (pages of 16,
context prefix + suffix + 32, 2 rows, step buckets of 8 and --budget tokens), serves it as its own
process and, for each of --prefixes random prefixes, sends one request after the other through
REST `:generate` (streamed, 8 new tokens): prefix + one suffix (nothing cached: the whole prompt is
prefilled, in chunks of the budget), then prefix + another suffix (the prefix's full pages are cached:
only the rest is prefilled). Time to first token is the client's, from sending to the first streamed
line. Prints the median and each run of both, and the server's prefix cache hits.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import tempfile
import time

import numpy as np
import requests

import _common

PAGE_SIZE, NEW_TOKENS = 16, 8


def first_token_seconds(base: str, prompt: list[int]) -> float:
    """Seconds from sending a streamed generate request to its first step's line."""
    start = time.perf_counter()
    with requests.post(f"{base}/v1/models/llama:generate", json={"prompts": [prompt], "max_new_tokens": NEW_TOKENS}, stream=True,
                       timeout=600) as answer:
        answer.raise_for_status()
        lines = answer.iter_lines()
        json.loads(next(lines))
        seconds = time.perf_counter() - start
        for _ in lines:  # the rest of the stream, so the next request finds the rows free
            pass
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--prefix", type=int, default=1000, help="tokens of the shared prefix")
    parser.add_argument("--suffix", type=int, default=24, help="tokens after it, different per request")
    parser.add_argument("--prefixes", type=int, default=5, help="prefixes (pairs of requests) measured")
    parser.add_argument("--budget", type=int, default=256, help="the step's largest token budget (prefill chunk)")
    options = parser.parse_args()
    import tpuexport

    max_context = -(-(options.prefix + options.suffix + 32) // PAGE_SIZE) * PAGE_SIZE
    generator = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as scratch:
        out = pathlib.Path(scratch) / "llama.tpu"
        tpuexport.convert(_common.random_llama(options.layers, options.hidden, max_context), task="text-generation", target="cpu",
                          max_context=max_context, max_batch=2, kv_cache="paged", page_size=PAGE_SIZE,
                          buckets={"tokens": [8, options.budget], "rows": [2]}, saved_model=False, out=out, verify_new_tokens=4)
        with _common.served(["tpuexport.cli", "serve", str(out), "--grpc-port", "0"], "/readyz") as base:
            first_token_seconds(base, generator.integers(0, 1024, 8).tolist())  # the first step of each bucket warms up
            first_token_seconds(base, generator.integers(0, 1024, options.budget + 8).tolist())
            uncached, cached = [], []
            for _ in range(options.prefixes):
                prefix = generator.integers(0, 1024, options.prefix).tolist()
                uncached.append(first_token_seconds(base, prefix + generator.integers(0, 1024, options.suffix).tolist()))
                cached.append(first_token_seconds(base, prefix + generator.integers(0, 1024, options.suffix).tolist()))
            metrics = requests.get(f"{base}/metrics", timeout=10).text
    hits = re.search(r'tpuexport_prefix_cache_hits_total\{[^}]*\} (\S+)', metrics)
    queries = re.search(r'tpuexport_prefix_cache_queries_total\{[^}]*\} (\S+)', metrics)
    print(f"llama {options.layers} layers, hidden {options.hidden}, f32, paged cache (pages of {PAGE_SIZE}, context {max_context}), "
          f"step budget {options.budget} tokens; prompts of a {options.prefix}-token prefix + {options.suffix} tokens, {NEW_TOKENS} new tokens")
    print("| prefix | median time to first token s | runs s |")
    print("|---|---|---|")
    for label, runs in (("not cached", uncached), ("cached", cached)):
        print(f"| {label} | {np.median(runs):.3f} | {', '.join(f'{run:.3f}' for run in runs)} |")
    print(f"speed-up {np.median(uncached) / np.median(cached):.1f}x; prefix cache hits {float(hits.group(1)):.0f} of "
          f"{float(queries.group(1)):.0f} prompt tokens looked up")


if __name__ == "__main__":
    main()
