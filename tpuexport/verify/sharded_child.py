"""Runs a lowered program partitioned by a sharding plan over N virtual CPU devices; jax only.

Started by sharded.py as `python -I sharded_child.py` with XLA_FLAGS asking XLA's host platform
for N devices (the parent's JAX backend is already initialized with one, so this needs its own
process), and a JSON request on stdin:
  devices, mesh {axes, shape}: the mesh, laid over the first N CPU devices in order
  programs {run: path}: jax.export serializations ("cpu", and "tpu" for the TPU-faithful one)
  weights, cases[i]: arrays as {path, dtype, shape} raw files; weight_specs, input_specs:
    PartitionSpecs as JSON lists (null, an axis, or a list of axes)
  out_dir: where outputs go
Every weight and input is placed with its NamedSharding and the program is called through
`jax.jit(exported.call)`, so XLA's partitioner splits it as it does for the TPU. Protocol, one
JSON object per stdout line:
  {"event": "case", "case": i, "outputs": {run: [{path, dtype, shape}, ...]}}
  {"event": "error", "case": i, "message"}      the run raised; the process goes on
  {"event": "compiled", "hlo": path}            the first case's compiled "cpu" program, as text

A text-generation request (sharded_generation.py) has "calls" instead of "cases": entry points
called in order (prefill, then decode steps), the state (the KV cache) carried between them as a
runtime carries it, on the devices:
  programs {run: {entry point: path}}; weight_specs, input_specs {entry point: [spec, ...]}
  state_inputs, state_outputs {entry point: [index, ...]}: where the state enters and leaves each
    entry point, in the same order; state [{dtype, shape}]: its zeros before the first call
  calls [{entry, inputs: [{path, dtype, shape} or null for a state input]}]
Each entry point is `jax.jit(exported.call, donate_argnums=1)` as compile_child.py compiles it (its
inputs donated), and the state each call returns is placed as the next call's entry point takes
it. Protocol:
  {"event": "call", "run": run, "call": i, "outputs": [{path, dtype, shape} or null for the state]}
  {"event": "error", "run": run, "call": i, "message"}   the run stops there
  {"event": "compiled", "entry": name, "hlo": path}     each entry point's "cpu" program, as text
  {"event": "resharded", "run": run, "calls": [i, ...]} calls whose state came in another layout
                                                        than their entry point takes (a copy per call)
"""

import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

jax.config.update("jax_platforms", "cpu")


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


def read_array(entry: dict) -> np.ndarray:
    data = pathlib.Path(entry["path"]).read_bytes()
    return np.frombuffer(data, dtype=jnp.dtype(entry["dtype"])).reshape(entry["shape"])


def write_array(array: np.ndarray, path: pathlib.Path) -> dict:
    array = np.ascontiguousarray(array)
    path.write_bytes(array.tobytes())
    return {"path": str(path), "dtype": str(array.dtype), "shape": list(array.shape)}


def partition_spec(entries) -> PartitionSpec:
    return PartitionSpec(*(tuple(entry) if isinstance(entry, list) else entry for entry in entries))


def run_generation(request: dict, mesh: Mesh, out_dir: pathlib.Path) -> None:
    """The "calls" of a text-generation request, once per run (module docstring)."""
    placed = {}  # the weights once per distinct list of specs (both entry points take the same, as a rule)
    weights, input_shardings = {}, {}
    for entry, specs in request["weight_specs"].items():
        key = json.dumps(specs)
        if key not in placed:
            placed[key] = [jax.device_put(read_array(array), NamedSharding(mesh, partition_spec(spec)))
                           for array, spec in zip(request["weights"], specs)]
        weights[entry] = placed[key]
        input_shardings[entry] = [NamedSharding(mesh, partition_spec(spec)) for spec in request["input_specs"][entry]]
    for run, paths in request["programs"].items():
        programs = {entry: jax.jit(jax.export.deserialize(bytearray(pathlib.Path(path).read_bytes())).call, donate_argnums=1)
                    for entry, path in paths.items()}
        compiled = {}
        state = [np.zeros(entry["shape"], jnp.dtype(entry["dtype"])) for entry in request["state"]]
        resharded = []
        for index, call in enumerate(request["calls"]):
            entry = call["entry"]
            shardings = input_shardings[entry]
            state_at = dict(zip(request["state_inputs"][entry], state))
            if any(isinstance(value, jax.Array) and not value.sharding.is_equivalent_to(shardings[position], value.ndim)
                   for position, value in state_at.items()):
                resharded.append(index)
            # Fresh buffers for every input (donated), the state moved into the layout this entry point takes.
            inputs = [jax.device_put(state_at[position] if array is None else read_array(array), sharding)
                      for position, (array, sharding) in enumerate(zip(call["inputs"], shardings))]
            try:
                if entry not in compiled:
                    compiled[entry] = programs[entry].lower(weights[entry], inputs).compile(compiler_options=request["compiler_options"])
                    if run == "cpu":
                        hlo_path = out_dir / f"{entry}.hlo.txt"
                        hlo_path.write_text(compiled[entry].as_text())
                        emit(event="compiled", entry=entry, hlo=str(hlo_path))
                results = compiled[entry](weights[entry], inputs)
            except Exception as error:  # XLA and shape assertions raise many kinds; the parent words it
                emit(event="error", run=run, call=index, message=" ".join(str(error).split())[:300])
                break
            state_outputs = request["state_outputs"][entry]
            state = [results[position] for position in state_outputs]
            emit(event="call", run=run, call=index,
                 outputs=[None if number in state_outputs else write_array(np.asarray(result), out_dir / f"{run}.{index}.{number}.bin")
                          for number, result in enumerate(results)])
        emit(event="resharded", run=run, calls=resharded)


def main() -> None:
    request = json.load(sys.stdin)
    out_dir = pathlib.Path(request["out_dir"])
    devices = jax.devices()[: request["devices"]]
    if len(devices) != request["devices"]:
        raise SystemExit(f"XLA gave {len(devices)} CPU devices, {request['devices']} asked ({os.environ.get('XLA_FLAGS')})")
    mesh = Mesh(np.array(devices).reshape(request["mesh"]["shape"]), tuple(request["mesh"]["axes"]))
    if "calls" in request:
        run_generation(request, mesh, out_dir)
        return
    weights = [jax.device_put(read_array(entry), NamedSharding(mesh, partition_spec(spec)))
               for entry, spec in zip(request["weights"], request["weight_specs"])]
    input_shardings = [NamedSharding(mesh, partition_spec(spec)) for spec in request["input_specs"]]
    programs = {run: jax.jit(jax.export.deserialize(bytearray(pathlib.Path(path).read_bytes())).call)
                for run, path in request["programs"].items()}
    for index, case in enumerate(request["cases"]):
        inputs = [jax.device_put(read_array(entry), sharding) for entry, sharding in zip(case, input_shardings)]
        outputs = {}
        try:
            for run, program in programs.items():
                compiled = program.lower(weights, inputs).compile(compiler_options=request["compiler_options"])
                if index == 0 and run == "cpu":
                    hlo_path = out_dir / "cpu.hlo.txt"
                    hlo_path.write_text(compiled.as_text())
                    emit(event="compiled", hlo=str(hlo_path))
                results = compiled(weights, inputs)
                outputs[run] = [write_array(np.asarray(result), out_dir / f"{index}.{run}.{number}.bin")
                                for number, result in enumerate(results)]
        except Exception as error:  # XLA and shape assertions raise many kinds; the parent words it
            emit(event="error", case=index, message=" ".join(str(error).split())[:300])
            continue
        emit(event="case", case=index, outputs=outputs)


if __name__ == "__main__":
    main()
    # Its reply is flushed: leave without jax's teardown, which the parent would wait for.
    sys.stdout.flush()
    os._exit(0)
