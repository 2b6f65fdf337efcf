"""The compiler's process: compiles one target's programs with libtpu (or XLA:CPU), nothing else loaded.

Started by aot.py as `python -I compile_child.py` with JSON requests on stdin, one per line (one,
unless the process is kept between conversions: compiler_processes.py): the target's topology and
options, and a list of programs (one per entry point of the conversion, e.g. prefill, decode and
sample; one for a forward program), each with its serialized jax.export program, its weights'
shapes, buckets and sharding. It compiles them in order, every bucket of each; the topology's
devices are made once per process, and a mesh that several programs share once per request. It imports only jax
(not tpuexport, torch or TensorFlow; public APIs but for a CPU twin's, since --compile-env runs it
under other jax releases), so a crash inside libtpu's compiler takes down this process alone and the
parent can name the bucket that was compiling. A single chip compiles for one device;
a slice (a program's "mesh") for a Mesh over the topology's devices, each weight and input a
NamedSharding with its PartitionSpec (JSON lists: null, an axis, or a list of axes).
The `cpu` target ("platform": "cpu") compiles for this process's own CPU device instead of a
topology; a multi-process CPU twin ("processes": P > 1, `cpu-PxK`) for the devices of P CPU clients
made in this process and joined by a loopback coordinator, as P processes under jax.distributed
would see them (`multi_process_cpu_devices`). On a slice a state output (a program's "state_outputs":
per output, the index of the input it is the next value of, or null) is compiled laid out as that
input, so the next call takes it as it is; when the devices span several processes (hosts), the other
outputs are compiled replicated, so every process reads them whole. The inputs are donated (the program may reuse their buffers for outputs of the
same shape), so the runtime must pass buffers it owns.
Protocol, one JSON object per stdout line, flushed as it happens (p: the program's index in the
request, i: the bucket's in the program):
  {"event": "start", "program": p, "bucket": i}            before compiling bucket i of program p
  {"event": "done", "program": p, "bucket": i, "seconds", "memory", "cost", "device_ids", "device_processes",
   "device_kind", "kernel_error"}                          files <p>-<i>.executable, <p>-<i>.hlo.txt written;
                                                           memory is per device; device_ids in mesh order,
                                                           device_processes the process of each;
                                                           kernel_error: why the bucket's program with
                                                           kernels ("exported" in its request) did not
                                                           compile (the portable one was), or null
  {"event": "error", "program": p, "bucket": i, "message"} XLA raised; the process stops there
  {"event": "error", "program": p, "bucket": i, "message", "errno", "filename"}
                                                           writing its files failed (e.g. the disk is full)
  {"event": "finished"}                                    every bucket of the request compiled; the
                                                           process reads the next request or stdin's end
The process asks the kernel for SIGKILL when its parent dies: a compiler left running (or hung)
by a conversion that was killed would otherwise keep a core busy for nobody.
"""

import ctypes
import json
import os
import pathlib
import signal
import socket
import sys
import threading
import time

# libtpu's lock file would stop a second process (parallel conversions, tests) from loading it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import mesh_utils, serialize_executable, topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding  # noqa: E402

jax.config.update("jax_platforms", "cpu")
# Every executable comes from the compiler, never from JAX's persistent compilation cache (on where
# the environment sets JAX_COMPILATION_CACHE_DIR): on XLA:CPU an executable read back from that
# cache serializes into one that fails when run ("NOT_FOUND: Function wrapped_tanh not found",
# jax 0.12.0.1), and `verify --recompile` must compare what the installed compiler produces now.
jax.config.update("jax_enable_compilation_cache", False)

# XLA's TPU cost model counts each call of this internal custom call (the compiler's own weight
# concatenation, e.g. of the q/k/v projections of unrolled layers) as -1 second in
# `optimal_seconds`: BERT-base unrolled holds 68 of them and reports -67.997 s, the same program
# scanned holds none and reports +0.0017 s (benchmarks/studies/optimal_seconds.py prints such pairs).
NEGATIVE_SECOND_CALLS = ('custom_call_target="ConcatBitcast"',)


def optimal_seconds(analysis: dict, hlo_text: str) -> float | None:
    """XLA's time estimate with the -1 s of each NEGATIVE_SECOND_CALLS call added back.

    Args:
      analysis: `compiled.cost_analysis()`.
      hlo_text: the compiled HLO text.
    Returns:
      Seconds, or None (unknown) when XLA gives no estimate or it is still negative.
    """
    if "optimal_seconds" not in analysis:
        return None
    seconds = float(analysis["optimal_seconds"]) + sum(hlo_text.count(call) for call in NEGATIVE_SECOND_CALLS)
    return seconds if seconds >= 0 else None


PR_SET_PDEATHSIG = 1  # prctl(2), Linux


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when the thread that started it ends (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


def multi_process_cpu_devices(processes: int):
    """The global CPU devices of `processes` processes under jax.distributed, as process 0 sees them.

    Makes one XLA:CPU client per process in this process (each with this process's forced device
    count), joined by a distributed runtime service on a free loopback port and with gloo
    collectives (XLA:CPU refuses to compile a multi-process program without a collectives
    implementation). Device ids and process indices are then those of P real processes: an
    executable compiled for them loads in each (deserialize_and_load), while one compiled in a
    single process of P*K devices names ids 0..P*K-1 that no process of P has.
    """
    # Private to jax: the pieces jax.distributed.initialize and the CPU backend are made of. Imported
    # here, not at the top: this script also runs under other jax releases (--compile-env,
    # compile_envs.py), which may lay them out differently; only a CPU twin needs them.
    from jax._src.lib import _jax
    from jaxlib import xla_client

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    service = _jax.get_distributed_runtime_service(address, processes)
    clients = [None] * processes

    def join(index: int) -> None:
        distributed = _jax.get_distributed_runtime_client(address, index, init_timeout=60)
        distributed.connect()
        clients[index] = (distributed, xla_client.make_cpu_client(
            distributed_client=distributed, node_id=index, num_nodes=processes,
            collectives=_jax.make_gloo_tcp_collectives(distributed_client=distributed)))

    threads = [threading.Thread(target=join, args=(index,)) for index in range(processes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if any(client is None for client in clients):
        raise RuntimeError(f"the {processes} in-process CPU clients of a multi-process twin did not all start")
    multi_process_cpu_devices.keep = (service, clients)  # alive until the process exits
    return clients[0][1].devices()


def partition_spec(entries) -> PartitionSpec:
    return PartitionSpec(*(tuple(entry) if isinstance(entry, list) else entry for entry in entries))


def shardings(program, devices_available, meshes):
    """(weight shardings, input shardings, device ids in mesh order) for one program of the request;
    `meshes` keeps the meshes made, by shape and axes, for the next programs."""
    mesh_request = program["mesh"]
    if mesh_request is None:
        device = SingleDeviceSharding(devices_available[0])
        return [device] * len(program["weights"]), [device] * len(program["buckets"][0]["inputs"]), [devices_available[0].id]
    shape, axes = tuple(mesh_request["shape"]), tuple(mesh_request["axes"])
    if (shape, axes) not in meshes:
        try:
            # Places neighbouring mesh positions on neighbouring chips of the torus.
            devices = mesh_utils.create_device_mesh(shape, devices=devices_available)
        except (ValueError, NotImplementedError, AssertionError):  # shapes it has no physical mapping for
            devices = np.array(devices_available).reshape(shape)
        meshes[shape, axes] = Mesh(devices, axes)
    mesh = meshes[shape, axes]
    weights = [NamedSharding(mesh, partition_spec(spec)) for spec in program["weight_specs"]]
    inputs = [NamedSharding(mesh, partition_spec(spec)) for spec in program["input_specs"]]
    return weights, inputs, [int(device.id) for device in mesh.devices.flat]


def compile_program(exported, weights, inputs, request, outputs=None):
    """The executable of `exported` for these weights and inputs (the inputs donated), its outputs laid
    out as `outputs` says (a sharding per output, None where the compiler chooses; None for all)."""
    return (jax.jit(exported.call, donate_argnums=1, out_shardings=outputs).trace(weights, inputs).lower()
            .compile(compiler_options=request["compiler_options"] or None))


def target_devices(request):
    """The devices the request's target compiles for (once for all its programs)."""
    if request["platform"] == "cpu" and request.get("processes", 1) > 1:
        return multi_process_cpu_devices(request["processes"])
    if request["platform"] == "cpu":
        return jax.devices("cpu")
    bounds = {"chips_per_host_bounds": tuple(request["host_bounds"])} if request.get("host_bounds") else {}
    return topologies.get_topology_desc(topology_name=request["topology"], platform="tpu", **bounds).devices


def compile_buckets(index, program, request, devices_available, meshes) -> bool:
    """Compiles every bucket of program `index`, emitting its events; False once one failed (the process stops)."""
    out_dir = pathlib.Path(request["out_dir"])
    exported = jax.export.deserialize(bytearray(pathlib.Path(program["exported"]).read_bytes()))
    weight_shardings, input_shardings, device_ids = shardings(program, devices_available, meshes)
    weights = [jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)
               for (shape, dtype), sharding in zip(program["weights"], weight_shardings)]
    by_id = {device.id: device for device in devices_available}
    device_processes = [int(by_id[device_id].process_index) for device_id in device_ids]
    outputs = None
    if program.get("mesh"):
        others = NamedSharding([*weight_shardings, *input_shardings][0].mesh, PartitionSpec()) if len(set(device_processes)) > 1 else None
        outputs = [others if state is None else input_shardings[state] for state in program["state_outputs"]]
    for bucket_index, bucket in enumerate(program["buckets"]):
        emit(event="start", program=index, bucket=bucket_index)
        inputs = [jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)
                  for (shape, dtype), sharding in zip(bucket["inputs"], input_shardings)]
        start = time.perf_counter()
        compiled, kernel_error = None, None
        if bucket.get("exported"):  # the bucket's static program with TPU kernels; the portable one if it does not compile
            try:
                kernel_program = jax.export.deserialize(bytearray(pathlib.Path(bucket["exported"]).read_bytes()))
                compiled = compile_program(kernel_program, weights, inputs, request, outputs)
            except Exception as error:  # XLA and Mosaic raise many kinds; the parent records it
                kernel_error = " ".join(str(error).split())
        try:
            if compiled is None:
                compiled = compile_program(exported, weights, inputs, request, outputs)
        except Exception as error:  # XLA raises XlaRuntimeError and others; the parent words it
            emit(event="error", program=index, bucket=bucket_index, message=" ".join(str(error).split()))
            return False
        seconds = time.perf_counter() - start
        executable, _, _ = serialize_executable.serialize(compiled)
        try:
            (out_dir / f"{index}-{bucket_index}.executable").write_bytes(bytes(executable))
            hlo_text = compiled.as_text()
            (out_dir / f"{index}-{bucket_index}.hlo.txt").write_text(hlo_text)
        except OSError as error:  # the parent raises it as the OSError it is (disk full is bad input there)
            emit(event="error", program=index, bucket=bucket_index, message=error.strerror, errno=error.errno, filename=error.filename)
            return False
        stats = compiled.memory_analysis()
        analysis = compiled.cost_analysis() or {}
        if isinstance(analysis, list):  # older jax returned one dict per computation
            analysis = analysis[0] if analysis else {}
        emit(
            event="done", program=index, bucket=bucket_index, seconds=seconds, device_ids=device_ids, device_processes=device_processes,
            device_kind=devices_available[0].device_kind, kernel_error=kernel_error,
            memory={
                "argument_bytes": int(stats.argument_size_in_bytes),
                "output_bytes": int(stats.output_size_in_bytes),
                "temp_bytes": int(stats.temp_size_in_bytes),
                "alias_bytes": int(stats.alias_size_in_bytes),
                "generated_code_bytes": int(stats.generated_code_size_in_bytes),
            },
            cost={
                "flops": float(analysis.get("flops", 0.0)),
                "bytes_accessed": float(analysis.get("bytes accessed", 0.0)),
                "optimal_seconds": optimal_seconds(analysis, hlo_text),
            },
        )
    return True


def main() -> None:
    """Answers requests, one per stdin line, until stdin ends (a kept process takes several,
    compiler_processes.py); returns after an error event."""
    devices = {}  # per target, made once for the process's requests
    for line in sys.stdin:
        request = json.loads(line)
        if not devices:
            die_with_parent(request["parent_pid"])
        target = json.dumps([request["platform"], request["processes"], request["topology"], request["host_bounds"]])
        if target not in devices:
            devices[target] = target_devices(request)
        meshes = {}
        for index, program in enumerate(request["programs"]):
            if not compile_buckets(index, program, request, devices[target], meshes):
                return
            # Nothing of one program's traces and executables is needed for the next: the process then
            # holds one program's at a time, as when each had a process of its own.
            jax.clear_caches()
        emit(event="finished")


if __name__ == "__main__":
    main()
    # Every event is flushed and every file closed: leave without the interpreter's teardown, which the
    # parent would wait for (a second or so of jax and libtpu finalizers per conversion and target), and
    # which for a multi-process CPU twin aborts (its in-process coordinator's clients report each other gone).
    sys.stdout.flush()
    os._exit(0)
