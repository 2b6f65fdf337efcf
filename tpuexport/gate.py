"""CI verification gates: re-checking a written artifact before it is released.

The checks, in the order they run (each gives one CheckResult):
  integrity    every file's sha256 against manifest["files"]: missing, extra and changed files
  golden       the StableHLO run on CPU against the stored eager outputs, at every stored size
  saved_model  the TF Serving SavedModel re-run, when the artifact has one
  compatibility  a warning when the date after which newer JAX releases may refuse the program's
               jax.export serialization (manifest program.serialization) is near or past
  recompile    (opt-in) every executable recompiled with the installed jax/libtpu; a changed
               compiled-HLO fingerprint is compiler drift: a warning, or a failure when strict
  against      (opt-in) the original model reloaded and compared on fresh random inputs

A plan (manifest "plan_only": true: compiled from the weights' shapes, no weights, no golden data)
has nothing to verify: its golden check fails saying so (the gate exits 1, a plan is not a release),
the SavedModel and against checks are skipped, integrity and recompile run as for any artifact.

A check that reads a file the integrity check found changed or missing is skipped: the integrity
failure already names the file, and damaged bytes must not reach XLA's native parsers, which may
abort the whole process on malformed input instead of raising.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import pathlib
import time
import xml.etree.ElementTree as ElementTree

import jax

from tpuexport import compile as compile_stage
from tpuexport import export as export_stage
from tpuexport import tasks
from tpuexport.artifact import Artifact, layout, load
from tpuexport.artifact.manifest import hash_tree, package_versions
from tpuexport.artifact.tf_serving import check_saved_model
from tpuexport.devices import runs_on_host_cpu
from tpuexport.errors import EXIT_OK, EXIT_VERIFICATION_FAILED
from tpuexport.lower import BucketKernels
from tpuexport.signature import ProgramSignature
from tpuexport.verify.compare import sqnr_db
from tpuexport.verify.report import VerificationCase, VerificationReport, describe_sizes
from tpuexport.verify.saved_model_check import failure_summary
from tpuexport.verify.sizes import plan_cases
from tpuexport.verify.tolerances import VerificationTolerances
from tpuexport.verify.verification import ProgramRuns, eager_outputs, make_inputs, run_case, short_error, to_numpy

PASSED, FAILED, WARNING, SKIPPED = "passed", "failed", "warning", "skipped"
COMPILER_PACKAGES = ("jax", "jaxlib", "libtpu")
# Convert drew its random inputs with seeds 0..3; far-off seeds make --against's inputs fresh.
AGAINST_SEED = 10_000
# Why a plan fails the gate, in one line.
PLAN_ONLY = "plan only (no weights, not verified): nothing to verify"
PLAN_ONLY_MESSAGE = f"{PLAN_ONLY}; convert the model with its weights for an artifact that can be released"
# How early `compatibility` warns that newer JAX may stop loading the program.
COMPATIBILITY_WARNING_DAYS = 60
# Fresh random inputs move an int8 output's SQNR by about a dB; more than this is real drift.
QUANTIZED_SQNR_MARGIN_DB = 3.0


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """The outcome of one gate check.

    Attributes:
      name: the check ("integrity", "golden", "saved_model", "recompile", "against").
      status: "passed", "failed", "warning" (compiler drift without strict) or "skipped".
      message: one line saying what was checked, or what failed and where.
      seconds: wall time of the check.
      details: JSON-ready figures behind the message (file lists, per-case errors, versions).
    """

    name: str
    status: str
    message: str
    seconds: float = 0.0
    details: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class GateReport:
    """Every check run on one artifact.

    Attributes:
      artifact: the artifact directory.
      checks: the results, in the order the checks ran.
      strict: whether compiler drift counts as a failure.
      plan_only: whether the artifact is a plan (no weights; its golden check failed for that).
    """

    artifact: str
    checks: tuple[CheckResult, ...]
    strict: bool = False
    plan_only: bool = False

    @property
    def passed(self) -> bool:
        return all(check.status != FAILED for check in self.checks)

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.passed else EXIT_VERIFICATION_FAILED

    def failures(self) -> list[CheckResult]:
        return [check for check in self.checks if check.status == FAILED]

    def to_json(self) -> dict:
        return {
            "artifact": self.artifact,
            "passed": self.passed,
            "strict": self.strict,
            "plan_only": self.plan_only,
            "checks": [check.to_json() for check in self.checks],
        }

    def to_junit(self) -> str:
        """JUnit XML: one testsuite, one testcase per check.

        Returns:
          The XML document. Failed checks carry <failure message=...>, skipped ones <skipped/>, and
          compiler drift without strict passes with the warning in <system-out>.
        """
        counts = {
            "tests": str(len(self.checks)),
            "failures": str(len(self.failures())),
            "errors": "0",
            "skipped": str(sum(check.status == SKIPPED for check in self.checks)),
            "time": f"{sum(check.seconds for check in self.checks):.3f}",
        }
        suites = ElementTree.Element("testsuites", {"name": "tpuexport verify", **counts})
        suite = ElementTree.SubElement(suites, "testsuite", {"name": f"tpuexport verify {self.artifact}", **counts})
        for check in self.checks:
            case = ElementTree.SubElement(
                suite, "testcase", {"classname": "tpuexport.verify", "name": check.name, "time": f"{check.seconds:.3f}"}
            )
            if check.status == FAILED:
                ElementTree.SubElement(case, "failure", {"message": check.message, "type": "tpuexport.verify"}).text = check.message
            elif check.status == SKIPPED:
                ElementTree.SubElement(case, "skipped", {"message": check.message})
            else:
                ElementTree.SubElement(case, "system-out").text = f"{check.status}: {check.message}"
        ElementTree.indent(suites)
        return '<?xml version="1.0" encoding="utf-8"?>\n' + ElementTree.tostring(suites, encoding="unicode") + "\n"


@runs_on_host_cpu
def verify_artifact(path, recompile: bool = False, strict: bool = False, against: str | None = None) -> GateReport:
    """Runs the gate checks on an artifact directory.

    Args:
      path: the artifact directory.
      recompile: also recompile every executable and compare fingerprints (compiler drift).
      strict: count compiler drift as a failure instead of a warning.
      against: a source reference (`file.py:factory`, `.pt2`) to reload and compare with, or None.
    Returns:
      The GateReport; `report.passed` is False when any check failed, and always for a plan.
    Raises:
      TpuExportError: no artifact at `path`, an unreadable or incomplete manifest, an unknown
        format version, or an `against` source that cannot be loaded.
    """
    artifact = load(path)
    loaded = export_stage.load_source(against) if against is not None else None
    integrity = check_integrity(artifact)
    damaged = set(integrity.details.get("changed", ())) | set(integrity.details.get("missing", ()))
    records = artifact.records
    program_files = [entry.exported for entry in records.entry_points.values()] + ([records.program.path] if records.program.path else [])
    if artifact.plan_only:
        checks = [
            integrity,
            CheckResult("golden", FAILED, PLAN_ONLY_MESSAGE),
            CheckResult("saved_model", SKIPPED, "plan only: no SavedModel"),
        ]
    else:
        checks = [
            integrity,
            _skip_if_damaged("golden", program_files + [artifact.manifest["verification"]["golden"]], damaged) or check_golden(artifact),
            _skip_if_damaged("saved_model", _saved_model_files(artifact), damaged) or check_saved_model_rerun(artifact),
        ]
    checks.append(check_compatibility(artifact))
    if recompile:
        checks.append(_skip_if_damaged("recompile", program_files, damaged) or check_recompile(artifact, strict))
    if loaded is not None:
        task = tasks.task_named(artifact.task)
        if artifact.plan_only:
            checks.append(CheckResult("against", SKIPPED, "plan only: no weights to run"))
        elif not task.offers_against:
            checks.append(CheckResult("against", SKIPPED, f"not offered for {task.name} artifacts yet"))
        else:
            checks.append(_skip_if_damaged("against", program_files, damaged) or check_against(artifact, loaded))
    return GateReport(str(artifact.path), tuple(checks), strict, artifact.plan_only)


def _skip_if_damaged(name: str, needed: list[str], damaged: set[str]) -> CheckResult | None:
    """A skipped result when a file the check reads failed the integrity check, else None."""
    blocked = sorted(set(needed) & damaged)
    if not blocked:
        return None
    return CheckResult(name, SKIPPED, f"not run: {', '.join(blocked)} failed the integrity check")


def _saved_model_files(artifact: Artifact) -> list[str]:
    """The files the SavedModel re-run reads: everything under tf_serving/ and the golden data."""
    serving = [name for name in artifact.manifest["files"] if name.startswith(f"{layout.TF_SERVING_DIR}/")]
    return serving + [artifact.manifest["verification"]["golden"]]


def gate_check(name: str):
    """Turns a check body returning (status, message, details) into a timed CheckResult.

    Args:
      name: the check's name in reports.
    Returns:
      A decorator. An exception from the body fails the check with the error named, because a
      damaged artifact or a changed model can raise anything and the other checks should still run.
    """

    def decorate(body):
        @functools.wraps(body)
        def run(*args, **kwargs) -> CheckResult:
            start = time.perf_counter()
            try:
                status, message, details = body(*args, **kwargs)
            except Exception as error:  # see the docstring: reported, not raised
                status, message, details = FAILED, f"raised {type(error).__name__}: {short_error(error)}", {}
            return CheckResult(name, status, message, round(time.perf_counter() - start, 3), details)

        return run

    return decorate


@gate_check("integrity")
def check_integrity(artifact: Artifact):
    """Compares every file's sha256 with manifest["files"].

    Args:
      artifact: the opened artifact.
    Returns:
      (status, message, details); details lists the "missing", "extra" and "changed" files.
    """
    recorded = artifact.manifest["files"]
    found = hash_tree(artifact.path)
    details = {
        "missing": sorted(set(recorded) - set(found)),
        "extra": sorted(set(found) - set(recorded)),
        "changed": sorted(name for name in set(recorded) & set(found) if recorded[name] != found[name]),
    }
    problems = [f"{kind} {name}" for kind, names in details.items() for name in names]
    if problems:
        return FAILED, f"{len(problems)} file(s) differ from the manifest: {'; '.join(problems)}", details
    return PASSED, f"all {len(recorded)} files match their sha256 in the manifest", details


@gate_check("golden")
def check_golden(artifact: Artifact):
    """Replays the stored golden cases as the task verified them (a forward program's sizes on CPU
    against the stored eager outputs; a generator's prefill or encode and decode steps, teacher-forced,
    against generate()'s tokens and logits).

    Args:
      artifact: the opened artifact.
    Returns:
      (status, message, details); details holds every case's runs.
    """
    report = tasks.task_named(artifact.task).replay_golden(artifact, _tolerances(artifact))
    details = {"cases": report.to_json()["cases"]}
    if not report.cases:
        return FAILED, "the artifact stores no golden data; convert again", details
    if not report.passed:
        return FAILED, report.failure_summary(), details
    return PASSED, f"{tasks.task_named(artifact.task).describe_golden(report)} within {_describe(report.tolerances)}", details


def _report(artifact: Artifact, cases: list[VerificationCase], against: str) -> VerificationReport:
    return VerificationReport(artifact.manifest["precision"], artifact.manifest["matmul_precision"], _tolerances(artifact),
                              tuple(cases), {}, against)


@gate_check("saved_model")
def check_saved_model_rerun(artifact: Artifact):
    """Re-runs the TF Serving SavedModel when the artifact has one.

    Args:
      artifact: the opened artifact.
    Returns:
      (status, message, details); skipped when there is no "tf_serving" section.
    """
    if "tf_serving" not in artifact.manifest:
        return SKIPPED, "no SavedModel in artifact", {}
    outcome = check_saved_model(artifact.path, artifact.manifest)
    if not outcome["passed"]:
        return FAILED, failure_summary(outcome), outcome
    sizes = "; ".join(describe_sizes(case["sizes"]) for case in outcome["cases"])
    return PASSED, f"TensorFlow {outcome.get('tensorflow')} runs the SavedModel within tolerance at {sizes}", outcome


@gate_check("compatibility")
def check_compatibility(artifact: Artifact, today: datetime.date | None = None):
    """Warns when newer JAX releases may soon refuse, or may already refuse, the program's serialization.

    Args:
      artifact: the opened artifact.
      today: the date to judge by (today by default).
    Returns:
      (status, message, details): "warning" within COMPATIBILITY_WARNING_DAYS of the manifest's
      program.serialization.loadable_until or past it, "skipped" for artifacts that predate the
      record, else "passed".
    """
    recorded = artifact.records.program.serialization
    if not recorded:
        return SKIPPED, "the manifest predates the jax.export compatibility record", {}
    until = datetime.date.fromisoformat(recorded["loadable_until"])
    days = (until - (today or datetime.date.today())).days
    details = {**recorded, "days_left": days}
    what = f"jax.export serialization version {recorded['serialization_version']} (of {recorded['version_date']})"
    if recorded.get("jax_release_date"):
        what += f" written by jax {recorded['jax_version']} (released {recorded['jax_release_date']})"
    if days < 0:
        return WARNING, (f"{what}: JAX releases after {until} may refuse to load it ({-days} days ago); convert again with a "
                         "current JAX, or keep this JAX to load it"), details
    if days <= COMPATIBILITY_WARNING_DAYS:
        return WARNING, f"{what}: JAX releases after {until} may refuse to load it (in {days} days); convert again with a current JAX", details
    return PASSED, f"{what}: JAX releases until {until} load it ({days} days left)", details


def _kernel_program(artifact: Artifact, relative: str) -> jax.export.Exported:
    """A bucket's static program with TPU kernels, read after its sha256 matched."""
    return jax.export.deserialize(bytearray(artifact.read_checked(relative)))


@gate_check("recompile")
def check_recompile(artifact: Artifact, strict: bool = False):
    """Recompiles every target, entry point and bucket and compares the compiled-HLO fingerprints.

    Args:
      artifact: the opened artifact.
      strict: report drift as a failure instead of a warning.
    Returns:
      (status, message, details); details has the drifted executables ("target/entry point/bucket")
      and the compiler versions at convert time ("then") and installed ("now").
    """
    records = artifact.records
    fingerprints, drifted = {}, []
    kernel_programs = artifact.manifest.get("kernels", {}).get("programs", {})
    for target_name, target in records.targets.items():
        resolved = compile_stage.resolve_targets([target_name])[0]
        entry_points, recorded = {}, {}
        for name, lowered in artifact.entry_points.items():
            recorded[name] = records.buckets(target_name, name)
            if not recorded[name]:
                continue
            plans = {target_name: compile_stage.ShardingPlan.from_json(target.sharding[name])} if name in target.sharding else {}
            # A bucket compiled from its static program with TPU kernels is compiled from that program again.
            kernels = {bucket.name: BucketKernels(dict(bucket.sizes), _kernel_program(artifact, kernel_programs[f"{name}/{bucket.name}"]))
                       for bucket in recorded[name]
                       if bucket.kernels.get("program") == "static with kernels" and f"{name}/{bucket.name}" in kernel_programs}
            entry_points[name] = compile_stage.EntryPointCompile(
                lowered, [compile_stage.Bucket(tuple(bucket.sizes.items())) for bucket in recorded[name]], plans=plans, kernels=kernels)
        # One compiler process per target for all entry points, as at convert time.
        compiled = compile_stage.compile_target(entry_points, resolved) if entry_points else {}
        for name, results in compiled.items():
            for bucket, result in zip(recorded[name], results):
                key = f"{target_name}/{name}/{bucket.name}"
                fingerprints[key] = {"then": bucket.fingerprint, "now": result.fingerprint}
                if fingerprints[key]["then"] != fingerprints[key]["now"]:
                    drifted.append(key)
    then = {name: artifact.manifest["versions"].get(name) for name in COMPILER_PACKAGES}
    now = {name: package_versions().get(name) for name in COMPILER_PACKAGES}
    details = {"drifted": drifted, "fingerprints": fingerprints, "versions": {"then": then, "now": now}}
    if not drifted:
        return PASSED, f"{len(fingerprints)} executable(s) recompile to the same HLO with {_describe_versions(now)}", details
    message = (
        f"compiler drift in {', '.join(drifted)}: the compiled HLO differs from convert time; "
        f"built with {_describe_versions(then)}, now {_describe_versions(now)}"
    )
    return (FAILED if strict else WARNING), message, details


@gate_check("against")
def check_against(artifact: Artifact, loaded: export_stage.LoadedSource):
    """Compares the artifact's program with the reloaded model on fresh random inputs.

    Args:
      artifact: the opened artifact.
      loaded: the original source, loaded with `load_source`.
    Returns:
      (status, message, details); the sizes are the dims' minimum, middle and maximum (the
      verification sizes), with inputs drawn from seeds convert did not use.
    """
    captured = export_stage.capture(loaded)
    difference = interface_difference(captured.signature, artifact.signature)
    if difference:
        return FAILED, f"{loaded.info.reference} no longer matches the artifact's interface: {difference}", {}
    if "quantization" in artifact.manifest:
        return _against_float_model(artifact, captured, loaded.info.reference)
    runs, tolerances = ProgramRuns(artifact.program), _tolerances(artifact)
    cases = [run_case(runs, captured.reference, inputs, planned, tolerances)[0] for planned, inputs in _fresh_inputs(artifact, captured)]
    report = _report(artifact, cases, loaded.info.reference)
    details = {"cases": report.to_json()["cases"]}
    if not report.passed:
        return FAILED, f"differs from {loaded.info.reference}: {report.failure_summary()}", details
    sizes = "; ".join(f"{case.label} {case.describe_sizes()}" for case in report.cases)
    return PASSED, f"matches {loaded.info.reference} on fresh inputs at {sizes} within {_describe(tolerances)}", details


def _against_float_model(artifact: Artifact, captured: export_stage.CapturedModel, reference: str):
    """For a quantized artifact (int8, int8-dynamic, int8/int4 weight-only): is it still as close to the
    float source as it was at convert time?

    A quantized program cannot match the float model elementwise, so each output's SQNR against the
    float model, over fresh inputs at the verification sizes, must stay within
    QUANTIZED_SQNR_MARGIN_DB of the SQNR the quantization report recorded.

    Returns:
      (status, message, details) with the measured and recorded SQNR per output.
    """
    actual, expected = [], []  # per case, the flat outputs
    runs = ProgramRuns(artifact.program)
    for _, inputs in _fresh_inputs(artifact, captured):
        actual.append(runs.run([to_numpy(t) for t in inputs])["tpu"])
        expected.append(eager_outputs(captured.reference, inputs))
    recorded = {o["name"]: o["sqnr_db"] for o in artifact.manifest["quantization"]["outputs"]}
    mode = artifact.manifest["quantization"]["mode"]
    measured = {
        spec.name: sqnr_db([outputs[index] for outputs in expected], [outputs[index] for outputs in actual])
        for index, spec in enumerate(artifact.signature.outputs)
    }
    details = {"sqnr_db": measured, "recorded_sqnr_db": recorded, "margin_db": QUANTIZED_SQNR_MARGIN_DB}
    worse = [
        f"{name} {measured[name]:.1f} dB (recorded {recorded[name]:.1f} dB)"
        for name in measured
        if measured[name] is not None and recorded.get(name) is not None
        and measured[name] < recorded[name] - QUANTIZED_SQNR_MARGIN_DB
    ]
    if worse:
        return FAILED, f"{mode} artifact drifted from {reference}: SQNR {'; '.join(worse)}", details
    listed = ", ".join(f"{name} {value:.1f} dB" if value is not None else f"{name} exact" for name, value in measured.items())
    return PASSED, f"{mode} artifact vs {reference} on fresh inputs: SQNR {listed} (within {QUANTIZED_SQNR_MARGIN_DB:g} dB of convert time)", details


def _fresh_inputs(artifact: Artifact, captured: export_stage.CapturedModel):
    """(planned case, inputs) at every verification size (sizes.py, default budget), drawn from
    seeds convert did not use."""
    signature = artifact.signature
    for index, planned in enumerate(plan_cases(signature, artifact.program.matmul_flops)):
        yield planned, make_inputs(signature.inputs, captured.example_inputs, planned.sizes, seed=AGAINST_SEED + index)


def interface_difference(source: ProgramSignature, artifact: ProgramSignature) -> str:
    """Names how a source's inputs, outputs or dim ranges differ from the artifact's.

    Args:
      source: the reloaded model's signature.
      artifact: the artifact's signature.
    Returns:
      One clause per differing part, or "" when they agree (example sizes may differ).
    """
    clauses = []
    for part in ("inputs", "outputs"):
        ours = [(s.name, tuple(s.shape), s.dtype) for s in getattr(source, part)]
        theirs = [(s.name, tuple(s.shape), s.dtype) for s in getattr(artifact, part)]
        if ours != theirs:
            clauses.append(f"{part} are {ours}, the artifact's are {theirs}")
    ranges = [(d.name, d.min, d.max) for d in source.dims]
    recorded = [(d.name, d.min, d.max) for d in artifact.dims]
    if ranges != recorded:
        clauses.append(f"dims are {ranges}, the artifact's are {recorded}")
    return "; ".join(clauses)


def _tolerances(artifact: Artifact) -> VerificationTolerances:
    return VerificationTolerances.from_json(artifact.manifest["verification"]["tolerances"])


def _describe(tolerances: VerificationTolerances) -> str:
    return f"tpu run {tolerances.tpu.describe()}, cpu run {tolerances.cpu.describe()}"


def _describe_versions(versions: dict) -> str:
    return ", ".join(f"{name} {version}" for name, version in versions.items())


def write_junit(report: GateReport, path: pathlib.Path) -> None:
    """Writes `report.to_junit()` to `path`, creating its directory (CI report folders often do not exist yet)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report.to_junit())
