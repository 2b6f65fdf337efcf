"""TPU kernels: where Pallas flash attention pays, and which chips compile it.

    python benchmarks/studies/kernels.py            # both tables (about a minute)
    python benchmarks/studies/kernels.py sizes      # XLA's attention vs the kernel on v5e per sequence length
    python benchmarks/studies/kernels.py targets    # the kernel compiled for every chip tpuexport targets
    python benchmarks/studies/kernels.py prefill [--layers N]   # text generation's prefill with and without kernels (minutes)

sizes: attention alone at 8 x seq, 32 query / 8 key-value heads of 64, bfloat16, causal, compiled
for v5e: tpuexport's portable lowering (lower/attention.py, as the kernel-free program computes it)
and the kernel (flash_call: flash_attention with the largest block dividing the sequence, k/v
repeated), XLA's bytes accessed and temporaries of each, and whether plan_kernel uses the kernel.
The rule plan_kernel applies (KERNEL_MIN_KEYS) comes from this table.

targets: the kernel path at 2 x 1024, 4 heads of 64, causal with a padding mask (segment ids),
compiled for each single chip of tpuexport's TARGETS: its temporaries, or XLA's error.

prefill: a Llama-3.2-1B-shaped causal LM (bf16, meta weights, `--layers` decoder layers) planned
with --task text-generation for v5e, cache 8 x 4096, prefill buckets batch 1 and 8 x seq 2048, with
--kernels auto and none: each executable's XLA bytes accessed and temporaries, and its kernels.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402


def _compiled(function, specs, topology: str):
    import jax
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    device = SingleDeviceSharding(topologies.get_topology_desc(topology_name=topology, platform="tpu",
                                                               chips_per_host_bounds=(1, 1, 1)).devices[0])
    placed = [jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=device) for spec in specs]
    return jax.jit(function).trace(*placed).lower().compile()


def _figures(compiled) -> tuple[float, float]:
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("bytes accessed", 0.0)), float(compiled.memory_analysis().temp_size_in_bytes)


def sizes() -> list[str]:
    import jax
    import jax.numpy as jnp

    from tpuexport.lower.attention import FLASH_BLOCKS, flash_call, plan_kernel, scaled_dot_product_attention

    batch, heads, kv_heads, dim = 8, 32, 8, 64
    lines = [f"attention alone on v5e, {batch} x seq, {heads} / {kv_heads} heads of {dim}, bf16, causal:",
             "| seq | portable GB accessed | kernel GB accessed | portable MiB temporaries | kernel MiB temporaries "
             "| kernel / portable bytes | --kernels auto uses it |",
             "|---|---|---|---|---|---|---|"]
    for seq in (128, 256, 512, 1024, 2048):
        specs = [jax.ShapeDtypeStruct((batch, count, seq, dim), jnp.bfloat16) for count in (heads, kv_heads, kv_heads)]
        block = next(size for size in FLASH_BLOCKS if seq % size == 0)
        blocks = {"block_q": block, "block_k_major": block, "block_k": block, "block_b": 1}
        portable = _figures(_compiled(lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True), specs, "v5e:1x1"))
        kernel = _figures(_compiled(lambda q, k, v: flash_call(q, k, v, None, None, True, dim ** -0.5, blocks), specs, "v5e:1x1"))
        use = plan_kernel(specs[0].shape, specs[1].shape, specs[2].shape, jnp.bfloat16, True, dim ** -0.5, False, False)
        lines.append(f"| {seq} | {portable[0] / 1e9:.3f} | {kernel[0] / 1e9:.3f} | {portable[1] / 2**20:.1f} | {kernel[1] / 2**20:.1f} | "
                     f"{kernel[0] / portable[0]:.2f}x | {'yes' if use.kernel else 'no'} |")
    return lines


def targets() -> list[str]:
    import jax
    import jax.numpy as jnp

    from tpuexport.compile.targets import TARGETS
    from tpuexport.lower.attention import attention_kernel, recording_kernel_uses

    batch, heads, seq, dim = 2, 4, 1024, 64
    specs = [jax.ShapeDtypeStruct((batch, heads, seq, dim), jnp.bfloat16)] * 3 + [jax.ShapeDtypeStruct((batch, 1, 1, seq), jnp.bool_)]
    lines = [f"flash attention (kernel path) at {batch} x {seq}, {heads} heads of {dim}, bf16, causal + padding, per target:",
             "| target | topology | compiles | temporaries MiB | kernel |", "|---|---|---|---|---|"]
    for target in TARGETS.values():
        with recording_kernel_uses() as uses:
            try:
                compiled = _compiled(lambda q, k, v, keys: attention_kernel(q, k, v, keys, None, causal=True), specs, target.topology)
                outcome, temporaries = "yes", f"{_figures(compiled)[1] / 2**20:.1f}"
            except Exception as error:  # XLA's and Mosaic's errors, reported as they are
                outcome, temporaries = f"no: {' '.join(str(error).split())[:120]}", "-"
        kernel = uses[0].kernel if uses else "-"
        lines.append(f"| {target.name} | {target.topology} | {outcome} | {temporaries} | {kernel} |")
    return lines


def prefill(layers: int) -> list[str]:
    import tempfile

    import torch
    import transformers

    import tpuexport

    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                                      num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
                                      tie_word_embeddings=True, torch_dtype=torch.bfloat16)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    lines = [f"Llama-3.2-1B dims, {layers} layer(s), bf16, v5e; cache 8 x 4096; prefill batch 1 and 8 x seq 2048 (plan, meta weights)", "",
             "| --kernels | entry point | bucket | XLA bytes accessed GB | temporaries MiB | program | attention |", "|---|---|---|---|---|---|---|"]
    for mode in ("none", "auto"):
        with tempfile.TemporaryDirectory() as scratch:
            artifact = tpuexport.convert(model, task="text-generation", max_context=4096, max_batch=8, buckets={"seq": [2048]},
                                         target="v5e", out=pathlib.Path(scratch) / "plan.tpu", weights=False, kernels=mode)
            for bucket in artifact.manifest["targets"]["v5e"]["buckets"]:
                kernels = bucket.get("kernels") or {}
                used = sorted({use.get("kernel") or "xla" for use in kernels.get("attention", [])}) or ["-"]
                lines.append(f"| {mode} | {bucket['entry_point']} | {bucket['name']} | {bucket['cost']['bytes_accessed'] / 1e9:.2f} | "
                             f"{bucket['memory']['temp_bytes'] / 2**20:.0f} | {kernels.get('program', 'portable')} | {', '.join(used)} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tables", nargs="*", metavar="sizes|targets|prefill", help="which tables (default sizes and targets)")
    parser.add_argument("--layers", type=int, default=2, help="prefill: decoder layers")
    options = parser.parse_args()
    tables = {"sizes": sizes, "targets": targets, "prefill": lambda: prefill(options.layers)}
    if set(options.tables) - set(tables):
        parser.error(f"unknown table(s) {sorted(set(options.tables) - set(tables))}; choose from sizes, targets, prefill")
    warnings.filterwarnings("ignore")
    for table in options.tables or ["sizes", "targets"]:
        print("\n".join(tables[table]()) + "\n", flush=True)


if __name__ == "__main__":
    main()
