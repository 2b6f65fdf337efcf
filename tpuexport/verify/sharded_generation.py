"""Verifying a text-generation artifact's slice plans: prefill and decode partitioned as for the TPU
on N virtual CPU devices, the KV cache carried between them, against the generation verification's
eager references.

On a slice each entry point has its own plan (pipeline.py `_plan_generation_slices`: the cache
split with the attention heads or the batch). As sharded.py does for a forward program, the entry
points run partitioned exactly as they are compiled for the TPU (the same mesh shape and
PartitionSpecs, NamedSharding, `jax.jit(exported.call)` with the inputs donated) over N CPU devices
in a child process (sharded_child.py), and the cache each call returns is placed as the next call's
entry point takes it, as a runtime holding it on the devices does.

One case of the generation verification (generation.py) is replayed, teacher-forced with its
stored eager tokens and compared with its stored eager logits by generation.py's rule and
tolerances, in both runs: generate() is not run again. The case is the cheapest that still shows
what a plan could break: the most rows (mixed prompt lengths, the shorter right-padded within the
bucket), then the shortest bucket; prefill and every decode step of it. The collectives XLA:CPU
inserted into each entry point are recorded, showing the run really was partitioned.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import tempfile
import time
from typing import Sequence

import numpy as np

from tpuexport.compile.hlo import collectives
from tpuexport.compile.sharding import ShardingPlan
from tpuexport.lower.generation import GenerationProgram, right_padded
from tpuexport.lower.lowered import CPU_COMPILER_OPTIONS
from tpuexport.verify.compare import Tolerances, compare_output
from tpuexport.verify.generation import GenerationCase, GenerationReport, compare_run, cpu_runs, stored_cases
from tpuexport.verify.report import RUNS
from tpuexport.verify.sharded import read_array, run_child, write_array
from tpuexport.verify.tolerances import VerificationTolerances


@dataclasses.dataclass(frozen=True)
class ShardedGenerationVerification:
    """The entry points partitioned by one slice plan against the eager references.

    Attributes:
      targets: the slice targets whose plans these are.
      plans: {entry point: ShardingPlan} (one mesh).
      case: the replayed generation case (both runs compared), or None when none could be replayed.
      tolerances: the generation verification's tolerances.
      collectives: {entry point: {kind: {"count", "bytes"}}} in the programs XLA:CPU compiled for
        the N devices.
      aliased: {entry point: outputs XLA:CPU aliased with donated inputs} (the cache's tensors, updated
        in place as on the TPU).
      resharded: the calls (0 is prefill, i the i-th decode step) whose cache came in another layout
        than their entry point takes: the runtime copies it on every such call.
      seconds: wall time, child process included.
      error: why no case ran (no stored case, the sharded program raised), else None.
      worst: {run: {"step", "row", "first_outside"}}: where each run's largest logits error is, and
        the first step with logits outside the tolerances (None if none is).
    """

    targets: tuple[str, ...]
    plans: dict[str, ShardingPlan]
    case: GenerationCase | None
    tolerances: VerificationTolerances
    collectives: dict[str, dict[str, dict[str, int]]]
    aliased: dict[str, int]
    resharded: tuple[int, ...]
    seconds: float
    error: str | None = None
    worst: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.error is None and self.case is not None and self.case.passed

    @property
    def plan(self) -> ShardingPlan:
        """One entry point's plan: they share the mesh, the preset and the device count."""
        return next(iter(self.plans.values()))

    @property
    def mesh_text(self) -> str:
        return self.plan.mesh_text

    def failure_summary(self) -> str:
        """Names the plan and, per failed run, the entry point, step and output that differ."""
        where = (f"the sharded entry points ({', '.join(self.targets)}: mesh {self.mesh_text}, {self.plan.preset}, "
                 f"on {self.plan.devices} CPU devices)")
        if self.error is not None:
            return f"{where}: {self.error}"
        clauses = []
        for name, run in self.case.runs.items():
            divergence = run.divergence
            if divergence is not None:
                clauses.append(f"{name} run, {step_name(divergence.step)}: output 'logits' of row {divergence.row} picks {divergence.described}")
            if not run.logits.passed:
                worst = self.worst[name]
                first = "" if worst["first_outside"] is None else f"first outside tolerance at {step_name(worst['first_outside'])}, "
                clauses.append(f"{name} run, output 'logits' {run.logits.describe_failure()}, {first}largest error at "
                               f"{step_name(worst['step'])} row {worst['row']} [{getattr(self.tolerances, name).describe()}]")
        return f"{where} do not match eager PyTorch in {self.case.label}: {'; '.join(clauses)}"

    def describe(self) -> str:
        exchanged = "; ".join(f"{entry} " + (", ".join(f"{kind} x{value['count']}" for kind, value in kinds.items()) or "no collectives")
                              for entry, kinds in self.collectives.items())
        done = "FAILED" if not self.passed else "passed"
        case = f"{self.case.label}, {self.case.runs['cpu'].tokens_compared} tokens" if self.case and self.case.runs else "no case ran"
        return (f"{', '.join(self.targets)}: mesh {self.mesh_text} on {self.plan.devices} CPU devices ({exchanged}); "
                f"{case}, {done}")

    def manifest_summary(self) -> dict:
        """This run as the manifest's "verification"["sharded"] lists it (details in report.json)."""
        entry = self.to_json()
        return ({key: entry[key] for key in ("targets", "passed", "devices", "mesh", "collectives", "aliased_outputs", "resharded_calls")}
                | {"case": {key: entry["case"][key] for key in ("label", "sizes", "lengths", "new_tokens", "passed")}})

    def to_json(self) -> dict:
        case = self.case
        return {
            "targets": list(self.targets),
            "passed": self.passed,
            "devices": self.plan.devices,
            "mesh": self.plan.to_json()["mesh"],
            "inputs": {entry: plan.to_json()["inputs"] for entry, plan in self.plans.items()},
            "collectives": self.collectives,
            "aliased_outputs": self.aliased,
            "resharded_calls": list(self.resharded),
            "seconds": round(self.seconds, 3),
            "error": self.error,
            "case": None if case is None else {
                "label": case.label, "sizes": case.sizes, "lengths": list(case.lengths), "slots": list(case.slots),
                "new_tokens": case.new_tokens, "passed": case.passed, "error": case.error,
                "runs": {name: {"passed": run.passed, "tokens_compared": run.tokens_compared,
                                "logits": {**dataclasses.asdict(run.logits), "passed": run.logits.passed},
                                "worst": self.worst.get(name),
                                "differences": [{**dataclasses.asdict(d), "tie": d.tie} for d in run.differences]}
                         for name, run in case.runs.items()},
            },
        }


def step_name(step: int) -> str:
    """Step 0 is prefill's token, step i the i-th decode step's."""
    return "prefill" if step == 0 else f"decode step {step}"


def verify_sharded_generation(program: GenerationProgram, plans: dict[str, ShardingPlan], targets: Sequence[str],
                              report: GenerationReport) -> ShardedGenerationVerification:
    """Replays one verified generation case with the entry points partitioned by `plans` on CPU devices.

    Args:
      program: the generation program (with weights).
      plans: {entry point: ShardingPlan} of one slice target (pipeline.py `_plan_generation_slices`).
      targets: the slice targets using these plans (for reports).
      report: the passed generation report: its stored cases (prompts, slots, eager tokens and
        logits) and tolerances are reused.
    Returns:
      The ShardedGenerationVerification, passed or not.
    Raises:
      TpuExportError: the child process itself failed (not a mismatch).
    """
    start = time.perf_counter()
    chosen = choose_case(report)
    if chosen is None:
        return ShardedGenerationVerification(tuple(targets), plans, None, report.tolerances, {}, {}, (), time.perf_counter() - start,
                                             "no stored generation case to replay")
    manifest_case, lengths, prompts, slots, eager_tokens, expected = chosen
    calls = teacher_forced_calls(program, prompts, slots, manifest_case["sizes"]["seq"], eager_tokens)
    logits, errors, hlo, resharded = run_calls(program, plans, calls)
    runs, worst = {}, {}
    error = raised(errors)
    if error is None:
        runs, worst = compare_runs({run: _stacked(logits.get(run, logits["cpu"]), slots, len(calls)) for run in RUNS}, expected, eager_tokens,
                                   report.tolerances)
    case = GenerationCase(manifest_case["sizes"], tuple(lengths), tuple(slots), len(eager_tokens[0]), runs, golden=True)
    return ShardedGenerationVerification(tuple(targets), plans, case, report.tolerances,
                                         {entry: collectives(text) for entry, text in hlo.items()},
                                         {entry: _aliased_outputs(text) for entry, text in hlo.items()}, tuple(resharded),
                                         time.perf_counter() - start, error, worst)


def choose_case(report: GenerationReport):
    """The stored case to replay (module docstring): most rows, then the shortest bucket; None if none is stored.

    Returns:
      stored_cases' tuple (manifest case, lengths, prompts, slots, eager tokens, eager logits), or None.
    """
    return stored_case(report, lambda chosen: (-chosen[0]["sizes"]["batch"], chosen[0]["sizes"]["seq"]))


def stored_case(report: GenerationReport, key):
    """The stored case of `report` first by `key` (over stored_cases' tuples), or None if none is stored."""
    cases = [{"sizes": case.sizes, "golden": case.golden} for case in report.cases]
    return min(stored_cases(report.golden, cases), key=key, default=None)


def teacher_forced_calls(program: GenerationProgram, prompts: list[list[int]], slots: list[int], seq: int,
                         eager_tokens: list[list[int]]) -> list[tuple[str, list[np.ndarray | None]]]:
    """The entry-point calls of one teacher-forced case, as generation.py's teacher_forced_logits
    makes them: prefill of the right-padded prompts into their slots, then one decode step per
    eager token but the last, every row at its own position, idle slots at token 0 position 0.

    Returns:
      [(entry point, inputs in its signature order, None for a state input)].
    """
    spec = program.spec
    state = set(program.state_inputs)

    def inputs(entry: str, given: dict[str, np.ndarray]) -> list[np.ndarray | None]:
        return [None if tensor.name in state else np.asarray(given[tensor.name]).astype(tensor.dtype)
                for tensor in program.entry_points[entry].signature.inputs]

    prefill = {"tokens": right_padded(prompts, seq), "lengths": np.array([len(prompt) for prompt in prompts]), "slots": np.array(slots)}
    calls = [("prefill", inputs("prefill", prefill))]
    for step in range(1, len(eager_tokens[0])):
        tokens, positions = np.zeros(spec.max_batch, np.int64), np.zeros(spec.max_batch, np.int64)
        for row, slot in enumerate(slots):
            tokens[slot], positions[slot] = eager_tokens[row][step - 1], len(prompts[row]) + step - 1
        calls.append(("decode", inputs("decode", {"tokens": tokens, "positions": positions})))
    return calls


def raised(errors: dict[str, tuple[int, str]]) -> str | None:
    """The first run's error from run_calls, worded, or None."""
    return next((f"{run} run, {step_name(call)}: the sharded program raised: {message}" for run, (call, message) in errors.items()), None)


def compare_runs(actual: dict[str, np.ndarray], expected: np.ndarray, eager_tokens: list[list[int]],
                 tolerances: VerificationTolerances) -> tuple[dict, dict]:
    """Each run's logits [rows, steps, vocab] against the eager ones by generation.py's rule: ({run: RunComparison},
    {run: where its largest error is and the first step outside the tolerances})."""
    runs, worst = {}, {}
    for run, logits in actual.items():
        runs[run] = compare_run(logits, expected, eager_tokens, getattr(tolerances, run))
        step, row = _worst(logits, expected)
        worst[run] = {"step": step, "row": row, "first_outside": _first_outside(logits, expected, getattr(tolerances, run))}
    return runs, worst


def _stacked(call_logits: list[np.ndarray], slots: list[int], steps: int) -> np.ndarray:
    """[rows, steps, vocab] from prefill's [rows, vocab] and each decode step's [max_batch, vocab]."""
    rows = [[call_logits[0][row]] + [call_logits[step][slot] for step in range(1, steps)] for row, slot in enumerate(slots)]
    return np.stack([np.stack(row) for row in rows]).astype(np.float32)


def _worst(actual: np.ndarray, expected: np.ndarray) -> tuple[int, int]:
    """(step, row) of the largest absolute logits error."""
    difference = np.nan_to_num(np.abs(actual.astype(np.float64) - expected.astype(np.float64)), nan=np.inf)
    row, step, _ = np.unravel_index(int(np.argmax(difference)), difference.shape)
    return int(step), int(row)


def _aliased_outputs(hlo_text: str) -> int:
    """Outputs a compiled HLO module aliases with its (donated) parameters: its header's input_output_alias entries."""
    header = hlo_text.split("\n", 1)[0]
    return len(re.findall(r"\{[\d,\s]*\}: \(\d+, \{[\d,\s]*\}, (?:may|must)-alias\)", header))


def _first_outside(actual: np.ndarray, expected: np.ndarray, tolerances: Tolerances) -> int | None:
    """The first step whose logits have an element outside the tolerances, by compare.py's rule with
    its scale terms taken over all steps, as compare_run takes them."""
    finite = expected[np.isfinite(expected)].astype(np.float64)
    scale = float(np.sqrt(np.mean(np.square(finite)))) if finite.size else 0.0
    step_size = float(np.abs(finite).max(initial=0.0)) / 127.0
    elementwise = dataclasses.replace(tolerances, atol=tolerances.atol + tolerances.scale_tol * scale + tolerances.quantization_steps * step_size,
                                      scale_tol=0.0, quantization_steps=0.0)
    return next((step for step in range(actual.shape[1])
                 if compare_output("logits", actual[:, step], expected[:, step], elementwise).mismatched), None)


def run_calls(program, plans: dict[str, ShardingPlan], calls: list):
    """Runs a generation program's calls ([(entry point, inputs in its signature order, None for a state
    input)], static or paged) in the child, partitioned by `plans`; returns ({run: [the logits of each
    call]}, {run: (call, error message)}, {entry point: compiled CPU HLO text}, [resharded call indices of
    the "cpu" run])."""
    runs = cpu_runs(program)
    if all(runs["tpu"][entry] is runs["cpu"][entry] for entry in runs["cpu"]):
        runs = {"cpu": runs["cpu"]}  # a bfloat16 program has no f32 matmul to round: one run computes both
    # Only the entry points the calls use (prefill and decode, or step): the state passes through them, not `sample`'s.
    called = list(dict.fromkeys(entry for entry, _ in calls))
    runs = {run: {entry: programs[entry] for entry in called} for run, programs in runs.items()}
    plans = {entry: plans[entry] for entry in called}
    weights = program.weights_program.weights
    with tempfile.TemporaryDirectory(prefix="tpuexport-sharded-generation-") as scratch:
        scratch_dir = pathlib.Path(scratch)
        paths = {run: {} for run in runs}
        for run, programs in runs.items():
            for entry, exported in programs.items():
                paths[run][entry] = str(scratch_dir / f"{run}.{entry}.jaxexport")
                pathlib.Path(paths[run][entry]).write_bytes(bytes(exported.serialize()))
        state = list(program.state_inputs)
        signatures = {entry: program.entry_points[entry].signature for entry in called}
        state_specs = {tensor.name: tensor for tensor in signatures[called[0]].inputs}
        plan = plans[called[0]]
        request = {
            "devices": plan.devices,
            "mesh": plan.to_json()["mesh"],
            "programs": paths,
            "weights": [write_array(weight, scratch_dir / f"weight{index}.bin") for index, weight in enumerate(weights)],
            "weight_specs": {entry: list(plan.to_json()["weights"].values()) for entry, plan in plans.items()},
            "input_specs": {entry: list(plan.to_json()["inputs"].values()) for entry, plan in plans.items()},
            "state_inputs": {entry: [[t.name for t in signature.inputs].index(name) for name in state]
                             for entry, signature in signatures.items()},
            "state_outputs": {entry: [[t.name for t in signature.outputs].index(name) for name in state]
                              for entry, signature in signatures.items()},
            "state": [{"shape": list(state_specs[name].concrete_shape(program.state_sizes)), "dtype": state_specs[name].dtype} for name in state],
            "calls": [{"entry": entry, "inputs": [None if array is None else write_array(array, scratch_dir / f"call{index}.input{number}.bin")
                                                  for number, array in enumerate(inputs)]}
                      for index, (entry, inputs) in enumerate(calls)],
            "out_dir": scratch,
            "compiler_options": CPU_COMPILER_OPTIONS,
        }
        events = run_child(request, "the sharded generation verification process")
        logits_at = {entry: [t.name for t in signature.outputs].index("logits") for entry, signature in signatures.items()}
        logits, errors, hlo, resharded = {run: [] for run in runs}, {}, {}, []
        for event in events:
            if event["event"] == "call":
                entry = calls[event["call"]][0]
                logits[event["run"]].append(read_array(event["outputs"][logits_at[entry]]))
            elif event["event"] == "error":
                errors[event["run"]] = (event["call"], event["message"])
            elif event["event"] == "compiled":
                hlo[event["entry"]] = pathlib.Path(event["hlo"]).read_text()
            elif event["run"] == "cpu":
                resharded = event["calls"]
        return logits, errors, hlo, resharded
