"""The paged KV cache (`--kv-cache paged`) vs the static one at Llama-3.2-1B's shape: cache bytes and
the sequences they hold, and what the paged step's executables cost on a TPU (compile-only).

Llama-3.2-1B (hidden 2048, 16 layers, 32 heads, 8 kv heads, head_dim 64, MLP 8192, vocab 128256,
tied) planned on the meta device (`weights=False`: lowered and compiled by libtpu, nothing verified)
at `--layers` layers, bf16, max context 4096, 8 rows: once with the paged cache (pages of 16, step
buckets of `--tokens` tokens x 8 rows) and once with the static cache (decode at batch 8, prefill at
batch 1 x 512). Per executable: XLA's argument, output-alias and temporary bytes, bytes accessed,
and compile seconds, from the manifest. The cache figures at the full 16 layers are exact arithmetic:
the static cache reserves max context per slot; pages hold what rows use, so at a mean length of 512
the same bytes hold context / 512 times the sequences (less the partly filled last page of each).

    python benchmarks/studies/paged_cache.py [--layers 2] [--tokens 8,512] [--target v5e] [--caches paged,static] [--json F]

A slice target (e.g. v5e-8) is planned tensor-parallel over one model axis of all its chips: figures
per chip, the cache's kv heads split over them.

`layouts` compiles, for one v5e chip, what the layout of the pages decides: a step's write of 8
tokens into the donated cache of 2 layers x 2048 pages of 16 (bf16, 8 kv heads of 64), and one
layer's gather of 8 rows x 256 pages followed by attention of 8 queries per kv head, once with a
position's 1024 keys-then-values lanes minor ([layers, pages, page_size, 2 * kv_heads * head_dim],
the artifact's) and once in ragged_paged_attention's layout ([layers, pages, page_size, 2 * kv_heads,
head_dim], keys and values interleaved per head).

    python benchmarks/studies/paged_cache.py layouts
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import tempfile
import time

import torch

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, tie_word_embeddings=True)
CONTEXT, ROWS, PAGE_SIZE, MEAN_LENGTH = 4096, 8, 16, 512
GIB = 2**30


def meta_model(layers: int):
    """Llama-3.2-1B's shape with `layers` layers, bf16, on the meta device."""
    import transformers

    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA_1B, "num_hidden_layers": layers})).eval()
    finally:
        torch.set_default_dtype(torch.float32)


def plan(layers: int, kv_cache: str, tokens: list[int], target: str) -> dict:
    """One plan's executables: {entry point/bucket: figures}."""
    import tpuexport

    buckets = {"tokens": tokens, "rows": [ROWS]} if kv_cache == "paged" else {"seq": [512], "batch": [1]}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        sliced = dict(sharding="tensor-parallel", mesh=f"model={target.split('-')[1]}") if "-" in target else {}
        artifact = tpuexport.convert(meta_model(layers), task="text-generation", max_context=CONTEXT, max_batch=ROWS, target=target, **sliced,
                                     buckets=buckets, precision="bf16", weights=False, kv_cache=kv_cache,
                                     page_size=PAGE_SIZE if kv_cache == "paged" else None, out=pathlib.Path(scratch) / "lm.tpu",
                                     # the static cache's bytes, as the figures compare (by default a TPU target's pages fill its HBM)
                                     num_pages=ROWS * CONTEXT // PAGE_SIZE if kv_cache == "paged" else None)
        manifest = artifact.manifest
    executables = {}
    for bucket in manifest["targets"][target]["buckets"]:
        name = f"{bucket['entry_point']}/{bucket['name']}"
        memory, cost = bucket["memory"], bucket.get("cost") or {}
        executables[name] = {"argument_bytes": memory["argument_bytes"], "alias_bytes": memory.get("alias_bytes"),
                             "temp_bytes": memory["temp_bytes"], "bytes_accessed": cost.get("bytes_accessed"),
                             "compile_seconds": round(manifest["build"]["compile_seconds"][f"{target}/{name}"], 1),
                             "paged_step": bucket.get("paged_step"), "decode_step": bucket.get("decode_step")}
    return {"kv_cache": kv_cache, "layers": layers, "cache_bytes": manifest["generation"]["cache_bytes"],
            "cache_shape": manifest["generation"]["cache_shape"], "executables": executables, "seconds": round(time.perf_counter() - start, 1)}


def capacity() -> dict:
    """Cache bytes and sequences held at the full shape (exact arithmetic, bf16)."""
    per_position = 2 * LLAMA_1B["num_hidden_layers"] * LLAMA_1B["num_key_value_heads"] * LLAMA_1B["head_dim"] * 2  # keys + values, bf16
    static = ROWS * CONTEXT * per_position
    pages_per_sequence = math.ceil(MEAN_LENGTH / PAGE_SIZE)
    page_bytes = PAGE_SIZE * per_position
    return {"bytes_per_position": per_position, "static_cache_bytes": static, "static_sequences": ROWS,
            "paged_pages_in_those_bytes": static // page_bytes, "paged_sequences_at_mean_length": (static // page_bytes) // pages_per_sequence,
            "mean_length": MEAN_LENGTH}


def layouts() -> None:
    """The write and the gather + attention in both layouts (module docstring), XLA's figures."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    device = topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu", chips_per_host_bounds=(1, 1, 1)).devices[0]
    placed = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))  # noqa: E731
    layers, pages, kv_heads, head_dim, tokens, groups = 2, 2048, 8, 64, 8, 4
    pages_per_row = CONTEXT // PAGE_SIZE

    def figures(function, args, donate=()):
        compiled = jax.jit(function, donate_argnums=donate).trace(*args).lower().compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        return f"{compiled.memory_analysis().temp_size_in_bytes / 2**20:.1f} MiB temporaries, {cost.get('bytes accessed', 0) / 2**20:.1f} MiB accessed"

    def write(cache, new, slots):
        flat = jnp.where(slots >= 0, slots, pages * PAGE_SIZE)
        for layer in range(layers):
            cache = cache.at[layer, flat // PAGE_SIZE, flat % PAGE_SIZE].set(new.reshape((tokens, *cache.shape[3:])), mode="drop")
        return cache

    def attention(keys, values, query):
        scores = jnp.einsum("hgqd,khd->hgqk", query, keys, preferred_element_type=jnp.float32)
        return jnp.einsum("hgqk,khd->hgqd", jax.nn.softmax(scores, -1).astype(query.dtype), values)

    def minor_lanes(cache, page_indices, query):  # keys and values: halves of the lanes, split into heads after
        gathered = cache[0][page_indices].reshape(-1, 2 * kv_heads * head_dim)
        half = kv_heads * head_dim
        return attention(gathered[:, :half].reshape(-1, kv_heads, head_dim), gathered[:, half:].reshape(-1, kv_heads, head_dim), query)

    def head_major(cache, page_indices, query):  # per head its keys then its values: a split of the lanes is a split of heads
        gathered = cache[0][page_indices].reshape(-1, kv_heads, 2 * head_dim)
        return attention(gathered[:, :, :head_dim], gathered[:, :, head_dim:], query)

    def interleaved(cache, page_indices, query):
        gathered = cache[0][page_indices].reshape(-1, 2 * kv_heads, head_dim)
        return attention(gathered[:, 0::2], gathered[:, 1::2], query)

    shapes = {"[layers, pages, page_size, 2 * kv_heads * head_dim], keys then values (before session 17)":
                  (layers, pages, PAGE_SIZE, 2 * kv_heads * head_dim),
              "[layers, pages, page_size, kv_heads * 2 * head_dim], per head keys then values (the artifact's)":
                  (layers, pages, PAGE_SIZE, 2 * kv_heads * head_dim),
              "[layers, pages, page_size, 2 * kv_heads, head_dim] (ragged_paged_attention's, interleaved)":
                  (layers, pages, PAGE_SIZE, 2 * kv_heads, head_dim)}
    print(f"v5e, bf16, cache of {layers} layers x {pages} pages of {PAGE_SIZE} ({layers * pages * PAGE_SIZE * 2 * kv_heads * head_dim * 2 / 2**20:.0f} "
          f"MiB), {tokens} tokens into {ROWS} rows of {pages_per_row} pages\n")
    print("| layout | write of the step's tokens (donated cache) | one layer's gather + attention |")
    print("|---|---|---|")
    for (name, shape), gather in zip(shapes.items(), (minor_lanes, head_major, interleaved)):
        cache = placed(shape, jnp.bfloat16)
        written = figures(write, (cache, placed((tokens, 2 * kv_heads * head_dim), jnp.bfloat16), placed((tokens,), jnp.int32)), (0,))
        read = figures(gather, (cache, placed((ROWS, pages_per_row), jnp.int32), placed((kv_heads, groups, tokens, head_dim), jnp.bfloat16)))
        print(f"| {name} | {written} | {read} |", flush=True)


def main() -> None:
    if sys.argv[1:2] == ["layouts"]:
        return layouts()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", default="8,512", help="the paged step's token budgets")
    parser.add_argument("--target", default="v5e")
    parser.add_argument("--caches", default="paged,static", help="which caches to plan")
    parser.add_argument("--json", type=pathlib.Path)
    options = parser.parse_args()
    tokens = [int(size) for size in options.tokens.split(",")]
    held = capacity()
    print(f"Llama-3.2-1B shape, bf16, context {CONTEXT}, {ROWS} rows, pages of {PAGE_SIZE}: {held['bytes_per_position'] / 1024:.0f} KiB "
          f"per position; static cache {held['static_cache_bytes'] / GIB:.2f} GiB holds {ROWS} sequences of any length <= {CONTEXT}; "
          f"as pages the same bytes ({held['paged_pages_in_those_bytes']} pages) hold {held['paged_sequences_at_mean_length']} sequences of "
          f"mean length {MEAN_LENGTH} ({held['paged_sequences_at_mean_length'] / ROWS:.0f}x)\n", flush=True)
    print(f"plans at {options.layers} layers on {options.target} (compile-only, XLA's figures per executable):\n")
    print("| cache | executable | arguments GiB | aliased GiB | temporaries GiB | bytes accessed GiB | compile s |")
    print("|---|---|---|---|---|---|---|", flush=True)
    results = []
    for kv_cache in options.caches.split(","):
        result = plan(options.layers, kv_cache, tokens, options.target)
        results.append(result)
        for name, figures in result["executables"].items():
            accessed = figures["bytes_accessed"]
            print(f"| {kv_cache} {result['cache_shape']} | {name} | {figures['argument_bytes'] / GIB:.3f} | "
                  f"{(figures['alias_bytes'] or 0) / GIB:.3f} | {figures['temp_bytes'] / GIB:.3f} | "
                  f"{accessed / GIB if accessed else float('nan'):.3f} | {figures['compile_seconds']} |", flush=True)
    for result in results:
        for name, figures in result["executables"].items():
            if figures["decode_step"]:
                print(f"\n{name} at {result['layers']} layers: the static cache's estimate of the largest batch the chip holds, "
                      f"each sequence reserving max context {CONTEXT}: {figures['decode_step']['largest_batch_estimate']}")
            if figures["paged_step"]:
                held = figures["paged_step"]
                print(f"\n{name} at {result['layers']} layers: the rest of the chip's HBM holds {held['pages_fit']} pages = "
                      f"{held['tokens_fit']} positions = {held['sequences_fit_at_mean_length']} sequences of mean length "
                      f"{held['mean_length']} (weights {held['weight_bytes'] / GIB:.2f} GiB, temporaries {held['temp_bytes'] / GIB:.2f} GiB)")
    if options.json:
        options.json.write_text(json.dumps({"capacity": held, "plans": results}, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
