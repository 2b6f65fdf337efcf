"""The TF Serving part of an artifact, written into the staging directory before its rename:

  tf_serving/<model name>/<version>/            SavedModel (--model_base_path=.../tf_serving/<name>)
      saved_model.pb, variables/, assets.extra/tf_serving_warmup_requests
  tf_serving/batching_parameters.txt           --batching_parameters_file (when the program batches)
  tf_serving/models.config                     --model_config_file

and then checked in a TensorFlow-only process against the golden data. A failed check stops the
conversion (SavedModelMismatch) before the artifact exists.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import re
import time
from typing import Callable, Sequence

from tpuexport._runtime import captured_native_stderr
from tpuexport.artifact import layout
from tpuexport.artifact.writer import verification_section
from tpuexport.compile import Bucket
from tpuexport.errors import TpuExportError
from tpuexport.lower import LoweredProgram
from tpuexport.artifact.tf_serving import config
from tpuexport.artifact.tf_serving.saved_model import PLATFORMS, SIGNATURE_NAME, build_saved_model, saved_model_bytes
from tpuexport.artifact.tf_serving.warmup import warmup_inputs, write_warmup_file
from tpuexport.verify import VerificationReport
from tpuexport.verify.saved_model_check import TensorFlowProcess, failure_summary

# Run-dependent parts of a check result: they go to the manifest's "build" section only.
TIMINGS = ("seconds", "tf_seconds")
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


@dataclasses.dataclass(frozen=True)
class TfServingExport:
    """An extra writer for `write_artifact`: called with the staging directory, it writes the TF
    Serving files, checks the SavedModel and returns the manifest sections "tf_serving",
    "verification" (the verify stage's block plus the "saved_model" check) and "build" (timings,
    kept there so that two conversions of the same source differ only under "build").

    Attributes:
      lowered: the lowered program and weights.
      verification: the passed verification report (golden data, tolerances, cases).
      buckets: the compiled buckets (warmup requests, allowed batch sizes).
      model_name: TF Serving's model name.
      model_version: TF Serving's version directory.
      final_dir: where the artifact will live once renamed (models.config holds absolute paths).
      checker: the TensorFlow-only process that checks the SavedModel; a conversion starts it
        early so that TensorFlow's import overlaps its other stages. None starts one here.
      buckets_compiled: waits until the buckets are compiled (raising if one cannot be, e.g. does
        not fit in HBM), called once the SavedModel is built and before warmup requests are made
        for the buckets; None when they already are.
      module_bytes: the program as TensorFlow runs it (`tensorflow_module`), when the conversion
        has made it already, or None.
      on_step: optional callable (step, seconds, detail), the conversion's progress lines.
    """

    lowered: LoweredProgram
    verification: VerificationReport
    buckets: Sequence[Bucket]
    model_name: str
    model_version: int
    final_dir: pathlib.Path
    checker: TensorFlowProcess | None = None
    buckets_compiled: Callable[[], object] | None = None
    module_bytes: bytes | None = None
    on_step: Callable[[str, float, str], None] | None = None

    def __call__(self, staging: pathlib.Path) -> dict:
        """Writes, checks and describes the TF Serving files in `staging`.

        Returns:
          The manifest sections {"tf_serving": ..., "verification": ..., "build": {"tf_serving_seconds": ...}}.
        Raises:
          TpuExportError: TensorFlow could not build the SavedModel.
          SavedModelMismatch: the SavedModel does not reproduce the golden outputs, or accepts
            out-of-range sizes.
        """
        verification = verification_section(self.verification)
        # Started first (unless the conversion did earlier): the checking process imports TensorFlow
        # while the SavedModel is built.
        with (contextlib.nullcontext(self.checker) if self.checker else TensorFlowProcess()) as checker:
            started = time.perf_counter()
            section = self.write_files(staging)
            build_seconds = round(time.perf_counter() - started, 3)
            self.report_step("saved_model", build_seconds,
                             f"{section['saved_model_bytes'] / 2**20:.2f} MiB, TF Serving model {self.model_name} v{self.model_version}")
            result = checker.check(staging, {"signature": self.lowered.signature.to_json(),
                                             "verification": verification, "tf_serving": section})
        self.report_step("check saved_model", result["seconds"],
                         f"{len(result['cases'])} size(s) in TensorFlow, {'passed' if result['passed'] else 'FAILED'}")
        outcome = {name: value for name, value in result.items() if name not in TIMINGS}
        report = self.record_in_report(staging, outcome)
        if not result["passed"]:
            raise SavedModelMismatch(report, failure_summary(result))
        timings = {"build": build_seconds, "check": result["seconds"], **{f"tf_{k}": v for k, v in result["tf_seconds"].items()}}
        return {
            "tf_serving": section,
            "verification": {**verification, "saved_model": manifest_summary(outcome)},
            "build": {"tf_serving_seconds": timings},
        }

    def write_files(self, staging: pathlib.Path) -> dict:
        """Writes the SavedModel, its warmup requests and the server configuration.

        Returns:
          The manifest's "tf_serving" section (without timings).
        """
        saved_model = layout.saved_model_path(self.model_name, self.model_version)
        directory = staging / saved_model
        # TensorFlow's native start-up logging (CUDA probing, CPU features) is noise for a CPU build.
        with captured_native_stderr():
            try:
                build_saved_model(self.lowered, directory, self.module_bytes)
            except TpuExportError:
                raise
            except Exception as error:  # TensorFlow raises many kinds
                message = " ".join(str(error).split())[:300]
                raise TpuExportError(f"building the TF SavedModel failed ({type(error).__name__}: {message}); "
                                     "pass --no-saved-model (saved_model=False) to skip it") from None
        if self.buckets_compiled is not None:
            self.buckets_compiled()  # warmup requests are made for buckets the TPU compiler accepted
        requests = warmup_inputs(self.lowered.signature, self.verification, self.buckets)
        write_warmup_file(directory / layout.WARMUP_REQUESTS, self.model_name, requests)

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
