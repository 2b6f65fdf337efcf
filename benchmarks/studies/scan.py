"""What lowering a model's layers as one scan saves: TPU compile seconds and StableHLO size of a
Llama-style decoder (transformers LlamaConfig, random weights, hidden 512) at 2, 8, 16 and 32
layers, scanned and unrolled (--no-scan).

    python benchmarks/studies/scan.py                      # the table (one process per model and mode)
    python benchmarks/studies/scan.py --layers 2 32 --target v6e

Per model and mode it prints the seconds of the lower stage and of the TPU compile of one bucket
(batch 1 x seq 128), and the bytes of the serialized StableHLO module (bytecode) and of its MLIR
text. Every model runs in its own process (XLA:CPU keeps what it maps until the process ends).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402
HIDDEN, INTERMEDIATE, HEADS, VOCAB = 512, 1376, 8, 1000
BATCH, SEQ = 1, 128


def decoder(layers: int) -> dict:
    """A Llama-style causal LM with random weights, dynamic batch and seq."""
    import torch
    import transformers
    from families import Outputs

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
                                      num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=512,
                                      tie_word_embeddings=False)
    model = Outputs(transformers.LlamaForCausalLM(config).eval(), ("input_ids", "attention_mask"), ("logits",), use_cache=False)
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=2, max=512)
    # An example batch of 1 would make torch.export specialize the batch dim.
    args = (torch.randint(0, VOCAB, (2, 16)), torch.ones(2, 16, dtype=torch.long))
    return {"model": model, "args": args, "dynamic_shapes": {name: {0: batch, 1: seq} for name in ("input_ids", "attention_mask")}}


def measure(layers: int, scan: bool, target_name: str) -> dict:
    """Lowers and compiles one decoder (in this process) and returns its figures."""
    from tpuexport import compile as compile_stage
    from tpuexport import export as export_stage
    from tpuexport import lower as lower_stage

    built = decoder(layers)
    captured = export_stage.capture(export_stage.LoadedSource(built["model"], built["args"], built["dynamic_shapes"], None,
                                                              export_stage.SourceInfo("api")))
    start = time.perf_counter()
    lowered = lower_stage.lower(captured.program, captured.signature, scan=scan)
    lower_seconds = time.perf_counter() - start
    [target] = compile_stage.resolve_targets([target_name])
    buckets = compile_stage.make_buckets(lowered.signature, {"batch": [BATCH], "seq": [SEQ]})
    [compiled] = compile_stage.compile_program(lowered, [target], buckets).results
    return {
        "layers": layers,
        "mode": "scanned" if lowered.scanned else "unrolled",
        "lower_seconds": lower_seconds,
        "compile_seconds": compiled.compile_seconds,
        "bytecode_bytes": len(lowered.exported.mlir_module_serialized),
        "mlir_text_bytes": len(lowered.exported.mlir_module()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="*", type=int, default=[2, 8, 16, 32])
    parser.add_argument("--target", default="v5e")
    parser.add_argument("--one", nargs=2, metavar=("LAYERS", "MODE"), help=argparse.SUPPRESS)  # a child's model
    options = parser.parse_args()
    warnings.filterwarnings("ignore")
    if options.one:
        layers, mode = options.one
        print(json.dumps(measure(int(layers), mode == "scanned", options.target)), flush=True)
        return
    print(f"Llama-style decoder, hidden {HIDDEN}, intermediate {INTERMEDIATE}, {HEADS} heads, vocab {VOCAB}; "
          f"{options.target} compile of batch {BATCH} x seq {SEQ}")
    print("| layers | mode | lower s | compile s | StableHLO bytecode bytes | MLIR text bytes |")
    print("|---|---|---|---|---|---|", flush=True)
    compile_seconds = {}
    for layers in options.layers:
        for mode in ("scanned", "unrolled"):
            child = subprocess.run([sys.executable, __file__, "--one", str(layers), mode, "--target", options.target],
                                   capture_output=True, text=True, check=True)
            row = json.loads(child.stdout.strip().splitlines()[-1])
            compile_seconds[layers, mode] = row["compile_seconds"]
            print(f"| {layers} | {row['mode']} | {row['lower_seconds']:.1f} | {row['compile_seconds']:.1f} | "
                  f"{row['bytecode_bytes']:,} | {row['mlir_text_bytes']:,} |", flush=True)
    first, last = min(options.layers), max(options.layers)
    for mode in ("scanned", "unrolled"):
        print(f"{mode}: {last} layers compile in {compile_seconds[last, mode] / compile_seconds[first, mode]:.2f}x "
              f"the time of {first} layers")


if __name__ == "__main__":
    main()
