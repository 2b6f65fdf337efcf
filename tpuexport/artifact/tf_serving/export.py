"""The TF Serving part of an artifact, written into the staging directory before its rename:

  tf_serving/<model name>/<version>/            SavedModel (--model_base_path=.../tf_serving/<name>)
      saved_model.pb, variables/, assets.extra/tf_serving_warmup_requests
  tf_serving/batching_parameters.txt           --batching_parameters_file (when the program batches)
  tf_serving/models.config                     --model_config_file

all made by a TensorFlow-only process (tensorflow_process.py), which then checks the SavedModel
against the golden data. A failed check stops the conversion (SavedModelMismatch) before the
artifact exists.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import time
from typing import Callable, Sequence

from tpuexport.artifact import layout
from tpuexport.compile import Bucket
from tpuexport.errors import TpuExportError
from tpuexport.lower import LoweredProgram
from tpuexport.artifact.tf_serving import config
from tpuexport.artifact.weights import write_arrays
from tpuexport.artifact.tf_serving.saved_model import (
    PLATFORMS, SIGNATURE_NAME, SKIP_HINT, build_request, saved_model_bytes, tensorflow_module,
)
from tpuexport.artifact.tf_serving.tensorflow_process import TensorFlowProcess
from tpuexport.artifact.tf_serving.warmup import warmup_inputs, write_warmup_file
from tpuexport.verify import VerificationReport
from tpuexport.verify.saved_model_check import child_request, failed_check, failure_summary

# Run-dependent parts of a check result: they go to the manifest's "build" section only ("ok" is the
# reply's own flag).
TIMINGS = ("seconds", "tf_seconds", "ok")
# TF Serving puts the name in URLs (/v1/models/<name>) and the base path; keep it to safe characters.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def check_model_name(name: str) -> str:
    """Returns `name` if TF Serving can serve a model under it.

    Raises:
      TpuExportError: empty or with characters other than letters, digits, '_', '.', '-'.
    """
    if not MODEL_NAME.fullmatch(name or ""):
        raise TpuExportError(f"model name {name!r} is not usable by TF Serving; pass --name with letters, digits, '_', '.', '-'")
    return name


def check_model_version(version: int) -> int:
    """Returns `version` if it is a TF Serving version number (a non-negative integer).

    Raises:
      TpuExportError: not a non-negative integer.
    """
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise TpuExportError(f"model version {version!r} is not a non-negative integer; pass --version 1 (or another integer)")
    return version


def default_model_name(out: pathlib.Path) -> str:
    """The artifact directory's stem ("mlp" for mlp.tpu), the API's default model name."""
    return pathlib.Path(out).stem


class SavedModelMismatch(Exception):
    """The SavedModel check failed; the conversion reports it as a verification failure.

    Attributes:
      report: verification/report.json's contents with the "saved_model" section, "passed" false.
      summary: what failed, one clause per failure.
    """

    def __init__(self, report: dict, summary: str):
        super().__init__(summary)
        self.report = report
        self.summary = summary


class SavedModelBuild:
    """The SavedModel, saved by the TensorFlow process while the conversion goes on.

    Started right after lowering: the program's module is written in TensorFlow's form and loaded
    by TensorFlow's reader (a program TensorFlow cannot take fails here, in seconds), the weights
    are written once (the file becomes the artifact's weights file), and the process is asked to
    save the SavedModel; `finish` collects it.

    Attributes:
      directory: where the SavedModel is being saved (inside `scratch`).
      weights_file: the weights as safetensors, by state_dict name.
    """

    def __init__(self, lowered: LoweredProgram, tensorflow: TensorFlowProcess, scratch: pathlib.Path,
                 weights_file: pathlib.Path | None = None):
        """Starts the build.

        Args:
          lowered: the lowered program and its weights.
          tensorflow: the TensorFlow process (started earlier, so its import overlapped).
          scratch: a directory of the conversion's own, on the artifact's filesystem (the files
            made here are moved into the artifact).
          weights_file: the weights already written as safetensors (streamed from a checkpoint),
            or None to write them from `lowered.weights`.
        Raises:
          TpuExportError: TensorFlow cannot load the program.
        """
        self.tensorflow = tensorflow
        module = tensorflow_module(lowered, tensorflow, scratch / "tensorflow_module.mlirbc")
        self.weights_file = weights_file or scratch / "weights.safetensors"
        if weights_file is None:
            write_arrays(self.weights_file, lowered.weight_names, lowered.weights)
        self.directory = scratch / "saved_model"
        self.started = time.perf_counter()
        tensorflow.send("build", **build_request(lowered, self.directory, module, self.weights_file))

    def finish(self, destination: pathlib.Path) -> float:
        """Waits for the SavedModel and moves it to `destination`.

        Returns:
          Seconds from the start of the build to its end (it ran alongside the conversion).
        Raises:
          TpuExportError: TensorFlow could not save it.
        """
        reply = self.tensorflow.receive("build")
        if not reply["ok"]:
            raise TpuExportError(f"building the TF SavedModel failed ({reply['error']}); {SKIP_HINT}")
        destination.parent.mkdir(parents=True, exist_ok=True)
        os.rename(self.directory, destination)
        return round(time.perf_counter() - self.started, 3)


@dataclasses.dataclass(frozen=True)
class TfServingExport:
    """An extra writer for `write_artifact`: called with the staging directory, it puts the TF
    Serving files there, checks the SavedModel and returns the manifest sections "tf_serving",
    "verification" (the verify stage's block plus the "saved_model" check) and "build" (timings,
    kept there so that two conversions of the same source differ only under "build").

    Attributes:
      lowered: the lowered program and weights.
      verification: the passed verification report (golden data, tolerances, cases).
      buckets: the compiled buckets (warmup requests, allowed batch sizes).
      model_name: TF Serving's model name.
      model_version: TF Serving's version directory.
      final_dir: where the artifact will live once renamed (models.config holds absolute paths).
      build: the SavedModel being saved (SavedModelBuild).
      scratch: the conversion's scratch directory (for the warmup requests' arrays).
      buckets_compiled: waits until the buckets are compiled (raising if one cannot be, e.g. does
        not fit in HBM), called before warmup requests are made for the buckets; None when they
        already are.
      on_step: optional callable (step, seconds, detail), the conversion's progress lines.
    """

    lowered: LoweredProgram
    verification: VerificationReport
    buckets: Sequence[Bucket]
    model_name: str
    model_version: int
    final_dir: pathlib.Path
    build: SavedModelBuild
    scratch: pathlib.Path
    buckets_compiled: Callable[[], object] | None = None
    on_step: Callable[[str, float, str], None] | None = None

    def __call__(self, staging: pathlib.Path) -> dict:
        """Writes, checks and describes the TF Serving files in `staging`.

        Returns:
          The manifest sections {"tf_serving": ..., "verification": ..., "build": {"tf_serving_seconds": ...}}.
        Raises:
          TpuExportError: TensorFlow could not build the SavedModel or its warmup file.
          SavedModelMismatch: the SavedModel does not reproduce the golden outputs, or accepts
            out-of-range sizes.
        """
        verification = self.verification.manifest_section()
        tensorflow = self.build.tensorflow
        saved_model = layout.saved_model_path(self.model_name, self.model_version)
        build_seconds = self.build.finish(staging / saved_model)
        section = self.write_files(staging, saved_model, tensorflow)
        self.report_step("saved_model", build_seconds,
                         f"{section['saved_model_bytes'] / 2**20:.2f} MiB, TF Serving model {self.model_name} v{self.model_version}, "
                         "saved by TensorFlow alongside verify")
        started = time.perf_counter()
        reply = tensorflow.request("check", **child_request(staging, self.lowered.signature, verification, section))
        result = {**reply, "seconds": round(time.perf_counter() - started, 3)} if reply["ok"] else failed_check(reply["error"], 0.0)
        self.report_step("check saved_model", result["seconds"],
                         f"{len(result['cases'])} size(s) in TensorFlow, {'passed' if result['passed'] else 'FAILED'}")
        outcome = {name: value for name, value in result.items() if name not in TIMINGS}
        report = self.record_in_report(staging, outcome)
        if not result["passed"]:
            raise SavedModelMismatch(report, failure_summary(result))
        timings = {"build": build_seconds, "check": result["seconds"], "tf_import": tensorflow.versions()["import_seconds"],
                   **{f"tf_{k}": v for k, v in result["tf_seconds"].items()}}
        return {
            "tf_serving": section,
            "verification": {"saved_model": manifest_summary(outcome)},
            "build": {"tf_serving_seconds": timings},
        }

    def write_files(self, staging: pathlib.Path, saved_model: str, tensorflow: TensorFlowProcess) -> dict:
        """Writes the SavedModel's warmup requests and the server configuration.

        Returns:
          The manifest's "tf_serving" section (without timings).
        Raises:
          TpuExportError: TensorFlow could not write the warmup file.
        """
        directory = staging / saved_model
        if self.buckets_compiled is not None:
            self.buckets_compiled()  # warmup requests are made for buckets the TPU compiler accepted
        requests = warmup_inputs(self.lowered.signature, self.verification, self.buckets)
        write_warmup_file(tensorflow, directory / layout.WARMUP_REQUESTS, self.model_name, requests, self.scratch)

        base_path = f"{layout.TF_SERVING_DIR}/{self.model_name}"
        final_dir = pathlib.Path(self.final_dir).resolve()
        absolute_base_path = str(final_dir / base_path)
        (staging / layout.MODELS_CONFIG).write_text(config.models_config_text(self.model_name, absolute_base_path, self.model_version))
        batch_sizes = self.write_batching_parameters(staging)
        batching_file = layout.BATCHING_PARAMETERS if batch_sizes else None
        return {
            "model_name": self.model_name,
            "model_version": self.model_version,
            "signature": SIGNATURE_NAME,
            "platforms": list(PLATFORMS),
            "model_base_path": base_path,
            "saved_model": saved_model,
            "saved_model_bytes": saved_model_bytes(directory),
            "warmup_requests": f"{saved_model}/{layout.WARMUP_REQUESTS}",
            "warmup_request_count": len(requests),
            "models_config": layout.MODELS_CONFIG,
            "batching_parameters": batching_file,
            "allowed_batch_sizes": batch_sizes,
            "server_command": config.server_command(
                self.model_name, absolute_base_path,
                str(final_dir / batching_file) if batching_file else None,
            ),
        }

    def write_batching_parameters(self, staging: pathlib.Path) -> list[int] | None:
        """Writes batching_parameters.txt when the program has a batch dim.

        Returns:
          The allowed batch sizes, or None when server-side batching does not apply.
        """
        signature = self.lowered.signature
        batch = config.batch_dim(signature)
        if batch is None:
            return None
        sizes = config.allowed_batch_sizes(batch, self.buckets)
        others = [dim.name for dim in signature.dims if dim.name != batch]
        (staging / layout.BATCHING_PARAMETERS).write_text(config.batching_parameters_text(batch, sizes, others))
        return sizes

    def record_in_report(self, staging: pathlib.Path, outcome: dict) -> dict:
        """Adds the check's outcome to verification/report.json (its "passed" then covers both checks).

        Returns:
          The updated report.
        """
        path = staging / layout.VERIFICATION_REPORT
        report = json.loads(path.read_text())
        report["passed"] = report["passed"] and outcome["passed"]
        report["saved_model"] = outcome
        path.write_text(json.dumps(report, indent=2) + "\n")
        return report

    def report_step(self, step: str, seconds: float, detail: str) -> None:
        if self.on_step:
            self.on_step(step, seconds, detail)


def manifest_summary(outcome: dict) -> dict:
    """The check as the manifest's "verification" block records it (details in report.json)."""
    return {
        "passed": outcome["passed"],
        "report": layout.VERIFICATION_REPORT,
        "cases": [{"label": c["label"], "sizes": c["sizes"], "passed": c["passed"]} for c in outcome["cases"]],
        "out_of_range": outcome["out_of_range"],
        "tensorflow": outcome["tensorflow"],
    }
