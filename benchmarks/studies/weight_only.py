"""Weight bytes and SQNR of weight-only int8 / int4 on the coverage families.

    nice -n 10 python benchmarks/studies/weight_only.py [--families bert,llama,...] [--group-size 64] [--base]
    nice -n 10 python benchmarks/studies/weight_only.py --sizes [--families bert-base,llama-base,...]

For each family (benchmarks/families.py, tiny random-weight configs: hidden 64, so int4 groups of
64; --base adds the 12-layer llama-base, hidden 768, with groups of 128) and mode, lowers the model
as a conversion does (lower with the weight-only scheme: the weights quantized as the artifact
stores them), runs the program on CPU on the example inputs and prints:
  - weight bytes of the program vs the same weights in f32 (embeddings, lm_head and convolutions
    quantized too, the default; norms and biases float),
  - how many weights were quantized,
  - SQNR (dB) of each output against the float model, and of the float model with its weights
    rounded and dequantized (the verification reference) against the program (float agreement).
Lowering only: conversions (compile, verification) of these modes are covered by the tests.

--sizes: weight bytes alone at the widths real checkpoints have (BASE_FAMILIES: bert-base,
llama-base, vit-base, resnet-50, swin-tiny, wav2vec2-base; int4 with the default group of 128),
lowered from the weights' shapes as a plan is (nothing quantized or run), since the tiny families'
64-wide matrices leave biases, norms and position tables a larger share than any real model has.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402
from families import BASE_FAMILIES, FAMILIES  # noqa: E402

from tpuexport import export as export_stage
from tpuexport import lower as lower_stage
from tpuexport.verify.quantization_report import weight_only_section
from tpuexport.quantize.weight_only import DEFAULT_GROUP_SIZE, DequantizedReference, check_scheme
from tpuexport.verify.compare import sqnr_db
from tpuexport.verify.verification import eager_outputs, to_numpy

DEFAULT = "bert,distilbert,gpt2,llama,qwen2,mistral,phi3,gemma,opt,t5,vit,clip-vision,whisper"


def measure(family, mode: str, group_size: int) -> dict:
    built = family.build()
    loaded = export_stage.LoadedSource(built["model"], built["args"], built.get("dynamic_shapes"), None, export_stage.SourceInfo("api"))
    captured = export_stage.capture(loaded)
    scheme = check_scheme(mode, group_size)
    lowered = lower_stage.lower(captured.program, captured.signature, weight_only=scheme)
    section = weight_only_section(lowered, scheme, captured.reference, captured.example_inputs)
    axes = {part: entry["axis"] for name, entry in lowered.quantized.items() for part in lowered.weight_parts[name]}
    expected = eager_outputs(DequantizedReference(captured.reference, axes, scheme), captured.example_inputs)
    actual = lowered.run([to_numpy(t) for t in captured.example_inputs])
    agreement = [sqnr_db([e], [a]) for e, a in zip(expected, actual) if np.issubdtype(e.dtype, np.floating)]
    return {"section": section, "agreement": agreement, "quantized": len(lowered.quantized)}


def weight_bytes(family, mode: str, group_size: int) -> dict:
    """The weight-only program's weight bytes vs f32, lowered from the weights' shapes (a plan)."""
    built = family.build()
    loaded = export_stage.LoadedSource(built["model"], built["args"], built.get("dynamic_shapes"), None, export_stage.SourceInfo("api"))
    captured = export_stage.capture(loaded)
    scheme = check_scheme(mode, group_size)
    lowered = lower_stage.lower(captured.program, captured.signature, weights=False, weight_only=scheme)
    section = weight_only_section(lowered, scheme)
    parameters = sum(int(np.prod(spec.shape)) for name, spec in zip(lowered.weight_names, lowered.weight_specs)
                     if name not in {entry["scale"] for entry in lowered.quantized.values()})
    return {"section": section, "quantized": len(lowered.quantized), "weights": len(lowered.weight_names), "parameters": parameters}


def print_sizes(names: list[str]) -> None:
    """--sizes: one row per base family and mode."""
    print(f"{'family':<15}{'mode':<18}{'group':>6}{'quantized':>12}{'f32 MiB':>10}{'stored MiB':>12}{'bytes vs f32':>14}")
    for name in names:
        for mode in ("int8-weight-only", "int4-weight-only"):
            start = time.perf_counter()
            try:
                row = weight_bytes(BASE_FAMILIES[name], mode, DEFAULT_GROUP_SIZE)
            except Exception as error:  # a family that fails is reported, the table goes on
                print(f"{name:<15}{mode:<18}  failed: {type(error).__name__}: {' '.join(str(error).split())[:150]}", flush=True)
                continue
            sizes = row["section"]["weight_bytes"]
            print(f"{name:<15}{mode:<18}{DEFAULT_GROUP_SIZE if mode.startswith('int4') else '-':>6}"
                  f"{row['quantized']:>5} of {row['weights']:<4}{sizes['f32'] / 2**20:>10.1f}{sizes['quantized'] / 2**20:>12.1f}"
                  f"{sizes['ratio']:>13.4f}x   ({time.perf_counter() - start:.0f} s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=DEFAULT)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--base", action="store_true", help="also llama-base (hidden 768) with groups of 128")
    parser.add_argument("--sizes", action="store_true", help="weight bytes only, at the base families' real widths (plans)")
    options = parser.parse_args()
    if options.sizes:
        chosen = options.families if options.families != DEFAULT else ",".join(BASE_FAMILIES)
        return print_sizes(chosen.split(","))
    runs = [(FAMILIES[name], options.group_size) for name in options.families.split(",")]
    if options.base:
        runs.append((BASE_FAMILIES["llama-base"], 128))
    print(f"{'family':<14}{'mode':<18}{'group':>6}{'quantized':>10}{'bytes vs f32':>14}  {'SQNR vs float (dB)':<46}{'vs dequantized ref (dB)'}")
    for family, group in runs:
        for mode in ("int8-weight-only", "int4-weight-only"):
            start = time.perf_counter()
            try:
                row = measure(family, mode, group)
            except Exception as error:  # a family that fails is reported, the table goes on
                print(f"{family.name:<14}{mode:<18}  failed: {type(error).__name__}: {' '.join(str(error).split())[:150]}", flush=True)
                continue
            section = row["section"]
            sqnr = ", ".join(f"{o['name']} {o['sqnr_db']:.1f}" if o["sqnr_db"] is not None else f"{o['name']} exact"
                             for o in section["outputs"])
            agreement = ", ".join("exact" if value is None else f"{value:.0f}" for value in row["agreement"])
            print(f"{family.name:<14}{mode:<18}{group if mode.startswith('int4') else '-':>6}{row['quantized']:>10}"
                  f"{section['weight_bytes']['ratio']:>13.4f}x  {sqnr:<46}{agreement}   ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
