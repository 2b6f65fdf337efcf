"""Lowering quality against hand-written JAX: XLA's analysis of tpuexport's TPU program and of a
native JAX model with the same weights, shapes and dtypes, both compiled for v5e.

    python benchmarks/native_jax.py                 # Llama-3.2-1B shape bf16 8 x 2048, BERT-base f32 8 x 128
    python benchmarks/native_jax.py --small         # the same architectures, tiny widths (seconds)
    python benchmarks/native_jax.py --models llama --modes scanned
    python benchmarks/native_jax.py --attention     # attention alone at Llama-1B's shape (seconds)
    python benchmarks/native_jax.py --models llama --modes scanned --kernels   # also with TPU kernels

Models (transformers configs, random weights, nothing downloaded):
  llama  LlamaForCausalLM, Llama-3.2-1B's shapes (hidden 2048, 16 layers, 32 query / 8 key-value
         heads, MLP 8192, vocabulary 128256, tied embeddings), bfloat16, input_ids -> logits,
         batch 8 x seq 2048; built on the meta device (no weight exists: both programs are
         compiled from shapes). --small: hidden 256, 4 layers, 8 / 2 heads, vocabulary 1000, 4 x 512.
  bert   BertModel-base (hidden 768, 12 layers, 12 heads), float32, input_ids + attention_mask ->
         last_hidden_state, pooler_output, batch 8 x 128. --small: hidden 64, 2 layers, 4 heads.

The native models are written the way a JAX engineer writes them: weights as [in, out] matrices,
einsums with bfloat16 operands where the model is bfloat16 and f32 accumulation for the scores,
the causal mask an iota compare, padding a [batch, key] select, grouped-query attention by
reshaping the query heads, the softmax `jax.nn.softmax` in f32, layers as a `jax.lax.scan` over
stacked weights ("scanned") or a Python loop ("unrolled") over the stacked weights, indexed per layer.
Unrolled, a third program: the same loop over per-layer weights, each its own argument ("native,
per-layer weights"), as tpuexport's unrolled program takes them. This one is how JAX engineers write
an unrolled model: MaxText with scan_layers=False creates one module per layer, `layers_{i}`, each
with its own parameters (src/maxtext/layers/decoders.py, nnx_decoders.py), and only scan_layers=True
stacks them, through nn.scan along param_scan_axis; Flax's examples loop over
`EncoderDecoder1DBlock(name=f'encoderdecoderblock_{lyr}')`. A jitted parameter tree passes every leaf
as its own argument. So the unrolled report labels the per-layer program MaxText's and prints
tpuexport's ratio against it; the loop over stacked weights is kept as the second reference.
XLA:TPU prefetches such separate weights into on-chip memory (sliced async copies), which its cost
analysis counts as more bytes accessed (the HBM read, the on-chip write and read), while a slice of
a stacked weight is read from HBM inside the matmul's fusion. Where the weights exist, each native
model is first run on CPU and compared with eager PyTorch (and tpuexport's program too), at
batch 2 x seq 16; the Llama-1B shape has no weights, its code is the --small model's.

Printed per model and mode: bytes accessed, flops (XLA's cost analysis), temporaries (XLA's
memory analysis), XLA:TPU's summed per-op cycle estimates (`estimated_cycles`) of both executables,
and tpuexport / native; then per program the bytes it prefetches into on-chip memory and its bytes
accessed without the prefetches' bookkeeping (decode_bytes.py's model: a prefetched weight is read
from HBM once, its on-chip copies add 4 x copy-start and 3 x slice-start bytes to bytes accessed). Each (model, mode) runs in its own
process. With --kernels, two more programs: tpuexport's bucket lowered again with TPU kernels
(what `--kernels auto` compiles; lower/kernels.py) and the native Llama with JAX's Pallas
`flash_attention` (causal, k/v repeated to the query heads, 512 blocks), and their ratio.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import warnings

import _common  # noqa: F401  (the checkout first on sys.path)

TOPOLOGY = "v5e:1x1"

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=500000.0,
                rms_norm_eps=1e-5)
LLAMA_SMALL = dict(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=500000.0,
                   rms_norm_eps=1e-5)
BERT_SMALL = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  max_position_embeddings=256)
# model: (full-size shape, small shape) as (batch, seq)
SHAPES = {"llama": ((8, 2048), (4, 512)), "bert": ((8, 128), (8, 128))}
CHECK_SHAPE = (2, 16)
PER_LAYER = "native, per-layer weights"
# Printed names of the native programs when unrolled: which one MaxText's scan_layers=False is.
UNROLLED_LABELS = {"native": "native, stacked weights indexed per layer",
                   PER_LAYER: "native, per-layer weights (MaxText scan_layers=False)"}
ESTIMATED_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')


# ---------------------------------------------------------------------------------------------
# Native JAX models


def rms_norm(x, weight, eps):
    import jax.numpy as jnp

    xf = x.astype(jnp.float32)
    normed = xf * jax_rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def jax_rsqrt(x):
    import jax

    return jax.lax.rsqrt(x)


def layer_norm(x, weight, bias, eps):
    import jax.numpy as jnp

    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax_rsqrt(var + eps) * weight + bias


def rotate_half(x):
    import jax.numpy as jnp

    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def llama_forward(weights: dict, input_ids, config: dict, scan: bool, flash: bool = False):
    """Logits of a Llama decoder (transformers' LlamaForCausalLM semantics, causal, no padding).

    Args:
      weights: {"embed" [V, H], "inv_freq" [D/2] f32, "norm" [H], "layers": {name: [L, ...]}}
        with the projection matrices as [in, out].
      input_ids: [batch, seq] int32.
      config: the LlamaConfig's fields.
      scan: layers as one jax.lax.scan (else a Python loop).
      flash: attention by JAX's Pallas TPU flash_attention kernel (TPU only; compiled, not run here).
    """
    import jax
    import jax.numpy as jnp

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // heads
    groups = heads // kv_heads
    eps = config["rms_norm_eps"]
    embed = weights["embed"]
    dtype = embed.dtype
    batch, seq = input_ids.shape
    x = jnp.take(embed, input_ids, axis=0, mode="clip")
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * weights["inv_freq"][None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)
    causal = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]
    scale = head_dim ** -0.5

    def rope(t):  # t: [b, s, ..., d]
        shape = (1, seq) + (1,) * (t.ndim - 3) + (head_dim,)
        return t * cos.reshape(shape) + rotate_half(t) * sin.reshape(shape)

    def layer(x, w):
        h = rms_norm(x, w["input_norm"], eps)
        q = jnp.einsum("bsh,hd->bsd", h, w["q"]).reshape(batch, seq, kv_heads, groups, head_dim)
        k = jnp.einsum("bsh,hd->bsd", h, w["k"]).reshape(batch, seq, kv_heads, head_dim)
        v = jnp.einsum("bsh,hd->bsd", h, w["v"]).reshape(batch, seq, kv_heads, head_dim)
        q, k = rope(q), rope(k)
        if flash:
            attended = flash_attention(q, k, v, scale)
        else:
            scores = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32) * scale
            scores = jnp.where(causal, scores, -jnp.inf)
            probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
            attended = jnp.einsum("bkgst,btkd->bskgd", probs, v).reshape(batch, seq, heads * head_dim)
        x = x + jnp.einsum("bsd,dh->bsh", attended, w["o"])
        h = rms_norm(x, w["post_norm"], eps)
        mlp = jax.nn.silu(jnp.einsum("bsh,hf->bsf", h, w["gate"])) * jnp.einsum("bsh,hf->bsf", h, w["up"])
        return x + jnp.einsum("bsf,fh->bsh", mlp, w["down"])

    x = _layers(layer, x, weights["layers"], scan)
    h = rms_norm(x, weights["norm"], eps)
    head = weights.get("lm_head", embed)
    return jnp.einsum("bsh,vh->bsv", h, head)


def flash_attention(q, k, v, scale):
    """Causal attention by Pallas's TPU flash kernel: q [b, s, kv_heads, groups, d], k and v
    [b, s, kv_heads, d] -> [b, s, heads * d] (k, v repeated per group: the kernel needs equal heads)."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash

    batch, seq, kv_heads, groups, head_dim = q.shape
    query = q.reshape(batch, seq, kv_heads * groups, head_dim).transpose(0, 2, 1, 3)
    key, value = (jnp.repeat(t.transpose(0, 2, 1, 3), groups, axis=1) for t in (k, v))
    block = min(512, seq)
    attended = pallas_flash.flash_attention(query, key, value, causal=True, sm_scale=scale, block_sizes=pallas_flash.BlockSizes(
        block_q=block, block_k_major=block, block_k=block, block_b=1))
    return attended.transpose(0, 2, 1, 3).reshape(batch, seq, kv_heads * groups * head_dim)


def bert_forward(weights: dict, input_ids, attention_mask, config: dict, scan: bool):
    """(last_hidden_state, pooler_output) of BertModel (absolute positions, token type 0, padding).

    Args:
      weights: embeddings, embedding LayerNorm, pooler and {"layers": {name: [L, ...]}}, the dense
        matrices as [in, out].
      input_ids, attention_mask: [batch, seq] int32 (mask 1 = attend).
      config: the BertConfig's fields.
      scan: layers as one jax.lax.scan (else a Python loop).
    """
    import jax
    import jax.numpy as jnp

    heads = config["num_attention_heads"]
    head_dim = config["hidden_size"] // heads
    eps = config["layer_norm_eps"]
    batch, seq = input_ids.shape
    x = (jnp.take(weights["word"], input_ids, axis=0, mode="clip") + weights["position"][:seq][None]
         + weights["token_type"][0][None, None])
    x = layer_norm(x, weights["embed_norm_w"], weights["embed_norm_b"], eps)
    dtype = x.dtype
    keep = (attention_mask != 0)[:, None, None, :]
    scale = head_dim ** -0.5

    def layer(x, w):
        def project(name):
            return (jnp.einsum("bsh,hd->bsd", x, w[name]) + w[name + "_b"]).reshape(batch, seq, heads, head_dim)

        q, k, v = project("q"), project("k"), project("v")
        scores = jnp.einsum("bshd,bthd->bhst", q, k, preferred_element_type=jnp.float32) * scale
        scores = jnp.where(keep, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
        attended = jnp.einsum("bhst,bthd->bshd", probs, v).reshape(batch, seq, heads * head_dim)
        x = layer_norm(x + jnp.einsum("bsd,dh->bsh", attended, w["o"]) + w["o_b"], w["attn_norm_w"], w["attn_norm_b"], eps)
        inner = jax.nn.gelu(jnp.einsum("bsh,hf->bsf", x, w["inter"]) + w["inter_b"], approximate=False)
        return layer_norm(x + jnp.einsum("bsf,fh->bsh", inner, w["out"]) + w["out_b"], w["out_norm_w"], w["out_norm_b"], eps)

    x = _layers(layer, x, weights["layers"], scan)
    pooled = jnp.tanh(jnp.einsum("bh,hk->bk", x[:, 0], weights["pooler"]) + weights["pooler_b"])
    return x, pooled


def _layers(layer, x, stacked, scan: bool):
    """The layers over x: `stacked` is {name: [L, ...]} (scanned, or unrolled indexing each layer),
    or a list of per-layer {name: array} (unrolled, each layer's weights their own arguments)."""
    import jax

    if isinstance(stacked, list):
        for weights in stacked:
            x = layer(x, weights)
        return x
    if scan:
        return jax.lax.scan(lambda carry, w: (layer(carry, w), None), x, stacked)[0]
    count = len(next(iter(stacked.values())))
    for index in range(count):
        x = layer(x, {name: value[index] for name, value in stacked.items()})
    return x


def per_layer_specs(weight_specs: dict) -> dict:
    """The weights' shapes with the stacked layers as a list of per-layer dicts."""
    import jax

    layers = weight_specs["layers"]
    count = next(iter(layers.values())).shape[0]
    return dict(weight_specs, layers=[{name: jax.ShapeDtypeStruct(spec.shape[1:], spec.dtype) for name, spec in layers.items()}
                                      for _ in range(count)])


# Per-layer weights: native name -> (state_dict suffix, transposed to [in, out])
LLAMA_LAYER = {"input_norm": ("input_layernorm.weight", False), "q": ("self_attn.q_proj.weight", True),
               "k": ("self_attn.k_proj.weight", True), "v": ("self_attn.v_proj.weight", True),
               "o": ("self_attn.o_proj.weight", True), "post_norm": ("post_attention_layernorm.weight", False),
               "gate": ("mlp.gate_proj.weight", True), "up": ("mlp.up_proj.weight", True), "down": ("mlp.down_proj.weight", True)}
BERT_LAYER = {"q": ("attention.self.query.weight", True), "q_b": ("attention.self.query.bias", False),
              "k": ("attention.self.key.weight", True), "k_b": ("attention.self.key.bias", False),
              "v": ("attention.self.value.weight", True), "v_b": ("attention.self.value.bias", False),
              "o": ("attention.output.dense.weight", True), "o_b": ("attention.output.dense.bias", False),
              "attn_norm_w": ("attention.output.LayerNorm.weight", False), "attn_norm_b": ("attention.output.LayerNorm.bias", False),
              "inter": ("intermediate.dense.weight", True), "inter_b": ("intermediate.dense.bias", False),
              "out": ("output.dense.weight", True), "out_b": ("output.dense.bias", False),
              "out_norm_w": ("output.LayerNorm.weight", False), "out_norm_b": ("output.LayerNorm.bias", False)}


def native_weights(model, kind: str) -> dict:
    """The HF model's weights in the native models' layout: numpy arrays, or ShapeDtypeStructs when
    the model is on the meta device."""
    import jax
    import numpy as np
    import torch

    state = model.state_dict()
    meta = any(t.is_meta for t in state.values())

    def convert(tensor, transpose=False):
        if meta:
            shape = tuple(tensor.shape)[::-1] if transpose else tuple(tensor.shape)
            return jax.ShapeDtypeStruct(shape, _jax_dtype(tensor.dtype))
        array = tensor.detach().to(torch.float32).numpy()
        array = array.T if transpose else array
        return np.ascontiguousarray(array).astype(_jax_dtype(tensor.dtype))

    def stacked(prefix: str, count: int, table: dict) -> dict:
        layers = {}
        for name, (suffix, transpose) in table.items():
            parts = [convert(state[f"{prefix}.{index}.{suffix}"], transpose) for index in range(count)]
            layers[name] = (jax.ShapeDtypeStruct((count, *parts[0].shape), parts[0].dtype) if meta else np.stack(parts))
        return layers

    config = model.config
    if kind == "llama":
        head_dim = config.hidden_size // config.num_attention_heads
        inv_freq = model.model.rotary_emb.inv_freq
        weights = {"embed": convert(state["model.embed_tokens.weight"]), "norm": convert(state["model.norm.weight"]),
                   "inv_freq": (jax.ShapeDtypeStruct((head_dim // 2,), np.float32) if meta
                                else inv_freq.to(torch.float32).numpy()),
                   "layers": stacked("model.layers", config.num_hidden_layers, LLAMA_LAYER)}
        if not config.tie_word_embeddings:
            weights["lm_head"] = convert(state["lm_head.weight"])
        return weights
    return {"word": convert(state["embeddings.word_embeddings.weight"]), "position": convert(state["embeddings.position_embeddings.weight"]),
            "token_type": convert(state["embeddings.token_type_embeddings.weight"]),
            "embed_norm_w": convert(state["embeddings.LayerNorm.weight"]), "embed_norm_b": convert(state["embeddings.LayerNorm.bias"]),
            "pooler": convert(state["pooler.dense.weight"], True), "pooler_b": convert(state["pooler.dense.bias"]),
            "layers": stacked("encoder.layer", config.num_hidden_layers, BERT_LAYER)}


def _jax_dtype(torch_dtype):
    import jax.numpy as jnp
    import torch

    return {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}[torch_dtype]


# ---------------------------------------------------------------------------------------------
# Building, checking and compiling one model


def build(kind: str, small: bool) -> dict:
    """The HF model wrapped as tpuexport converts it, its example args and dims, and the native
    model as a function of (weights, inputs)."""
    import functools

    import torch
    import families

    if kind == "llama":
        config = LLAMA_SMALL if small else LLAMA_1B
        model, args, dims = families.bf16_llama(config, device="cpu" if small else "meta")
        hf = model.model
        forward = functools.partial(_llama_outputs, config=hf.config.to_dict())
        return {"model": model, "args": args, "dims": dims, "hf": hf, "native": forward, "precision": "bf16"}
    built = (families.FAMILIES["bert"] if small else families.BASE_FAMILIES["bert-base"]).build()
    hf = built["model"].model
    forward = functools.partial(_bert_outputs, config=hf.config.to_dict())
    torch.manual_seed(0)
    return {"model": built["model"], "args": built["args"], "dims": built["dynamic_shapes"], "hf": hf, "native": forward,
            "precision": "f32"}


def _llama_outputs(weights, inputs, config, scan, flash=False):
    return [llama_forward(weights, inputs[0], config, scan, flash)]


def _bert_outputs(weights, inputs, config, scan):
    return list(bert_forward(weights, inputs[0], inputs[1], config, scan))


def check_shape_inputs(kind: str, vocab: int):
    import torch

    generator = torch.Generator().manual_seed(3)
    batch, seq = CHECK_SHAPE
    ids = torch.randint(3, vocab, (batch, seq), generator=generator)
    if kind == "llama":
        return (ids,)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, seq - 5:] = 0
    return ids, mask, torch.zeros_like(ids)  # token_type_ids: the native model adds type 0's embedding


def relative_error(actual, expected) -> float:
    """max |actual - expected| / max |expected| (both in f32)."""
    import numpy as np

    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    return float(np.max(np.abs(actual - expected)) / max(float(np.max(np.abs(expected))), 1e-30))


def compile_v5e(function, argument_specs) -> dict:
    """XLA's figures of `function` compiled for one v5e chip (compile-only topology)."""
    import jax
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from hlo_prefetch import prefetched_bytes, without_prefetch_bookkeeping

    topology = topologies.get_topology_desc(topology_name=TOPOLOGY, platform="tpu", chips_per_host_bounds=(1, 1, 1))
    device = SingleDeviceSharding(topology.devices[0])
    placed = jax.tree.map(lambda spec: jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=device), argument_specs)
    start = time.perf_counter()
    compiled = jax.jit(function).trace(*placed).lower().compile()
    seconds = time.perf_counter() - start
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    memory = compiled.memory_analysis()
    hlo_text = compiled.as_text()
    prefetched = prefetched_bytes(hlo_text)
    # XLA's estimate as the artifact records it: None ("unknown") where XLA gives none or a negative one
    from tpuexport.compile.compile_child import optimal_seconds
    return {"bytes_accessed": float(cost.get("bytes accessed", 0.0)), "flops": float(cost.get("flops", 0.0)),
            "temp_bytes": int(memory.temp_size_in_bytes), "argument_bytes": int(memory.argument_size_in_bytes),
            "estimated_cycles": estimated_cycles(hlo_text), "optimal_seconds": optimal_seconds(cost, hlo_text),
            "prefetched": prefetched, "without_prefetch": without_prefetch_bookkeeping(float(cost.get("bytes accessed", 0.0)), prefetched),
            "compile_seconds": seconds}


def estimated_cycles(hlo_text: str) -> int:
    """XLA:TPU's own run-time estimate: the `estimated_cycles` its cost model writes into the
    backend_config of each op it tiles (fusions, convolutions), summed over the compiled HLO. A loop
    body counts once, as in the cost analysis."""
    return sum(int(cycles) for cycles in ESTIMATED_CYCLES.findall(hlo_text))


def measure_attention() -> list[str]:
    """Attention alone at Llama-3.2-1B's shape (8 x 2048, 32 query / 8 key-value heads of 64, bf16):
    tpuexport's lowering of scaled_dot_product_attention (causal; with a [batch, 1, 1, seq] padding
    mask) against the native model's attention, compiled for v5e. Seconds, not minutes."""
    import jax
    import jax.numpy as jnp

    from tpuexport.lower.attention import scaled_dot_product_attention

    batch, heads, kv_heads, seq, dim = 8, 32, 8, 2048, 64

    def native(q, k, v, keep):
        grouped = q.reshape(batch, kv_heads, heads // kv_heads, seq, dim)
        scores = jnp.einsum("bkgqd,bksd->bkgqs", grouped, k, preferred_element_type=jnp.float32) * dim ** -0.5
        allowed = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]
        if keep is not None:
            allowed = allowed & keep[:, :, None]
        probs = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1).astype(q.dtype)
        return jnp.einsum("bkgqs,bksd->bkgqd", probs, v).reshape(batch, heads, seq, dim)

    qkv = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in ((batch, heads, seq, dim), (batch, kv_heads, seq, dim), (batch, kv_heads, seq, dim))]
    padding = jax.ShapeDtypeStruct((batch, 1, 1, seq), jnp.bool_)
    cases = [("causal", lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True), lambda q, k, v: native(q, k, v, None), qkv),
             ("causal + padding", lambda q, k, v, m: scaled_dot_product_attention(q, k, v, attn_mask=m & jnp.tril(jnp.ones((seq, seq), bool))),
              lambda q, k, v, m: native(q, k, v, m[:, 0]), [*qkv, padding])]
    lines = [f"attention alone, {batch} x {seq}, {heads} / {kv_heads} heads of {dim}, bf16, {TOPOLOGY}:",
             "| mask | program | bytes accessed GB | temporaries GB |", "|---|---|---|---|"]
    for name, ours, theirs, specs in cases:
        figures = {program: compile_v5e(function, specs) for program, function in (("tpuexport", ours), ("native", theirs))}
        for program, values in figures.items():
            lines.append(f"| {name} | {program} | {values['bytes_accessed'] / 1e9:.3f} | {values['temp_bytes'] / 1e9:.3f} |")
        lines.append(f"| {name} | **tpuexport / native** | **{_ratio(figures['tpuexport']['bytes_accessed'], figures['native']['bytes_accessed'])}** "
                     f"| **{_ratio(figures['tpuexport']['temp_bytes'], figures['native']['temp_bytes'])}** |")
    return lines


def measure(kind: str, small: bool, scan: bool, kernels: bool = False) -> dict:
    """Builds, checks and compiles one model in one mode (in this process)."""
    import jax
    import numpy as np
    import torch

    from tpuexport import export as export_stage
    from tpuexport import lower as lower_stage

    built = build(kind, small)
    hf, native = built["hf"], built["native"]
    has_weights = not any(t.is_meta for t in hf.state_dict().values())
    weights = native_weights(hf, kind)
    result = {"model": kind, "mode": "scanned" if scan else "unrolled", "small": small, "checked": has_weights}

    source = export_stage.LoadedSource(built["model"], built["args"], built["dims"], None, export_stage.SourceInfo("api"))
    if not has_weights:
        source = export_stage.on_meta_device(source)
    captured = export_stage.capture(source)
    start = time.perf_counter()
    lowered = lower_stage.lower(captured.program, captured.signature, built["precision"], scan=scan, weights=has_weights)
    result["lower_seconds"] = time.perf_counter() - start

    if has_weights:
        inputs = check_shape_inputs(kind, hf.config.vocab_size)
        with torch.no_grad():
            eager = built["model"](*inputs)
        expected = [value.to(torch.float32).numpy() for value in eager.values()]  # the outputs' order, as native returns them
        int_inputs = [np.asarray(t.numpy(), np.int32) for t in inputs]
        ours = jax.jit(lambda w, x: native(w, x, scan=scan))(weights, int_inputs)
        result["native_vs_eager"] = max(relative_error(a, e) for a, e in zip(ours, expected))
        converted = lowered.run([t.numpy() for t in inputs])
        result["tpuexport_vs_eager"] = max(relative_error(a, e) for a, e in zip(converted, expected))

    batch, seq = SHAPES[kind][1 if small else 0]
    sizes = {"batch": batch, "seq": seq}
    input_specs = [jax.ShapeDtypeStruct(spec.concrete_shape(sizes), spec.dtype) for spec in lowered.signature.inputs]
    result["shape"] = f"{batch} x {seq}"
    result["tpuexport"] = compile_v5e(lowered.exported.call, (list(lowered.weight_specs), input_specs))
    weight_specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), weights)
    result["native"] = compile_v5e(lambda w, x: native(w, x, scan=scan), (weight_specs, input_specs))
    if not scan:
        result[PER_LAYER] = compile_v5e(lambda w, x: native(w, x, scan=False), (per_layer_specs(weight_specs), input_specs))
    if kernels:
        bucket = lower_stage.lower_bucket_kernels(lowered, sizes)
        result["kernels"] = [use.to_json() for use in bucket.uses[:1]] + ([{"reason": bucket.reason}] if bucket.reason else [])
        if bucket.exported is not None:
            result["tpuexport + kernels"] = compile_v5e(bucket.exported.call, (list(lowered.weight_specs), input_specs))
        if kind == "llama":
            result["native + flash"] = compile_v5e(lambda w, x: native(w, x, scan=scan, flash=True), (weight_specs, input_specs))
    return result


# ---------------------------------------------------------------------------------------------
# Report


def _label(row: dict, program: str) -> str:
    """The printed name of a program: unrolled, which native program is MaxText's."""
    return UNROLLED_LABELS.get(program, program) if row["mode"] == "unrolled" else program


def report_rows(results: list[dict]) -> list[str]:
    gb = 1e9
    lines = ["| model | mode | shape | program | bytes accessed GB | flops | temporaries MB | est. cycles | compile s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in results:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['mode']} | | error: {row['error']} | | | | | |")
            continue
        for program in ("tpuexport", "native", PER_LAYER, "tpuexport + kernels", "native + flash"):
            if program not in row:
                continue
            figures = row[program]
            lines.append(f"| {row['model']} | {row['mode']} | {row['shape']} | {_label(row, program)} | {figures['bytes_accessed'] / gb:.4g} | "
                         f"{figures['flops']:.4g} | {figures['temp_bytes'] / 1e6:.4g} | {figures['estimated_cycles']:.4g} | "
                         f"{figures['compile_seconds']:.1f} |")
        ours, native = row["tpuexport"], row["native"]
        lines.append(f"| {row['model']} | {row['mode']} | {row['shape']} | **tpuexport / {_label(row, 'native')}** | "
                     f"**{_ratio(ours['bytes_accessed'], native['bytes_accessed'])}** | {_ratio(ours['flops'], native['flops'])} | "
                     f"**{_ratio(ours['temp_bytes'], native['temp_bytes'])}** | {_ratio(ours['estimated_cycles'], native['estimated_cycles'])} | |")
        if PER_LAYER in row:
            native = row[PER_LAYER]
            lines.append(f"| {row['model']} | {row['mode']} | {row['shape']} | **tpuexport / {_label(row, PER_LAYER)}** | "
                         f"**{_ratio(ours['bytes_accessed'], native['bytes_accessed'])}** | {_ratio(ours['flops'], native['flops'])} | "
                         f"**{_ratio(ours['temp_bytes'], native['temp_bytes'])}** | {_ratio(ours['estimated_cycles'], native['estimated_cycles'])} | |")
        if "tpuexport + kernels" in row and "native + flash" in row:
            ours, native = row["tpuexport + kernels"], row["native + flash"]
            lines.append(f"| {row['model']} | {row['mode']} | {row['shape']} | **tpuexport + kernels / native + flash** | "
                         f"**{_ratio(ours['bytes_accessed'], native['bytes_accessed'])}** | {_ratio(ours['flops'], native['flops'])} | "
                         f"**{_ratio(ours['temp_bytes'], native['temp_bytes'])}** | {_ratio(ours['estimated_cycles'], native['estimated_cycles'])} | |")
    lines += ["", "VMEM prefetches (decode_bytes.py: bytes accessed count a prefetched weight's HBM read once, plus its on-chip "
              "copies, 4 x copy-start and 3 x slice-start bytes):", "",
              "| model | mode | program | copy-start MB | slice-start MB | bytes accessed without prefetch bookkeeping GB | / native (unrolled: stacked weights) "
              "| / native, per-layer weights |",
              "|---|---|---|---|---|---|---|---|"]
    for row in results:
        if "error" in row:
            continue
        # tpuexport's programs against the native one they are compared with above.
        references = {"tpuexport": "native", "tpuexport + kernels": "native + flash"}
        for program in ("tpuexport", "native", PER_LAYER, "tpuexport + kernels", "native + flash"):
            if program not in row:
                continue
            figures, reference = row[program], row.get(references.get(program, ""))
            ratio = _ratio(figures["without_prefetch"], reference["without_prefetch"]) if reference else ""
            per_layer = row.get(PER_LAYER) if program == "tpuexport" else None
            per_layer_ratio = _ratio(figures["without_prefetch"], per_layer["without_prefetch"]) if per_layer else ""
            lines.append(f"| {row['model']} | {row['mode']} | {_label(row, program)} | {figures['prefetched']['copy-start'] / 1e6:.4g} | "
                         f"{figures['prefetched']['slice-start'] / 1e6:.4g} | {figures['without_prefetch'] / 1e9:.4g} | {ratio} | "
                         f"{per_layer_ratio} |")
    lines.append("")
    for row in results:
        for use in row.get("kernels", []):
            lines.append(f"{row['model']} {row['mode']} kernels: {json.dumps(use)}")
    for row in results:
        if "error" in row:
            continue
        if row["checked"]:
            lines.append(f"{row['model']} {row['mode']}: at batch {CHECK_SHAPE[0]} x seq {CHECK_SHAPE[1]} on CPU, max |error| / max |eager|: "
                         f"native {row['native_vs_eager']:.2e}, tpuexport {row['tpuexport_vs_eager']:.2e}; lowered in {row['lower_seconds']:.1f} s")
        else:
            lines.append(f"{row['model']} {row['mode']}: no weights (meta device): compiled from shapes, not run "
                         f"(the --small model checks the same code); lowered in {row['lower_seconds']:.1f} s")
    return lines


def _ratio(ours: float, native: float) -> str:
    if native > 0:
        return f"{ours / native:.2f}x"
    return "1.00x" if ours == 0 else "- (native 0)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny widths (seconds per model)")
    parser.add_argument("--models", nargs="*", default=["llama", "bert"], choices=sorted(SHAPES))
    parser.add_argument("--modes", nargs="*", default=["scanned", "unrolled"], choices=["scanned", "unrolled"])
    parser.add_argument("--attention", action="store_true", help="attention alone at Llama-1B's shape (seconds)")
    parser.add_argument("--kernels", action="store_true", help="also tpuexport with TPU kernels and native JAX with flash attention")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)  # a child's model
    options = parser.parse_args()
    warnings.filterwarnings("ignore")
    if options.attention:
        print("\n".join(measure_attention()))
        return
    if options.one:
        kind, mode = options.one
        print(json.dumps(measure(kind, options.small, mode == "scanned", options.kernels)), flush=True)
        return
    print(f"tpuexport vs native JAX on {TOPOLOGY} ({'--small' if options.small else 'full size'}); XLA cost and memory analysis",
          flush=True)
    results = []
    for kind in options.models:
        for mode in options.modes:
            command = ([sys.executable, __file__, "--one", kind, mode] + (["--small"] if options.small else [])
                       + (["--kernels"] if options.kernels else []))
            child = subprocess.run(command, capture_output=True, text=True)
            if child.returncode != 0:
                tail = (child.stderr.strip().splitlines() or ["no output"])[-1]
                results.append({"model": kind, "mode": mode, "error": f"exit {child.returncode}: {tail[:200]}"})
            else:
                results.append(json.loads(child.stdout.strip().splitlines()[-1]))
            # Each row as soon as it is measured (a full-size model takes minutes).
            print(f"  {json.dumps(results[-1])}", file=sys.stderr, flush=True)
    print("\n".join(report_rows(results)))


if __name__ == "__main__":
    main()
