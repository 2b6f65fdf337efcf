"""`Runner`: an artifact's executables loaded on this host's devices, without compiling.

    runner = tpuexport.runner("mlp.tpu")              # picks the target matching the local devices
    runner.run({"x": rows})                          # {"output_0": ...}, padded to a bucket and back

Opening a runner (on the devices JAX sees, tpuexport/devices.py; the compilations it runs counted,
compilations.py):
  1. picks the target whose executables match the local devices (the TPU kind and device count,
     `cpu-N` on N forced CPU devices, or `cpu`), trying first those spanning every local device,
     or the one asked for, and among its version sets (--compile-env) the host's (selection.py);
  2. compares the target's compile key (compile/compile_key.py) with the host: any difference is
     refused in one line naming it (every version set's), unless `allow_recompile`, which compiles
     the artifact's StableHLO for the local devices instead (and says why in `compiled_here`);
  3. checks each executable's sha256 against the manifest and the globals its pickle names
     (executables.py), and deserializes it (jax.experimental.serialize_executable): nothing is
     compiled;
  4. places the weights on the devices once, from the memory-mapped weights file, laid out as the
     executables expect: on one device the mapping itself, with a slice's sharding shard by shard.

Several processes (the hosts of a multi-host slice, or a `cpu-PxK` twin's processes) open a runner
each with the same `Cluster` (processes.py): they join jax.distributed first, each loads the same
executables and places only its own devices' weight shards; the leader's executable calls are
published to the followers, which run them too (`Runner.follow`).

A request runs on the smallest bucket that holds it: the batch dim is padded with zero rows up to
the bucket (only when the artifact's padded-bucket verification passed, see verify/padding.py)
and the outputs are sliced back; other dims must equal a bucket's. The inputs are fresh device
buffers donated to the executable (compiled with donated inputs, compile_child.py).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import time
import warnings
from typing import Iterator, Mapping, Sequence

import jax
import numpy as np

from tpuexport.artifact import Artifact, load, map_weights
from tpuexport.artifact.manifest import sha256_file
from tpuexport.compile.aot import compiler_options, cpu_executable_program
from tpuexport.compile.slices import resolve_targets
from tpuexport.devices import runtime_devices
from tpuexport.export.cache_specs import PAGES_DIM
from tpuexport.errors import TpuExportError
from tpuexport.lower.sampling import GREEDY, Sampling
from tpuexport.lower.seq2seq import source_rows
from tpuexport.runtime.compilations import CompilationCounter
from tpuexport.runtime.executables import load_executable
from tpuexport.runtime.selection import choose, refusal
from tpuexport.runtime.processes import DEFAULT_TIMEOUT_SECONDS, Cluster, Mirror, Step, device_order_difference, join
from tpuexport.lower.program import DEFAULT_ENTRY_POINT
from tpuexport.runtime.entry_points import BucketEntry, EntryPoint, choose_bucket, entry_points
from tpuexport.verify.row_padding import pad_rows


@dataclasses.dataclass(frozen=True)
class PreparedRequest:
    """A request checked against an entry point: arrays in the program's dtypes and its bucket.

    Attributes:
      entry: the entry point.
      arrays: one array per input, in signature order, in the artifact's dtypes.
      sizes: the request's dim sizes.
      bucket: the smallest bucket that holds it.
    """

    entry: EntryPoint
    arrays: tuple[np.ndarray, ...]
    sizes: dict[str, int]
    bucket: BucketEntry

    @property
    def rows(self) -> int:
        """Rows along the batch dim (1 when the entry point does not batch)."""
        return self.sizes[self.entry.batch_dim] if self.entry.batch_dim else 1


@dataclasses.dataclass(frozen=True)
class Execution:
    """One run of an executable.

    Attributes:
      outputs: {output name: array}, the padding rows removed (numpy arrays; the entry point's
        state outputs are device arrays, for the next call: a bfloat16 state of an XLA:CPU
        executable comes as its uint16 bit patterns, `BucketEntry.state_as_bits`).
      bucket: the bucket that ran.
      rows: the real rows.
      padded_to: the bucket's rows (equal to `rows` when nothing was padded).
    """

    outputs: dict[str, np.ndarray]
    bucket: BucketEntry
    rows: int
    padded_to: int


class Runner:
    """Executables of one target loaded on the local devices, with the weights placed once.

    Attributes:
      artifact: the opened artifact.
      target: the target whose executables (or buckets, when compiled here) run.
      entry_points: {name: EntryPoint}.
      compiled_here: why the StableHLO was compiled on this host instead of loading the
        executables (allow_recompile with a differing compile key), or None when they were loaded.
      load_seconds: wall time to load (or compile) the executables and place the weights.
      devices: the devices the executables run on, ordered by id.
      compilations_at_start: XLA compilations the process ran while the runner opened
        (compilations.py): 0 when the executables were loaded, one per bucket when compiled here.
      mirror: in a multi-process run, this process's side of the step protocol (processes.py);
        None in a single process.
      version_set: the compile environment's version set whose executables were loaded
        (selection.py), or None for the target's own.
    """

    def __init__(self, artifact: Artifact, target: str, entry: dict[str, EntryPoint], executables: dict, weights: list,
                 compiled_here: str | None, load_seconds: float, devices: tuple, compilations_at_start: int,
                 version_set: str | None = None):
        self.artifact = artifact
        self.target = target
        self.entry_points = entry
        self._executables = executables
        self._weights = weights
        self.compiled_here = compiled_here
        self.load_seconds = load_seconds
        self.devices = devices
        self.compilations_at_start = compilations_at_start
        self.version_set = version_set
        self.mirror: Mirror | None = None
        self._mirrored_step = 0  # the leader's step number of the call being executed

    @functools.cached_property
    def generation_program(self):
        """The artifact's generation program as this target's executables run it: a paged cache at their
        page count (sized per target: tasks/page_count.py), other programs as they are."""
        program = self.artifact.generation_program
        step = self.entry_points.get("step")
        pages = {bucket.sizes[PAGES_DIM] for bucket in step.buckets if PAGES_DIM in bucket.sizes} if step else set()
        return program.at_pages(pages.pop()) if len(pages) == 1 else program

    @property
    def weights(self) -> list:
        """The weights on the devices, in the program's order, laid out as the executables take them."""
        return self._weights

    def __repr__(self) -> str:
        how = f"compiled here: {self.compiled_here}" if self.compiled_here else "loaded without compiling"
        return f"Runner({str(self.artifact.path)!r}, target={self.target!r}, {how})"

    def describe(self) -> str:
        """One line: target, buckets, padding, how the executables got here and the compilations that took."""
        parts = []
        for entry in self.entry_points.values():
            buckets = ", ".join(bucket.name for bucket in entry.buckets)
            padding = f"{entry.batch_dim} padded to the next bucket" if entry.batch_dim else f"exact sizes only ({entry.padding_note})"
            parts.append(f"{entry.name}: buckets {buckets}, {padding}")
        how = f"compiled the StableHLO here ({self.compiled_here})" if self.compiled_here else "loaded without compiling"
        if self.version_set:
            how += f" (version set {self.version_set})"
        devices = f"{len(self.devices)} {self.devices[0].device_kind} device{'s' if len(self.devices) > 1 else ''}"
        if self.mirror is not None:
            devices += f" in {self.mirror.processes} processes (this is process {self.mirror.index})"
        return (f"target {self.target} on {devices}, {how} in {self.load_seconds:.2f} s, compilations_at_start: "
                f"{self.compilations_at_start}; {'; '.join(parts)}")

    def entry_point(self, name: str | None = None) -> EntryPoint:
        """The entry point called `name` (the default one for None or "").

        Raises:
          TpuExportError: no such entry point.
        """
        name = name or DEFAULT_ENTRY_POINT
        if name not in self.entry_points:
            raise TpuExportError(f"unknown signature {name!r}; this model has {', '.join(self.entry_points)}")
        return self.entry_points[name]

    def prepare(self, inputs: Mapping[str, object] | Sequence[object], entry_point: str | None = None) -> PreparedRequest:
        """Checks a request's inputs and finds its bucket, without running anything.

        Args:
          inputs: {input name: array-like} or array-likes in signature order.
          entry_point: the entry point's name, None for the default.
        Returns:
          The PreparedRequest.
        Raises:
          TpuExportError: unknown or missing input names, a dtype that does not cast to the
            program's (same kind: float to float, int to int or float), integers out of range,
            wrong ranks or sizes, sizes outside every bucket, or token rows without the placeholder
            tokens a multimodal model's signature records; one line naming the problem.
        """
        entry = self.entry_point(entry_point)
        specs = entry.signature.inputs
        if isinstance(inputs, Mapping):
            unknown = sorted(set(inputs) - {spec.name for spec in specs})
            missing = [spec.name for spec in specs if spec.name not in inputs]
            if unknown or missing:
                expected = ", ".join(spec.name for spec in specs)
                problem = f"unknown input(s) {', '.join(map(repr, unknown))}" if unknown else f"missing input(s) {', '.join(map(repr, missing))}"
                raise TpuExportError(f"{problem}; the inputs are: {expected}")
            values = [inputs[spec.name] for spec in specs]
        else:
            values = list(inputs)
            if len(values) != len(specs):
                raise TpuExportError(f"the model takes {len(specs)} input(s) ({', '.join(s.name for s in specs)}), got {len(values)}")
        arrays = tuple(_as_input_array(value, spec, spec.name in entry.state) for value, spec in zip(values, specs))
        try:
            sizes = entry.signature.sizes_of([array.shape for array in arrays])
        except ValueError as error:
            raise TpuExportError(f"input shapes do not fit the model: {error}") from None
        problem = entry.signature.placeholder_error(arrays)
        if problem:
            raise TpuExportError(problem)
        return PreparedRequest(entry, arrays, sizes, choose_bucket(entry, sizes))

    def execute(self, request: PreparedRequest, on_device: bool = False) -> Execution:
        """Runs a prepared request: pads the batch dim to its bucket, runs, slices the outputs back.

        Args:
          request: from `prepare`.
          on_device: keep every output on the device (jax arrays; the caller copies what it reads,
            e.g. a generator's sampled tokens but not the logits they were drawn from), not only
            the state.
        Returns:
          The Execution.
        Raises:
          ProcessLost: in a multi-process run, another process stopped or a collective failed.
        """
        if self.mirror is None:
            return self._execute(request, on_device)
        with self.mirror.lock:  # one order of calls in every process
            return self._execute(request, on_device)

    def _execute(self, request: PreparedRequest, on_device: bool) -> Execution:
        entry, bucket = request.entry, request.bucket
        padded_to = bucket.sizes[entry.batch_dim] if entry.batch_dim else 1
        arrays = [pad_rows(array, padded_to) for array in request.arrays] if entry.batch_dim else list(request.arrays)
        arrays = [_state_form(array, spec.name in bucket.state_as_bits) if spec.name in entry.state and spec.dtype == "bfloat16" else array
                  for array, spec in zip(arrays, entry.signature.inputs)]
        if self.mirror is None:
            results = self._call(entry, bucket, arrays)
        else:
            results = self._call_mirrored(request, arrays, on_device)
        outputs = {}
        for spec, result in zip(entry.signature.outputs, results):
            if spec.name in entry.state:  # the next call's input: stays on the device
                outputs[spec.name] = result
                continue
            array = result if on_device else np.asarray(result)
            outputs[spec.name] = array[:request.rows] if entry.batch_dim else array
        if self.mirror is not None and self.mirror.leader:
            self.mirror.keep(self._mirrored_step, outputs)
        return Execution(outputs, bucket, request.rows, padded_to)

    def _call(self, entry: EntryPoint, bucket: BucketEntry, arrays: list) -> list:
        executable, input_shardings = self._executables[(entry.name, bucket.name)]
        # Fresh buffers, donated to the executable (it may reuse them for outputs).
        inputs = [_put(array, sharding) for array, sharding in zip(arrays, input_shardings)]
        return executable(self._weights, inputs)

    def _call_mirrored(self, request: PreparedRequest, arrays: list, on_device: bool) -> list:
        """The call in every process: the leader publishes it (processes.py) and runs it; a follower
        runs what the leader published. Waits for the results (for at most the run's timeout), so that
        a process lost or hung inside the collectives fails this call (ProcessLost) rather than a later read."""
        mirror = self.mirror
        if mirror.leader:
            inputs = tuple(("ref", mirror.reference(array)) if isinstance(array, jax.Array) else ("array", np.asarray(array))
                           for array in request.arrays)
            self._mirrored_step = mirror.publish(Step(request.entry.name, request.bucket.name, request.sizes, on_device, inputs))
        try:
            return mirror.run(lambda: jax.block_until_ready(self._call(request.entry, request.bucket, arrays)))
        except jax.errors.JaxRuntimeError as error:
            raise mirror.lose(f"a collective failed ({' '.join(str(error).split())[:200]})") from None

    def follow(self) -> int:
        """A follower's work: runs the leader's calls as they come, until the leader stops.

        Returns:
          The number of calls run.
        Raises:
          ProcessLost: the leader is gone or a collective failed.
          TpuExportError: called in the leader or in a single process.
        """
        if self.mirror is None or self.mirror.leader:
            raise TpuExportError("follow() runs in the followers of a multi-process run (process id 1 and up)")
        calls = 0
        while (step := self.mirror.next_step()) is not None:
            entry = self.entry_point(step.entry_point)
            bucket = next(bucket for bucket in entry.buckets if bucket.name == step.bucket)
            request = PreparedRequest(entry, tuple(self.mirror.resolve(step)), step.sizes, bucket)
            self.mirror.hold(self.execute(request, on_device=step.on_device).outputs)
            calls += 1
        return calls

    def close(self) -> None:
        """The leader of a multi-process run tells the followers to stop (nothing in a single process)."""
        if self.mirror is not None:
            self.mirror.stop()

    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling = GREEDY,
               ignore_eos: bool = False) -> Iterator[list[int | None]]:
        """Generation through a text-generation artifact's prefill, decode and sample executables, the
        KV cache and the logits kept on the device (only the drawn tokens come to the host): yields
        each step's new token per prompt (None for a row that has finished), as `Artifact.stream`
        does on CPU.

        Raises:
          TpuExportError: not a text-generation artifact, or prompts it cannot take.
        """
        program = self.generation_program
        return program.stream(source_rows(program, prompts), max_new_tokens, runner=self.device_runner(), sampling=sampling,
                              stop_ids=() if ignore_eos else self.artifact.eos_token_ids)

    def device_runner(self):
        """A generation session's runner over these executables: (entry point, inputs) -> outputs in
        signature order, every output left on the device."""
        def call(name: str, inputs: list) -> list:
            return list(self.execute(self.prepare(inputs, name), on_device=True).outputs.values())

        return call

    def run(self, inputs: Mapping[str, object] | Sequence[object], entry_point: str | None = None) -> dict[str, np.ndarray]:
        """Checks, pads, runs and slices one request (see `prepare` and `execute`).

        Returns:
          {output name: array} in the artifact's dtypes.
        Raises:
          TpuExportError: a request that does not fit (see `prepare`).
        """
        return self.execute(self.prepare(inputs, entry_point)).outputs


def open_runner(path, target: str | None = None, allow_recompile: bool = False, cluster: Cluster | None = None) -> Runner:
    """Opens an artifact's executables on this host (see the module docstring).

    Args:
      path: the artifact directory (or an opened Artifact).
      target: the target to run ("cpu", "v5e", ...); None picks the one matching the local devices.
      allow_recompile: when the compile key differs from the host (or no target matches it),
        compile the StableHLO for the local devices instead of refusing.
      cluster: this process's place in a multi-process run (processes.py), joined before JAX's
        devices start; None for a single process.
    Returns:
      The Runner (in a multi-process run, the leader's runs in every process; followers call
      `follow()`).
    Raises:
      TpuExportError: a plan (no weights), an unknown target, no target matching the host, a
        compile key that differs from the host's (naming what differs), or a damaged executable.
    """
    artifact = path if isinstance(path, Artifact) else load(path)
    if artifact.plan_only:
        raise TpuExportError(f"{artifact.path} is a plan without weights: it cannot run; convert the model with its weights")
    if cluster is not None:
        join(cluster)
    with CompilationCounter() as compilations:
        runner = _open(artifact, target, allow_recompile, runtime_devices(), compilations)
    if jax.process_count() > 1:
        if runner.compiled_here:
            raise TpuExportError("--allow-recompile cannot serve a multi-process run (each process would compile on its own); "
                                 "convert with the slice's --target")
        runner.mirror = Mirror(cluster.timeout if cluster else DEFAULT_TIMEOUT_SECONDS)
    return runner


def _open(artifact: Artifact, target: str | None, allow_recompile: bool, devices: list, compilations: CompilationCounter) -> Runner:
    """open_runner's work on the given devices, `compilations` counting what it compiles."""
    start = time.perf_counter()
    choice = choose(artifact.manifest, target, devices)
    chosen, difference = choice.target, choice.difference
    entries = entry_points(artifact.records, chosen, choice.version_set)
    if difference and not allow_recompile:
        raise TpuExportError(refusal(artifact.path, artifact.manifest, choice, len(devices)))
    if difference:
        executables, entries = _compile_here(artifact, chosen, entries, devices)
    else:
        executables = _load_executables(artifact, entries, _target_devices(artifact, chosen, devices))
    # Every bucket takes the weights with the same layout: place them once, as the first expects.
    _, input_shardings, weight_shardings = next(iter(executables.values()))
    arrays = map_weights(artifact.path / artifact.records.program.path)
    weights = [_place(arrays[name], sharding) for name, sharding in zip(artifact.records.program.names, weight_shardings)]
    loaded = {key: (executable, input_shardings) for key, (executable, input_shardings, _) in executables.items()}
    used = tuple(sorted({device for sharding in [*weight_shardings, *input_shardings] for device in sharding.device_set},
                        key=lambda device: device.id))
    return Runner(artifact, chosen, entries, loaded, weights, difference or None, time.perf_counter() - start, used, compilations.count,
                  choice.version_set)


def _target_devices(artifact: Artifact, target: str, devices: list) -> list:
    """The local devices a target's executables run on: its first N, or for a slice the devices its
    mesh was compiled over (manifest device_ids), in that order.

    Raises:
      TpuExportError: a slice's devices that this run lacks or has in other processes, or a
        single-device target in a multi-process run; one line naming the first difference.
    """
    entry = artifact.manifest["targets"][target]
    count, compiled_on = entry["compile_key"]["devices"], entry.get("device_ids")
    processes = len({device.process_index for device in devices})
    if count == 1 or not compiled_on:
        if processes > 1:
            raise TpuExportError(f"{artifact.path} target {target} runs in one process, this run has {processes}; start it without "
                                 "--coordinator, or convert for the slice's multi-process target (cpu-PxK, v5e-16, ...)")
        return devices[:count]
    difference = device_order_difference(compiled_on, entry.get("device_processes", []), devices)
    if difference:
        raise TpuExportError(f"{artifact.path} target {target} was compiled over devices {compiled_on} (mesh order), and {difference}: "
                             "run it on the slice it was built for (every host, with its --process-id), or convert for these devices")
    here = {device.id: device for device in devices}
    return [here[device_id] for device_id in compiled_on]


def _place(array: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A weight from the memory-mapped weights file on the devices, as `sharding` lays it out: each
    local device's slice of the mapping, read for that device alone (make_array_from_callback asks
    only for the shards of this process's devices); on one device, the mapping itself (XLA:CPU runs an
    aligned array in place). benchmarks/studies/sharded_placement.py measures the host memory."""
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return jax.device_put(array, sharding)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def _put(array, sharding: jax.sharding.Sharding) -> jax.Array:
    """An input on the devices as `sharding` lays it out. A host array under a sharding that spans
    other processes' devices is placed shard by shard from this process's copy: jax.device_put would
    first check that every process's copy is equal (a collective, and a compilation per shape, at
    every call), which the step protocol (processes.py) already makes so."""
    if isinstance(array, jax.Array) or sharding.is_fully_addressable:
        return jax.device_put(array, sharding)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def _trees(entry: EntryPoint, weight_count: int):
    """The pytrees of `exported.call(weights, inputs)`: its arguments and its list of outputs."""
    arguments = jax.tree_util.tree_structure(((list(range(weight_count)), list(range(len(entry.signature.inputs)))), {}))
    return arguments, jax.tree_util.tree_structure(list(range(len(entry.signature.outputs))))


def _load_executables(artifact: Artifact, entries: dict[str, EntryPoint], devices: list) -> dict:
    """{(entry point, bucket): (executable, input shardings, weight shardings)}, deserialized onto `devices`.

    Raises:
      TpuExportError: an executable whose bytes differ from the manifest's sha256.
    """
    weight_count = len(artifact.records.program.names)
    loaded = {}
    for entry in entries.values():
        in_tree, out_tree = _trees(entry, weight_count)
        for bucket in entry.buckets:
            path = _inside(artifact.path, bucket.executable)
            recorded = artifact.manifest["files"].get(bucket.executable)
            # Damaged bytes must not reach the deserializer (XLA's parsers may abort the process).
            if not path.is_file() or recorded != sha256_file(path):
                raise TpuExportError(f"{bucket.executable} is missing or differs from its sha256 in the manifest; the artifact is "
                                     "damaged, convert again")
            executable = load_executable(path.read_bytes(), in_tree, out_tree, devices, bucket.executable)
            (weight_shardings, input_shardings), _ = executable.input_shardings
            loaded[(entry.name, bucket.name)] = (executable, list(input_shardings), list(weight_shardings))
    return loaded


def _compile_here(artifact: Artifact, target: str, entries: dict[str, EntryPoint], devices: list) -> tuple[dict, dict[str, EntryPoint]]:
    """Compiles the artifact's StableHLO for every bucket on the first local device (allow_recompile),
    on XLA:CPU as the cpu target's executables are compiled (bfloat16 state as bit patterns).

    Returns:
      (as `_load_executables`, the entry points with their buckets' state_as_bits as compiled here).
    """
    lowered = artifact.entry_points
    shared = next(iter(lowered.values()))  # every entry point takes the same weights
    programs, bits = {}, {}
    for name in entries:
        programs[name], bits[name] = (cpu_executable_program(lowered[name]) if devices[0].platform == "cpu"
                                      else (lowered[name].exported, ()))
    entries = {name: dataclasses.replace(entry, buckets=tuple(dataclasses.replace(bucket, state_as_bits=bits[name]) for bucket in entry.buckets))
               for name, entry in entries.items()}
    device = jax.sharding.SingleDeviceSharding(devices[0])
    weights = [jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=device) for spec in shared.weight_specs]
    options = compiler_options(resolve_targets(["cpu"])[0]) if devices[0].platform == "cpu" else {}
    compiled = {}
    for entry in entries.values():
        for bucket in entry.buckets:
            inputs = [jax.ShapeDtypeStruct(spec.concrete_shape(bucket.sizes), np.uint16 if spec.name in bits[entry.name] else spec.dtype,
                                           sharding=device) for spec in entry.signature.inputs]
            with warnings.catch_warnings():
                # Donation helps only where an output can take an input's buffer; jax warns otherwise.
                warnings.filterwarnings("ignore", "Some donated buffers were not usable")
                executable = (jax.jit(programs[entry.name].call, donate_argnums=1).trace(weights, inputs).lower()
                              .compile(compiler_options=options or None))
            compiled[(entry.name, bucket.name)] = (executable, [device] * len(inputs), [device] * len(weights))
    return compiled, entries


def _inside(root: pathlib.Path, relative: str) -> pathlib.Path:
    """`root / relative`, refusing paths that leave the artifact directory.

    Raises:
      TpuExportError: an absolute path or one climbing out of `root`.
    """
    path = (root / relative).resolve()
    if not path.is_relative_to(root.resolve()):
        raise TpuExportError(f"the manifest names {relative!r}, outside the artifact directory; the artifact is damaged, convert again")
    return path


def _state_form(array, as_bits: bool):
    """A bfloat16 state array in the form the executable takes: its uint16 bit patterns (as_bits)
    or bfloat16. A host array is viewed (no copy); a device array in the other form is converted on
    the device (a copy: only for state the caller made, an executable's own state comes in its form)."""
    wanted = np.dtype(np.uint16) if as_bits else np.dtype(jax.numpy.bfloat16)
    if array.dtype == wanted:
        return array
    if isinstance(array, jax.Array):
        return jax.lax.bitcast_convert_type(array, wanted)
    return array.view(wanted)


def _as_input_array(value, spec, state: bool = False) -> np.ndarray:
    """`value` as an array of the input's dtype (a device array of that dtype as it is; for a
    bfloat16 state input, also one of its uint16 bit patterns, as an XLA:CPU executable returns it).

    Raises:
      TpuExportError: a value that is not numeric (or bool for a bool input), a dtype of another
        kind (a float for an integer input), or integers outside the program's integer type.
    """
    target = np.dtype(spec.dtype) if spec.dtype != "bfloat16" else np.dtype(jax.numpy.bfloat16)
    if isinstance(value, jax.Array) and (value.dtype == target or (state and target == jax.numpy.bfloat16 and value.dtype == np.uint16)):
        return value  # already on a device (state from the previous call): not copied to the host
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as error:
        raise TpuExportError(f"input {spec.name!r} is not a rectangular array ({' '.join(str(error).split())[:120]})") from None
    if array.dtype == target:
        return array
    if array.dtype.kind not in "biuf" or not np.can_cast(array.dtype, target, casting="same_kind") \
            or (target.kind == "b" and array.dtype.kind != "b"):
        raise TpuExportError(f"input {spec.name!r} has dtype {array.dtype}, the model takes {spec.dtype}; send {spec.dtype} values")
    if target.kind in "iu" and array.size:
        limits = np.iinfo(target)
        if array.min() < limits.min or array.max() > limits.max:
            raise TpuExportError(f"input {spec.name!r} holds values {array.min()}..{array.max()}, outside {spec.dtype}")
    return array.astype(target)
