"""Loads an artifact's executables (or deserializes its programs) under another Python environment,
running nothing: `tpuexport verify --runtime-env PYTHON` (runtime_env.py) starts it as
`PYTHON -I load_child.py` with a JSON request on stdin:
  {"executables": [{"path", "weights", "inputs", "outputs", "devices"}],
   "programs": [{"path", "weights", "buckets": [[[shape, dtype] per input] per bucket]}]}
Each executable is deserialized onto its first `devices` devices (serialize_executable's
deserialize_and_load, its argument trees `(weights list, inputs list)` and a list of outputs, as the
runtime's); each program is deserialized by jax.export and lowered at every bucket's input shapes,
its symbolic shapes refined to the bucket's (what fails when a program holds an op this jax cannot
refine, before XLA compiles: jax 0.11.2 on jax 0.12's erfc composite, e.g. GELU), not compiled.
It prints one JSON line:
  {"loaded", "programs", "seconds", "compilations", "counter_works"}
compilations: XLA compilations while loading (jax.monitoring's backend compile event, as
tpuexport/runtime/compilations.py counts them); counter_works: a jit of a tiny function afterwards
was counted, so a 0 means none ran. Errors: {"error": "..."}. Imports only jax and numpy (public APIs
but for the shape refinement, which jax runs when it compiles; skipped where a release lacks it).
"""

import json
import os
import pathlib
import sys
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# The event JAX's dispatch records around each backend compile (jax/_src/dispatch.py BACKEND_COMPILE_EVENT).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def refine(module) -> None:
    """Refines a lowered module's symbolic shapes as jax does before compiling (private to jax)."""
    try:
        from jax._src.interpreters.mlir import refine_polymorphic_shapes
    except ImportError:  # a jax release that moved it: the check is then deserialize and lower only
        return
    refine_polymorphic_shapes(module)


def main() -> None:
    request = json.load(sys.stdin)
    import jax
    import numpy as np
    from jax import monitoring
    from jax.experimental import serialize_executable

    compilations = []

    def listen(event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            compilations.append(duration)

    devices = jax.devices()
    monitoring.register_event_duration_secs_listener(listen)
    start = time.perf_counter()
    try:
        for entry in request["executables"]:
            in_tree = jax.tree_util.tree_structure(((list(range(entry["weights"])), list(range(entry["inputs"]))), {}))
            out_tree = jax.tree_util.tree_structure(list(range(entry["outputs"])))
            serialize_executable.deserialize_and_load(pathlib.Path(entry["path"]).read_bytes(), in_tree, out_tree,
                                                      backend=devices[0].client, execution_devices=devices[:entry["devices"]])
        for program in request["programs"]:
            exported = jax.export.deserialize(bytearray(pathlib.Path(program["path"]).read_bytes()))
            weights = [jax.ShapeDtypeStruct(aval.shape, aval.dtype) for aval in exported.in_avals[:program["weights"]]]
            for bucket in program["buckets"]:
                inputs = [jax.ShapeDtypeStruct(tuple(shape), dtype) for shape, dtype in bucket]
                refine(jax.jit(exported.call).trace(weights, inputs).lower().compiler_ir("stablehlo"))
    except Exception as error:  # XLA and jax raise many kinds; the parent words it
        print(json.dumps({"error": " ".join(f"{type(error).__name__}: {error}".split())[:400]}), flush=True)
        return
    seconds = time.perf_counter() - start
    loading = len(compilations)
    jax.jit(lambda x: x + 1)(np.float32(1)).block_until_ready()
    print(json.dumps({"loaded": len(request["executables"]), "programs": len(request["programs"]), "seconds": seconds,
                      "compilations": loading, "counter_works": len(compilations) > loading}), flush=True)


if __name__ == "__main__":
    main()
    # Its reply is flushed: leave without jax's teardown, which the parent would wait for.
    sys.stdout.flush()
    os._exit(0)
