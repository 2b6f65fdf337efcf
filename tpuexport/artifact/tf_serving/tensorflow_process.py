"""The process that does everything TensorFlow does for an artifact (tensorflow_child.py).

TensorFlow never loads into the converting process: the child imports it from the moment a
conversion starts (overlapping export and lowering), checks that TensorFlow's StableHLO reader
loads the program right after lowering, saves the SavedModel while verification and the TPU
compiler run, and finally writes the warmup file and checks the SavedModel on the golden cases.
That it has no jax, torch or tpuexport is also what proves the SavedModel needs none of them.
"""

from __future__ import annotations

import json
import os
import pathlib
import select
import subprocess
import sys
import tempfile
import time

from tpuexport.errors import TpuExportError
from tpuexport.lower.lowered import CPU_COMPILER_OPTIONS

CHILD_SCRIPT = pathlib.Path(__file__).with_name("tensorflow_child.py")
TIMEOUT_SECONDS = 900


def with_cpu_compiler_options(environment) -> dict:
    """The environment with XLA_FLAGS carrying how the converting process compiles for CPU
    (lowered.CPU_COMPILER_OPTIONS), so TensorFlow's XLA runs the program in the same memory."""
    flags = " ".join(f"--{name}={value}" for name, value in CPU_COMPILER_OPTIONS.items())
    # TensorFlow's C++ logging at errors only (its stderr is read only when it fails).
    return {"TF_CPP_MIN_LOG_LEVEL": "2", **environment, "XLA_FLAGS": f"{environment.get('XLA_FLAGS', '')} {flags}".strip()}


class TensorFlowProcess:
    """The child process; a context manager that ends it on exit.

    Attributes:
      started: when the process was started (perf_counter).
    """

    def __init__(self):
        self.started = time.perf_counter()
        self.stderr = tempfile.TemporaryFile(mode="w+b")  # TensorFlow logs there; read only when it fails
        self.process = subprocess.Popen(
            [sys.executable, "-I", str(CHILD_SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
            env=with_cpu_compiler_options(os.environ),
        )
        self._versions: dict | None = None

    def __enter__(self) -> "TensorFlowProcess":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.stderr.close()

    def versions(self) -> dict:
        """TensorFlow's version, its StableHLO version and its XlaCallModule's highest calling
        convention, as the child announced them once TensorFlow was imported (waits for that).

        Raises:
          TpuExportError: the child could not import TensorFlow.
        """
        if self._versions is None:
            self._versions = self._reply("import TensorFlow")
        return self._versions

    def request(self, operation: str, **payload) -> dict:
        """Sends one request and waits for its reply (see `send` and `receive`)."""
        self.send(operation, **payload)
        return self.receive(operation)

    def send(self, operation: str, **payload) -> None:
        """Sends one request; its reply is read by the next `receive` (requests are answered in order).

        Args:
          operation: "load_module", "build", "warmup" or "check" (tensorflow_child.py).
          **payload: the request's fields.
        Raises:
          TpuExportError: the child could not import TensorFlow, or died.
        """
        self.versions()
        try:
            self.process.stdin.write(json.dumps({"op": operation, **payload}) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise self._died(operation) from None

    def receive(self, operation: str) -> dict:
        """The reply to the oldest request not yet received: a dict with "ok" (and "error" when not ok).

        Raises:
          TpuExportError: the child died or did not answer within TIMEOUT_SECONDS.
        """
        return self._reply(operation)

    def _reply(self, step: str) -> dict:
        ready, _, _ = select.select([self.process.stdout], [], [], TIMEOUT_SECONDS)
        line = self.process.stdout.readline() if ready else ""
        if not ready:
            self.process.kill()
            raise TpuExportError(f"TensorFlow did not finish {step} within {TIMEOUT_SECONDS} s; pass --no-saved-model to skip the SavedModel")
        if not line:
            raise self._died(step)
        return json.loads(line)

    def _died(self, step: str) -> TpuExportError:
        self.process.wait()
        self.stderr.seek(0)
        tail = " | ".join(line.strip() for line in self.stderr.read().decode(errors="replace").strip().splitlines()[-3:])
        return TpuExportError(f"the TensorFlow process exited with code {self.process.returncode} during {step} ({tail[:300]}); "
                              "pass --no-saved-model to skip the SavedModel")

    def elapsed(self) -> float:
        return round(time.perf_counter() - self.started, 3)
