"""Writing an artifact directory atomically: everything goes to a temporary sibling directory,
which is renamed into place only once complete, so a failed conversion leaves nothing behind.

A conversion that is killed (SIGKILL, power loss) cannot remove its hidden siblings of OUT
(`.OUT.partial-*`, the pipeline's `.OUT.scratch-*`); their names hold the host and process id that
made them, and the next conversion into OUT removes those whose process is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import pathlib
import shutil
import socket
import uuid
from typing import Callable

from tpuexport.artifact import layout
from tpuexport.artifact.manifest import build_section, dumps, hash_tree, package_versions
from tpuexport.artifact.records import BucketRecord, EntryPointRecord, ExecutableSet, Manifest, TargetRecord, WeightsRecord
from tpuexport.artifact.weights import write_arrays
from tpuexport.arrays import save_arrays
from tpuexport.compile import CompiledBucket, CompileReport, installed_versions, version_set_name
from tpuexport.compile.compile_key import export_compatibility
from tpuexport.errors import TpuExportError
from tpuexport.export import SourceInfo
from tpuexport.lower import LoweredProgram
from tpuexport.lower.cost import flops_at
from tpuexport.lower.program import EntryPoints
from tpuexport.memory import PeakMemory


def check_destination(out: pathlib.Path, overwrite: bool) -> None:
    """Fails early (before any work) when `out` cannot be written.

    Raises:
      TpuExportError: `out` exists and overwrite is False, or its parent is not a directory.
    """
    if out.exists() and not overwrite:
        raise TpuExportError(f"{out} already exists; pass --force (overwrite=True) or choose another -o")
    if out.exists() and not (out / layout.MANIFEST).is_file():
        raise TpuExportError(f"{out} exists and is not a tpuexport artifact; refusing to replace it, choose another -o")
    if not out.parent.is_dir():
        raise TpuExportError(f"the parent directory of {out} does not exist; create it first")


# Two conversions into one directory: the first to finish wins, the other fails with this.
APPEARED = "{out} appeared while converting (another conversion wrote it); nothing of this one was written, choose another -o"


def sibling_prefix(out: pathlib.Path, kind: str) -> str:
    """The name prefix of a hidden sibling of `out` this process makes ("partial", "scratch", "old")."""
    return f".{out.name}.{kind}-{socket.gethostname()}-{os.getpid()}-"


def remove_abandoned_siblings(out: pathlib.Path) -> None:
    """Removes the hidden siblings of `out` that conversions on this host left when they were killed."""
    host = socket.gethostname()
    for sibling in out.parent.glob(f".{glob_escape(out.name)}.*-{glob_escape(host)}-*-*"):
        pid = sibling.name.split("-")[-2]  # the last part, a random suffix, has no "-"
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(sibling, ignore_errors=True)


def glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


@contextlib.contextmanager
def staging_directory(out: pathlib.Path, overwrite: bool):
    """Yields a temporary directory next to `out`; on success it replaces `out`, on error it is removed."""
    remove_abandoned_siblings(out)
    staging = out.parent / f"{sibling_prefix(out, 'partial')}{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        yield staging
        if out.exists():
            if not overwrite:
                raise TpuExportError(APPEARED.format(out=out))
            retired = out.parent / f"{sibling_prefix(out, 'old')}{uuid.uuid4().hex[:8]}"
            os.rename(out, retired)
            os.rename(staging, out)
            shutil.rmtree(retired)
        else:
            try:
                os.rename(staging, out)
            except OSError as error:  # another conversion renamed its directory there since the check above
                if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                raise TpuExportError(APPEARED.format(out=out)) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# An entry point's padding when the task says nothing of it: exact compiled sizes only.
EXACT_SIZES = (None, "no padded bucket was verified for this entry point")
# The manifest's "verification" block of a plan: nothing ran, and it says so.
PLAN_VERIFICATION = {"passed": None, "status": "not verified: plan only"}


def write_artifact(
    out: pathlib.Path,
    *,
    source: SourceInfo,
    task: str,
    program: EntryPoints,
    compiled: Callable[[], dict[str, CompileReport]],
    verification=None,
    stage_seconds: dict[str, float],
    stage_memory: Callable[[], dict[str, PeakMemory]] = dict,
    overwrite: bool = False,
    extra_writers=(),
    sharded_verification=(),
    weights_file: pathlib.Path | None = None,
    padding: dict[str, tuple[str | None, str]] | None = None,
    bucket_figures: Callable[[str, CompiledBucket], dict] | None = None,
    version_sets: Callable[[], dict[str, dict[str, CompileReport]]] = dict,
    memory_budget: dict | None = None,
) -> dict:
    """Writes the artifact directory: one weights file, each entry point's program files and
    executables, the verification report and golden data, and the manifest (records.py), last.

    Args:
      out: the artifact directory to create (or replace, with overwrite).
      source: where the model came from.
      task: the task that made the entry points (manifest "task").
      program: the entry points over one set of weights (a plan's have no weights).
      compiled: returns {entry point: its CompileReport}; called once the program files and the
        extra writers are done, so that compilation running in the background overlaps them.
      verification: the passed report (verify.VerificationReport or GenerationReport: its
        `manifest_section()`, `to_json()` and `golden`), or None for a plan.
      stage_seconds: wall time per stage (under "build"; read after `compiled` returned).
      stage_memory: returns {stage: PeakMemory} (under "build"; called after `compiled` returned, a
        stage still running, such as the writer's own, so far).
      overwrite: replace an existing artifact.
      extra_writers: callables (staging_dir) -> {section: JSON}, run in order after the program
        files, report and golden data (e.g. the TF Serving SavedModel). A section that exists
        already and is a dict is extended, not replaced; "build" entries go to the "build" section.
      sharded_verification: each slice plan's run on N CPU devices (its `to_json()`, `manifest_summary()`).
      weights_file: the weights already written as safetensors, moved into the artifact instead of
        being written again; None to write them here.
      padding: {entry point: (the dim a runtime pads, or None; why not)}; EXACT_SIZES for those missing.
      bucket_figures: (entry point, compiled bucket) -> figures the task adds to the bucket's record
        (a decode step's), or None.
      version_sets: returns the compile environments' executables, {version set name: {entry point:
        CompileReport}} (called after `compiled`); each target records them under "version_sets",
        and the manifest's "version_sets" section lists every set's versions, this interpreter's first.
      memory_budget: the conversion's memory budget and the per-run bounds verification ran within
        (verify.RunMemory.to_json()), recorded under "build" (it depends on the machine); None for none.
    Returns:
      The manifest written.
    """
    shared = program.weights_program
    with staging_directory(out, overwrite) as staging:
        put, move = _putter(staging), _mover(staging)
        entry_points = {
            name: EntryPointRecord(*_program_files(put, lowered.exported, name), lowered.signature, lowered.matmul_flops,
                                   tuple(lowered.decision_matmuls),
                                   tuple(spec.name for spec in lowered.signature.inputs if spec.name in program.state_inputs),
                                   *(padding or {}).get(name, EXACT_SIZES))
            for name, lowered in program.entry_points.items()
        }
        weights = WeightsRecord(_weights_file(shared, weights_file, staging, move), tuple(shared.weight_names), dict(shared.tied),
                                dict(shared.weight_layouts), shared.weight_bytes, shared.exported.calling_convention_version,
                                tuple(shared.exported.platforms), export_compatibility())
        sections = {"generation": program.manifest_section()} if program.manifest_section() is not None else {}
        sections["verification"] = dict(PLAN_VERIFICATION) if verification is None else verification.manifest_section()
        # Runs of identical blocks lowered as one scan: module path, blocks, and which state_dict
        # names each stacked weight (among program.weight_names) holds.
        sections["scanned"] = list(shared.scanned)
        if verification is not None:
            report = verification.to_json() | ({"sharded": [result.to_json() for result in sharded_verification]}
                                               if sharded_verification else {})
            put(layout.VERIFICATION_REPORT, json.dumps(report, indent=2) + "\n")
            put(layout.GOLDEN, save_arrays(verification.golden))
        if sharded_verification:
            sections["verification"]["sharded"] = [result.manifest_summary() for result in sharded_verification]
        extra_build = _run_extra_writers(extra_writers, staging, sections)
        reports = compiled()
        targets = _target_records(put, program, reports, bucket_figures)
        compile_seconds = {f"{result.target.name}/{name}/{result.bucket.name}": result.compile_seconds
                           for name, report in reports.items() for result in report.results}
        other_sets = version_sets()
        if other_sets:
            targets = _with_version_sets(put, program, targets, other_sets, bucket_figures)
            sections["version_sets"] = {version_set_name(installed_versions()): installed_versions(),
                                        **{name: next(iter(reports.values())).versions for name, reports in other_sets.items()}}
            compile_seconds.update({f"{result.target.name}@{set_name}/{name}/{result.bucket.name}": result.compile_seconds
                                    for set_name, sets in other_sets.items() for name, report in sets.items() for result in report.results})
        build = {**build_section(stage_seconds), **extra_build,
                 "compile_seconds": {key: round(seconds, 3) for key, seconds in compile_seconds.items()},
                 **({"memory_budget": memory_budget} if memory_budget is not None else {})}
        manifest = Manifest(task, shared.plan_only, package_versions(), dataclasses.asdict(source), shared.precision,
                            shared.resolved_precision, shared.matmul_precision, weights, entry_points, targets, sections, build,
                            hash_tree(staging), stage_memory()).to_json()
        put(layout.MANIFEST, dumps(manifest))
    return manifest


def _putter(staging: pathlib.Path) -> Callable[[str, bytes | str], str]:
    """put(relative path, data): writes a file under the staging directory, returns the relative path."""
    def put(relative: str, data: bytes | str) -> str:
        path = staging / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        return relative

    return put


def _mover(staging: pathlib.Path) -> Callable[[pathlib.Path, str], str]:
    """move(file, relative path): moves a file already written (on the same filesystem) into the
    staging directory, returns the relative path."""
    def move(source: pathlib.Path, relative: str) -> str:
        (staging / relative).parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, staging / relative)
        return relative

    return move


def _program_files(put, exported, entry_point: str) -> tuple[str, str, str]:
    """Writes an entry point's three program files under program/<entry point>/; returns their paths
    (the jax.export serialization, MLIR text, StableHLO bytecode)."""
    return (put(layout.entry_point_program(entry_point, layout.EXPORTED), bytes(exported.serialize())),
            put(layout.entry_point_program(entry_point, layout.MLIR_TEXT), exported.mlir_module()),
            put(layout.entry_point_program(entry_point, layout.STABLEHLO_BYTECODE), bytes(exported.mlir_module_serialized)))


def _run_extra_writers(extra_writers, staging: pathlib.Path, sections: dict) -> dict:
    """Runs the extra writers in order, their sections merged into `sections` (a dict section that
    exists is extended).

    Returns:
      Their "build" entries (run-dependent figures such as timings), for the "build" section.
    """
    extra_build = {}
    for writer in extra_writers:
        written = writer(staging)
        extra_build.update(written.pop("build", {}))
        for name, value in written.items():
            sections[name] = {**sections[name], **value} if isinstance(sections.get(name), dict) and isinstance(value, dict) else value
    return extra_build


def _target_records(put, program: EntryPoints, reports: dict[str, CompileReport],
                    bucket_figures: Callable[[str, CompiledBucket], dict] | None) -> dict[str, TargetRecord]:
    """Writes every executable; returns each target's record (facts, compile key, plans, buckets)."""
    facts, keys, plans, buckets = {}, {}, {}, {}
    for name, report in reports.items():
        for result in report.results:
            target = result.target.name
            facts.setdefault(target, _target_facts(result))
            keys.setdefault(target, result.compile_key)
            if result.plan is not None:
                plans.setdefault(target, {})[name] = result.plan.to_json()
            figures = _bucket_figures(result, program.entry_points[name]) | (bucket_figures(name, result) if bucket_figures else {})
            executable = put(layout.executable_path(target, result.bucket.name, name), result.executable)
            buckets.setdefault(target, []).append(BucketRecord(name, result.bucket.name, result.bucket.as_dict(), executable,
                                                               result.fingerprint, tuple(result.state_as_bits), figures))
    return {target: TargetRecord(facts[target], keys[target], plans.get(target, {}), tuple(buckets[target])) for target in facts}


def _with_version_sets(put, program: EntryPoints, targets: dict[str, TargetRecord], version_sets: dict[str, dict[str, CompileReport]],
                       bucket_figures: Callable[[str, CompiledBucket], dict] | None) -> dict[str, TargetRecord]:
    """Writes every compile environment's executables (layout.executable_path with its version set);
    returns the target records with them under "version_sets"."""
    sets = {target: {} for target in targets}
    for set_name, reports in version_sets.items():
        keys, buckets = {}, {}
        for name, report in reports.items():
            for result in report.results:
                target = result.target.name
                keys.setdefault(target, result.compile_key)
                figures = _bucket_figures(result, program.entry_points[name]) | (bucket_figures(name, result) if bucket_figures else {})
                executable = put(layout.executable_path(target, result.bucket.name, name, set_name), result.executable)
                buckets.setdefault(target, []).append(BucketRecord(name, result.bucket.name, result.bucket.as_dict(), executable,
                                                                   result.fingerprint, tuple(result.state_as_bits), figures))
        for target in keys:
            sets[target][set_name] = ExecutableSet(keys[target], tuple(buckets[target]))
    return {name: dataclasses.replace(record, version_sets=sets[name]) for name, record in targets.items()}


def _target_facts(result: CompiledBucket) -> dict:
    """A target's chip facts in its manifest record (a slice's devices, their ids and their processes too:
    `processes` hosts, `device_processes` the process of each of device_ids, in mesh order)."""
    target = result.target
    facts = {"generation": target.generation, "topology": target.topology, "hbm_bytes": target.hbm_bytes, "platform": target.platform}
    if target.is_slice:
        facts.update({"chips": target.chips, "devices": target.devices, "hbm_bytes_per_device": target.hbm_bytes_per_device,
                      "device_ids": list(result.device_ids), "processes": len(set(result.device_processes)) or 1,
                      "device_processes": list(result.device_processes)})
    return facts


def _bucket_figures(result: CompiledBucket, lowered: LoweredProgram) -> dict:
    """An executable's figures: XLA's memory and cost analysis, HBM fit, matmul FLOPs, collectives, kernels."""
    figures = {
        "memory": result.memory,
        "cost": result.cost,
        "program_matmul_flops": flops_at(lowered.matmul_flops, result.bucket.as_dict()),
        "fits_in_hbm": result.fits_in_hbm,
        "hbm_utilization": round(result.memory["total_bytes"] / result.target.hbm_bytes_per_device, 6),
        "matmul_flops": result.matmul_flops,
    }
    if result.target.is_slice:
        figures["collectives"] = result.collectives
    if result.kernels:  # which program it was compiled from: kernels with their block sizes, or why not (lower/kernels.py)
        figures["kernels"] = result.kernels
    return figures


def kernels_writer(mode: str, kernels: dict[str, dict] | None, checks: list[dict]):
    """The writer (see write_artifact's extra_writers) of the manifest's "kernels" section and of each
    bucket's static program with kernels (layout.kernel_program_path), which `tpuexport verify
    --recompile` compiles again.

    Args:
      mode: "auto" or "none".
      kernels: {entry point: {bucket name: lower.BucketKernels}}, or None.
      checks: the kernel uses' interpret-mode checks (verify.KernelCheck.to_json()).
    """
    def write(staging: pathlib.Path) -> dict:
        programs = {}
        for entry_point, buckets in (kernels or {}).items():
            for bucket, lowering in (buckets or {}).items():
                if lowering.exported is not None:
                    path = programs[f"{entry_point}/{bucket}"] = layout.kernel_program_path(entry_point, bucket)
                    (staging / path).parent.mkdir(parents=True, exist_ok=True)
                    (staging / path).write_bytes(bytes(lowering.exported.serialize()))
        return {"kernels": {"mode": mode, "programs": programs, "verification": list(checks)}}

    return write


def _weights_file(lowered: LoweredProgram, weights_file: pathlib.Path | None, staging: pathlib.Path, move) -> str | None:
    """Puts the weights into the artifact: moves the file already written, else writes them one
    array at a time (write_arrays: no in-memory copy of the model).

    Returns:
      The weights file's path in the artifact, or None for a plan (no weights).
    """
    if lowered.plan_only:
        return None
    if weights_file:
        return move(weights_file, layout.WEIGHTS)
    (staging / layout.WEIGHTS).parent.mkdir(parents=True, exist_ok=True)
    write_arrays(staging / layout.WEIGHTS, lowered.weight_names, lowered.weights)
    return layout.WEIGHTS
