"""What v5e's grouped matmul (jax.lax.ragged_dot, mixture-of-experts layers) costs per expert weight
layout and dtype: one layer's experts, compiled for v5e (compile-only topology).

    PYTHONPATH=. nice -n 10 python benchmarks/studies/grouped_matmul.py

Mixtral-8x7B's gate/up shapes (8 experts, 4096 -> 14336) at 64 rows (a decode step), 2048 and 4096
(a 2048-token prefill: top-2 routing gives the experts two rows per token). Rows:
  - the weight stored [experts, out, in] as transformers keeps it and swapped to [experts, in, out]
    before ragged_dot (what tpuexport lowered until lower/weight_layouts.py), the same layout
    contracted in place by ragged_dot_general's dimension numbers, and stored [experts, in, out] as
    the TPU's grouped matmul reads it (what tpuexport stores now);
  - bf16, and int8 weights as a weight-only program could read them: the integers as ragged_dot's
    right-hand side (mixed bf16 x s8 operands, f32 accumulation), the per-output-channel scale
    applied to each row's result after the product (it commutes with the contraction): each row's
    scales gathered (jnp.take, what tpuexport did until issue #24), or as tpuexport's lowering does it
    (lower/quantized_weights.py: a one-hot [rows, experts] x [experts, n] product), or the same with a
    bf16 ragged_dot result (rounded twice: measured, not used);
  - int4: packed u8 bitcast to s4;
  - scanned: LAYERS layers' [experts, in, out] weights stacked, one ragged_dot per step of a scan
    reading its layer's slice (what a scanned program does), and the same with the layer folded into
    the groups (one ragged_dot over [layers * experts, in, out], the other layers' groups empty).
    XLA's figures for a loop count its body once.
Prints XLA's argument and temporary bytes and its bytes accessed. Temporaries the size of the weight
mean the compiler copied it (a relayout or a dequantized copy).
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402
from tpuexport.lower.quantized_weights import QuantizedArray, quantized_grouped_matmul  # noqa: E402

EXPERTS, INNER, OUTER = 8, 4096, 14336
LAYERS = 4
# ragged_dot_general contracting the rhs's last dim: an [experts, out, in] weight read in place.
CONTRACTING_LAST = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
                                                     rhs_group_dimensions=[0])


def figures(function, specs) -> str:
    topology = topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu", chips_per_host_bounds=(1, 1, 1))
    placed = [jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(topology.devices[0])) for shape, dtype in specs]
    try:
        compiled = jax.jit(function).trace(*placed).lower().compile()
    except Exception as error:  # the compiler's refusal is the figure
        return f"does not compile: {' '.join(str(error).split())[:120]}"
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
    mib = 2 ** 20
    accessed = cost.get("bytes accessed", 0)
    return (f"arguments {memory.argument_size_in_bytes / mib:8.1f} MiB  temporaries {memory.temp_size_in_bytes / mib:8.1f} MiB  "
            f"bytes accessed {accessed / mib:8.1f} MiB" if accessed > 0 else "bytes accessed unknown")


def scaled(product, scale, group_sizes, rows: int):
    """Each row's product times its expert's per-output-channel scale."""
    expert = jnp.repeat(jnp.arange(EXPERTS), group_sizes, total_repeat_length=rows)
    return (product * scale[expert].astype(jnp.float32)).astype(jnp.bfloat16)


def lowered(x, w, scale, group_sizes):
    """tpuexport's lowering of an int8 weight-only grouped matmul."""
    weight = QuantizedArray(values=w, scale=scale[:, None, :], bits=8, axis=-2, dtype=jnp.dtype(jnp.bfloat16))
    return quantized_grouped_matmul(x, weight, jnp.cumsum(group_sizes))


def bf16_product(x, w, scale, group_sizes):
    """The same with ragged_dot's result rounded to bf16 before the scales."""
    product = jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.bfloat16).astype(jnp.float32)
    expert = jnp.repeat(jnp.arange(EXPERTS), group_sizes, total_repeat_length=x.shape[0])
    row_scales = jnp.dot(jax.nn.one_hot(expert, EXPERTS, dtype=jnp.float32), scale.astype(jnp.float32), precision="highest")
    return (product * row_scales).astype(jnp.bfloat16)


def scanned_slices(x, w, s):
    """A scan over the layers, each step's ragged_dot reading its layer's slice of the stack."""
    def step(h, layer):
        return jax.lax.ragged_dot(h, jax.lax.dynamic_index_in_dim(w, layer, keepdims=False), s)[:, :INNER], None

    return jax.lax.scan(step, x, jnp.arange(LAYERS))[0]


def scanned_folded(x, w, s):
    """The same with the layer folded into the groups: other layers' groups get no rows."""
    flat = w.reshape(LAYERS * EXPERTS, INNER, OUTER)

    def step(h, layer):
        sizes = jax.lax.dynamic_update_slice(jnp.zeros((LAYERS * EXPERTS,), jnp.int32), s, (layer * EXPERTS,))
        return jax.lax.ragged_dot(h, flat, sizes)[:, :INNER], None

    return jax.lax.scan(step, x, jnp.arange(LAYERS))[0]


def main() -> None:
    sizes = ((EXPERTS,), jnp.int32)
    for rows in (64, 2048, 4096):
        x = ((rows, INNER), jnp.bfloat16)
        print(f"{rows} rows, experts {EXPERTS} x {INNER} -> {OUTER} (bf16 weights {EXPERTS * INNER * OUTER * 2 / 2**20:.0f} MiB)", flush=True)
        rows_of = [
            ("bf16 [e, out, in], swapped", lambda x, w, s: jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), s),
             [x, ((EXPERTS, OUTER, INNER), jnp.bfloat16), sizes]),
            ("bf16 [e, out, in], general", lambda x, w, s: jax.lax.ragged_dot_general(x, w, s, CONTRACTING_LAST),
             [x, ((EXPERTS, OUTER, INNER), jnp.bfloat16), sizes]),
            ("bf16 [e, in, out]", lambda x, w, s: jax.lax.ragged_dot(x, w, s), [x, ((EXPERTS, INNER, OUTER), jnp.bfloat16), sizes]),
            ("int8 [e, out, in], swapped", lambda x, w, c, s: scaled(jax.lax.ragged_dot(
                x, jnp.swapaxes(w, 1, 2), s, preferred_element_type=jnp.float32), c, s, x.shape[0]),
             [x, ((EXPERTS, OUTER, INNER), jnp.int8), ((EXPERTS, OUTER), jnp.bfloat16), sizes]),
            ("int8 [e, in, out], gathered", lambda x, w, c, s: scaled(
                jax.lax.ragged_dot(x, w, s, preferred_element_type=jnp.float32), c, s, x.shape[0]),
             [x, ((EXPERTS, INNER, OUTER), jnp.int8), ((EXPERTS, OUTER), jnp.bfloat16), sizes]),
            ("int8 [e, in, out], lowering", lowered,
             [x, ((EXPERTS, INNER, OUTER), jnp.int8), ((EXPERTS, OUTER), jnp.bfloat16), sizes]),
            ("int8 [e, in, out], bf16 out", bf16_product,
             [x, ((EXPERTS, INNER, OUTER), jnp.int8), ((EXPERTS, OUTER), jnp.bfloat16), sizes]),
            ("int8 dequantized first", lambda x, w, c, s: jax.lax.ragged_dot(x, w.astype(jnp.bfloat16) * c[:, None, :], s),
             [x, ((EXPERTS, INNER, OUTER), jnp.int8), ((EXPERTS, OUTER), jnp.bfloat16), sizes]),
            ("int4 [e, in, out] (s4)", lambda x, w, c, s: scaled(jax.lax.ragged_dot(
                x, jax.lax.bitcast_convert_type(w, jnp.int4).reshape(EXPERTS, INNER, OUTER), s, preferred_element_type=jnp.float32),
                c, s, x.shape[0]),
             [x, ((EXPERTS, INNER, OUTER // 2), jnp.uint8), ((EXPERTS, OUTER), jnp.bfloat16), sizes]),
            (f"bf16 scan of {LAYERS}, slices", scanned_slices, [x, ((LAYERS, EXPERTS, INNER, OUTER), jnp.bfloat16), sizes]),
            (f"bf16 scan of {LAYERS}, folded", scanned_folded, [x, ((LAYERS, EXPERTS, INNER, OUTER), jnp.bfloat16), sizes]),
        ]
        for label, function, specs in rows_of:
            print(f"  {label:<28}{figures(function, specs)}", flush=True)


if __name__ == "__main__":
    main()
