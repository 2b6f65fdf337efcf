"""What the check of an artifact's TF SavedModel against the stored eager outputs asks and reports.

The check itself runs in the artifact stage (artifact/tf_serving/check.py), which owns the
TensorFlow process; this module builds its request and reads its outcome. The SavedModel is what a
TF Serving host runs, with neither tpuexport nor jax nor torch installed; so it is loaded and run in a child process (artifact/tf_serving/tensorflow_child.py,
started with `python -I` so that nothing of this package is importable) that blocks jax and torch. The child
runs `serving_default` on every golden case, compares each output with the eager PyTorch output
under the artifact's tolerances, and calls it once at sizes outside a dim's range, which must
fail with TensorFlow's shape-assertion error.
"""

from __future__ import annotations

import pathlib

from tpuexport.signature import ProgramSignature
from tpuexport.verify.report import describe_sizes

COMPARE_MODULE = pathlib.Path(__file__).with_name("compare.py")


def child_request(artifact_dir: pathlib.Path, signature: ProgramSignature, verification: dict, tf_serving: dict) -> dict:
    """What the child needs, with absolute paths and concrete shapes (the child cannot evaluate dims).

    Args:
      artifact_dir: the artifact (or its staging) directory.
      signature: the served entry point's signature.
      verification, tf_serving: the manifest's sections of those names.
    """
    cases = [
        {
            "label": case["label"],
            "sizes": case["sizes"],
            "inputs": {spec.name: f"{index}/input/{spec.name}" for spec in signature.inputs},
            "outputs": {spec.name: f"{index}/output/{spec.name}" for spec in signature.outputs},
        }
        for index, case in enumerate(verification["cases"])
        if case["golden"]
    ]
    return {
        "saved_model": str(artifact_dir / tf_serving["saved_model"]),
        "signature_name": tf_serving["signature"],
        "golden": str(artifact_dir / verification["golden"]),
        "compare_module": str(COMPARE_MODULE),
        "inputs": [{"name": spec.name, "dtype": spec.dtype} for spec in signature.inputs],
        "outputs": [spec.name for spec in signature.outputs],
        # TensorFlow runs the SavedModel's StableHLO with XLA:CPU, in plain f32: the "cpu" run's rule.
        "tolerances": verification["tolerances"]["cpu"],
        "cases": cases,
        "out_of_range": out_of_range_call(signature),
    }


def out_of_range_call(signature: ProgramSignature) -> dict | None:
    """Sizes one past a dim's bound (the example sizes elsewhere) and the input shapes there.

    Returns:
      {"sizes", "shapes": {input name: shape}}, or None when no dim has a bound to cross.
    """
    sizes = signature.example_sizes()
    for dim in signature.dims:
        if dim.max is not None:
            sizes[dim.name] = dim.max + 1
            break
        if dim.min > 1:
            sizes[dim.name] = dim.min - 1
            break
    else:
        return None
    return {"sizes": sizes, "shapes": {spec.name: list(spec.concrete_shape(sizes)) for spec in signature.inputs}}


def failed_check(error: str, seconds: float) -> dict:
    return {"passed": False, "error": error, "cases": [], "out_of_range": None, "seconds": round(seconds, 3)}


def failure_summary(result: dict) -> str:
    """Names what failed in a check result, one clause each (for the conversion's error message)."""
    if result.get("error"):
        return f"TF SavedModel check failed: {result['error']}"
    clauses = []
    for case in result["cases"]:
        sizes = describe_sizes(case["sizes"])
        if case["error"]:
            clauses.append(f"TF SavedModel at {sizes} raised: {case['error']}")
        for output in case["outputs"]:
            if not output["passed"]:
                clauses.append(
                    f"TF SavedModel output {output['name']!r} at {sizes}: max abs error {output['max_abs_error']:.3g}, "
                    f"relative RMS error {output['relative_rms_error']:.3g}, "
                    f"{output['mismatched']}/{output['elements']} elements outside tolerance"
                )
    out_of_range = result["out_of_range"]
    if out_of_range and not out_of_range["rejected"]:
        clauses.append(f"TF SavedModel accepted out-of-range sizes {out_of_range['sizes']} ({out_of_range['error'] or 'no error'})")
    return "; ".join(clauses) or "TF SavedModel check failed"
