"""Runs an artifact's TF SavedModel in a process that has TensorFlow and nothing of tpuexport,
torch or jax, as a TF Serving host would; run by saved_model_check.py, not imported.

    python -I saved_model_child.py < request.json > result.json

It imports TensorFlow before reading its request, so that it can be started ahead of time.
The request (JSON on stdin) names the SavedModel, the golden file, the comparison rule's module
(compare.py, loaded by path so that the rule is the same as the verify stage's), the inputs,
tolerances, the cases to run and one out-of-range call. The result (JSON on stdout) holds one
entry per case in verification/report.json's case format, the out-of-range outcome and timings.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import sys
import time

# tensorflow.lite imports jax when it can; blocking it (and torch) proves the SavedModel needs neither.
for _blocked in ("jax", "torch"):
    sys.modules[_blocked] = None

SHAPE_ASSERTION = re.compile(r"Input shapes do not match the symbolic shape constraint [^.]*")


def load_compare_module(path: str):
    """The verify stage's compare.py, loaded from its file without importing the tpuexport package."""
    spec = importlib.util.spec_from_file_location("tpuexport_compare", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolves annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def run_case(serve, request: dict, case: dict, golden: dict, compare) -> dict:
    """Calls serving_default on one golden case's inputs and compares with its eager outputs.

    Returns:
      The case in report.json's format (label, sizes, passed, error, outputs).
    """
    import numpy as np
    import tensorflow as tf

    tolerances = compare.Tolerances(**request["tolerances"])
    feed = {
        spec["name"]: tf.constant(golden[case["inputs"][spec["name"]]].astype(tf.as_dtype(spec["dtype"]).as_numpy_dtype))
        for spec in request["inputs"]
    }
    try:
        results = serve(**feed)
    except tf.errors.OpError as error:
        return {**case_header(case), "passed": False, "error": " ".join(error.message.split())[:500], "outputs": []}
    outputs = [
        compare.compare_output(name, np.asarray(results[name].numpy()), golden[case["outputs"][name]], tolerances)
        for name in request["outputs"]
    ]
    return {
        **case_header(case),
        "passed": all(o.passed for o in outputs),
        "error": None,
        "outputs": [{**dataclasses.asdict(o), "passed": o.passed} for o in outputs],
    }


def case_header(case: dict) -> dict:
    return {"label": case["label"], "sizes": case["sizes"]}


def run_out_of_range(serve, request: dict) -> dict:
    """Calls serving_default at sizes outside a dim's range; it must fail with a shape assertion.

    Returns:
      {"sizes", "rejected": whether TF raised the shape-assertion error, "error": its message}.
    """
    import tensorflow as tf

    check = request["out_of_range"]
    feed = {
        spec["name"]: tf.zeros(check["shapes"][spec["name"]], tf.as_dtype(spec["dtype"]))
        for spec in request["inputs"]
    }
    try:
        serve(**feed)
    except tf.errors.InvalidArgumentError as error:
        found = SHAPE_ASSERTION.search(error.message)
        message = found.group(0) if found else " ".join(error.message.split())[:300]
        return {"sizes": check["sizes"], "rejected": found is not None, "error": message}
    return {"sizes": check["sizes"], "rejected": False, "error": None}


def main() -> None:
    # TensorFlow first, the request second: the parent writes the SavedModel meanwhile.
    started = time.perf_counter()
    import safetensors.numpy
    import tensorflow as tf

    imported = time.perf_counter()
    request = json.load(sys.stdin)
    waited = time.perf_counter()
    serve = tf.saved_model.load(request["saved_model"]).signatures[request["signature_name"]]
    loaded = time.perf_counter()
    compare = load_compare_module(request["compare_module"])
    with open(request["golden"], "rb") as golden_file:
        golden = safetensors.numpy.load(golden_file.read())
    cases = [run_case(serve, request, case, golden, compare) for case in request["cases"]]
    out_of_range = run_out_of_range(serve, request) if request["out_of_range"] else None
    finished = time.perf_counter()
    json.dump({
        "passed": bool(cases) and all(c["passed"] for c in cases) and (out_of_range is None or out_of_range["rejected"]),
        "cases": cases,
        "out_of_range": out_of_range,
        "tensorflow": tf.__version__,
        "jax_or_torch_loaded": any(sys.modules.get(name) is not None for name in ("jax", "torch")),
        "tf_seconds": {
            "import": round(imported - started, 3),
            "load": round(loaded - waited, 3),
            "run": round(finished - loaded, 3),
        },
    }, sys.stdout)


if __name__ == "__main__":
    main()
