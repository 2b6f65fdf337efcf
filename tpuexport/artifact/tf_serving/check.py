"""Re-running an artifact's TF SavedModel on its golden data, in a TensorFlow-only process
(what the request holds and how the outcome reads: verify/saved_model_check.py)."""

from __future__ import annotations

import pathlib

from tpuexport.artifact.tf_serving.tensorflow_process import TensorFlowProcess
from tpuexport.errors import TpuExportError
from tpuexport.signature import ProgramSignature
from tpuexport.verify.saved_model_check import child_request, failed_check


def check_saved_model(artifact_dir: pathlib.Path, manifest: dict) -> dict:
    """Runs the artifact's SavedModel at the verification sizes in a TensorFlow-only process.

    Args:
      artifact_dir: an artifact directory, or a conversion's staging directory before its rename.
      manifest: the artifact's manifest; the served entry point's signature, "verification"
        (tolerances, golden, cases) and "tf_serving" (saved_model, signature) are read.
    Returns:
      JSON-able: "passed"; "cases" (one per golden case: label, sizes, passed, error, outputs
      with their errors, as in verification/report.json); "out_of_range" (sizes, rejected,
      error; None when no dim has a bound); "tensorflow" (its version); "jax_or_torch_loaded";
      "tf_seconds" (import, load, run in the child); "seconds" (wall time, the process's start
      included); "error" when the child itself failed.
    Raises:
      TpuExportError: the manifest has no "tf_serving" section.
    """
    if "tf_serving" not in manifest:
        raise TpuExportError(f"{artifact_dir} has no TF SavedModel (converted with --no-saved-model); convert again without it")
    with TensorFlowProcess() as tensorflow:
        try:
            signature = ProgramSignature.from_json(manifest["entry_points"][manifest["tf_serving"]["signature"]]["signature"])
            reply = tensorflow.request("check", **child_request(pathlib.Path(artifact_dir).resolve(), signature, manifest["verification"],
                                                                manifest["tf_serving"]))
        except TpuExportError as error:
            return failed_check(str(error), tensorflow.elapsed())
        if not reply["ok"]:
            return failed_check(reply["error"], tensorflow.elapsed())
        tf_seconds = {"import": tensorflow.versions()["import_seconds"], **reply["tf_seconds"]}
        return {**reply, "tf_seconds": tf_seconds, "seconds": tensorflow.elapsed()}
