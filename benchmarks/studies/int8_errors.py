"""How far an int8 artifact's outputs are from the PT2E reference, correct and with planted bugs.

    python benchmarks/studies/int8_errors.py                                 # the tiny coverage families, static int8
    python benchmarks/studies/int8_errors.py bert-base --modes int8,int8-weight-only
    python benchmarks/studies/int8_errors.py --bugs none --json int8.json    # correct lowerings only

For every family and mode the program is lowered as tpuexport lowers it and again under each
planted bug (benchmarks/planted_bugs.py INT8_BUGS), run at the verification sizes plainly on
XLA:CPU ("cpu") and TPU-faithfully ("tpu", default matmul precision), and compared with the
PT2E-converted model run eagerly. Per output and size it prints the SQNR against that reference
and the share of elements more than k int8 steps away (one step = max|reference| / 127); per
lowering, one "op-by-op" row: whether every op conforms when fed the reference's own values
(verify/conformance.py, at the cheapest size), and the worst float error and tie share. These
distributions set the int8 verification rule (docs/quantization.md).
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
STEPS = (1, 2, 4, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*")
    parser.add_argument("--modes", default="int8", help="comma-separated int8 modes")
    parser.add_argument("--bugs", default="all", help="comma-separated planted bugs, 'all' or 'none'")
    parser.add_argument("--json", type=pathlib.Path, help="write every row here")
    options = parser.parse_args()
    warnings.filterwarnings("ignore")
    import numpy as np
    from families import BASE_FAMILIES, FAMILIES
    from planted_bugs import INT8_BUGS

    from tpuexport import export as export_stage
    from tpuexport import lower as lower_stage
    from tpuexport.quantize import quantize
    from tpuexport.verify.compare import sqnr_db
    from tpuexport.verify.conformance import check_ops
    from tpuexport.verify.sizes import plan_cases
    from tpuexport.verify.verification import ProgramRuns, eager_outputs, make_inputs, to_numpy

    known = {**FAMILIES, **BASE_FAMILIES}
    names = options.families or [name for name, family in FAMILIES.items() if family.kind != "pattern"]
    bugs = [] if options.bugs == "none" else list(INT8_BUGS) if options.bugs == "all" else options.bugs.split(",")
    print("| family | mode | lowering | run | output | sizes | SQNR vs PT2E dB | " + " | ".join(f"> {k} step" for k in STEPS) + " | max steps |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(STEPS) + "---|", flush=True)
    rows = []
    for name in names:
        built = known[name].build()
        loaded = export_stage.LoadedSource(built["model"], built["args"], built["dynamic_shapes"], built["calibration"],
                                           export_stage.SourceInfo("api"))
        for mode in options.modes.split(","):
            try:
                captured = export_stage.capture(loaded)
                quantized = quantize(captured, mode)
                program, signature = quantized.captured.program, quantized.captured.signature
                flops = lower_stage.lower(program, signature).matmul_flops
            except Exception as error:  # the table reports what failed and goes on
                print(f"| {name} | {mode} | - | - | - | - | {type(error).__name__}: {' '.join(str(error).split())[:100]} |", flush=True)
                continue
            cases = []
            planned_cases = plan_cases(signature, flops)
            cheapest = min(range(len(planned_cases)), key=lambda index: planned_cases[index].flops)
            for index, planned in enumerate(planned_cases):
                inputs = list(captured.example_inputs) if planned.label == "example" else make_inputs(
                    signature.inputs, captured.example_inputs, planned.sizes, seed=index)
                cases.append((planned.sizes, inputs, eager_outputs(quantized.captured.reference, inputs)))
            for variant in ["correct", *bugs]:
                planted = contextlib.nullcontext() if variant == "correct" else INT8_BUGS[variant]()
                with planted:
                    lowered = lower_stage.lower(program, signature)
                    runs = ProgramRuns(lowered)
                    sizes, inputs, _ = cases[cheapest]
                    conformance = check_ops(lowered.graph, inputs, sizes)
                verdict = "conforms" if conformance.passed else f"{len(conformance.failures)} op(s) fail, first: {conformance.failures[0][:80]}"
                rows.append({"family": name, "mode": mode, "lowering": variant, "run": "op-by-op", "sizes": sizes,
                             **conformance.to_json()})
                print(f"| {name} | {mode} | {variant} | op-by-op | {conformance.ops} ops | {','.join(f'{k}={v}' for k, v in sizes.items())} | "
                      f"{verdict}; worst float error {conformance.worst_float_error:.1e}, ties {conformance.worst_tie_fraction:.1e} |", flush=True)
                for sizes, inputs, expected in cases:
                    actual = runs.run([to_numpy(t) for t in inputs])
                    for run in ("cpu", "tpu"):
                        for spec, a, e in zip(signature.outputs, actual[run], expected):
                            if not np.issubdtype(e.dtype, np.floating):
                                continue
                            steps = np.abs(a.astype(np.float64) - e) / (np.abs(e).max() / 127)
                            beyond = {k: float((steps > k).mean()) for k in STEPS}
                            sqnr = sqnr_db([e], [a])
                            size_text = ",".join(f"{k}={v}" for k, v in sizes.items())
                            rows.append({"family": name, "mode": mode, "lowering": variant, "run": run, "output": spec.name,
                                         "sizes": sizes, "sqnr_db": sqnr, "beyond": beyond, "max_steps": float(steps.max())})
                            print(f"| {name} | {mode} | {variant} | {run} | {spec.name} | {size_text} | "
                                  f"{'exact' if sqnr is None else sqnr} | " + " | ".join(f"{v:.1e}" for v in beyond.values())
                                  + f" | {float(steps.max()):.2f} |", flush=True)
    if options.json:
        options.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
