"""Does v5e's compiler convert weight-only weights inside the dot? One projection, compiled for v5e.

    nice -n 10 python benchmarks/studies/weight_only_fusion.py [--tokens 8]

For Llama-3-8B's MLP shapes (up 14336 x 4096, down 4096 x 14336) and 8 (a decode step) or more tokens
(--tokens 2048: a prefill) of bf16 activations,
compiles `x @ w.T` with w bf16, int8 (lower/quantized_weights.py: s8 and a bf16 scale per row) and
int4 (packed u8, bf16 scales per 128), the latter both as tpuexport lowers it (output features in
chunks of at most CHUNK_ELEMENTS weights) and unchunked, and prints XLA's per-chip argument and
temporary bytes and its bytes-accessed estimate. Temporaries of the size of the bf16 weight mean
the compiler materialized a dequantized copy.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402
from tpuexport.lower import quantized_weights  # noqa: E402
from tpuexport.lower.quantized_weights import QuantizedArray, quantized_matmul

GROUP = 128


def compiled_figures(function, specs) -> str:
    topology = topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu", chips_per_host_bounds=(1, 1, 1))
    placed = [jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(topology.devices[0])) for shape, dtype in specs]
    compiled = jax.jit(function).trace(*placed).lower().compile()
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
    mib = 2 ** 20
    return (f"arguments {memory.argument_size_in_bytes / mib:8.1f} MiB  temporaries {memory.temp_size_in_bytes / mib:8.1f} MiB  "
            f"XLA bytes accessed {cost.get('bytes accessed', 0) / mib:8.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8, help="rows of activations (8: a decode step)")
    tokens = parser.parse_args().tokens
    for out, inner in ((14336, 4096), (4096, 14336)):
        x = ((tokens, inner), jnp.bfloat16)
        print(f"{out} x {inner} weight (bf16 copy {out * inner * 2 / 2**20:.0f} MiB), {tokens} tokens", flush=True)
        print(f"  {'bf16':<16}" + compiled_figures(lambda x, w: x @ w.T, [x, ((out, inner), jnp.bfloat16)]), flush=True)

        def int8(x, values, scale):
            return quantized_matmul(x, QuantizedArray(values, scale, 8, -1, jnp.dtype(jnp.bfloat16), transposed=True))

        print(f"  {'int8':<16}" + compiled_figures(int8, [x, ((out, inner), jnp.int8), ((out, 1), jnp.bfloat16)]), flush=True)

        def int4(x, values, scale):
            return quantized_matmul(x, QuantizedArray(values, scale, 4, -1, jnp.dtype(jnp.bfloat16), transposed=True))

        int4_specs = [x, ((out, inner // 2), jnp.uint8), ((out, inner // GROUP), jnp.bfloat16)]
        print(f"  {'int4 chunked':<16}" + compiled_figures(int4, int4_specs), flush=True)
        chunk = quantized_weights.CHUNK_ELEMENTS
        quantized_weights.CHUNK_ELEMENTS = out * inner
        try:  # a new function: jax caches a function's trace, which would keep the chunks
            print(f"  {'int4 unchunked':<16}" + compiled_figures(lambda *args: int4(*args), int4_specs), flush=True)
        finally:
            quantized_weights.CHUNK_ELEMENTS = chunk


if __name__ == "__main__":
    main()
