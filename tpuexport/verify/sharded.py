"""Verifying the sharded program: the slice's mesh and plan on N virtual CPU devices, against eager PyTorch.

A sharding plan must not change what the program computes: XLA's partitioner splits the program
across devices and adds collectives, and a partial sum computed per device and all-reduced is
added up in another order than one device's. So the program runs once more, partitioned exactly as
for the TPU (the same mesh shape and PartitionSpecs, placed with NamedSharding and called through
`jax.jit(exported.call)`) over N CPU devices that XLA's host platform provides in a child process
(sharded_child.py, `--xla_force_host_platform_device_count=N`; the converting process's JAX backend
already has its one device). Both runs of verification.py are repeated (TPU-faithful and plain
f32) and compared with the eager outputs under the same tolerances.

The inputs are the verified cases' golden inputs whose dims split evenly over the mesh; when no
verified size does (say batch 1 and 4 over data=8), inputs are made at the first compiled bucket's
sizes, which the plan requires to split evenly, and eager PyTorch runs on them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import jax.numpy as jnp
import numpy as np
import torch

from tpuexport.compile.buckets import Bucket
from tpuexport.compile.hlo import collectives
from tpuexport.compile.sharding import ShardingPlan, spec_axes
from tpuexport.errors import TpuExportError
from tpuexport.lower import LoweredProgram
from tpuexport.lower.lowered import CPU_COMPILER_OPTIONS
from tpuexport.lower.matmul_precision import MATMUL_PRECISIONS
from tpuexport.verify.compare import compare_output
from tpuexport.verify.report import VerificationCase, VerificationReport
from tpuexport.verify.tolerances import VerificationTolerances
from tpuexport.verify.tpu_numerics import tpu_faithful
from tpuexport.verify.verification import eager_outputs, make_inputs, short_error, to_numpy

CHILD_SCRIPT = pathlib.Path(__file__).with_name("sharded_child.py")
TIMEOUT_SECONDS = 1800


@dataclasses.dataclass(frozen=True)
class ShardedVerification:
    """The sharded program against eager PyTorch, for the slice targets sharing one plan.

    Attributes:
      targets: the slice targets whose plan this is.
      plan: the sharding plan.
      cases: one VerificationCase per input set, both runs compared.
      tolerances: the tolerances of both runs (the conversion's).
      collectives: {kind: {"count", "bytes"}} in the program XLA:CPU compiled for the N devices:
        what shows that the run really was partitioned.
      seconds: wall time, child process included.
    """

    targets: tuple[str, ...]
    plan: ShardingPlan
    cases: tuple[VerificationCase, ...]
    tolerances: VerificationTolerances
    collectives: dict[str, dict[str, int]]
    seconds: float

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(case.passed for case in self.cases)

    def failure_summary(self) -> str:
        """Names the plan and every mismatched output of every run."""
        clauses = []
        for case in self.cases:
            if case.error is not None:
                clauses.append(f"{case.label} case ({case.describe_sizes()}) raised: {case.error}")
            for run, outputs in case.runs.items():
                for output in outputs:
                    if not output.passed:
                        clauses.append(f"output {output.name!r} at {case.describe_sizes()} ({run} run): {output.describe_failure()} "
                                       f"[{getattr(self.tolerances, run).describe()}]")
        return (f"the sharded program ({', '.join(self.targets)}: {self.plan.describe()}, on {self.plan.devices} CPU devices) "
                f"does not match eager PyTorch: {'; '.join(clauses) or 'no case ran'}")

    def describe(self) -> str:
        exchanged = ", ".join(f"{kind} x{entry['count']}" for kind, entry in self.collectives.items()) or "no collectives"
        return (f"{', '.join(self.targets)}: mesh {self.plan.mesh_text} on {self.plan.devices} CPU devices ({exchanged}), "
                f"{len(self.cases)} size(s), {'passed' if self.passed else 'FAILED'}")

    def manifest_summary(self) -> dict:
        """This run as the manifest's "verification"["sharded"] lists it (details in report.json)."""
        entry = self.to_json()
        return ({key: entry[key] for key in ("targets", "passed", "devices", "mesh", "collectives")}
                | {"cases": [{key: case[key] for key in ("label", "sizes", "reason", "passed")} for case in entry["cases"]]})

    def to_json(self) -> dict:
        return {
            "targets": list(self.targets),
            "passed": self.passed,
            "devices": self.plan.devices,
            "mesh": self.plan.to_json()["mesh"],
            "collectives": self.collectives,
            "seconds": round(self.seconds, 3),
            "cases": [
                {"label": case.label, "sizes": case.sizes, "reason": case.reason, "passed": case.passed, "error": case.error,
                 "runs": {run: [{**dataclasses.asdict(o), "passed": o.passed} for o in outputs] for run, outputs in case.runs.items()}}
                for case in self.cases
            ],
        }


@dataclasses.dataclass(frozen=True)
class _Inputs:
    label: str
    sizes: dict[str, int]
    reason: str
    inputs: list[np.ndarray]
    expected: list[np.ndarray] | None
    error: str | None = None


def verify_sharded(
    lowered: LoweredProgram,
    plan: ShardingPlan,
    targets: Sequence[str],
    report: VerificationReport,
    reference: Callable[..., Any],
    example_inputs: Sequence[torch.Tensor],
    buckets: Sequence[Bucket],
) -> ShardedVerification:
    """Runs the program partitioned by `plan` on `plan.devices` CPU devices and compares with eager.

    Args:
      lowered: the lowered program.
      plan: the sharding plan (from compile.plan_sharding).
      targets: the slice targets using this plan (for reports).
      report: the passed verification report (its golden data and tolerances are reused).
      reference: the eager model.
      example_inputs: the flat example inputs (for inputs made at a bucket's sizes).
      buckets: the compiled buckets.
    Returns:
      The ShardedVerification, passed or not.
    Raises:
      TpuExportError: the child process itself failed (not a mismatch).
    """
    start = time.perf_counter()
    sets = _input_sets(lowered, plan, report, reference, example_inputs, buckets)
    runnable = [s for s in sets if s.error is None]
    outputs, errors, hlo_text = _run_child(lowered, plan, [s.inputs for s in runnable]) if runnable else ({}, {}, "")
    cases = []
    index = -1  # the input set's position among those sent to the child
    for input_set in sets:
        if input_set.error is not None:
            cases.append(VerificationCase(input_set.label, input_set.sizes, {}, input_set.error, reason=input_set.reason))
            continue
        index += 1
        if index in errors:
            cases.append(VerificationCase(input_set.label, input_set.sizes, {}, f"sharded program raised: {errors[index]}",
                                          reason=input_set.reason))
            continue
        runs = outputs[index]
        comparisons = {
            run: tuple(compare_output(spec.name, actual, expected, getattr(report.tolerances, run))
                       for spec, actual, expected in zip(lowered.signature.outputs, runs.get(run, runs["cpu"]), input_set.expected))
            for run in ("tpu", "cpu")
        }
        cases.append(VerificationCase(input_set.label, input_set.sizes, comparisons, reason=input_set.reason))
    return ShardedVerification(tuple(targets), plan, tuple(cases), report.tolerances, collectives(hlo_text),
                               time.perf_counter() - start)


def _splits_evenly(shapes: Sequence[tuple[int, ...]], plan: ShardingPlan) -> bool:
    sizes = dict(plan.mesh)
    for shape, (_, spec) in zip(shapes, plan.inputs):
        for axis, entry in enumerate(spec):
            parts = int(np.prod([sizes[a] for a in spec_axes(entry)]))
            if shape[axis] % parts:
                return False
    return True


def _input_sets(lowered, plan, report, reference, example_inputs, buckets) -> list[_Inputs]:
    signature = lowered.signature
    sets = []
    for index, case in enumerate(report.cases):
        if not case.golden:
            continue
        inputs = [report.golden[f"{index}/input/{spec.name}"] for spec in signature.inputs]
        if _splits_evenly([i.shape for i in inputs], plan):
            expected = [report.golden[f"{index}/output/{spec.name}"] for spec in signature.outputs]
            sets.append(_Inputs(case.label, case.sizes, "verified size, golden inputs", inputs, expected))
    if sets:
        return sets
    bucket = buckets[0]
    made = make_inputs(signature.inputs, example_inputs, bucket.as_dict(), seed=len(report.cases))
    inputs = [to_numpy(tensor) for tensor in made]
    label, reason = f"bucket {bucket.name}", "no verified size splits evenly over the mesh: the first bucket's sizes"
    try:
        expected = eager_outputs(reference, made)
    except Exception as error:  # the user's model may raise anything
        failure = f"eager PyTorch raised {type(error).__name__}: {short_error(error)}"
        return [_Inputs(label, bucket.as_dict(), reason, inputs, None, failure)]
    return [_Inputs(label, bucket.as_dict(), reason, inputs, expected)]


def _run_child(lowered: LoweredProgram, plan: ShardingPlan, cases: list[list[np.ndarray]]):
    """Runs the child; returns ({case: {run: outputs}}, {case: error message}, the compiled CPU HLO text)."""
    tpu_program = tpu_faithful(lowered.exported, MATMUL_PRECISIONS[lowered.matmul_precision])
    with tempfile.TemporaryDirectory(prefix="tpuexport-sharded-") as scratch:
        scratch_dir = pathlib.Path(scratch)
        programs = {"cpu": lowered.exported} if tpu_program is lowered.exported else {"cpu": lowered.exported, "tpu": tpu_program}
        program_paths = {}
        for run, program in programs.items():
            program_paths[run] = str(scratch_dir / f"{run}.jaxexport")
            pathlib.Path(program_paths[run]).write_bytes(bytes(program.serialize()))
        specs = plan.to_json()
        request = {
            "devices": plan.devices,
            "mesh": specs["mesh"],
            "programs": program_paths,
            "weights": [write_array(weight, scratch_dir / f"weight{index}.bin") for index, weight in enumerate(lowered.weights)],
            "weight_specs": list(specs["weights"].values()),
            "input_specs": list(specs["inputs"].values()),
            "cases": [[write_array(np.asarray(array).astype(spec.dtype), scratch_dir / f"case{case}.input{index}.bin")
                       for index, (array, spec) in enumerate(zip(inputs, lowered.signature.inputs))]
                      for case, inputs in enumerate(cases)],
            "out_dir": scratch,
            "compiler_options": CPU_COMPILER_OPTIONS,
        }
        outputs, errors, hlo_text = {}, {}, ""
        for event in run_child(request, "the sharded verification process"):
            if event["event"] == "case":
                outputs[event["case"]] = {run: [read_array(entry) for entry in entries] for run, entries in event["outputs"].items()}
            elif event["event"] == "error":
                errors[event["case"]] = event["message"]
            else:
                hlo_text = pathlib.Path(event["hlo"]).read_text()
        return outputs, errors, hlo_text


def run_child(request: dict, what: str) -> list[dict]:
    """Runs sharded_child.py on `request["devices"]` CPU devices of XLA's host platform.

    Args:
      request: the child's JSON request (its "devices" is the device count).
      what: the process's name in the error.
    Returns:
      The events the child printed, one JSON object per line.
    Raises:
      TpuExportError: the child failed (its last stderr line).
    """
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={request['devices']}".strip()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    child = subprocess.run([sys.executable, "-I", str(CHILD_SCRIPT)], input=json.dumps(request), capture_output=True,
                           text=True, env=env, timeout=TIMEOUT_SECONDS)
    if child.returncode != 0:
        last = " ".join(child.stderr.strip().splitlines()[-1:])[:300]
        raise TpuExportError(f"{what} failed (exit code {child.returncode}: {last})")
    return [json.loads(line) for line in child.stdout.splitlines()]


def write_array(array: np.ndarray, path: pathlib.Path) -> dict:
    """Writes an array as a raw file for the child; returns its {path, dtype, shape}."""
    array = np.asarray(array)  # not ascontiguousarray: it makes a 0-d array (Gemma 2's scalar weights) 1-d
    path.write_bytes(array.tobytes(order="C"))
    return {"path": str(path), "dtype": str(array.dtype), "shape": list(array.shape)}


def read_array(entry: dict) -> np.ndarray:
    """An array the child wrote (its {path, dtype, shape}), copied out of the file."""
    return np.frombuffer(pathlib.Path(entry["path"]).read_bytes(), dtype=jnp.dtype(entry["dtype"])).reshape(entry["shape"]).copy()

