"""Ahead-of-time TPU compilation through libtpu's compile-only topologies (no TPU needed), and
the same for the build host's XLA:CPU (the `cpu` target, which the runtime can load here).

For each target the lowered program's buckets are compiled by XLA's TPU compiler, for one chip
or, for a slice, partitioned over its devices by a sharding plan (sharding.py), in a child
process (compile_child.py) that loads nothing but jax and libtpu. One process per target compiles
every entry point of the program (text generation's prefill, decode and sample; a forward program
is one entry point), one after another: starting a compiler process (importing jax, loading
libtpu, making the topology) costs about 1 s of CPU, more than compiling a small entry point (which is
also why a process converting many models can keep them between conversions: compiler_processes.py). A
crash inside libtpu's compiler (seen: a segfault compiling a transformer for 7x at one bucket size)
then becomes an error naming the target and bucket instead of killing the conversion, and the
user's process never loads libtpu. XLA's own memory and cost analyses give the figures for the
report and the HBM-fit verdict, per device; a slice's compiled HLO also says which collectives
its devices exchange (hlo.py).

The targets' processes (and each compile environment's) run at the same time (up to one per
core), in the background of the conversion (`CompileJob`): verification and the SavedModel need
only the lowered program, so they run while the TPU compiler works.

A compiler process that does not finish a bucket within TPUEXPORT_COMPILE_TIMEOUT seconds
(environment, default COMPILE_TIMEOUT_SECONDS; its start-up counts toward its first bucket) is
killed and the conversion fails naming the target and bucket.

With compile environments (compile_envs.py, `--compile-env`), each target's compiler process also
runs under each environment's interpreter, with the same request: those executables carry that
environment's versions in their compile key (a version set of their own in the artifact).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable

import jax

from tpuexport.compile.buckets import Bucket
from tpuexport.compile.compile_envs import CompileEnv, describe_versions, environment_for
from tpuexport.compile.compile_key import compile_key
from tpuexport.compile.compiler_processes import compiler_for, compiler_settings
from tpuexport.compile.hlo import collectives, matmul_flops_by_types
from tpuexport.compile.sharding import DATA_AXIS, ShardingPlan, describe_buffers, per_device_buffers
from tpuexport.compile.targets import Target
from tpuexport.errors import TpuExportError
from tpuexport.lower import DEFAULT_ENTRY_POINT, LoweredProgram
from tpuexport.lower.cpu_program import cpu_program, state_positions
from tpuexport.lower.lowered import CPU_COMPILER_OPTIONS

if TYPE_CHECKING:  # kernels.py imports torch; the runtime imports this module without it
    from tpuexport.lower.kernels import BucketKernels

# The slowest compile measured (Llama-3-70B planned for v5p-128, docs/checkpoints-and-plans.md) takes 151 s: ten times that,
# so only a hung compiler reaches it.
COMPILE_TIMEOUT_SECONDS = 1800.0
COMPILE_TIMEOUT_VARIABLE = "TPUEXPORT_COMPILE_TIMEOUT"


def compile_timeout() -> float:
    """Seconds a compiler process may spend on one bucket (TPUEXPORT_COMPILE_TIMEOUT, else the default).

    Raises:
      TpuExportError: the variable is not a positive number.
    """
    text = os.environ.get(COMPILE_TIMEOUT_VARIABLE)
    if text is None:
        return COMPILE_TIMEOUT_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise TpuExportError(f"{COMPILE_TIMEOUT_VARIABLE}={text!r} is not a positive number of seconds; set it to e.g. 600 or unset it")
    return seconds


@dataclasses.dataclass(frozen=True)
class CompiledBucket:
    """One TPU executable and what XLA says about it.

    Attributes:
      target: the Target it was compiled for.
      bucket: the concrete dim sizes.
      executable: the serialized PJRT executable (loadable only on a real TPU of that kind).
      compile_seconds: wall time of lowering + compiling.
      memory: bytes per device from `memory_analysis()`: argument, output, temp, alias,
        generated_code and their total (argument + output + temp + generated_code - alias).
      cost: `cost_analysis()` figures: flops, bytes_accessed, optimal_seconds (XLA's estimate,
        None when unknown; never negative, see compile_child.optimal_seconds).
      fingerprint: sha256 of the compiled HLO text, to detect compiler drift later.
      hlo_text: the compiled HLO text (TPU layouts and op types), kept in memory only.
      matmul_flops: FLOPs of the compiled dots and convolutions per operand types, e.g.
        {"s8xs8->s32": ..., "f32xf32->f32": ...} (see compile/hlo.py).
      plan: the sharding plan a slice was compiled with, None for a single chip.
      collectives: {kind: {"count", "bytes"}} of the compiled HLO (hlo.collectives; empty for a
        single chip).
      device_ids: the topology's device ids in mesh order (one id for a single chip).
      device_processes: the process (host) of each of device_ids, as the topology (or a `cpu-PxK`
        twin's processes) assigns them; more than one process means a multi-host slice.
      compile_key: what the executable loads on (compile_key.compile_key): versions, platform,
        device kind and count, compiler options, jax.export versions.
      kernels: which program it was compiled from: the bucket's static program with TPU kernels
        (lower/kernels.py; its attention ops' kernels and block sizes) or the portable one, and why
        ({} when kernels were not asked for).
      state_as_bits: the bfloat16 state (inputs returned as outputs of the same name: a KV cache)
        the executable takes and returns as uint16 bit patterns (`cpu_executable_program`).
    """

    target: Target
    bucket: Bucket
    executable: bytes
    compile_seconds: float
    memory: dict[str, int]
    cost: dict[str, float]
    fingerprint: str
    hlo_text: str
    matmul_flops: dict[str, int]
    plan: ShardingPlan | None = None
    collectives: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    device_ids: tuple[int, ...] = ()
    device_processes: tuple[int, ...] = ()
    compile_key: dict = dataclasses.field(default_factory=dict)
    kernels: dict = dataclasses.field(default_factory=dict)
    state_as_bits: tuple[str, ...] = ()

    @property
    def fits_in_hbm(self) -> bool:
        return self.memory["total_bytes"] <= self.target.hbm_bytes_per_device


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """The compile stage's result: one CompiledBucket per (target, bucket), targets outermost.

    Attributes:
      results: the executables.
      versions: the jax/jaxlib/libtpu versions of the compile environment that compiled them
        (compile_envs.CompileEnv.versions), or {} for this interpreter's.
    """

    results: tuple[CompiledBucket, ...]
    versions: dict = dataclasses.field(default_factory=dict)

    def for_target(self, name: str) -> list[CompiledBucket]:
        return [r for r in self.results if r.target.name == name]


@dataclasses.dataclass(frozen=True)
class EntryPointCompile:
    """One entry point of a program to compile for every target of a CompileJob.

    Attributes:
      lowered: the entry point's lowering (lower stage).
      buckets: concrete dim sizes, one executable each.
      on_compiled: called after each of its executables (for progress output; from the job's
        threads), or None.
      plans: {slice target name: its sharding plan} (sharding.plan_sharding); a slice without a
        plan is compiled with every weight and input whole on every device.
      kernels: {bucket name: its kernel lowering (lower.kernels.lower_bucket_kernels)}: a single
        TPU chip compiles a bucket's static program with kernels where it has one; None (kernels
        not asked for) compiles the portable program everywhere.
    """

    lowered: LoweredProgram
    buckets: list[Bucket]
    on_compiled: Callable[[CompiledBucket], None] | None = None
    plans: dict[str, ShardingPlan] = dataclasses.field(default_factory=dict)
    kernels: dict[str, BucketKernels] | None = None


def compile_program(
    lowered: LoweredProgram,
    targets: list[Target],
    buckets: list[Bucket],
    on_compiled: Callable[[CompiledBucket], None] | None = None,
    plans: dict[str, ShardingPlan] | None = None,
    kernels: dict[str, BucketKernels] | None = None,
) -> CompileReport:
    """Compiles one lowered program (one entry point) for every target and bucket, and waits for it.

    Args:
      lowered, buckets, on_compiled, plans, kernels: as EntryPointCompile's fields.
      targets: TPU targets (single chips and slices).
    Returns:
      The CompileReport.
    Raises:
      TpuExportError: XLA refused to compile or libtpu crashed (naming the target and bucket), or
        a bucket does not fit in a device's HBM (all such buckets are named, with their largest
        buffers).
    """
    with CompileJob({DEFAULT_ENTRY_POINT: EntryPointCompile(lowered, buckets, on_compiled, plans or {}, kernels)}, targets) as job:
        return job.result()[DEFAULT_ENTRY_POINT]


class CompileJob:
    """Compilation running in child processes, one per target for all entry points, while the caller goes on.

    Used as a context manager: leaving the block before `result()` (e.g. verification failed)
    kills the compiler processes. `on_compiled` is called from the job's threads.

    Attributes:
      children: every compiler process that compiled for it, one per target and compile environment
        (kept ones, within `kept_compilers()`, live on after the job).
      compile_envs: the other environments every target is also compiled under (compile_envs.py).
      target_sizes: called with (target, job) in the target's thread before it compiles: {dim: size}
        that replaces those dims' sizes in every bucket compiled for that target (a paged cache's
        pages, sized to the target's HBM: tasks/page_count.py), or None for the buckets as given.
    """

    def __init__(self, entry_points: dict[str, EntryPointCompile], targets: list[Target], compile_envs: tuple[CompileEnv, ...] = (),
                 target_sizes: Callable[[Target, "CompileJob"], dict[str, int]] | None = None):
        self.entry_points = entry_points
        self.targets = targets
        self.compile_envs = tuple(compile_envs)
        self.target_sizes = target_sizes
        self.children: list[subprocess.Popen] = []
        self.busy: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.cancelled = False
        processes = len(targets) * (1 + len(self.compile_envs))
        self.pool = ThreadPoolExecutor(max_workers=max(1, min(processes, os.cpu_count() or 1)), thread_name_prefix="tpu-compile")
        self.started_at = time.perf_counter()
        self.finished_at = self.started_at
        self.futures = [self.pool.submit(self._compile, target) for target in targets]
        self.env_futures = {env.name: [self.pool.submit(self._compile, target, env) for target in targets] for env in self.compile_envs}
        for future in [*self.futures, *(future for futures in self.env_futures.values() for future in futures)]:
            future.add_done_callback(self._finished)

    def _compile(self, target: Target, env: CompileEnv | None = None) -> dict[str, list[CompiledBucket]]:
        """compile_target, at the target's own sizes of the dims `target_sizes` gives."""
        sizes = self.target_sizes(target, self) if self.target_sizes is not None else {}
        return compile_target({name: at_sizes(entry, sizes) for name, entry in self.entry_points.items()}, target, self, env)

    def _finished(self, _future) -> None:
        with self.lock:
            self.finished_at = max(self.finished_at, time.perf_counter())

    @property
    def seconds(self) -> float:
        """Wall time from the start of the job to its last target's end (once `result()` returned)."""
        return self.finished_at - self.started_at

    def __enter__(self) -> "CompileJob":
        return self

    def __exit__(self, *exc_info) -> None:
        self.cancel()

    def started(self, child: subprocess.Popen) -> None:
        """Registers a compiler process working for the job (killed at once if the job was cancelled meanwhile)."""
        with self.lock:
            self.children.append(child)
            self.busy.add(child)
            if self.cancelled:
                child.kill()

    def finished(self, child: subprocess.Popen) -> None:
        """A compiler process is done with the job's request: cancelling no longer kills it."""
        with self.lock:
            self.busy.discard(child)

    def result(self) -> dict[str, CompileReport]:
        """Waits for every target: {entry point: its CompileReport}; see `compile_program` for what it raises."""
        by_target = [future.result() for future in self.futures]
        return {name: _judge_hbm_fit([result for results in by_target for result in results[name]], entry.lowered)
                for name, entry in self.entry_points.items()}

    def version_sets(self) -> dict[str, dict[str, CompileReport]]:
        """Waits for every compile environment: {version set name: {entry point: its CompileReport}}
        ({} without compile environments); raises as `result()`."""
        sets = {}
        for env in self.compile_envs:
            by_target = [future.result() for future in self.env_futures[env.name]]
            sets[env.name] = {name: dataclasses.replace(_judge_hbm_fit([result for results in by_target for result in results[name]],
                                                                       entry.lowered), versions=dict(env.versions))
                              for name, entry in self.entry_points.items()}
        return sets

    def cancel(self) -> None:
        """Kills compiler processes still running and waits for the threads."""
        with self.lock:
            self.cancelled = True
            for child in self.busy:
                if child.poll() is None:
                    child.kill()
        self.pool.shutdown(wait=True, cancel_futures=True)


def _judge_hbm_fit(results: list[CompiledBucket], lowered: LoweredProgram) -> CompileReport:
    misfits = [r for r in results if not r.fits_in_hbm]
    if misfits:
        listed = "; ".join(
            f"{r.target.name} bucket {r.bucket.name} needs {r.memory['total_bytes']:,} bytes{_per_device(r.target)} "
            f"(temporaries {r.memory['temp_bytes']:,}), HBM is {r.target.hbm_bytes_per_device:,}; largest arguments"
            f"{_per_device(r.target)}: {_largest_buffers(lowered, r.plan, r.bucket)}"
            for r in misfits
        )
        raise TpuExportError(f"does not fit in HBM: {listed}; use smaller buckets, a sharding plan that splits more, "
                             "or a target with more HBM")
    return CompileReport(tuple(results))


def _per_device(target: Target) -> str:
    return " per device" if target.is_slice else ""


def _largest_buffers(lowered: LoweredProgram, plan: ShardingPlan | None, bucket: Bucket) -> str:
    return describe_buffers(per_device_buffers(plan, lowered.weight_names, lowered.weight_specs, lowered.signature, bucket))


@dataclasses.dataclass(frozen=True)
class _ProgramInRequest:
    """What the parent keeps of one entry point it sent a compiler process, to make its CompiledBuckets.

    Attributes:
      entry: the entry point to compile.
      plan: its sharding plan on this target (None for a single chip).
      kernel_records: per bucket, what the manifest records about its kernels on this target.
      state_as_bits: the state it takes and returns as uint16 bits (cpu_executable_program).
    """

    entry: EntryPointCompile
    plan: ShardingPlan | None
    kernel_records: list[dict]
    state_as_bits: tuple[str, ...]


def compile_target(
    entry_points: dict[str, EntryPointCompile],
    target: Target,
    job: CompileJob | None = None,
    env: CompileEnv | None = None,
) -> dict[str, list[CompiledBucket]]:
    """Compiles every entry point's buckets for one target in one compiler process (see the module docstring).

    Args:
      entry_points: {entry point: what to compile}, compiled in this order.
      target: the TPU target.
      job: the CompileJob running this, which may kill the process, or None.
      env: the compile environment whose interpreter runs the compiler (its versions go into the
        compile key; entry points' on_compiled is not called), or None for this interpreter.
    Returns:
      {entry point: one CompiledBucket per bucket, in order} (HBM fit is not judged here).
    Raises:
      TpuExportError: XLA refused a bucket (HBM overflow reported as such) or libtpu crashed.
    """
    with tempfile.TemporaryDirectory(prefix="tpuexport-compile-") as scratch:
        scratch_dir = pathlib.Path(scratch)
        programs, kept = [], []
        for index, entry in enumerate(entry_points.values()):
            program, program_kept = _program_request(index, entry, target, scratch_dir)
            programs.append(program)
            kept.append(program_kept)
        request = {
            "parent_pid": os.getpid(),
            "platform": target.platform,
            "processes": target.processes,
            # A single chip is a one-chip host; a slice has Cloud TPU's hosts (where they differ from
            # libtpu's default for the topology).
            "host_bounds": [1, 1, 1] if not target.is_slice else list(target.host_bounds) if target.host_bounds else None,
            "topology": target.topology,
            "compiler_options": compiler_options(target),
            "out_dir": scratch,
            "programs": programs,
        }
        results = {name: [] for name in entry_points}
        names = list(entry_points)
        for index, result in _run_compiler(request, target, kept, scratch_dir, job, env):
            results[names[index]].append(result)
        return results


def at_sizes(entry: EntryPointCompile, sizes: dict[str, int]) -> EntryPointCompile:
    """`entry` with `sizes` replacing those dims' sizes in its buckets (a bucket without them is kept);
    its kernel lowerings follow their buckets' new names."""
    if not sizes:
        return entry
    buckets = [Bucket(tuple((name, sizes.get(name, size)) for name, size in bucket.sizes)) for bucket in entry.buckets]
    kernels = None if entry.kernels is None else {new.name: entry.kernels[old.name] for old, new in zip(entry.buckets, buckets)
                                                  if old.name in entry.kernels}
    return dataclasses.replace(entry, buckets=buckets, kernels=kernels)


def _program_request(index: int, entry: EntryPointCompile, target: Target, scratch_dir: pathlib.Path) -> tuple[dict, _ProgramInRequest]:
    """The compiler process's request for one entry point (program `index`; its files written into
    `scratch_dir`), and what the parent keeps of it."""
    lowered = entry.lowered
    exported_path = scratch_dir / f"{index}.jaxexport"
    program, state_as_bits = cpu_executable_program(lowered) if target.platform == "cpu" else (lowered.exported, ())
    exported_path.write_bytes(bytes(program.serialize()))
    plan = entry.plans.get(target.name)
    if target.is_slice and plan is None:
        plan = ShardingPlan(((DATA_AXIS, target.devices),), "replicated",
                            tuple((name, ()) for name in lowered.weight_names),
                            tuple((spec.name, ()) for spec in lowered.signature.inputs))
    records, kernel_programs = _kernel_programs(target, entry.buckets, entry.kernels, scratch_dir, index)
    input_names = [spec.name for spec in lowered.signature.inputs]
    plan_json = plan.to_json() if plan else None
    request = {
        "exported": str(exported_path),
        # Per output, the input it is the next state of (the KV cache), or None: on a slice a state output
        # is laid out as its input (the next call takes it without a reshard, which JAX would compile
        # at run time); on a multi-host slice the others are replicated, so that every host can read them whole.
        "state_outputs": [input_names.index(spec.name) if spec.name in input_names else None for spec in lowered.signature.outputs],
        # Shapes only: the compiler never sees a weight's values (nor needs them, for a plan).
        "weights": [[list(w.shape), str(w.dtype)] for w in lowered.weight_specs],
        "buckets": [
            {"inputs": [[list(spec.concrete_shape(bucket.as_dict())), "uint16" if spec.name in state_as_bits else spec.dtype]
                        for spec in lowered.signature.inputs],
             "exported": kernel_program}
            for bucket, kernel_program in zip(entry.buckets, kernel_programs)
        ],
        "mesh": plan_json["mesh"] if plan else None,
        "weight_specs": list(plan_json["weights"].values()) if plan else None,
        "input_specs": list(plan_json["inputs"].values()) if plan else None,
    }
    return request, _ProgramInRequest(entry, plan, records, state_as_bits)


def cpu_executable_program(lowered: LoweredProgram) -> tuple[jax.export.Exported, tuple[str, ...]]:
    """The program an XLA:CPU executable is compiled from: the lowered one, with its bfloat16 state
    taken and returned as uint16 bit patterns when it has any (lower/cpu_program.py: XLA:CPU then
    updates a bfloat16 KV cache in place; with bfloat16 arguments each decode step passed over the
    whole cache once per layer and row, benchmarks/studies/cpu_generation.py).

    Args:
      lowered: the lowering stage's result.
    Returns:
      (the program, the names of the state inputs/outputs it takes and returns as bits).
    """
    specs = lowered.signature.inputs
    cpu = cpu_program(lowered.exported, len(lowered.weight_names),
                      state_positions([s.name for s in specs], [s.name for s in lowered.signature.outputs], [s.dtype for s in specs]))
    return cpu.exported, tuple(specs[position].name for position in cpu.bits_inputs)


def _kernel_programs(target: Target, buckets: list[Bucket], kernels: dict | None,
                     scratch_dir: pathlib.Path, program: int) -> tuple[list[dict], list[str | None]]:
    """Per bucket, what the manifest records about kernels on this target, and the path of the
    static program with kernels to compile (written into `scratch_dir`, named by `program`'s index), or
    None for the portable one."""
    records, paths = [], []
    for index, bucket in enumerate(buckets):
        lowering = (kernels or {}).get(bucket.name)
        if lowering is None:
            records.append({})
            paths.append(None)
            continue
        record = lowering.to_json()
        why_not = None
        if target.platform != "tpu":
            why_not = "XLA:CPU target: Pallas TPU kernels run on TPUs only"
        elif target.is_slice:
            why_not = "slice target: a kernel over a sharded program needs a per-device partition (shard_map), not supported yet"
        if lowering.exported is None or why_not:
            records.append({**record, "program": "portable", **({"reason": why_not} if why_not else {})})
            paths.append(None)
            continue
        path = scratch_dir / f"{program}-{index}-kernels.jaxexport"
        path.write_bytes(bytes(lowering.exported.serialize()))
        records.append(record)
        paths.append(str(path))
    return records, paths


def compiler_options(target: Target) -> dict:
    """XLA options the target's executables are compiled with: XLA:CPU's are the ones every CPU run
    of the program uses (lowered.CPU_COMPILER_OPTIONS); TPUs use XLA's defaults."""
    return dict(CPU_COMPILER_OPTIONS) if target.platform == "cpu" else {}


def compiler_environment(target: Target, environment=None) -> dict:
    """The compiler process's environment: JAX on its CPU backend, libtpu loadable beside other processes,
    and for a CPU twin XLA:CPU forced to its devices per process (N for cpu-N, K for cpu-PxK)."""
    environment = dict(os.environ if environment is None else environment)
    if target.platform == "cpu" and target.devices > 1:
        per_process = target.devices // target.processes
        environment["XLA_FLAGS"] = f"{environment.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={per_process}".strip()
    return {**environment, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def _run_compiler(request: dict, target: Target, programs: list[_ProgramInRequest], scratch_dir: pathlib.Path,
                  job: CompileJob | None, env: CompileEnv | None = None):
    """Runs `request` in a compiler process (under `env`'s interpreter, when given; a kept one within
    `kept_compilers()`); yields (program index, CompiledBucket) as it compiles them."""
    timeout = compile_timeout()
    python = env.python if env else sys.executable
    environment = compiler_environment(target, environment_for() if env else None)
    compiler, kept = compiler_for((python, target.name, compiler_settings(environment)), python, environment)
    if job is not None:
        job.started(compiler.process)
    watchdog = _Watchdog(compiler.process, timeout)
    compiler.send(request, last=kept is None)
    compiling = None
    try:
        for event in compiler.events():
            watchdog.restart()
            program = programs[event["program"]]
            bucket = program.entry.buckets[event["bucket"]]
            if event["event"] == "start":
                compiling = bucket
            elif event["event"] == "error" and event.get("errno") is not None:
                raise OSError(event["errno"], event["message"], event.get("filename"))
            elif event["event"] == "error" and env is not None:
                raise TpuExportError(f"the jax of --compile-env {env.python} ({describe_versions(env.versions)}) could not compile "
                                     f"{target.name} bucket {bucket.name}: {event['message'][:240]}; this program uses what that "
                                     "jax release does not support: use a newer jax there, or drop that environment")
            elif event["event"] == "error":
                raise _compile_error(target, bucket, event["message"], _largest_buffers(program.entry.lowered, program.plan, bucket))
            else:
                compiling = None
                kernels = dict(program.kernel_records[event["bucket"]])
                if event.get("kernel_error"):  # the static program with kernels did not compile: the portable one did
                    kernels.update(program="portable", reason=f"the program with kernels did not compile for {target.name}: "
                                                               f"{event['kernel_error'][:200]}")
                result = dataclasses.replace(_compiled_bucket(target, bucket, event, scratch_dir, program, env), kernels=kernels,
                                             state_as_bits=program.state_as_bits)
                if program.entry.on_compiled and env is None:
                    program.entry.on_compiled(result)
                yield event["program"], result
    finally:
        watchdog.stop()
        if job is not None:
            job.finished(compiler.process)
        if compiler.finished and kept is not None:
            kept.give_back(compiler)
            returncode = 0
        else:  # done, failed or abandoned (an error raised here or in the caller): it ends
            stderr_text = compiler.stderr_text()
            returncode = compiler.end(kill=not compiler.finished)
    if watchdog.fired:
        raise TpuExportError(
            f"the TPU compiler for {target.name} took more than {timeout:g} s "
            f"{f'on bucket {compiling.name}' if compiling else 'to start'} and was stopped; "
            f"raise {COMPILE_TIMEOUT_VARIABLE} (seconds) if it is only slow, else drop that bucket or target")
    if returncode != 0 or not compiler.finished:
        raise _crash_error(target, compiling, returncode, stderr_text, env)


class _Watchdog:
    """Kills a process that goes `timeout` seconds without `restart()` (a hung compiler)."""

    def __init__(self, process: subprocess.Popen, timeout: float):
        self.process, self.timeout, self.fired = process, timeout, False
        self.timer = None
        self.restart()

    def restart(self) -> None:
        self.stop()
        self.timer = threading.Timer(self.timeout, self._fire)
        self.timer.daemon = True
        self.timer.start()

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def _fire(self) -> None:
        if self.process.poll() is None:
            self.fired = True
            self.process.kill()


def _compiled_bucket(target: Target, bucket: Bucket, event: dict, scratch_dir: pathlib.Path, program: _ProgramInRequest,
                     env: CompileEnv | None = None) -> CompiledBucket:
    files = f"{event['program']}-{event['bucket']}"  # the program's and bucket's index, as compile_child.py names them
    plan, lowered = program.plan, program.entry.lowered
    memory = dict(event["memory"])
    memory["total_bytes"] = (
        memory["argument_bytes"] + memory["output_bytes"] + memory["temp_bytes"]
        + memory["generated_code_bytes"] - memory["alias_bytes"]
    )
    hlo_text = (scratch_dir / f"{files}.hlo.txt").read_text()
    return CompiledBucket(
        target, bucket, (scratch_dir / f"{files}.executable").read_bytes(), event["seconds"], memory, event["cost"],
        hashlib.sha256(hlo_text.encode()).hexdigest(), hlo_text, matmul_flops_by_types(hlo_text),
        plan, collectives(hlo_text) if target.is_slice else {}, tuple(event["device_ids"]), tuple(event["device_processes"]),
        compile_key(target.platform, event["device_kind"], target.devices, None if target.platform == "cpu" else target.topology,
                    compiler_options(target), lowered.exported.calling_convention_version, target.processes,
                    env.versions if env else None, env.serialization_version if env else None),
    )


def _compile_error(target: Target, bucket: Bucket, message: str, largest_buffers: str) -> TpuExportError:
    if "RESOURCE_EXHAUSTED" in message:
        # XLA's TPU compiler checks temporaries against the chip's usable HBM itself.
        return TpuExportError(
            f"does not fit in HBM: {target.name} bucket {bucket.name} ({message[:240]}); HBM is "
            f"{target.hbm_bytes_per_device:,} bytes{_per_device(target)}; largest arguments{_per_device(target)}: {largest_buffers}; "
            "use smaller buckets, a sharding plan that splits more, or a target with more HBM"
        )
    return TpuExportError(f"XLA could not compile for {target.name} bucket {bucket.name}: {message[:300]}")


def _crash_error(target: Target, bucket: Bucket | None, returncode: int, stderr_text: str, env: CompileEnv | None = None) -> TpuExportError:
    cause = f"signal {signal.Signals(-returncode).name}" if returncode < 0 else f"exit code {returncode}"
    if returncode == -signal.SIGKILL:
        where = f" compiling bucket {bucket.name}" if bucket is not None else ""
        return TpuExportError(f"the TPU compiler process for {target.name} was killed (SIGKILL, as the kernel's out-of-memory "
                              f"killer sends){where}; free memory or convert fewer targets at once, and convert again")
    if bucket is None:
        last = " ".join(stderr_text.strip().splitlines()[-1:])[:200]
        if env is not None:
            return TpuExportError(f"the TPU compiler process for {target.name} under --compile-env {env.python} failed ({cause}: {last}); "
                                  f"check that environment's jax (it needs jax, jaxlib, numpy and flatbuffers), or drop it")
        return TpuExportError(f"the TPU compiler process for {target.name} failed ({cause}: {last}); "
                              "reinstall with `pip install -c constraints.txt -e .`")
    return TpuExportError(
        f"libtpu crashed ({cause}) compiling {target.name} bucket {bucket.name}: a TPU compiler bug, not your model; "
        f"drop that bucket or target, or try another libtpu version"
    )
