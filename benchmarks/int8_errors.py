"""How far an int8 artifact's outputs are from the PT2E reference, correct and with planted bugs.

    python benchmarks/int8_errors.py                        # the tiny coverage families
    python benchmarks/int8_errors.py bert-base resnet-50    # full-size configs (slow)
    python benchmarks/int8_errors.py --bugs none            # correct lowerings only

For every family the static-int8 program is lowered as tpuexport lowers it and again under each
planted bug (benchmarks/planted_bugs.py), run at the verification sizes, and compared with the
PT2E-converted model run eagerly. Per output and size it prints the SQNR against that reference
and the share of elements more than k int8 steps away (one step = max|reference| / 127). These
distributions set the int8 verification rule (docs/quantization.md).
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import warnings

HERE = pathlib.Path(__file__).resolve().parent
STEPS = (0.5, 1, 2, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*")
    parser.add_argument("--bugs", default="all", help="comma-separated planted bugs, 'all' or 'none'")
    options = parser.parse_args()
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(HERE))
    import numpy as np
    from families import BASE_FAMILIES, FAMILIES
    from planted_bugs import INT8_BUGS

    from tpuexport import export as export_stage
    from tpuexport import lower as lower_stage
    from tpuexport.quantize import quantize
    from tpuexport.verify.compare import sqnr_db
    from tpuexport.verify.verification import eager_outputs, make_inputs, to_numpy, verification_sizes

    known = {**FAMILIES, **BASE_FAMILIES}
    names = options.families or [name for name, family in FAMILIES.items() if family.kind != "pattern"]
    bugs = [] if options.bugs == "none" else list(INT8_BUGS) if options.bugs == "all" else options.bugs.split(",")
    print("| family | lowering | output | sizes | SQNR vs PT2E dB | " + " | ".join(f"> {k} step" for k in STEPS) + " | max steps |")
    print("|---|---|---|---|---|" + "---|" * len(STEPS) + "---|", flush=True)
    for name in names:
        built = known[name].build()
        loaded = export_stage.LoadedSource(built["model"], built["args"], built["dynamic_shapes"], built["calibration"],
                                           export_stage.SourceInfo("api"))
        try:
            captured = export_stage.capture(loaded)
            quantized = quantize(captured, "int8")
        except Exception as error:  # the table reports what failed and goes on
            print(f"| {name} | - | - | - | {type(error).__name__}: {' '.join(str(error).split())[:100]} |", flush=True)
            continue
        program, signature = quantized.captured.program, quantized.captured.signature
        cases = []
        for index, (label, sizes) in enumerate(verification_sizes(signature)):
            inputs = list(captured.example_inputs) if label == "example" else make_inputs(
                signature.inputs, captured.example_inputs, sizes, seed=index)
            cases.append((sizes, inputs, eager_outputs(quantized.captured.reference, inputs)))
        for variant in ["correct", *bugs]:
            planted = contextlib.nullcontext() if variant == "correct" else INT8_BUGS[variant]()
            with planted:
                lowered = lower_stage.lower(program, signature)
            for sizes, inputs, expected in cases:
                actual = lowered.run([to_numpy(t) for t in inputs])
                for spec, a, e in zip(signature.outputs, actual, expected):
                    if not np.issubdtype(e.dtype, np.floating):
                        continue
                    steps = np.abs(a.astype(np.float64) - e) / (np.abs(e).max() / 127)
                    beyond = " | ".join(f"{float((steps > k).mean()):.1e}" for k in STEPS)
                    sqnr = sqnr_db([e], [a])
                    size_text = ",".join(f"{k}={v}" for k, v in sizes.items())
                    print(f"| {name} | {variant} | {spec.name} | {size_text} | {'exact' if sqnr is None else sqnr} | {beyond} | "
                          f"{float(steps.max()):.2f} |", flush=True)


if __name__ == "__main__":
    main()
