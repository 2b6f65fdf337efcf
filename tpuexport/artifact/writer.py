"""Writing an artifact directory atomically: everything goes to a temporary sibling directory,
which is renamed into place only once complete, so a failed conversion leaves nothing behind.

A conversion that is killed (SIGKILL, power loss) cannot remove its hidden siblings of OUT
(`.OUT.partial-*`, the pipeline's `.OUT.scratch-*`); their names hold the host and process id that
made them, and the next conversion into OUT removes those whose process is gone.
"""

from __future__ import annotations

import contextlib
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
from tpuexport.arrays import save_arrays
from tpuexport.compile import CompileReport
from tpuexport.compile.compile_key import export_compatibility
from tpuexport.errors import TpuExportError
from tpuexport.export import CACHE_INPUTS, SourceInfo
from tpuexport.lower import GenerationProgram, LoweredProgram
from tpuexport.lower.cost import flops_at
from tpuexport.verify import GenerationReport, VerificationReport


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


def write_artifact(
    out: pathlib.Path,
    *,
    source: SourceInfo,
    lowered: LoweredProgram,
    compiled: Callable[[], CompileReport],
    verification: VerificationReport | None,
    stage_seconds: dict[str, float],
    overwrite: bool = False,
    extra_writers=(),
    sharded_verification: list[dict] | tuple = (),
    weights_file: pathlib.Path | None = None,
) -> dict:
    """Writes the artifact directory.

    Args:
      out: the artifact directory to create (or replace, with overwrite).
      source: where the model came from.
      lowered: the lowered program and weights (a plan without weights writes no weights file).
      compiled: returns the TPU executables and their figures; called once the program files and
        the extra writers are done, so that compilation running in the background overlaps them.
      verification: the passed verification report with golden data, or None for a plan
        (`lowered.plan_only`): no report, no golden data, and the manifest says "plan_only": true.
      stage_seconds: wall time per stage, recorded under "build" (read when the manifest is
        written, after `compiled` returned).
      overwrite: replace an existing artifact.
      extra_writers: callables (staging_dir) -> dict of manifest sections, run in order after the
        program files, verification report and golden data are written (e.g. the TF Serving
        SavedModel). A "build" entry among them (run-dependent figures such as timings) is merged
        into the manifest's "build" section rather than replacing it.
      sharded_verification: each sharding plan's run on virtual CPU devices
        (ShardedVerification.to_json()), recorded under "sharded" in the report and the manifest's
        "verification"; empty without slice targets.
      weights_file: the weights already written as safetensors (by name), moved into the artifact
        instead of being written again; None to write them here.
    Returns:
      The manifest written.
    """
    with staging_directory(out, overwrite) as staging:
        put, move = _putter(staging), _mover(staging)
        exported = lowered.exported
        program = {
            **_program_files(put, exported),
            "calling_convention_version": exported.calling_convention_version,
            # Until when newer JAX releases keep loading exported.jaxexport (compile_key.py).
            "serialization": export_compatibility(),
            "platforms": list(exported.platforms),
            "call": "exported.call(weights, inputs): two lists, in weight_names and signature.inputs order",
            "weights": _weights_file(lowered, weights_file, put, move),
            "weight_names": list(lowered.weight_names),
            "tied_weights": dict(lowered.tied),
            # Weights stored in another layout than their state_dict tensors: the tensor's axes in stored order.
            "weight_layouts": {name: list(layout) for name, layout in lowered.weight_layouts.items()},
            # Matmuls pinned to "highest" whatever matmul_precision says: they feed a top-k, sort or argmax.
            "decision_matmuls": list(lowered.decision_matmuls),
            "weight_bytes": lowered.weight_bytes,
            "matmul_flops": lowered.matmul_flops,
        }
        manifest = {
            **_manifest_head(source, lowered),
            "signature": lowered.signature.to_json(),
            "program": program,
            "targets": {},
            "verification": dict(PLAN_VERIFICATION) if verification is None else verification_section(verification),
            # Runs of identical blocks lowered as one scan: module path, blocks, and which
            # state_dict names each stacked weight (among program.weight_names) holds.
            "scanned": list(lowered.scanned),
        }
        if verification is not None:
            report = verification.to_json()
            if sharded_verification:
                report["sharded"] = list(sharded_verification)
            _put_verification(put, report, verification.golden)
        if sharded_verification:
            manifest["verification"]["sharded"] = [
                {key: entry[key] for key in ("targets", "passed", "devices", "mesh", "collectives")}
                | {"cases": [{key: case[key] for key in ("label", "sizes", "reason", "passed")} for case in entry["cases"]]}
                for entry in sharded_verification
            ]
        extra_build = _run_extra_writers(extra_writers, staging, manifest)
        results = compiled().results
        for result in results:
            _target_entry(manifest, result)["buckets"].append(_bucket_entry(put, result, lowered))
        compile_seconds = {f"{r.target.name}/{r.bucket.name}": r.compile_seconds for r in results}
        _put_manifest(put, staging, manifest, stage_seconds, extra_build, compile_seconds)
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


def _manifest_head(source: SourceInfo, lowered: LoweredProgram) -> dict:
    """The manifest's first sections, alike for every artifact: format, versions, source, precisions."""
    return {
        "format": layout.FORMAT,
        "format_version": layout.FORMAT_VERSION,
        "plan_only": lowered.plan_only,
        "versions": package_versions(),
        "source": {"kind": source.kind, "path": source.path, "sha256": source.sha256, "reference": source.reference,
                   "checkpoint": source.checkpoint},
        "precision": lowered.precision,
        # What "auto" (or f32) resolved to: what the program computes in, which set the tolerances.
        "resolved_precision": lowered.resolved_precision,
        "matmul_precision": lowered.matmul_precision,
    }


def _put_verification(put, report: dict, golden: dict) -> None:
    """Writes the verification report and its golden data."""
    put(layout.VERIFICATION_REPORT, json.dumps(report, indent=2) + "\n")
    put(layout.GOLDEN, save_arrays(golden))


def _run_extra_writers(extra_writers, staging: pathlib.Path, manifest: dict) -> dict:
    """Runs the extra writers in order, their sections merged into the manifest.

    Returns:
      Their "build" entries (run-dependent figures such as timings), for the "build" section.
    """
    extra_build = {}
    for writer in extra_writers:
        sections = writer(staging)
        extra_build.update(sections.pop("build", {}))
        manifest.update(sections)
    return extra_build


def _put_manifest(put, staging: pathlib.Path, manifest: dict, stage_seconds: dict[str, float], extra_build: dict,
                  compile_seconds: dict[str, float]) -> None:
    """Completes the manifest (build section with compile seconds per executable, every file's
    sha256) and writes it, last: a directory without a manifest is no artifact."""
    manifest["build"] = {**build_section(stage_seconds), **extra_build,
                         "compile_seconds": {key: round(seconds, 3) for key, seconds in compile_seconds.items()}}
    manifest["files"] = hash_tree(staging)
    put(layout.MANIFEST, dumps(manifest))


def kernels_writer(mode: str, kernels: dict | None, checks: list[dict]):
    """The writer (see write_artifact's extra_writers) of the manifest's "kernels" section and of each
    bucket's static program with kernels (layout.kernel_program_path), which `tpuexport verify
    --recompile` compiles again.

    Args:
      mode: "auto" or "none".
      kernels: {bucket name: lower.BucketKernels}, or None.
      checks: the kernel uses' interpret-mode checks (verify.KernelCheck.to_json()).
    """
    def write(staging: pathlib.Path) -> dict:
        programs = {}
        for name, lowering in (kernels or {}).items():
            if lowering.exported is not None:
                programs[name] = layout.kernel_program_path(name)
                (staging / programs[name]).parent.mkdir(parents=True, exist_ok=True)
                (staging / programs[name]).write_bytes(bytes(lowering.exported.serialize()))
        return {"kernels": {"mode": mode, "programs": programs, "verification": list(checks)}}

    return write


def _program_files(put, exported, entry_point: str | None = None) -> dict:
    """Writes a program's three files (program/, or program/<entry point>/) and returns their paths."""
    def path(name: str) -> str:
        return layout.entry_point_program(entry_point, name) if entry_point else name

    return {
        "exported": put(path(layout.EXPORTED), bytes(exported.serialize())),
        "mlir_text": put(path(layout.MLIR_TEXT), exported.mlir_module()),
        "stablehlo_bytecode": put(path(layout.STABLEHLO_BYTECODE), bytes(exported.mlir_module_serialized)),
    }


def _target_entry(manifest: dict, result) -> dict:
    """The manifest's entry of a result's target (created with the target's facts on first use)."""
    target = result.target
    entry = manifest["targets"].setdefault(target.name, {
        "generation": target.generation,
        "topology": target.topology,
        "hbm_bytes": target.hbm_bytes,
        "platform": target.platform,
        # What the executables load on; the runtime compares it with the host.
        "compile_key": result.compile_key,
        "buckets": [],
    })
    if target.is_slice:
        entry.update({
            "chips": target.chips,
            "devices": target.devices,
            "hbm_bytes_per_device": target.hbm_bytes_per_device,
            "device_ids": list(result.device_ids),
        })
        # A text-generation artifact's entry points each have their plan (under its buckets).
        if "entry_points" not in manifest:
            entry["sharding"] = result.plan.to_json()
    return entry


def _bucket_entry(put, result, lowered: LoweredProgram, entry_point: str | None = None) -> dict:
    """Writes one executable and returns its manifest entry."""
    target = result.target
    bucket = {
        "name": result.bucket.name,
        "sizes": result.bucket.as_dict(),
        "executable": put(layout.executable_path(target.name, result.bucket.name, entry_point), result.executable),
        "memory": result.memory,
        "cost": result.cost,
        "program_matmul_flops": flops_at(lowered.matmul_flops, result.bucket.as_dict()),
        "fits_in_hbm": result.fits_in_hbm,
        "hbm_utilization": round(result.memory["total_bytes"] / target.hbm_bytes_per_device, 6),
        "fingerprint": result.fingerprint,
        "matmul_flops": result.matmul_flops,
    }
    if target.is_slice:
        bucket["collectives"] = result.collectives
    if result.kernels:  # which program it was compiled from: kernels with their block sizes, or why not (lower/kernels.py)
        bucket["kernels"] = result.kernels
    if result.state_as_bits:  # how the runtime passes this executable its state (compile/aot.py, cpu_executable_program)
        bucket["state_as_bits"] = list(result.state_as_bits)
    return bucket


# The manifest's "verification" block of a plan: nothing ran, and it says so.
PLAN_VERIFICATION = {"passed": None, "status": "not verified: plan only"}


def _weights_file(lowered: LoweredProgram, weights_file: pathlib.Path | None, put, move) -> str | None:
    """Puts the weights into the artifact: moves the file already written, else writes them.

    Returns:
      The weights file's path in the artifact, or None for a plan (no weights).
    """
    if lowered.plan_only:
        return None
    if weights_file:
        return move(weights_file, layout.WEIGHTS)
    return put(layout.WEIGHTS, save_arrays(dict(zip(lowered.weight_names, lowered.weights))))


def _report_summary(verification: VerificationReport | GenerationReport) -> dict:
    """What the "verification" block of every artifact says: outcome, reference, arithmetic,
    tolerances, and where the report and golden data are."""
    return {
        "passed": verification.passed,
        "against": verification.against,
        "matmul_precision": verification.matmul_precision,
        "tolerances": verification.tolerances.to_json(),
        "report": layout.VERIFICATION_REPORT,
        "golden": layout.GOLDEN,
    }


def verification_section(verification: VerificationReport) -> dict:
    """The manifest's "verification" block (extra writers extend it, e.g. with the SavedModel check)."""
    return {
        **_report_summary(verification),
        "cases": [{"label": c.label, "sizes": c.sizes, "reason": c.reason, "golden": c.golden} for c in verification.cases],
        "conformance": None if verification.conformance is None else verification.conformance.to_json(),
    }


def write_generation_artifact(
    out: pathlib.Path,
    *,
    source: SourceInfo,
    program: GenerationProgram,
    compiled: dict[str, CompileReport],
    verification: GenerationReport | None,
    stage_seconds: dict[str, float],
    overwrite: bool = False,
    extra_writers=(),
    weights_file: pathlib.Path | None = None,
    sharded_verification: list[dict] | tuple = (),
) -> dict:
    """Writes a text-generation artifact: one weights file, each entry point's program files and
    executables, and the manifest's "entry_points" and "generation" sections (README, "Text
    generation": the layout a runtime reads).

    Args:
      out: the artifact directory to create (or replace, with overwrite).
      source: where the model came from.
      program: the entry points over one set of weights (a plan's have no weights).
      compiled: {entry point: its CompileReport}.
      verification: the passed generation report, or None for a plan.
      stage_seconds: wall time per stage (under "build").
      overwrite: replace an existing artifact.
      extra_writers: callables (staging_dir) -> dict of manifest sections, as for `write_artifact`
        (a Hugging Face source's tokenizer and config files).
      weights_file: the weights already written as safetensors (streamed from a checkpoint), moved
        into the artifact instead of being written again; None to write them here.
      sharded_verification: each slice plan's generation on virtual CPU devices
        (ShardedGenerationVerification.to_json()), under "sharded" in the report and, summarized,
        in the manifest's "verification".
    Returns:
      The manifest written.
    """
    spec = program.spec
    shared = program.weights_program
    with staging_directory(out, overwrite) as staging:
        put, move = _putter(staging), _mover(staging)
        entry_points = {}
        for name, lowered in program.entry_points.items():
            inputs = [tensor.name for tensor in lowered.signature.inputs]
            entry_points[name] = {
                **_program_files(put, lowered.exported, name),
                "signature": lowered.signature.to_json(),
                "matmul_flops": lowered.matmul_flops,
                "decision_matmuls": list(lowered.decision_matmuls),
                # The state: inputs returned as the output of the same name; the executables donate every
                # input, so XLA aliases these with their outputs (updated in place).
                "donated_inputs": [input_name for input_name in inputs if input_name in program.state_inputs],
                "state": {input_name: input_name for input_name in inputs if input_name in program.state_inputs},
                "call": "exported.call(weights, inputs): two lists, in program.weight_names and this signature's input order",
            }
        manifest = {
            **_manifest_head(source, shared),
            "task": "text-generation",
            # What every entry point shares: the weights, passed first to each.
            "program": {
                "weights": _weights_file(shared, weights_file, put, move),
                "weight_names": list(shared.weight_names),
                "tied_weights": dict(shared.tied),
                # Weights stored in another layout than their state_dict tensors: the tensor's axes in stored order.
                "weight_layouts": {name: list(layout) for name, layout in shared.weight_layouts.items()},
                "weight_bytes": shared.weight_bytes,
                "calling_convention_version": shared.exported.calling_convention_version,
                "platforms": list(shared.exported.platforms),
                # Until when newer JAX releases keep loading the entry points' exported.jaxexport (compile_key.py).
                "serialization": export_compatibility(),
            },
            "entry_points": entry_points,
            "generation": program.manifest_section(),
            "targets": {},
            "verification": dict(PLAN_VERIFICATION) if verification is None else _generation_verification(verification),
            "scanned": list(shared.scanned),
        }
        if verification is not None:
            _put_verification(put, verification.to_json() | ({"sharded": list(sharded_verification)} if sharded_verification else {}),
                              verification.golden)
        if sharded_verification:
            manifest["verification"]["sharded"] = [
                {key: entry[key] for key in ("targets", "passed", "devices", "mesh", "collectives", "aliased_outputs", "resharded_calls")}
                | {"case": {key: entry["case"][key] for key in ("label", "sizes", "lengths", "new_tokens", "passed")}}
                for entry in sharded_verification
            ]
        for name, report in compiled.items():
            for result in report.results:
                bucket = {"entry_point": name, **_bucket_entry(put, result, program.entry_points[name], name)}
                if result.plan is not None:
                    bucket["sharding"] = result.plan.to_json()
                if name == "decode":
                    bucket["decode_step"] = _decode_step_figures(result, spec)
                _target_entry(manifest, result)["buckets"].append(bucket)
        extra_build = _run_extra_writers(extra_writers, staging, manifest)
        compile_seconds = {f"{result.target.name}/{name}/{result.bucket.name}": result.compile_seconds
                           for name, report in compiled.items() for result in report.results}
        _put_manifest(put, staging, manifest, stage_seconds, extra_build, compile_seconds)
    return manifest


def _decode_step_figures(result, spec) -> dict:
    """What one decode step must read per device (its arguments: weights + the whole cache, the
    live cache at max batch x max context) next to XLA's bytes accessed, and the largest batch
    that fits the device, estimated linearly from the compiled max batch (cache and temporaries
    grow with the batch, weights do not)."""
    memory = result.memory
    must_read = memory["argument_bytes"]
    per_slot = (_cache_bytes_per_device(result, spec) + memory["temp_bytes"]) / spec.max_batch
    headroom = result.target.hbm_bytes_per_device - memory["total_bytes"]
    accessed = result.cost.get("bytes_accessed") or 0.0
    return {
        "must_read_bytes": must_read,
        # The arguments less the cache: the weights (and the step's few token and position ids).
        "weight_bytes": must_read - _cache_bytes_per_device(result, spec),
        "cache_bytes": _cache_bytes_per_device(result, spec),
        "temp_bytes": memory["temp_bytes"],
        "xla_bytes_accessed": accessed if accessed > 0 else "unknown",
        "bytes_accessed_over_must_read": round(accessed / must_read, 4) if accessed > 0 and must_read else "unknown",
        "largest_batch_estimate": max(0, int(spec.max_batch + headroom // per_slot)) if per_slot > 0 else "unknown",
    }


def _cache_bytes_per_device(result, spec) -> int:
    """The KV cache's bytes on one device: whole on a chip, divided by the mesh axes that split it on a slice."""
    if result.plan is None:
        return spec.cache_bytes
    mesh = dict(result.plan.mesh)
    inputs = dict(result.plan.inputs)
    split = 1
    for entry in inputs.get(CACHE_INPUTS[0], ()):
        for axis in (entry if isinstance(entry, (tuple, list)) else (entry,)):
            if axis is not None:
                split *= mesh[axis]
    return spec.cache_bytes // split


def _generation_verification(verification: GenerationReport) -> dict:
    """The manifest's "verification" block of a text-generation artifact."""
    return {
        **_report_summary(verification),
        "tokens_compared": verification.tokens_compared(),
        "ties": verification.ties(),
        "cases": [{"label": case.label, "sizes": case.sizes, "lengths": list(case.lengths), "slots": list(case.slots),
                   "new_tokens": case.new_tokens, "golden": case.golden} for case in verification.cases],
    }
