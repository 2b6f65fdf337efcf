"""Text generation at Llama-3.2-1B's (or Llama-3-8B's) shape: the KV cache layouts compared by
XLA's analysis of the v5e decode step, and the per-target figures of a text-generation artifact.

The model is transformers' LlamaForCausalLM with Llama-3.2-1B's shapes (hidden 2048, 16 layers, 32
heads, 8 kv heads, vocab 128256, tied embeddings) or Llama-3-8B's (hidden 4096, 32 layers, 32 / 8
heads, MLP 14336, untied), bfloat16. Nothing is downloaded. `layouts` and `targets` build it on the
meta device, so the artifact is a plan (`weights=False`): every entry point and bucket lowered and
compiled by libtpu, nothing verified. `convert` writes random weights as a bf16 safetensors
checkpoint (benchmarks/studies/streamed_conversion.py's writer) and runs the whole conversion from it
(weights streamed, greedy generation verified against `generate()` on CPU, every entry point
compiled), or plans it with --meta.

    python benchmarks/studies/generation.py layouts [--shape S] [--layers N]   # the decode step alone per cache layout, v5e, 8 x 4096
    python benchmarks/studies/generation.py targets        # v5e and v5e-8 (tensor-parallel), 8 x 4096, a plan
    python benchmarks/studies/generation.py convert [--shape llama-3.2-1b] [--layers N] [--target v5e,v5e-8] [--sharding tensor-parallel]
                                            [--max-context 4096] [--max-batch 8] [--prefill-seq 128] [--quantize MODE] [--meta]
                                            [--kv-cache-dtype int8]

Figures per target (per chip): weights, KV cache at max batch x max context, temporaries (XLA's
memory analysis of the decode step), the largest batch estimated to fit, compile seconds per entry
point and bucket, and the decode step's XLA bytes accessed divided by what it must read (its
arguments: weights + the whole cache); 1.0 is the memory-bound limit.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402

LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, tie_word_embeddings=True, rope_theta=500000.0)
LLAMA_3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, max_position_embeddings=8192, tie_word_embeddings=False, rope_theta=500000.0)
SHAPES = {"llama-3.2-1b": LLAMA_3_2_1B, "llama-3-8b": LLAMA_3_8B}
MAX_CONTEXT, MAX_BATCH = 4096, 8


def meta_llama(config: dict = LLAMA_3_2_1B, device: str = "meta"):
    """LlamaForCausalLM of this config, bfloat16, on the meta device (no weights) or with random
    weights on the CPU."""
    import transformers

    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    finally:
        torch.set_default_dtype(torch.float32)


def model_config(shape: str, layers: int | None) -> dict:
    """The config of a shape in SHAPES, with `layers` decoder layers when given (a few layers compile in
    seconds and show how the decode step's bytes grow per layer)."""
    return {**SHAPES[shape], **({"num_hidden_layers": layers} if layers else {})}


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


def compiled_entry_point(model, entry_point: str, target: str = "v5e", **options):
    """One entry point of the program `tpuexport.plan(model, task="text-generation", precision="bf16",
    kernels="none", **options)` builds, through the pipeline's passes up to compile (no artifact).

    Returns:
      (the GenerationSpec, the entry point's LoweredProgram, its first CompiledBucket for `target`).
    """
    from tpuexport import export as export_stage
    from tpuexport import pipeline

    conversion_options = pipeline.ConversionOptions((target,), pathlib.Path(tempfile.mkdtemp()) / "plan.tpu", precision="bf16",
                                                    kernels="none", task="text-generation", weights=False, **options)
    source = export_stage.LoadedSource(model, None, None, None, export_stage.SourceInfo("api"))
    with pipeline.passes(source, conversion_options, "compile") as conversion:
        result = conversion.compiled()[entry_point].results[0]
        return conversion.program.spec, conversion.program.entry_points[entry_point], result


def decode_step(layout: str, config: dict = LLAMA_3_2_1B) -> dict:
    """The decode entry point for one cache layout, lowered from shapes and compiled for v5e:
    XLA's memory and cost analysis of one step (no artifact)."""
    start = time.perf_counter()
    spec, lowered, result = compiled_entry_point(meta_llama(config), "decode", max_batch=MAX_BATCH, max_context=MAX_CONTEXT,
                                                 cache_layout=layout, buckets={"seq": [128]})
    return {"layout": layout, "cache_shape": list(spec.cache_shape), "weight_bytes": lowered.weight_bytes, "cache_bytes": spec.cache_bytes,
            "memory": result.memory, "cost": result.cost, "compile_seconds": round(result.compile_seconds, 1),
            "seconds": round(time.perf_counter() - start, 1)}


def _memory_status() -> str:
    """The process's resident set now and at its peak (Linux /proc), for the progress lines."""
    fields = dict(line.split(":", 1) for line in pathlib.Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return f"RSS {int(fields['VmRSS'].split()[0]) / 2**20:.1f} GiB, peak {int(fields['VmHWM'].split()[0]) / 2**20:.1f} GiB"


def convert(options: argparse.Namespace) -> dict:
    """Converts (or with --meta, plans) the model for text generation and returns the manifest's
    figures and the run's peak RSS. Each stage is printed to stderr as it ends, with the process's
    memory (a long conversion that runs out of memory says where)."""
    import resource
    import sys

    import tpuexport

    config = model_config(options.shape, options.layers)
    if options.meta:
        model = meta_llama(config)
    else:
        with tpuexport.parameters_on_meta():  # buffers (rotary frequencies) real, parameters from the checkpoint
            model = meta_llama(config, "cpu")
    stages = {}
    start = time.perf_counter()

    def progress(stage: str, seconds: float, detail) -> None:
        stages[stage] = round(seconds, 1)
        print(f"[{time.perf_counter() - start:7.1f} s] {stage}: {seconds:.1f} s; {_memory_status()}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = None
        if not options.meta:
            # Random weights written as a bf16 Hugging Face checkpoint and streamed from it: the artifact's
            # weights and verification's eager model are then memory maps of files. Built in memory
            # instead, the 16-layer model's verification held 16.8 GiB and the kernel killed it (OOM, 24 GiB
            # machine shared with other work).
            from streamed_conversion import write_checkpoint

            checkpoint = pathlib.Path(scratch) / "checkpoint"
            checkpoint.mkdir()
            write_checkpoint(config, "bfloat16", checkpoint)
            progress("write random checkpoint", time.perf_counter() - start, None)
        artifact = tpuexport.convert(model, task="text-generation", max_context=options.max_context, max_batch=options.max_batch,
                                     target=options.target.split(","), sharding=options.sharding, precision="bf16",
                                     buckets={"seq": [int(size) for size in options.prefill_seq.split(",")]}, quantize=options.quantize,
                                     kv_cache_dtype=options.kv_cache_dtype, weights=not options.meta, checkpoint=checkpoint, saved_model=False,
                                     out=pathlib.Path(scratch) / "llm.tpu", progress=progress)
        manifest = artifact.manifest
    verification = manifest.get("verification") or {}
    return {"shape": options.shape, "layers": model.config.num_hidden_layers, "seconds": round(time.perf_counter() - start, 1), "stages": stages,
            "weight_bytes": manifest["program"]["weight_bytes"], "cache_bytes": manifest["generation"]["cache_bytes"],
            "compile_seconds": manifest["build"]["compile_seconds"], "targets": manifest["targets"],
            "verification": {key: verification.get(key) for key in ("passed", "against", "cases")} if verification else None,
            "peak_rss_bytes": {"converting process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                               "largest child": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}}


def figures_table(result: dict) -> list[str]:
    """The per-chip figures as a table: one row per target, entry point and bucket."""
    gib = lambda value: f"{value / 2**30:.2f}"  # noqa: E731
    lines = ["| target | entry point | bucket | weights GiB | KV cache GiB | temporaries GiB | total GiB (of HBM) | compile s | "
             "XLA bytes accessed GiB | ÷ (weights + cache) | largest batch (linear estimate) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for target, entry in result["targets"].items():
        for bucket in entry["buckets"]:
            memory, cost = bucket["memory"], bucket["cost"]
            step = bucket.get("decode_step")
            accessed = cost.get("bytes_accessed")
            weights = gib(step["weight_bytes"]) if step else "(as decode)"
            cache = gib(step["cache_bytes"]) if step else "(aliased " + gib(memory["alias_bytes"]) + ")"
            lines.append(
                f"| {target} | {bucket['entry_point']} | {bucket['name']} | {weights} | {cache} | {gib(memory['temp_bytes'])} | "
                f"{gib(memory['total_bytes'])} ({bucket['hbm_utilization']:.0%}) | "
                f"{result['compile_seconds'][target + '/' + bucket['entry_point'] + '/' + bucket['name']]:.0f} | "
                f"{'unknown' if accessed is None else gib(accessed)} | {step['bytes_accessed_over_must_read'] if step else '-'} | "
                f"{step['largest_batch_estimate'] if step else '-'} |")
    return lines


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
    parser.add_argument("what", choices=["layouts", "targets", "convert"])
    parser.add_argument("--json", type=pathlib.Path, help="Also write the figures as JSON here.")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="llama-3.2-1b", help="convert: the model's shape")
    parser.add_argument("--layers", type=int, help="layouts, convert: decoder layers (default: the shape's)")
    parser.add_argument("--target", default="v5e,v5e-8", help="convert: comma-separated targets")
    parser.add_argument("--sharding", default="tensor-parallel", help="convert: the slices' sharding preset")
    parser.add_argument("--max-context", type=int, default=MAX_CONTEXT)
    parser.add_argument("--max-batch", type=int, default=MAX_BATCH)
    parser.add_argument("--prefill-seq", default="128", help="convert: prefill's prompt-length buckets, comma-separated")
    parser.add_argument("--quantize", help="convert: a weight-only mode (int8-weight-only, int4-weight-only)")
    parser.add_argument("--kv-cache-dtype", default="model", help="convert: the KV cache's dtype (model or int8)")
    parser.add_argument("--meta", action="store_true", help="convert: plan on the meta device (no weights, not verified)")
    arguments = parser.parse_args()
    if arguments.what == "layouts":
        layers = model_config(arguments.shape, arguments.layers)["num_hidden_layers"]
        print(f"decode step, v5e, {arguments.shape} ({layers} layers), batch {MAX_BATCH} x context {MAX_CONTEXT}, bf16\n")
        print("| layout | cache shape (each of K, V) | XLA GiB accessed | / (weights + cache) | est. ms | temporaries MiB | aliased GiB | "
              "compile s |")
        print("|---|---|---|---|---|---|---|---|", flush=True)
        results = []
        for layout in ("layer_batch_head_pos", "layer_batch_pos_head"):
            results.append(decode_step(layout, model_config(arguments.shape, arguments.layers)))
            print(describe_layout(results[-1]), flush=True)
    elif arguments.what == "targets":
        results = [plan(["v5e", "v5e-8"], "layer_batch_head_pos", {"seq": [2048], "batch": [1]}, "tensor-parallel")]
        for result in results:
            print("\n".join(describe(result)), flush=True)
    else:
        if "-" not in arguments.target:
            arguments.sharding = None  # sharding presets apply to slices only
        results = [convert(arguments)]
        result = results[0]
        print(f"{result['shape']} ({result['layers']} layers) {'plan (meta weights)' if arguments.meta else 'random weights'}, bf16"
              f"{', ' + arguments.quantize if arguments.quantize else ''}; --task text-generation --target "
              f"{' --target '.join(arguments.target.split(','))}{' --sharding ' + arguments.sharding if arguments.sharding else ''} "
              f"--max-context {arguments.max_context} --max-batch {arguments.max_batch} --bucket seq={arguments.prefill_seq}")
        print(f"weights {result['weight_bytes'] / 2**30:.2f} GiB, KV cache {arguments.max_batch} x {arguments.max_context} "
              f"{result['cache_bytes'] / 2**30:.2f} GiB (whole); wall {result['seconds']} s; stages (s): {result['stages']}")
        if result["verification"] and result["verification"]["passed"] is not None:
            cases = result["verification"]["cases"] or []
            print(f"verified: passed {result['verification']['passed']}, {len(cases)} prefill bucket(s), against "
                  f"{result['verification']['against']}")
        print("peak RSS: " + ", ".join(f"{name} {value / 2**30:.2f} GiB" for name, value in result["peak_rss_bytes"].items()) + "\n")
        print("\n".join(figures_table(result)), flush=True)
    if arguments.json:
        arguments.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
