"""What a Mixtral-shaped model's v5e executable costs with its expert weights stored as torch keeps
them ([experts, out, in], transposed in the program before each grouped matmul) or as the TPU's
grouped matmul reads them ([experts, in, out]; lower/weight_layouts.py).

    nice -n 10 python benchmarks/studies/experts_layout.py [--layers 2] [--buckets 8x8,1x2048] [--quantize int8-weight-only] [--no-scan]

transformers' MixtralForCausalLM with Mixtral-8x7B's layer shapes (hidden 4096, 8 experts of
14336, top-2, 32 heads, 8 kv heads, vocabulary 32000) and `--layers` layers, bf16, built on the
meta device (no weight exists), is planned (a conversion without weights, as `tpuexport.plan`; attention
kernels off) for `v5e` at each bucket
(batch x seq; 8 x 8 is 64 tokens, the size of a decode step's batch, 1 x 2048 a prefill), its
layers scanned (the default) or unrolled (`--no-scan`), bf16 or weight-only int8 (`--quantize`).
Printed per bucket: XLA's argument bytes (the weights), temporaries and bytes accessed, how many
weights the program stores in another layout (manifest program.weight_layouts) and how many are
quantized, and the lower stage's and the compiler's seconds. The tpuexport measured is the one on PYTHONPATH: run it with an older checkout's there
for the "before" figures.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402

MIXTRAL_8X7B_LAYER = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096, tie_word_embeddings=False)


def bf16_mixtral(layers: int):
    """MixtralForCausalLM of Mixtral-8x7B's layer shapes with `layers` layers, bf16, on the meta
    device, wrapped to take input_ids and return logits; dims batch 1..64 x seq 2..4096."""
    import transformers
    from families import bf16_causal_lm

    config = transformers.MixtralConfig(**MIXTRAL_8X7B_LAYER, num_hidden_layers=layers)
    return bf16_causal_lm(transformers.MixtralForCausalLM, config, "meta", max_seq=4096)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--buckets", default="8x8,1x2048", help="batch x seq sizes, comma-separated")
    parser.add_argument("--quantize", default=None, help="a weight-only mode, e.g. int8-weight-only")
    parser.add_argument("--no-scan", dest="scan", action="store_false")
    parser.add_argument("--target", default="v5e", help="a chip or a slice, e.g. v5e-8")
    parser.add_argument("--sharding", default=None, help="a slice's preset, e.g. tensor-parallel")
    parser.add_argument("--rule", action="append", default=[], help="a sharding rule REGEX=SPEC (repeatable)")
    options = parser.parse_args()
    import tpuexport

    source = pathlib.Path(tpuexport.__file__).resolve().parent.parent
    commit = subprocess.run(["git", "-C", str(source), "log", "-1", "--format=%h %s"], capture_output=True, text=True).stdout.strip()
    print(f"tpuexport from {source} at {commit[:100]}", flush=True)
    sizes = [tuple(int(size) for size in bucket.split("x")) for bucket in options.buckets.split(",")]
    model, args, shapes = bf16_mixtral(options.layers)
    gib, mib = 2 ** 30, 2 ** 20
    for batch, seq in sizes:
        with tempfile.TemporaryDirectory() as directory:
            start = time.perf_counter()
            # A plan (no weights): `tpuexport.plan`, with the scan option; attention kernels off in both programs.
            artifact = tpuexport.convert(model, args, shapes, out=pathlib.Path(directory) / "plan.tpu", weights=False,
                                         saved_model=False, kernels="none", buckets={"batch": [batch], "seq": [seq]},
                                         quantize=options.quantize, scan=options.scan,
                                         target=options.target, sharding=options.sharding, rules=options.rule)
            manifest = artifact.manifest
        layouts = manifest["program"].get("weight_layouts", {})
        bucket = manifest["targets"][options.target]["buckets"][0]
        memory, cost = bucket["memory"], bucket["cost"]
        quantized = sum(name.endswith("_scale") for name in manifest["program"]["weight_names"])  # a plan has no quantization section
        print(f"{options.layers} layers {'scanned' if options.scan else 'unrolled'}, {options.quantize or 'bf16'}, batch {batch} x seq {seq} "
              f"({batch * seq} tokens): weights {manifest['program']['weight_bytes'] / gib:.2f} GiB, {quantized} quantized, "
              f"{len(layouts)} stored transposed; planned in {time.perf_counter() - start:.0f} s", flush=True)
        print(f"  arguments {memory['argument_bytes'] / mib:9.1f} MiB  temporaries {memory['temp_bytes'] / mib:9.1f} MiB  "
              f"bytes accessed {cost['bytes_accessed'] / mib:9.1f} MiB  total {memory['total_bytes'] / gib:.2f} GiB "
              f"({bucket['hbm_utilization']:.0%} of HBM)", flush=True)
        stages, compiles = manifest["build"]["stage_seconds"], manifest["build"]["compile_seconds"]
        print(f"  lower {stages.get('lower', 0.0):.1f} s  compile {sum(compiles.values()):.1f} s", flush=True)


if __name__ == "__main__":
    main()
