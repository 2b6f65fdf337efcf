"""Text generation at Llama-3.2-1B's shape: the KV cache layouts compared by XLA's analysis of the
v5e decode step, and the per-target figures of a text-generation plan.

The model is transformers' LlamaForCausalLM with Llama-3.2-1B's shapes (hidden 2048, 16 layers, 32
heads, 8 kv heads, vocab 128256, tied embeddings), bfloat16, built on the meta device: nothing is
downloaded and no weight exists, so the artifact is a plan (`weights=False`): every entry point
and bucket lowered and compiled by libtpu, nothing verified (tests/test_generation.py verifies
generation on tiny models).

    python benchmarks/generation.py layouts        # the decode step alone per cache layout, v5e, 8 x 4096
    python benchmarks/generation.py targets        # v5e and v5e-8 (tensor-parallel), 8 x 4096

Figures per target (per chip): weights, KV cache at max batch x max context, temporaries (XLA's
memory analysis of the decode step), the largest batch estimated to fit, compile seconds per entry
point and bucket, and the decode step's XLA bytes accessed divided by what it must read (its
arguments: weights + the whole cache); 1.0 is the memory-bound limit.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import torch

LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, tie_word_embeddings=True, rope_theta=500000.0)
MAX_CONTEXT, MAX_BATCH = 4096, 8


def meta_llama():
    """Llama-3.2-1B-shaped LlamaForCausalLM, bfloat16, on the meta device."""
    import transformers

    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_3_2_1B)).eval()
    finally:
        torch.set_default_dtype(torch.float32)


def plan(targets: list[str], layout: str, buckets: dict, sharding: str | None = None) -> dict:
    """Plans the model for text generation and returns the manifest's figures."""
    import tpuexport

    stages = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        artifact = tpuexport.convert(meta_llama(), task="text-generation", max_context=MAX_CONTEXT, max_batch=MAX_BATCH, target=targets,
                                     sharding=sharding, buckets=buckets, precision="bf16", cache_layout=layout, weights=False,
                                     saved_model=False, out=pathlib.Path(scratch) / "llm.tpu",
                                     progress=lambda stage, seconds, detail: stages.__setitem__(stage, round(seconds, 1)))
        manifest = artifact.manifest
    return {"layout": layout, "seconds": round(time.perf_counter() - start, 1), "stages": stages,
            "weight_bytes": manifest["program"]["weight_bytes"], "cache_bytes": manifest["generation"]["cache_bytes"],
            "compile_seconds": manifest["build"]["compile_seconds"], "targets": manifest["targets"]}


def decode_step(layout: str) -> dict:
    """The decode entry point alone for one cache layout, lowered from shapes and compiled for v5e:
    XLA's memory and cost analysis of one step (no prefill, no artifact)."""
    from tpuexport import compile as compile_stage
    from tpuexport import export as export_stage
    from tpuexport import lower as lower_stage

    start = time.perf_counter()
    model = meta_llama()
    spec = export_stage.generation_spec(model, MAX_BATCH, MAX_CONTEXT, layout, prefill_buckets=(128,))
    args, _ = export_stage.example_arguments(spec)["decode"]
    source = export_stage.LoadedSource(export_stage.entry_point_modules(model, spec)["decode"], args, None, None,
                                       export_stage.SourceInfo("api"))
    captured = export_stage.capture(export_stage.on_meta_device(source))
    lowered = lower_stage.lower(captured.program, captured.signature, "bf16", weights=False)
    (result,) = compile_stage.compile_program(lowered, compile_stage.resolve_targets(["v5e"]),
                                              compile_stage.make_buckets(lowered.signature, None)).results
    return {"layout": layout, "cache_shape": list(spec.cache_shape), "weight_bytes": lowered.weight_bytes, "cache_bytes": spec.cache_bytes,
            "memory": result.memory, "cost": result.cost, "compile_seconds": round(result.compile_seconds, 1),
            "seconds": round(time.perf_counter() - start, 1)}


def describe_layout(result: dict) -> str:
    memory, cost = result["memory"], result["cost"]
    must_read = memory["argument_bytes"]
    return (f"| {result['layout']} | {result['cache_shape']} | {cost['bytes_accessed'] / 2**30:.3f} | "
            f"{cost['bytes_accessed'] / must_read:.3f} | {cost['optimal_seconds'] * 1e3:.3f} | {memory['temp_bytes'] / 2**20:.1f} | "
            f"{memory['alias_bytes'] / 2**30:.3f} | {result['compile_seconds']} |")


def describe(result: dict) -> list[str]:
    """One line per target and executable."""
    lines = [f"layout {result['layout']}: weights {result['weight_bytes'] / 2**30:.2f} GiB, KV cache {MAX_BATCH} x {MAX_CONTEXT} "
             f"{result['cache_bytes'] / 2**30:.2f} GiB (whole), {result['seconds']} s"]
    for target, entry in result["targets"].items():
        for bucket in entry["buckets"]:
            memory, cost = bucket["memory"], bucket["cost"]
            line = (f"  {target:6s} {bucket['entry_point']:7s} {bucket['name']:16s} per chip: arguments {memory['argument_bytes'] / 2**30:.2f} GiB, "
                    f"temporaries {memory['temp_bytes'] / 2**30:.2f} GiB, aliased {memory['alias_bytes'] / 2**30:.2f} GiB, "
                    f"total {memory['total_bytes'] / 2**30:.2f} GiB; XLA bytes accessed {cost['bytes_accessed'] / 2**30:.2f} GiB, "
                    f"est. {cost['optimal_seconds'] * 1e3:.2f} ms; compile "
                    f"{result['compile_seconds'][target + '/' + bucket['entry_point'] + '/' + bucket['name']]} s")
            step = bucket.get("decode_step")
            if step:
                line += (f"; decode: cache per chip {step['cache_bytes'] / 2**30:.2f} GiB, bytes accessed / (weights + cache) "
                         f"{step['bytes_accessed_over_must_read']}, largest batch (estimate) {step['largest_batch_estimate']}")
            lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["layouts", "targets"])
    parser.add_argument("--json", type=pathlib.Path, help="Also write the figures as JSON here.")
    arguments = parser.parse_args()
    if arguments.what == "layouts":
        print(f"decode step, v5e, batch {MAX_BATCH} x context {MAX_CONTEXT}, bf16\n")
        print("| layout | cache shape (each of K, V) | XLA GiB accessed | / (weights + cache) | est. ms | temporaries MiB | aliased GiB | "
              "compile s |")
        print("|---|---|---|---|---|---|---|---|", flush=True)
        results = []
        for layout in ("layer_batch_head_pos", "layer_batch_pos_head"):
            results.append(decode_step(layout))
            print(describe_layout(results[-1]), flush=True)
    else:
        results = [plan(["v5e", "v5e-8"], "layer_batch_head_pos", {"seq": [2048], "batch": [1]}, "tensor-parallel")]
        for result in results:
            print("\n".join(describe(result)), flush=True)
    if arguments.json:
        arguments.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
