"""The int8 KV cache (--kv-cache-dtype int8) measured: the v5e decode step of a Llama-3.2-1B-shaped
model with a bf16 cache vs an int8 cache (XLA's analysis, compile-only), the scales' dtype, and on a
tiny Llama how far int8 KV moves greedy generation from the float model's generate().

    python benchmarks/studies/kv_int8.py step [--layers N] [--kv model,int8]   # v5e decode step, batch 8 x context 4096
    python benchmarks/studies/kv_int8.py scales      # tiny Llama, eager: the scales' dtype (f32 vs bf16), reconstruction and logits SQNR
    python benchmarks/studies/kv_int8.py tiny        # tiny Llama and GPT-2 converted with int8 KV: the report's divergence and SQNR
    python benchmarks/studies/kv_int8.py attention   # decode attention alone in JAX, 4 layers at 8 x 4096, v5e: where an int8 cache's bytes go

`step` lowers the decode entry point as the conversion does (meta weights, bf16, cache layout
layer_batch_head_pos) and prints per chip: weights and cache bytes (the cache with its scales),
temporaries, XLA's bytes accessed over what the step must read (its arguments: weights + cache;
1.0 is the memory-bound limit) and the largest batch estimated to fit, as the manifest's
`decode_step` estimates it (cache and temporaries grown linearly from the compiled batch).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402

GIB = 2**30


def decode_step(kv_cache_dtype: str, layers: int | None) -> dict:
    """The decode entry point of a Llama-3.2-1B-shaped model compiled for v5e at 8 x 4096: XLA's figures."""
    import generation

    start = time.perf_counter()
    model = generation.meta_llama(generation.model_config("llama-3.2-1b", layers))
    spec, lowered, result = generation.compiled_entry_point(model, "decode", max_batch=generation.MAX_BATCH,
                                                            max_context=generation.MAX_CONTEXT, buckets={"seq": [128]},
                                                            kv_cache_dtype=kv_cache_dtype)
    from hlo_prefetch import prefetched_bytes, without_prefetch_bookkeeping

    memory, accessed = result.memory, result.cost["bytes_accessed"]
    prefetched = prefetched_bytes(result.hlo_text)
    per_slot = (spec.cache_bytes + memory["temp_bytes"]) / spec.max_batch
    return {"kv": kv_cache_dtype, "layers": spec.layers, "weights": lowered.weight_bytes, "cache": spec.cache_bytes,
            "arguments": memory["argument_bytes"], "temp": memory["temp_bytes"], "alias": memory.get("alias_bytes"),
            "accessed": accessed, "ratio": accessed / memory["argument_bytes"],
            "prefetched": prefetched, "adjusted": without_prefetch_bookkeeping(accessed, prefetched),
            "largest_batch": int(spec.max_batch + (result.target.hbm_bytes_per_device - memory["total_bytes"]) // per_slot),
            "optimal_ms": 1e3 * result.cost.get("optimal_seconds", float("nan")), "compile_s": result.compile_seconds,
            "s8_in_hlo": "s8[" in result.hlo_text, "seconds": time.perf_counter() - start}


def step(options: argparse.Namespace) -> None:
    print(f"v5e decode step, Llama-3.2-1B shape, bf16, batch 8 x context 4096, {options.layers or 16} layers; per chip (GiB):")
    print("| cache | weights + cache (arguments) | temporaries | aliased | XLA bytes accessed / arguments | prefetched into VMEM (copy-start / "
          "slice-start) | without prefetch bookkeeping / arguments | est. step | largest batch | compile s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for kv in options.kv.split(","):
        row = decode_step(kv, options.layers)
        label = "bf16" if kv == "model" else "int8 + bf16 scales"
        print(f"| {label} | {row['weights'] / GIB:.3f} + {row['cache'] / GIB:.3f} ({row['arguments'] / GIB:.3f}) | "
              f"{row['temp'] / GIB:.3f} | {(row['alias'] or 0) / GIB:.3f} | {row['accessed'] / GIB:.2f} / {row['arguments'] / GIB:.2f} = "
              f"{row['ratio']:.2f} | {row['prefetched']['copy-start'] / GIB:.3f} / {row['prefetched']['slice-start'] / GIB:.3f} | "
              f"{row['adjusted'] / GIB:.2f} / {row['arguments'] / GIB:.2f} = {row['adjusted'] / row['arguments']:.2f} | {row['optimal_ms']:.1f} ms | {row['largest_batch']} | {row['compile_s']:.0f} |", flush=True)


def tiny_llama(dtype=torch.float32):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def tiny_gpt2():
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128)).eval()


def eager_greedy(modules: dict, spec, prompts: list[list[int]], steps: int, scale_dtype: str | None = None) -> tuple[list[list[int]], np.ndarray]:
    """Greedy generation through the eager entry points (one prefill of every prompt, slot = row, then
    decode steps): (tokens per row, logits [rows, steps, vocab]). scale_dtype: the int8 cache's
    scales in this dtype instead of the spec's (the entry points quantize to the scales they get)."""
    cache = [torch.zeros(shape, dtype=getattr(torch, scale_dtype if scale_dtype and name.endswith("_scale") else dtype))
             for name, (shape, dtype) in spec.cache_tensors().items()]
    seq = max(map(len, prompts))
    tokens = torch.zeros((len(prompts), seq), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = torch.tensor(prompt)
    lengths = torch.tensor([len(prompt) for prompt in prompts])
    with torch.no_grad():
        out = modules["prefill"](tokens, lengths, torch.arange(len(prompts)), *cache)
        logits = [out["logits"]]
        for step in range(1, steps):
            cache = [out[name] for name in spec.cache_inputs]
            out = modules["decode"](logits[-1].argmax(-1), lengths + step - 1, *cache)
            logits.append(out["logits"])
    stacked = torch.stack(logits, 1).float().numpy()
    return [list(map(int, row)) for row in stacked.argmax(-1)], stacked


def eager_cache(modules: dict, spec, prompts: list[list[int]]) -> torch.Tensor:
    """The model-dtype cache's keys and values of the prompts' real positions after prefill: [n, head_dim]."""
    cache = [torch.zeros(shape, dtype=getattr(torch, dtype)) for shape, dtype in spec.cache_tensors().values()]
    tokens = torch.tensor(prompts)
    with torch.no_grad():
        out = modules["prefill"](tokens, torch.tensor([len(prompt) for prompt in prompts]), torch.arange(len(prompts)), *cache)
    length = len(prompts[0])
    return torch.cat([out[name][:, :len(prompts), :, :length].reshape(-1, spec.head_dim) for name in ("cache_k", "cache_v")])


def first_divergence(tokens: list[list[int]], reference: list[list[int]]) -> int | None:
    steps = [next((step for step, (a, b) in enumerate(zip(row, other)) if a != b), None) for row, other in zip(tokens, reference)]
    return min((step for step in steps if step is not None), default=None)


def scales(options: argparse.Namespace) -> None:
    """Eager int8-KV greedy generation of a tiny Llama (f32 and bf16), f32 vs bf16 scales: the logits'
    SQNR against the model-dtype cache's (same entry points) before the first greedy divergence."""
    from tpuexport import export as export_stage
    from tpuexport.export.functional_cache import dequantize_kv, quantize_kv
    from tpuexport.verify.compare import sqnr_db

    generator = np.random.default_rng(0)
    prompts = [[int(t) for t in generator.integers(0, 256, 48)] for _ in range(4)]
    for dtype in ("float32", "bfloat16"):
        model = tiny_llama(getattr(torch, dtype))
        results = {}
        for kv, scale in (("model", "float32"), ("int8", "float32"), ("int8", "bfloat16")):
            spec = export_stage.generation_spec(model, 4, 64, prefill_buckets=(48,), kv_cache_dtype=kv)
            results[(kv, scale)] = eager_greedy(export_stage.entry_point_modules(model, spec), spec, prompts, 16, scale)
        float_tokens, float_logits = results[("model", "float32")]
        spec = export_stage.generation_spec(model, 4, 64, prefill_buckets=(48,))
        keys = eager_cache(export_stage.entry_point_modules(model, spec), spec, prompts)
        for scale in ("float32", "bfloat16"):
            q, scales_ = quantize_kv(keys, getattr(torch, scale))
            error = sqnr_db([keys.float().numpy()], [dequantize_kv(q, scales_, keys.dtype).float().numpy()])
            print(f"tiny Llama {dtype}: the prompts' cached keys and values quantized with {scale} scales: reconstruction SQNR "
                  f"{error:.2f} dB", flush=True)
        for scale in ("float32", "bfloat16"):
            tokens, logits = results[("int8", scale)]
            first = first_divergence(tokens, float_tokens)
            upto = 16 if first is None else first + 1
            print(f"tiny Llama {dtype}, 4 prompts of 48 tokens + 16 steps, int8 KV with {scale} scales: logits SQNR "
                  f"{sqnr_db(list(float_logits[:, :upto]), list(logits[:, :upto])):.1f} dB vs the {dtype} cache (steps 0..{upto - 1}), "
                  f"first greedy divergence step {first}", flush=True)


def tiny(options: argparse.Namespace) -> None:
    """A tiny Llama and a tiny GPT-2 converted with --kv-cache-dtype int8 (verified against the eager
    int8-KV entry points): the verification's divergence from the float model's generate() and SQNR."""
    import json

    import tpuexport

    for family, build in (("llama", tiny_llama), ("gpt2", tiny_gpt2)):
        with tempfile.TemporaryDirectory() as scratch:
            start = time.perf_counter()
            artifact = tpuexport.convert(build(), task="text-generation", max_context=64, max_batch=2, kv_cache_dtype="int8",
                                         buckets={"seq": [16, 48], "batch": [2]}, target="v5e", verify_new_tokens=16,
                                         out=pathlib.Path(scratch) / "lm.tpu")
            report = json.loads((artifact.path / "verification" / "report.json").read_text())
            divergence = report["float_divergence"]
            first = divergence["first"]
            print(f"{family}: f32, context 64, 2 cases (prefill 2 x 16 and 2 x 48, rows of mixed lengths) x 16 new tokens; verified "
                  f"{report['passed']} ({report['tokens_compared']} tokens vs the eager int8-KV entry points, {report['ties']} tie(s)); "
                  f"vs float generate(): first divergence {'none' if first is None else 'step ' + str(first['step'])}, logits SQNR "
                  f"{divergence['sqnr_db']:.1f} dB; convert {time.perf_counter() - start:.0f} s", flush=True)


def attention(options: argparse.Namespace) -> None:
    """Decode attention alone, written in JAX (Llama-1B's 8 kv heads x 4 query heads each, head_dim 64,
    batch 8 x 4096 keys, 4 layers), compiled for v5e: a bf16 cache; an int8 cache dequantized before
    the dots (what the entry points do); the scales factored out of the dots (scores x key scale,
    probabilities x value scale); and both dots s8 x s8 (query and probabilities quantized too)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    device = topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu", chips_per_host_bounds=(1, 1, 1)).devices[0]
    batch, heads, groups, keys, dim, layers = 8, 8, 4, 4096, 64, 4

    def placed(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))

    def attend(query, key, value):
        scores = jnp.einsum("bhgd,bhtd->bhgt", query, key, preferred_element_type=jnp.float32) / dim ** 0.5
        return jnp.einsum("bhgt,bhtd->bhgd", jax.nn.softmax(scores, -1).astype(jnp.bfloat16), value, preferred_element_type=jnp.float32)

    def bf16_cache(query, key, value):
        return sum(attend(query, key[layer], value[layer]) for layer in range(layers))

    def dequantized(query, key, value, key_scale, value_scale):
        return sum(attend(query, key[layer].astype(jnp.bfloat16) * key_scale[layer][..., None],
                          value[layer].astype(jnp.bfloat16) * value_scale[layer][..., None]) for layer in range(layers))

    def factored(query, key, value, key_scale, value_scale):
        out = 0
        for layer in range(layers):
            scores = jnp.einsum("bhgd,bhtd->bhgt", query, key[layer].astype(jnp.bfloat16), preferred_element_type=jnp.float32)
            scores = scores * key_scale[layer][:, :, None, :].astype(jnp.float32) / dim ** 0.5
            weights = jax.nn.softmax(scores, -1) * value_scale[layer][:, :, None, :].astype(jnp.float32)
            out = out + jnp.einsum("bhgt,bhtd->bhgd", weights.astype(jnp.bfloat16), value[layer].astype(jnp.bfloat16),
                                   preferred_element_type=jnp.float32)
        return out

    def int8_dots(query, key, value, key_scale, value_scale):
        query_scale = jnp.max(jnp.abs(query.astype(jnp.float32)), -1) / 127.0
        query_q = jnp.round(query.astype(jnp.float32) / query_scale[..., None]).astype(jnp.int8)
        out = 0
        for layer in range(layers):
            scores = jnp.einsum("bhgd,bhtd->bhgt", query_q, key[layer], preferred_element_type=jnp.int32).astype(jnp.float32)
            scores = scores * query_scale[..., None] * key_scale[layer][:, :, None, :].astype(jnp.float32) / dim ** 0.5
            weights = jax.nn.softmax(scores, -1) * value_scale[layer][:, :, None, :].astype(jnp.float32)
            weights_scale = jnp.max(weights, -1) / 127.0
            weights_q = jnp.round(weights / weights_scale[..., None]).astype(jnp.int8)
            out = out + jnp.einsum("bhgt,bhtd->bhgd", weights_q, value[layer], preferred_element_type=jnp.int32).astype(jnp.float32) * weights_scale[..., None]
        return out

    query = placed((batch, heads, groups, dim), jnp.bfloat16)
    bf16, int8 = placed((layers, batch, heads, keys, dim), jnp.bfloat16), placed((layers, batch, heads, keys, dim), jnp.int8)
    scales = placed((layers, batch, heads, keys), jnp.bfloat16)
    print(f"decode attention alone, JAX, v5e: {layers} layers, batch {batch} x {keys} keys, {heads} kv heads x {groups} query heads, head_dim {dim}")
    for name, function, args in (("bf16 cache", bf16_cache, (query, bf16, bf16)),
                                  ("int8 cache, dequantized before the dots", dequantized, (query, int8, int8, scales, scales)),
                                  ("int8 cache, scales factored out of the dots", factored, (query, int8, int8, scales, scales)),
                                  ("int8 cache, s8 x s8 dots (query, probabilities quantized)", int8_dots, (query, int8, int8, scales, scales))):
        compiled = jax.jit(function).trace(*args).lower().compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        memory = compiled.memory_analysis()
        print(f"  {name}: arguments {memory.argument_size_in_bytes / 2**20:.0f} MiB, XLA bytes accessed {cost['bytes accessed'] / 2**20:.0f} MiB, "
              f"temporaries {memory.temp_size_in_bytes / 2**20:.1f} MiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["step", "scales", "tiny", "attention"])
    parser.add_argument("--layers", type=int, help="step: decoder layers (default: the shape's 16)")
    parser.add_argument("--kv", default="model,int8", help="step: the --kv-cache-dtype values compared")
    options = parser.parse_args()
    {"step": step, "scales": scales, "tiny": tiny, "attention": attention}[options.what](options)


if __name__ == "__main__":
    main()
