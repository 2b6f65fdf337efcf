"""Load on `tpuexport serve`'s generate API (CPU runtime, loopback): tokens/s and latency with N
concurrent clients, and how many rows each decode step ran (continuous batching).

    python benchmarks/serve_generation.py [--layers 4] [--hidden 256] [--max-batch 8] [--clients 8] [--requests 4] [--new-tokens 32]
                                          [--kv-cache static|paged] [--num-pages N]

Converts a Llama with random f32 weights for the `cpu` target (static cache: prefill batches 1 and
max batch, the default, prompts bucketed at 32; paged: pages of 16, --num-pages of them (default:
the static cache's bytes at this max batch), step buckets of max batch and 32 tokens x max batch
rows), serves it as its own process, and
runs N client threads, each sending --requests generate
requests of one random prompt (4-24 tokens) one after the other. Prints generated tokens per
second over the whole run, p50/p99 request latency, and the mean rows per decode step from the
server's metrics (`tpuexport_decode_rows`; "unknown" where the server does not report it).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import tempfile
import threading
import time

import numpy as np
import requests

import _common


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-context", type=int, default=128)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4, help="per client, one after the other")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--kv-cache", choices=("static", "paged"), default="static")
    parser.add_argument("--num-pages", type=int, help="paged: pages of 16 positions [default: max batch rows of max context]")
    options = parser.parse_args()
    import tpuexport

    cache = ({"buckets": {"seq": [32]}} if options.kv_cache == "static" else
             {"kv_cache": "paged", "page_size": 16, "num_pages": options.num_pages,
              "buckets": {"tokens": [options.max_batch, 32], "rows": [options.max_batch]}})
    with tempfile.TemporaryDirectory() as scratch:
        out = pathlib.Path(scratch) / "llama.tpu"
        tpuexport.convert(_common.random_llama(options.layers, options.hidden, options.max_context), task="text-generation", target="cpu",
                          max_context=options.max_context, max_batch=options.max_batch, saved_model=False, out=out, verify_new_tokens=4,
                          **cache)
        with _common.served(["tpuexport.cli", "serve", str(out), "--grpc-port", "0"], "/readyz") as base:
            latencies, tokens, lock = [], [0], threading.Lock()

            def client(index: int) -> None:
                generator = np.random.default_rng(index)
                with requests.Session() as session:
                    for _ in range(options.requests):
                        prompt = generator.integers(0, 1024, int(generator.integers(4, 25))).tolist()
                        start = time.perf_counter()
                        answer = session.post(f"{base}/v1/models/llama:generate", json={"prompts": [prompt], "max_new_tokens": options.new_tokens},
                                              timeout=600)
                        answer.raise_for_status()
                        generated = json.loads(answer.text.splitlines()[-1])["generated"][0]
                        with lock:
                            latencies.append(time.perf_counter() - start)
                            tokens[0] += len(generated)

            threads = [threading.Thread(target=client, args=(index,)) for index in range(options.clients)]
            start = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            seconds = time.perf_counter() - start
            metrics = requests.get(f"{base}/metrics", timeout=10).text
    rows = re.search(r'tpuexport_decode_rows_sum\{[^}]*\} (\S+)', metrics)
    steps = re.search(r'tpuexport_decode_rows_count\{[^}]*\} (\S+)', metrics)
    mean_rows = f"{float(rows.group(1)) / float(steps.group(1)):.2f}" if rows and steps and float(steps.group(1)) else "unknown"
    pages = f" in {options.num_pages} pages of 16" if options.kv_cache == "paged" and options.num_pages else ""
    print(f"llama {options.layers} layers, hidden {options.hidden}, f32, {options.kv_cache} cache {options.max_batch} x {options.max_context}{pages}; "
          f"{options.clients} clients x {options.requests} requests x {options.new_tokens} new tokens")
    print("| generated tokens/s | requests | p50 latency s | p99 latency s | mean rows per decode step |")
    print("|---|---|---|---|---|")
    print(f"| {tokens[0] / seconds:.1f} | {len(latencies)} | {np.percentile(latencies, 50):.2f} | {np.percentile(latencies, 99):.2f} | {mean_rows} |")


if __name__ == "__main__":
    main()
