"""Checking an artifact's TF SavedModel against the stored eager outputs, in a TensorFlow-only process.

The SavedModel is what a TF Serving host runs, with neither tpuexport nor jax nor torch
installed; so it is loaded and run in a child process (saved_model_child.py, started with
`python -I` so that nothing of this package is importable) that blocks jax and torch. The child
runs `serving_default` on every golden case, compares each output with the eager PyTorch output
under the artifact's tolerances, and calls it once at sizes outside a dim's range, which must
fail with TensorFlow's shape-assertion error.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

from tpuexport.errors import TpuExportError
from tpuexport.signature import ProgramSignature
from tpuexport.verify.report import describe_sizes

CHILD_SCRIPT = pathlib.Path(__file__).with_name("saved_model_child.py")
COMPARE_MODULE = pathlib.Path(__file__).with_name("compare.py")
TIMEOUT_SECONDS = 900


def check_saved_model(artifact_dir: pathlib.Path, manifest: dict) -> dict:
    """Runs the artifact's SavedModel at the verification sizes in a TensorFlow-only process.

    Args:
      artifact_dir: an artifact directory, or a conversion's staging directory before its rename.
      manifest: the artifact's manifest; "signature", "verification" (tolerances, golden, cases)
        and "tf_serving" (saved_model, signature) are read.
    Returns:
      JSON-able: "passed"; "cases" (one per golden case: label, sizes, passed, error, outputs
      with their errors, as in verification/report.json); "out_of_range" (sizes, rejected,
      error; None when no dim has a bound); "tensorflow" (its version); "jax_or_torch_loaded";
      "tf_seconds" (import, load, run in the child); "seconds" (wall time from process start);
      "error" when the child itself failed.
    Raises:
      TpuExportError: the manifest has no "tf_serving" section.
    """
    with TensorFlowProcess() as process:
        return process.check(artifact_dir, manifest)


class TensorFlowProcess:
    """The child process. It imports TensorFlow as soon as it starts and then waits for its
    request, so a conversion starts it early and TensorFlow's import overlaps its other stages."""

    def __init__(self):
        self.started = time.perf_counter()
        self.process = subprocess.Popen(
            [sys.executable, "-I", str(CHILD_SCRIPT)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )

    def __enter__(self) -> "TensorFlowProcess":
        return self

    def __exit__(self, *exc_info) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.communicate()

    def check(self, artifact_dir: pathlib.Path, manifest: dict) -> dict:
        """Sends the check of `artifact_dir` to the process and waits for the result.

        Returns:
          The result described in `check_saved_model`.
        Raises:
          TpuExportError: the manifest has no "tf_serving" section.
        """
        if "tf_serving" not in manifest:
            raise TpuExportError(f"{artifact_dir} has no TF SavedModel (converted with --no-saved-model); convert again without it")
        request = child_request(pathlib.Path(artifact_dir).resolve(), manifest)
        self.started = time.perf_counter()  # from here on the check's own time; TF's import is in tf_seconds
        try:
            stdout, stderr = self.process.communicate(json.dumps(request), timeout=TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            return failed_check(f"TensorFlow did not finish within {TIMEOUT_SECONDS} s", self.elapsed())
        if self.process.returncode != 0:
            return failed_check(f"the TensorFlow process exited with code {self.process.returncode}: {stderr_tail(stderr)}",
                                self.elapsed())
        return {**json.loads(stdout), "seconds": self.elapsed()}

    def elapsed(self) -> float:
        return round(time.perf_counter() - self.started, 3)


def child_request(artifact_dir: pathlib.Path, manifest: dict) -> dict:
    """What the child needs, with absolute paths and concrete shapes (the child cannot evaluate dims)."""
    signature = ProgramSignature.from_json(manifest["signature"])
    verification = manifest["verification"]
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
        "saved_model": str(artifact_dir / manifest["tf_serving"]["saved_model"]),
        "signature_name": manifest["tf_serving"]["signature"],
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


def stderr_tail(text: str, lines: int = 5) -> str:
    """The last lines of the child's stderr, on one line (TensorFlow's log noise comes first)."""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


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
