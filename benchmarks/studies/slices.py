"""A ~1B-parameter Llama-style decoder on a TPU slice, tensor-parallel, and on one chip.

    python benchmarks/studies/slices.py [--slice v5e-8] [--chip v5e] [--bucket batch=8,16 --bucket seq=2048]
                                [--sharding tensor-parallel] [--mesh model=8]

The model is transformers' LlamaForCausalLM with Llama 3.2 1B's shape (2048 wide, 16 layers, 32
query and 8 key/value heads, MLP 8192, vocabulary 128256, tied embeddings: 1.24B parameters),
random bfloat16 weights, nothing downloaded. It is exported and lowered once, then compiled for
the slice with the sharding plan and for the single chip, each in libtpu's compiler process.
Printed per target: the plan, per-chip argument / output / temporary / total bytes against the
chip's HBM, the collectives of the compiled HLO (kind, count, bytes per chip) and compile seconds;
for a target that does not fit, the one-line error a conversion reports.

This measures the compile stage only: verifying a 1B model (eager PyTorch and XLA:CPU at every
verification size, and again sharded on virtual CPU devices) would take far longer than the
compilation; tests/test_slices.py verifies sharded programs on tiny models.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=True)


def build_llama():
    """The random-weight bfloat16 1B decoder, wrapped to take input_ids and return logits."""
    import torch

    from families import bf16_llama

    torch.manual_seed(0)
    return bf16_llama(LLAMA_1B)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slice", default="v5e-8")
    parser.add_argument("--chip", default="v5e")
    parser.add_argument("--bucket", action="append", default=None, metavar="DIM=SIZE")
    parser.add_argument("--sharding", default="tensor-parallel")
    parser.add_argument("--mesh", default=None)
    options = parser.parse_args()
    warnings.filterwarnings("ignore")

    from tpuexport import compile as compile_stage
    from tpuexport import export as export_stage
    from tpuexport import lower as lower_stage
    from tpuexport.errors import TpuExportError

    start = time.perf_counter()
    model, args, shapes = build_llama()
    parameters = sum(p.numel() for p in model.parameters())
    print(f"Llama-style decoder, {parameters / 1e9:.2f}B parameters (bfloat16), built in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    captured = export_stage.capture(export_stage.LoadedSource(model, args, shapes, None, export_stage.SourceInfo("api")))
    print(f"export {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    lowered = lower_stage.lower(captured.program, captured.signature, precision="bf16")
    print(f"lower {time.perf_counter() - start:.1f} s: {len(lowered.weights)} weight arrays, "
          f"{sum(w.nbytes for w in lowered.weights) / 2**30:.2f} GiB")
    buckets = compile_stage.make_buckets(captured.signature, compile_stage.parse_bucket_options(options.bucket or ["batch=8,16", "seq=2048"]))

    slice_target, chip = compile_stage.resolve_targets([options.slice, options.chip])
    start = time.perf_counter()
    plan = compile_stage.plan_sharding(compile_stage.make_request(options.mesh, options.sharding), slice_target,
                                       lowered.weight_names, lowered.weights, lowered.signature, buckets, lowered.stacked)
    print(f"\nplan for {slice_target.name} ({time.perf_counter() - start:.2f} s): {plan.describe()}")
    for name, spec in plan.weights:
        if ".layers.0." in name or ".layers.0-" in name or ".layers." not in name:
            print(f"  {name:<45} {spec}")
    print(f"  {'inputs':<45} {dict(plan.inputs)}")
    for note in plan.notes:
        print(f"  note: {note}")

    for target, plans in ((slice_target, {slice_target.name: plan}), (chip, None)):
        where = f"{target.chips} chip{'s' if target.chips > 1 else ''}, {target.hbm_bytes_per_device / 2**30:.0f} GiB HBM per chip"
        print(f"\n{target.name} ({where}, topology {target.topology})")
        for bucket in buckets:
            start = time.perf_counter()
            try:
                report = compile_stage.compile_program(lowered, [target], [bucket], plans=plans)
            except TpuExportError as error:
                print(f"  bucket {bucket.name}: error after {time.perf_counter() - start:.1f} s: {error}")
                continue
            [result] = report.results
            memory = result.memory
            print(f"  bucket {result.bucket.name}: compiled in {result.compile_seconds:.1f} s")
            print(f"    per chip: arguments {memory['argument_bytes'] / 2**30:.3f} GiB, outputs {memory['output_bytes'] / 2**30:.3f} GiB, "
                  f"temporaries {memory['temp_bytes'] / 2**30:.3f} GiB, total {memory['total_bytes'] / 2**30:.3f} GiB "
                  f"of {target.hbm_bytes_per_device / 2**30:.0f} GiB ({'fits' if result.fits_in_hbm else 'does not fit'})")
            print(f"    flops per chip {result.cost['flops']:.3g}")
            for kind, entry in result.collectives.items():
                print(f"    {kind:<20} x{entry['count']:<4} {entry['bytes'] / 2**20:10.1f} MiB per chip")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
