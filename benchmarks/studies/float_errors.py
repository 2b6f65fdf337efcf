"""How far a float artifact's outputs are from eager PyTorch, on CPU and as the TPU computes them,
for correct lowerings and for planted bugs.

    python benchmarks/studies/float_errors.py                          # the tiny coverage families
    python benchmarks/studies/float_errors.py resnet-50 bert-base      # full-size configs (slow)
    python benchmarks/studies/float_errors.py mlp cnn transformer      # the examples (examples/*.py)
    python benchmarks/studies/float_errors.py --bugs none --json errors.json

For every family the program is lowered as tpuexport lowers it, and again under each planted bug
(benchmarks/planted_bugs.py FLOAT_BUGS), then run at the example sizes and every dim's minimum:
plainly on XLA:CPU (true f32), TPU-faithfully for each matmul precision (verify/tpu_numerics.py),
and lowered with --precision bf16 and bf16-mixed (bfloat16 arithmetic, the same on CPU and TPU).
Per run it prints the worst output's

  normalized error  max over elements of |actual - expected| / (|expected| + rms(expected))
  relative RMS      rms(actual - expected) / rms(expected)

These distributions set the float verification rule (docs/verification.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402
RUNS = ("cpu-f32", "tpu-default", "tpu-high", "bf16", "bf16-mixed")


def output_errors(actual, expected) -> tuple[float, float]:
    """(normalized error, relative RMS) of one output, as defined in the module docstring."""
    import numpy as np

    a, e = actual.astype(np.float64), expected.astype(np.float64)
    scale = float(np.sqrt(np.mean(np.square(e)))) if e.size else 0.0
    if scale == 0.0:
        return (0.0, 0.0) if np.array_equal(a, e) else (float("inf"), float("inf"))
    difference = np.abs(a - e)
    return float(np.max(difference / (np.abs(e) + scale))), float(np.sqrt(np.mean(np.square(difference))) / scale)


def example_families() -> dict:
    """examples/<name>.py as families (their build() returns the same dict)."""
    from families import Family

    return {path.stem: Family(path.stem, "example", lambda name=path.stem: _common.build_example(name))
            for path in _common.EXAMPLES.glob("*.py")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*")
    parser.add_argument("--bugs", default="all", help="comma-separated planted bugs, 'all' or 'none'")
    parser.add_argument("--json", type=pathlib.Path, help="write every row here")
    options = parser.parse_args()
    warnings.filterwarnings("ignore")
    import numpy as np
    from families import BASE_FAMILIES, FAMILIES
    from planted_bugs import FLOAT_BUGS

    from tpuexport import export as export_stage
    from tpuexport import lower as lower_stage
    from tpuexport.lower.matmul_precision import MATMUL_PRECISIONS
    from tpuexport.verify.tpu_numerics import tpu_faithful
    from tpuexport.verify.sizes import plan_cases
    from tpuexport.verify.verification import eager_outputs, make_inputs, to_numpy

    known = {**FAMILIES, **BASE_FAMILIES, **example_families()}
    names = options.families or [name for name, family in FAMILIES.items() if family.kind != "pattern"]
    bugs = [] if options.bugs == "none" else list(FLOAT_BUGS) if options.bugs == "all" else options.bugs.split(",")
    print("| family | lowering | run | sizes | worst output | normalized error | relative RMS |")
    print("|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for name in names:
        built = known[name].build()
        loaded = export_stage.LoadedSource(built["model"], built["args"], built["dynamic_shapes"], None, export_stage.SourceInfo("api"))
        try:
            captured = export_stage.capture(loaded)
            flops = lower_stage.lower(captured.program, captured.signature).matmul_flops
        except Exception as error:  # the table reports what failed and goes on
            print(f"| {name} | - | - | - | {type(error).__name__}: {' '.join(str(error).split())[:100]} | | |", flush=True)
            continue
        signature = captured.signature
        cases = []
        for index, planned in enumerate(plan_cases(signature, flops)[:2]):  # the example and every dim at its minimum
            inputs = list(captured.example_inputs) if planned.label == "example" else make_inputs(
                signature.inputs, captured.example_inputs, planned.sizes, seed=index)
            cases.append((planned.sizes, [to_numpy(t) for t in inputs], eager_outputs(captured.reference, inputs)))
        for variant in ["correct", *bugs]:
            planted = contextlib.nullcontext() if variant == "correct" else FLOAT_BUGS[variant]()
            with planted:
                lowered = lower_stage.lower(captured.program, signature)
                bf16 = lower_stage.lower(captured.program, signature, precision="bf16")
                mixed = lower_stage.lower(captured.program, signature, precision="bf16-mixed")
            programs = {"cpu-f32": (lowered.exported, lowered.weights), "bf16": (bf16.exported, bf16.weights),
                        "bf16-mixed": (mixed.exported, mixed.weights)}
            for run in ("tpu-default", "tpu-high"):
                programs[run] = (tpu_faithful(lowered.exported, MATMUL_PRECISIONS[run.removeprefix("tpu-")]), lowered.weights)
            for run, (program, weights) in programs.items():
                for sizes, inputs, expected in cases:
                    actual = [np.asarray(o, dtype=np.float32) if np.issubdtype(np.asarray(o).dtype, np.floating) else np.asarray(o)
                              for o in program.call(list(weights), [a.astype(s.dtype) for a, s in zip(inputs, signature.inputs)])]
                    errors = {spec.name: output_errors(a, e) for spec, a, e in zip(signature.outputs, actual, expected)
                              if np.issubdtype(e.dtype, np.floating)}
                    worst = max(errors, key=lambda output: errors[output][0])
                    size_text = ",".join(f"{k}={v}" for k, v in sizes.items())
                    rows.append({"family": name, "lowering": variant, "run": run, "sizes": sizes,
                                 "outputs": {k: {"normalized": v[0], "relative_rms": v[1]} for k, v in errors.items()}})
                    print(f"| {name} | {variant} | {run} | {size_text} | {worst} | {errors[worst][0]:.2e} | {errors[worst][1]:.2e} |",
                          flush=True)
    if options.json:
        options.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
