"""The TPU compiler's process: compiles one target's buckets with libtpu, nothing else loaded.

Started by aot.py as `python -I compile_child.py` with a JSON request on stdin. It imports only
jax (not tpuexport, torch or TensorFlow), so a crash inside libtpu's compiler takes down this
process alone and the parent can name the bucket that was compiling. Protocol, one JSON object
per stdout line, flushed as it happens:
  {"event": "start", "bucket": i}                          before compiling bucket i
  {"event": "done", "bucket": i, "seconds", "memory", "cost"}   files <i>.executable, <i>.hlo.txt written
  {"event": "error", "bucket": i, "message"}               XLA raised; the process stops there
"""

import json
import os
import pathlib
import sys
import time

# libtpu's lock file would stop a second process (parallel conversions, tests) from loading it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
from jax.experimental import serialize_executable, topologies  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

jax.config.update("jax_platforms", "cpu")


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


def main() -> None:
    request = json.load(sys.stdin)
    out_dir = pathlib.Path(request["out_dir"])
    exported = jax.export.deserialize(bytearray(pathlib.Path(request["exported"]).read_bytes()))
    topology = topologies.get_topology_desc(
        topology_name=request["topology"], platform="tpu", chips_per_host_bounds=(1, 1, 1)
    )
    sharding = SingleDeviceSharding(topology.devices[0])
    weights = [jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding) for shape, dtype in request["weights"]]
    for index, bucket in enumerate(request["buckets"]):
        emit(event="start", bucket=index)
        inputs = [jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding) for shape, dtype in bucket["inputs"]]
        start = time.perf_counter()
        try:
            compiled = jax.jit(exported.call).trace(weights, inputs).lower().compile()
        except Exception as error:  # XLA raises XlaRuntimeError and others; the parent words it
            emit(event="error", bucket=index, message=" ".join(str(error).split()))
            return
        seconds = time.perf_counter() - start
        executable, _, _ = serialize_executable.serialize(compiled)
        (out_dir / f"{index}.executable").write_bytes(bytes(executable))
        (out_dir / f"{index}.hlo.txt").write_text(compiled.as_text())
        stats = compiled.memory_analysis()
        analysis = compiled.cost_analysis() or {}
        if isinstance(analysis, list):  # older jax returned one dict per computation
            analysis = analysis[0] if analysis else {}
        emit(
            event="done", bucket=index, seconds=seconds,
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
                "optimal_seconds": float(analysis.get("optimal_seconds", 0.0)),
            },
        )


if __name__ == "__main__":
    main()
