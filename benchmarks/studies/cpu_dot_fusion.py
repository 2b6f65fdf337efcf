"""The time cost of giving XLA:CPU's dot library (YNNPACK) each dot alone, as CPU runs with large
temporaries do (lower/lowered.py LARGE_RUN_OPTIONS, session 23): a Llama-3.2-1B-shaped decoder layer's prefill
(bf16, hidden 2048, 32 heads, 8 kv heads, MLP 8192) at 2048 tokens, compiled with the CPU runs'
options (RUN_COMPILER_OPTIONS) and with LARGE_RUN_OPTIONS, which add
`xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT`,
run alternately; the median of each and their ratio printed, with XLA's planned temporaries.

    nice -n 10 python benchmarks/studies/cpu_dot_fusion.py [--tokens 2048] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import pathlib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tpuexport.lower.lowered import LARGE_RUN_OPTIONS, RUN_COMPILER_OPTIONS  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 2048, 32, 8, 64, 8192


def layer(weights, x):
    """One pre-norm decoder layer with causal grouped-query attention, as the prefill computes it."""
    wq, wk, wv, wo, w1, w3, w2 = weights
    tokens = x.shape[0]
    h = x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-5).astype(x.dtype)
    q = (h @ wq).reshape(tokens, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    k, v = (h @ wk).reshape(tokens, KV_HEADS, HEAD_DIM), (h @ wv).reshape(tokens, KV_HEADS, HEAD_DIM)
    scores = jnp.einsum("qgrd,kgd->grqk", q, k) * HEAD_DIM**-0.5
    mask = jnp.tril(jnp.ones((tokens, tokens), bool))
    probs = jax.nn.softmax(jnp.where(mask, scores.astype(jnp.float32), -jnp.inf), -1).astype(x.dtype)
    attended = jnp.einsum("grqk,kgd->qgrd", probs, v).reshape(tokens, HIDDEN)
    x = x + attended @ wo
    return x + (jax.nn.silu(x @ w1) * (x @ w3)) @ w2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    options = parser.parse_args()
    keys = jax.random.split(jax.random.key(0), 8)
    shapes = [(HIDDEN, HEADS * HEAD_DIM), (HIDDEN, KV_HEADS * HEAD_DIM), (HIDDEN, KV_HEADS * HEAD_DIM), (HEADS * HEAD_DIM, HIDDEN),
              (HIDDEN, MLP), (HIDDEN, MLP), (MLP, HIDDEN)]
    weights = [(0.02 * jax.random.normal(key, shape)).astype(jnp.bfloat16) for key, shape in zip(keys, shapes)]
    x = jax.random.normal(keys[-1], (options.tokens, HIDDEN)).astype(jnp.bfloat16)
    compiled = {label: jax.jit(layer).lower(weights, x).compile(compiler_options=chosen)
                for label, chosen in (("fused (XLA's default)", RUN_COMPILER_OPTIONS), ("each dot alone", LARGE_RUN_OPTIONS))}
    times = {label: [] for label in compiled}
    outputs = {label: function(weights, x).block_until_ready() for label, function in compiled.items()}
    for _ in range(options.repeats):
        for label, function in compiled.items():
            start = time.perf_counter()
            function(weights, x).block_until_ready()
            times[label].append(time.perf_counter() - start)
    first, second = (statistics.median(times[label]) for label in compiled)
    for label, function in compiled.items():
        temp = function.memory_analysis().temp_size_in_bytes
        print(f"{label:<22} median {statistics.median(times[label]):.3f} s over {options.repeats}, planned temporaries {temp / 2**20:.0f} MiB")
    fused_out, alone_out = (outputs[label].astype(jnp.float32) for label in compiled)
    print(f"each dot alone / fused: {second / first:.2f}x; outputs differ by at most {float(jnp.max(jnp.abs(fused_out - alone_out))):.3g} "
          f"(largest {float(jnp.max(jnp.abs(fused_out))):.3g})")


if __name__ == "__main__":
    main()
