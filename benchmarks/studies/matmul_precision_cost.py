"""What each --matmul-precision costs on the TPU: XLA's own cost analysis of the compiled v5e
executable, and the matrix-unit time the passes imply.

    python benchmarks/studies/matmul_precision_cost.py                       # the examples and bert, llama, resnet
    python benchmarks/studies/matmul_precision_cost.py bert-base --target v6e

Per model and setting it prints XLA's flops and `optimal_seconds` for one bucket at the example
shapes, and the matmul time at the chip's peak bf16 rate: bf16 passes x the program's float dot
and convolution FLOPs (from the compiled HLO) / peak. XLA's cost analysis counts the logical FLOPs
of a dot once whatever its precision, and its time estimate sees only part of the difference (one
pass lets XLA convert f32 operands to bf16 before the dot, halving the bytes it reads); the pass
count is the rest.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402


def build(name: str) -> dict:
    from families import BASE_FAMILIES, FAMILIES

    if (_common.EXAMPLES / f"{name}.py").is_file():
        return _common.build_example(name)
    return {**FAMILIES, **BASE_FAMILIES}[name].build()


def _microseconds(seconds: float | None) -> str:
    return "unknown" if seconds is None else f"{seconds * 1e6:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["mlp", "cnn", "transformer", "bert", "llama", "resnet"])
    parser.add_argument("--target", default="v5e")
    options = parser.parse_args()
    warnings.filterwarnings("ignore")
    from tpuexport import compile as compile_stage
    from tpuexport import export as export_stage
    from tpuexport import lower as lower_stage
    from tpuexport.lower.matmul_precision import MATMUL_PRECISIONS

    [target] = compile_stage.resolve_targets([options.target])
    print("| model | setting | XLA flops | XLA optimal µs | float matmul GFLOP (compiled HLO) | bf16 passes | matmul µs at peak |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for name in options.models:
        built = build(name)
        captured = export_stage.capture(export_stage.LoadedSource(built["model"], built["args"], built["dynamic_shapes"], None,
                                                                  export_stage.SourceInfo("api")))
        for setting, precision in MATMUL_PRECISIONS.items():
            lowered = lower_stage.lower(captured.program, captured.signature, matmul_precision=setting)
            [compiled] = compile_stage.compile_program(lowered, [target], compile_stage.make_buckets(lowered.signature, None)).results
            # With one pass XLA turns f32 operands into bf16 ones before the dot, so count both.
            float_flops = sum(flops for types, flops in compiled.matmul_flops.items() if not types.startswith("s"))
            seconds = precision.bf16_passes * float_flops / (target.peak_bf16_tflops * 1e12)
            print(f"| {name} | {setting} | {compiled.cost['flops']:.4g} | {_microseconds(compiled.cost['optimal_seconds'])} | "
                  f"{float_flops / 1e9:.4f} | {precision.bf16_passes} | {seconds * 1e6:.3f} |", flush=True)


if __name__ == "__main__":
    main()
