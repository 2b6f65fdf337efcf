"""Where a text-generation step's bytes go on TPU, by XLA's analysis (compile-only, no TPU): the
decode (or prefill) entry point of a Llama-3.2-1B-shaped model, and small JAX programs that isolate
one part each.

    python benchmarks/studies/decode_bytes.py step [--layers 2] [--target v5e|v5e-8] [--entry decode|prefill] [--context 4096]
    python benchmarks/studies/decode_bytes.py writes       # the KV cache write alone: scatter vs dynamic_update_slice
    python benchmarks/studies/decode_bytes.py prefetch     # how XLA counts weights it prefetches into VMEM
    python benchmarks/studies/decode_bytes.py attention    # one-query attention alone, 1 and 16 layers

`step` lowers the entry point as the conversion does (meta weights, bf16, batch 8 x context, cache
layout layer_batch_head_pos; v5e-8 tensor-parallel with the cache split by kv heads), compiles it,
and prints XLA's bytes accessed over what the step must read (its arguments: weights + cache, per
chip), the bytes the compiled HLO prefetches into VMEM (memory space S(1): `copy-start` of whole
arrays, `slice-start` of pieces) and the bytes accessed without that prefetch's bookkeeping.

XLA's bytes accessed count every instruction's operands and results in any memory space. `prefetch`
measures what that makes of a weight the TPU prefetches: chains of Llama-1B MLPs at batch 8, where
bytes accessed = weights + 4 x (copy-start bytes) + 3 x (slice-start bytes) exactly; a prefetched
weight is read from HBM once, so those extra counts are VMEM traffic and bookkeeping, not HBM
traffic. `step` subtracts them with these factors.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402
from hlo_prefetch import COPY_START_EXTRA, SLICE_START_EXTRA, prefetched_bytes, without_prefetch_bookkeeping  # noqa: E402


def step(options: argparse.Namespace) -> None:
    import generation
    from tpuexport import compile as compile_stage

    model = generation.meta_llama(generation.model_config("llama-3.2-1b", options.layers))
    prefill_seq = min(128, options.context)
    # On a slice, as the pipeline plans a generation slice: the cache split with the kv heads.
    sharding = compile_stage.ShardingRequest(preset="tensor-parallel") if compile_stage.resolve_targets([options.target])[0].is_slice else None
    _, _, result = generation.compiled_entry_point(model, options.entry, options.target, max_batch=generation.MAX_BATCH,
                                                   max_context=options.context, buckets={"batch": [generation.MAX_BATCH], "seq": [prefill_seq]},
                                                   **({"sharding": sharding} if sharding else {}))
    accessed, must_read = result.cost["bytes_accessed"], result.memory["argument_bytes"]
    prefetched = prefetched_bytes(result.hlo_text)
    adjusted = without_prefetch_bookkeeping(accessed, prefetched)
    gib = 2**30
    print(f"{options.entry} {result.bucket.name}, {options.layers} layers, {options.target}, batch {generation.MAX_BATCH} x context "
          f"{options.context}, per chip: must read (arguments) {must_read / gib:.3f} GiB; XLA bytes accessed {accessed / gib:.3f} GiB "
          f"({accessed / must_read:.2f}x); prefetched into VMEM: copy-start {prefetched['copy-start'] / gib:.3f} GiB, slice-start "
          f"{prefetched['slice-start'] / gib:.3f} GiB; without their bookkeeping {adjusted / gib:.3f} GiB ({adjusted / must_read:.2f}x); "
          f"temporaries {result.memory['temp_bytes'] / 2**20:.1f} MiB; collectives {result.collectives or 'none'}; "
          f"compile {result.compile_seconds:.0f} s")


def _v5e():
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu", chips_per_host_bounds=(1, 1, 1)).devices[0]


def _compiled(function, args, donate=()):
    import jax

    compiled = jax.jit(function, donate_argnums=donate).trace(*args).lower().compile()
    cost = compiled.cost_analysis()
    return compiled, (cost[0] if isinstance(cost, list) else cost)


def writes() -> None:
    """The cache write of a decode step (one key per row) and of a prefill (8 prompts of 128), 2 layers
    of an 8 x 4096 cache [layers, batch, kv_heads, context, head_dim] bf16, donated."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    placed = SingleDeviceSharding(_v5e())
    layers, batch, heads, context, dim, steps = 2, 8, 8, 4096, 64, 128
    cache = jax.ShapeDtypeStruct((layers, batch, heads, context, dim), jnp.bfloat16, sharding=placed)
    rows = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=placed)
    one = jax.ShapeDtypeStruct((layers, batch, heads, dim), jnp.bfloat16, sharding=placed)
    prompts = jax.ShapeDtypeStruct((layers, batch, heads, steps, dim), jnp.bfloat16, sharding=placed)

    def decode_scatter(cache, new, positions):  # what index_put lowers to
        for layer in range(layers):
            cache = cache.at[layer, jnp.arange(batch)[:, None], jnp.arange(heads)[None, :], positions[:, None]].set(new[layer])
        return cache

    def decode_rows(cache, new, positions):  # lower/generation.py's write_decode_cache
        for layer in range(layers):
            for row in range(batch):
                cache = jax.lax.dynamic_update_slice(cache, new[layer, row][None, None, :, None, :], (layer, row, 0, positions[row], 0))
        return cache

    def decode_rows_guarded(cache, new, positions):  # the same, keeping the old entry for a position out of range
        for layer in range(layers):
            for row in range(batch):
                start = (layer, row, 0, positions[row], 0)
                update = new[layer, row][None, None, :, None, :]
                kept = jax.lax.dynamic_slice(cache, start, update.shape)
                update = jnp.where((positions[row] >= 0) & (positions[row] < context), update, kept)
                cache = jax.lax.dynamic_update_slice(cache, update, start)
        return cache

    def prefill_scatter(cache, new, slots):
        for layer in range(layers):
            cache = cache.at[layer, slots[:, None, None], jnp.arange(heads)[None, :, None], jnp.arange(steps)[None, None, :]].set(new[layer])
        return cache

    def prefill_rows(cache, new, slots):  # lower/generation.py's write_prefill_cache
        for layer in range(layers):
            def write_row(row, cache, layer=layer):
                update = jax.lax.dynamic_index_in_dim(new[layer], row, 0, keepdims=True)[None]
                return jax.lax.dynamic_update_slice(cache, update, (layer, slots[row], 0, 0, 0))
            cache = jax.lax.fori_loop(0, batch, write_row, cache)
        return cache

    cache_bytes = layers * batch * heads * context * dim * 2
    print("| cache write (2 layers, 8 x 4096) | XLA bytes / cache bytes | temporaries MiB |\n|---|---|---|")
    for name, function, new in [("decode: index_put (scatter)", decode_scatter, one), ("decode: dynamic_update_slice per row", decode_rows, one),
                                ("decode: dynamic_update_slice per row, out-of-range guard", decode_rows_guarded, one),
                                ("prefill: index_put (scatter)", prefill_scatter, prompts),
                                ("prefill: loop of dynamic_update_slice per row", prefill_rows, prompts)]:
        compiled, cost = _compiled(function, (cache, new, rows), donate=(0,))
        print(f"| {name} | {cost['bytes accessed'] / cache_bytes:.3f} | {compiled.memory_analysis().temp_size_in_bytes / 2**20:.1f} |", flush=True)


def prefetch() -> None:
    """Chains of Llama-1B MLPs (gate, up: [8192, 2048], down: [2048, 8192], bf16) at batch 8."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    placed = SingleDeviceSharding(_v5e())
    hidden, inner, batch = 2048, 8192, 8

    def array(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=placed)

    def mlps(x, weights):
        for gate, up, down in weights:
            h = jax.nn.silu(jnp.einsum("be,fe->bf", x, gate, preferred_element_type=jnp.float32)) * jnp.einsum(
                "be,fe->bf", x, up, preferred_element_type=jnp.float32)
            x = x + jnp.einsum("bf,ef->be", h.astype(jnp.bfloat16), down, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        return x

    print("| MLPs | weights GiB | XLA bytes GiB | copy-start GiB | slice-start GiB | weights + 4 x copy + 3 x slice |\n|---|---|---|---|---|---|")
    for count in (1, 2, 4, 16):
        weights = [(array(inner, hidden), array(inner, hidden), array(hidden, inner)) for _ in range(count)]
        compiled, cost = _compiled(mlps, (array(batch, hidden), weights))
        prefetched = prefetched_bytes(compiled.as_text())
        weight_bytes = count * 3 * inner * hidden * 2
        model = weight_bytes + COPY_START_EXTRA * prefetched["copy-start"] + SLICE_START_EXTRA * prefetched["slice-start"]
        print(f"| {count} | {weight_bytes / 2**30:.3f} | {cost['bytes accessed'] / 2**30:.3f} | {prefetched['copy-start'] / 2**30:.3f} | "
              f"{prefetched['slice-start'] / 2**30:.3f} | {model / 2**30:.3f} |", flush=True)


def attention() -> None:
    """One query per row over a [layers, 8, 8 kv heads, 4096, 64] bf16 cache, 32 query heads (groups
    of 4), as lower/attention.py computes it with the step's new key selected in, and its dots alone."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    placed = SingleDeviceSharding(_v5e())
    batch, heads, context, dim, groups = 8, 8, 4096, 64, 4

    def array(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=placed)

    def selected(cache, new, layer, positions):
        current = jnp.arange(context)[None, None, :, None] == positions[:, None, None, None]
        return jnp.where(current, new, cache[layer])

    def attend(layers):
        def run(keys, values, query, new, positions):
            outputs = []
            for layer in range(layers):
                k, v = selected(keys, new[layer], layer, positions), selected(values, new[layer], layer, positions)
                grouped = query[layer].reshape(batch, heads, groups, dim)
                mask = jnp.where(jnp.arange(context)[None, :] <= positions[:, None], 0.0, -1e30)[:, None, None, :]
                scores = jnp.einsum("bhgd,bhkd->bhgk", grouped, k, preferred_element_type=jnp.float32) * dim ** -0.5 + mask
                weights = jax.nn.softmax(scores, axis=-1).astype(jnp.bfloat16)
                outputs.append(jnp.einsum("bhgk,bhkd->bhgd", weights, v, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
            return jnp.stack(outputs)
        return run

    def scores(query_rows, select):
        def run(keys, values, query, new, positions):
            k = selected(keys, new[0], 0, positions) if select else keys[0]
            return jnp.einsum("bhgd,bhkd->bhgk", query[0].reshape(batch, heads, groups, dim)[:, :, :query_rows], k,
                              preferred_element_type=jnp.float32)
        return run

    print("| program | XLA bytes / bytes of the K (and V) it reads |\n|---|---|")
    for layers, name, function, read in [(1, "attention, 1 layer", attend(1), 2), (16, "attention, 16 layers", attend(16), 2),
                                         (1, "scores, 4 query rows per kv head, cache read as it is", scores(4, False), 1),
                                         (1, "scores, 1 query row per kv head, cache read as it is", scores(1, False), 1),
                                         (1, "scores, 4 query rows, the new key selected in", scores(4, True), 1)]:
        cache = array((layers, batch, heads, context, dim))
        args = (cache, cache, array((layers, batch, heads * groups, 1, dim)), array((layers, batch, heads, 1, dim)), array((batch,), jnp.int32))
        _, cost = _compiled(function, args)
        print(f"| {name} | {cost['bytes accessed'] / (read * layers * batch * heads * context * dim * 2):.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["step", "writes", "prefetch", "attention"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--target", default="v5e", choices=["v5e", "v5e-8"])
    parser.add_argument("--entry", default="decode", choices=["decode", "prefill"])
    parser.add_argument("--context", type=int, default=4096)
    options = parser.parse_args()
    {"step": lambda: step(options), "writes": writes, "prefetch": prefetch, "attention": attention}[options.what]()


if __name__ == "__main__":
    main()
