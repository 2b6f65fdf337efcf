"""The KV cache bounded by the sliding window vs the max-context cache, at Mistral-7B-v0.1's or
Gemma-3-4B's shape.

Mistral-7B-v0.1 (hidden 4096, 32 layers, 32 heads, 8 kv heads, head_dim 128, MLP 14336, vocab 32000,
untied; every layer attends within a 4096-position sliding window) or Gemma 3 4B's text decoder
(hidden 2560, 34 layers, 8 heads, 4 kv heads, head_dim 256, MLP 10240, vocab 262208, tied; five
layers in six attend within a 1024-position window, the sixth to every position) planned for text
generation at max context 32768, bf16, on the meta device (`weights=False`: every entry point
lowered and compiled by libtpu, nothing verified), once with `--sliding-window-cache bounded` (the
default: a ring of W positions per slot for the sliding layers) and once with `full` (32768
positions per slot for every layer).

A 32-layer decode step at 32k context takes minutes per executable to compile on this machine,
so the plans are made at a few layers (`--layers`, default 2 and 4 for Mistral, 6 and 12 for Gemma
3: whole patterns of five sliding layers and a full one) and the per-chip figures are extrapolated
linearly to the model's layers from the two (weights, cache and temporaries all grow by a fixed
amount per layer, or per pattern; the cache exactly). The largest batch at 32 layers is the
manifest's estimate redone with the extrapolated figures: (HBM - weights) // ((cache +
temporaries) / max batch).

    python benchmarks/studies/window_cache.py [--shape mistral-7b|gemma-3-4b] [--layers 2,4] [--target v5e,v5e-8] [--max-context 32768]
                                      [--max-batch 8] [--json F]
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

MISTRAL_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, max_position_embeddings=32768, sliding_window=4096, rope_theta=10000.0,
                  tie_word_embeddings=False)
GEMMA_3_4B = dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=256, max_position_embeddings=131072, sliding_window=1024, sliding_window_pattern=6,
                  query_pre_attn_scalar=256, tie_word_embeddings=True)
# {shape: (model class, config class, config, default layer counts)}
SHAPES = {"mistral-7b": ("MistralForCausalLM", "MistralConfig", MISTRAL_7B, "2,4"),
          "gemma-3-4b": ("Gemma3ForCausalLM", "Gemma3TextConfig", GEMMA_3_4B, "6,12")}
GIB = 2**30


def meta_model(shape: str, layers: int):
    """The shape's causal LM with `layers` decoder layers, bf16, on the meta device."""
    import transformers

    model_class, config_class, config, _ = SHAPES[shape]
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            config = getattr(transformers, config_class)(**{**config, "num_hidden_layers": layers})
            return getattr(transformers, model_class)(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)


def plan(layers: int, mode: str, options: argparse.Namespace) -> dict:
    """Plans the model with `layers` layers and --sliding-window-cache `mode`: per target, the decode
    step's per-chip figures and each executable's compile seconds (or the one line a target refused)."""
    import tpuexport

    targets = options.target.split(",")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        try:
            artifact = tpuexport.convert(meta_model(options.shape, layers), task="text-generation", max_context=options.max_context,
                                         max_batch=options.max_batch, target=targets,
                                         sharding="tensor-parallel" if any("-" in target for target in targets) else None,
                                         buckets={"seq": [options.prefill_seq], "batch": [1]}, precision="bf16", weights=False,
                                         sliding_window_cache=mode, saved_model=False, out=pathlib.Path(scratch) / "llm.tpu")
        except tpuexport.TpuExportError as error:
            return {"layers": layers, "mode": mode, "error": str(error), "seconds": round(time.perf_counter() - start, 1)}
        manifest = artifact.manifest
    figures = {}
    for target, entry in manifest["targets"].items():
        decode = next(bucket for bucket in entry["buckets"] if bucket["entry_point"] == "decode")
        step = decode["decode_step"]
        figures[target] = {
            "hbm_bytes": decode["memory"].get("hbm_bytes") or None,
            "weight_bytes": step["weight_bytes"], "cache_bytes": step["cache_bytes"], "temp_bytes": step["temp_bytes"],
            "total_bytes": decode["memory"]["total_bytes"], "largest_batch_estimate": step["largest_batch_estimate"],
            "bytes_accessed_over_must_read": step["bytes_accessed_over_must_read"],
            "compile_seconds": {bucket["entry_point"] + "/" + bucket["name"]:
                                round(manifest["build"]["compile_seconds"][f"{target}/{bucket['entry_point']}/{bucket['name']}"], 1)
                                for bucket in entry["buckets"]},
        }
    generation = manifest["generation"]
    shapes = [generation["cache_shape"]] + ([generation["window_cache_shape"]] if "window_cache_shape" in generation else [])
    return {"layers": layers, "mode": mode, "cache_shape": " + ".join(map(str, shapes)),
            "cache_window": generation.get("cache_window"),
            "cache_bytes": generation["cache_bytes"], "targets": figures, "seconds": round(time.perf_counter() - start, 1)}


def extrapolated(small: dict, large: dict, layers: int, hbm: int, max_batch: int) -> dict:
    """One target's per-chip figures at `layers` layers, linear in the layer count through two plans."""
    scale = lambda key: small[key] + (large[key] - small[key]) * (layers - small["layers"]) / (large["layers"] - small["layers"])  # noqa: E731
    weights, cache, temps = scale("weight_bytes"), scale("cache_bytes"), scale("temp_bytes")
    per_slot = (cache + temps) / max_batch
    return {"weight_bytes": weights, "cache_bytes": cache, "temp_bytes": temps,
            "largest_batch": max(0, int((hbm - weights) // per_slot)), "fits_max_batch": weights + cache + temps <= hbm}


def main() -> None:
    import tpuexport.compile as compile_stage

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=tuple(SHAPES), default="mistral-7b")
    parser.add_argument("--layers", help="two layer counts to plan at (extrapolated to the shape's; default per shape)")
    parser.add_argument("--target", default="v5e,v5e-8")
    parser.add_argument("--max-context", type=int, default=32768)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--prefill-seq", type=int, default=128)
    parser.add_argument("--json", type=pathlib.Path)
    options = parser.parse_args()
    config = SHAPES[options.shape][2]
    counts = [int(count) for count in (options.layers or SHAPES[options.shape][3]).split(",")]
    print(f"{options.shape} shape (window {config['sliding_window']}), plan on meta weights, bf16, --max-context "
          f"{options.max_context} --max-batch {options.max_batch} --bucket seq={options.prefill_seq} --bucket batch=1, "
          f"--target {options.target} (slices tensor-parallel)\n", flush=True)
    results = []
    print("| layers | --sliding-window-cache | cache shape (K, V each; + the sliding layers' rings) | target | weights GiB/chip | cache GiB/chip | decode temps GiB | "
          "largest batch (manifest) | decode bytes accessed / (weights + cache) | compile s (decode, prefill) |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for layers in counts:
        for mode in ("bounded", "full"):
            result = plan(layers, mode, options)
            results.append(result)
            if "error" in result:
                print(f"| {layers} | {mode} | - | - | refused: {result['error']} |", flush=True)
                continue
            for target, figures in result["targets"].items():
                seconds = figures["compile_seconds"]
                print(f"| {layers} | {mode} | {result['cache_shape']} | {target} | {figures['weight_bytes'] / GIB:.3f} | "
                      f"{figures['cache_bytes'] / GIB:.3f} | {figures['temp_bytes'] / GIB:.3f} | {figures['largest_batch_estimate']} | "
                      f"{figures['bytes_accessed_over_must_read']} | {seconds.get('decode/static')}, "
                      f"{seconds.get(f'prefill/batch1_seq{options.prefill_seq}')} |", flush=True)
    layers = config["num_hidden_layers"]
    print(f"\nextrapolated to {layers} layers (linear through layers {counts[0]} and {counts[1]}); largest batch = (HBM - weights) // "
          f"((cache + temporaries) / {options.max_batch})\n")
    print("| --sliding-window-cache | target | weights GiB/chip | cache GiB/chip at batch "
          f"{options.max_batch} | cache GiB per slot | decode temps GiB | fits batch {options.max_batch} | largest batch |")
    print("|---|---|---|---|---|---|---|---|")
    extrapolations = []
    for mode in ("bounded", "full"):
        small, large = (next(result for result in results if result["layers"] == count and result["mode"] == mode) for count in counts[:2])
        if "error" in small or "error" in large:
            continue
        for target in small["targets"]:
            hbm = compile_stage.resolve_targets([target])[0].hbm_bytes_per_device
            figures = extrapolated({**small["targets"][target], "layers": small["layers"]},
                                   {**large["targets"][target], "layers": large["layers"]}, layers, hbm, options.max_batch)
            extrapolations.append({"mode": mode, "target": target, "layers": layers, **figures})
            print(f"| {mode} | {target} | {figures['weight_bytes'] / GIB:.2f} | {figures['cache_bytes'] / GIB:.2f} | "
                  f"{figures['cache_bytes'] / options.max_batch / GIB:.3f} | {figures['temp_bytes'] / GIB:.2f} | "
                  f"{'yes' if figures['fits_max_batch'] else 'no'} | {figures['largest_batch']} |", flush=True)
    if options.json:
        options.json.write_text(json.dumps({"plans": results, "extrapolated": extrapolations}, indent=2) + "\n")


if __name__ == "__main__":
    main()
