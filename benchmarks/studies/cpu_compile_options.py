"""XLA:CPU compile options for the runs verification makes (lower/lowered.py RUN_COMPILER_OPTIONS):
per coverage family, the CPU seconds of compiling and running the program and its TPU-faithful
rewrite at three sizes under each option set (the lower of two rounds, the sets alternating), and
whether the outputs equal the first set's bit for bit.

    python benchmarks/studies/cpu_compile_options.py [FAMILY ...]

CPU seconds are the process's (all threads), so a loaded machine inflates them less than wall time.
"""

from __future__ import annotations

import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from families import FAMILIES  # noqa: E402

from tpuexport import export as export_stage  # noqa: E402
from tpuexport import lower as lower_stage  # noqa: E402
from tpuexport.inputs import make_inputs  # noqa: E402
from tpuexport.lower import lowered  # noqa: E402
from tpuexport.lower.matmul_precision import MATMUL_PRECISIONS  # noqa: E402
from tpuexport.verify.tpu_numerics import tpu_faithful  # noqa: E402

BASE = {name: value for name, value in lowered.RUN_COMPILER_OPTIONS.items() if name != "xla_backend_optimization_level"}
OPTION_SETS = {"LLVM -O2 (XLA's default)": BASE, "LLVM -O1": {**BASE, "xla_backend_optimization_level": 1}}


def sizes_to_run(signature) -> list[dict[str, int]]:
    """Each dim at its minimum, a quarter and half of its maximum."""
    return [{dim.name: max(dim.min, min(dim.max, pick(dim))) for dim in signature.dims}
            for pick in (lambda d: d.min, lambda d: d.max // 4, lambda d: d.max // 2)]


def main(names: list[str]) -> None:
    print(f"{'family':10} {'options':26} {'cpu s':>7}  outputs")
    for name in names:
        built = FAMILIES[name].build()
        loaded = export_stage.LoadedSource(built["model"], built["args"], built.get("dynamic_shapes"), None, export_stage.SourceInfo("api"))
        captured = export_stage.capture(loaded)
        lowered = lower_stage.lower(captured.program, captured.signature)
        programs = (lowered.exported, tpu_faithful(lowered.exported, MATMUL_PRECISIONS[lowered.matmul_precision]))
        inputs = [[np.asarray(t) for t in make_inputs(lowered.signature.inputs, built["args"], sizes, seed=index)]
                  for index, sizes in enumerate(sizes_to_run(lowered.signature))]
        first, seconds, equal = None, {label: [] for label in OPTION_SETS}, {}
        for _ in range(2):
            for label, options in OPTION_SETS.items():
                lowered.RUN_COMPILER_OPTIONS = options
                lowered._executables.clear()
                start = time.process_time()
                outputs = [output for case in inputs for program in programs for output in lowered.run(case, program=program)]
                seconds[label].append(time.process_time() - start)
                first = first or outputs
                equal[label] = sum(np.array_equal(a, b) for a, b in zip(first, outputs))
        for label in OPTION_SETS:
            print(f"{name:10} {label:26} {min(seconds[label]):7.1f}  {equal[label]}/{len(outputs)} equal bit for bit")

if __name__ == "__main__":
    main(sys.argv[1:] or ["llama", "bert", "vit", "resnet"])
