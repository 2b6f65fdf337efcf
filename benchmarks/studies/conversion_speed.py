"""`tpuexport convert` against the irreducible work done by hand, stage by stage, in one run.

    python benchmarks/studies/conversion_speed.py                 # BERT-base and ResNet-50 (full configs, random weights)
    python benchmarks/studies/conversion_speed.py bert-base --repeat 2

Each model has a dynamic batch (BERT-base: sequence 128; ResNet-50: 224-pixel images) and one v5e
bucket at batch 8. "By hand" is what any conversion must do at least, with the same libraries:
torch.export; torch's and torchax's decompositions and torchax's interpreter traced by jax.export
(cpu and tpu, a symbolic batch); one v5e compile through libtpu's compile-only topology; a
SavedModel saved by TensorFlow around the program's XlaCallModule. tpuexport also verifies (eager
PyTorch and XLA:CPU runs), checks the SavedModel in TensorFlow, writes and hashes the artifact. Both
sides run in fresh child processes, one after the other, so neither warms the other's caches; the
ratio is tpuexport's wall time over the hand-made one.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402

BATCH = 8


def build(name: str) -> dict:
    """The model as a factory dict, with a dynamic batch only and example inputs at BATCH."""
    import torch
    from families import BASE_FAMILIES

    built = BASE_FAMILIES[name].build()
    batch = torch.export.Dim("batch", min=1, max=64)
    if name == "bert-base":
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(3, 30522, (BATCH, 128), generator=generator)
        built["args"] = (ids, torch.ones(BATCH, 128, dtype=torch.long))
        built["dynamic_shapes"] = {"input_ids": {0: batch}, "attention_mask": {0: batch}}
    else:
        built["args"] = (torch.randn(BATCH, 3, 224, 224),)
        built["dynamic_shapes"] = {"pixel_values": {0: batch}}
    return built


def tpuexport_run(name: str, workdir: pathlib.Path) -> dict:
    """One `tpuexport.convert`, its stage seconds as it reports them."""
    import tpuexport

    built = build(name)
    stages: dict[str, float] = {}
    start = time.perf_counter()
    tpuexport.convert(built["model"], built["args"], built["dynamic_shapes"], target="v5e", out=workdir / f"{name}.tpu",
                      progress=lambda stage, seconds, detail: stages.setdefault(stage, round(seconds, 2)))
    return {"total": round(time.perf_counter() - start, 2), "stages": stages}


def by_hand_run(name: str, workdir: pathlib.Path) -> dict:
    """The irreducible steps with torch, torchax, jax and TensorFlow directly."""
    import jax
    import numpy as np
    import torch

    from tpuexport.lower.torchax_import import import_torchax

    jax.config.update("jax_platforms", "cpu")
    stages = {}
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        stages[stage] = round(now - clock, 2)
        clock = now

    built = build(name)
    model = built["model"].eval()
    with torch.no_grad():
        program = torch.export.export(model, built["args"], dynamic_shapes=built["dynamic_shapes"])
    lap("export")

    torchax = import_torchax()
    decomposed = program.run_decompositions().run_decompositions(torchax.decompositions.DECOMPOSITIONS)
    state = {**decomposed.state_dict, **decomposed.constants}
    weights = [np.asarray(state[spec.target].detach().numpy()) for spec in decomposed.graph_signature.input_specs
               if spec.kind != torch.export.graph_signature.InputKind.USER_INPUT]

    def program_fn(weights_list, inputs_list):
        return torchax.export.JaxInterpreter(decomposed.graph_module).run(*weights_list, *inputs_list, enable_io_processing=False)

    (batch,) = jax.export.symbolic_shape("batch", constraints=("batch <= 64",))
    input_avals = [jax.ShapeDtypeStruct((batch, *tuple(a.shape[1:])), np.int32 if a.dtype == torch.long else np.float32)
                   for a in built["args"]]
    weight_avals = [jax.ShapeDtypeStruct(w.shape, np.int32 if w.dtype == np.int64 else w.dtype) for w in weights]
    exported = jax.export.export(jax.jit(program_fn), platforms=("cpu", "tpu"))(weight_avals, input_avals)
    lap("lower")

    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    topology = topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu", chips_per_host_bounds=(1, 1, 1))
    sharding = SingleDeviceSharding(topology.devices[0])
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in weight_avals]
    concrete = [jax.ShapeDtypeStruct((BATCH, *a.shape[1:]), a.dtype, sharding=sharding) for a in input_avals]
    jax.jit(exported.call).trace(placed, concrete).lower().compile()
    lap("compile")

    import tensorflow as tf
    from tensorflow.compiler.tf2xla.python import xla as tfxla

    from tpuexport.artifact.tf_serving.saved_model import composites_as_calls
    from jax.extend.mlir import serialize_portable_artifact
    from jax.extend.mlir.dialects import stablehlo
    from tensorflow.compiler.mlir.stablehlo import stablehlo as tf_stablehlo

    version = stablehlo.get_smaller_version(tf_stablehlo.get_current_version(), stablehlo.get_current_version())
    module_bytes = serialize_portable_artifact(composites_as_calls(exported.mlir_module()), version)
    module = tf.Module()
    module.weights = [tf.Variable(w.astype(np.int32) if w.dtype == np.int64 else w, trainable=False) for w in weights]
    specs = [tf.TensorSpec([None, *a.shape[1:]], tf.as_dtype(a.dtype)) for a in input_avals]

    @tf.function(input_signature=specs, autograph=False)
    def serve(*inputs):
        arguments = [*module.weights, *inputs]
        return tfxla.call_module([arguments[i] for i in exported.module_kept_var_idx], version=exported.calling_convention_version,
                                 module=module_bytes, Tout=[tf.as_dtype(a.dtype) for a in exported.out_avals],
                                 Sout=[[s if isinstance(s, int) else None for s in a.shape] for a in exported.out_avals],
                                 platforms=["CPU", "TPU"])

    module.serve = serve
    tf.saved_model.save(module, str(workdir / f"{name}-by-hand"), signatures={"serving_default": serve})
    lap("saved_model")
    return {"total": round(sum(stages.values()), 2), "stages": stages}


def child(kind: str, name: str) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        command = [sys.executable, str(pathlib.Path(__file__)), "--child", kind, name, "--result", str(pathlib.Path(scratch) / "r.json")]
        start = time.perf_counter()
        subprocess.run(command, check=True, env=_common.child_environment(), capture_output=True)
        result = json.loads((pathlib.Path(scratch) / "r.json").read_text())
        result["process"] = round(time.perf_counter() - start, 2)
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["bert-base", "resnet-50"])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=pathlib.Path, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        kind, name = options.child
        import warnings

        warnings.filterwarnings("ignore")
        with tempfile.TemporaryDirectory() as workdir:
            run = tpuexport_run if kind == "tpuexport" else by_hand_run
            options.result.write_text(json.dumps(run(name, pathlib.Path(workdir))))
        return
    for name in options.models:
        for attempt in range(options.repeat):
            hand, ours = child("by-hand", name), child("tpuexport", name)
            print(f"\n{name} (run {attempt + 1}): tpuexport {ours['total']} s, by hand {hand['total']} s, "
                  f"ratio {ours['total'] / hand['total']:.2f}x (whole processes: {ours['process']} s vs {hand['process']} s)")
            print("| by hand | s | tpuexport stage | s |\n|---|---|---|---|")
            left, right = list(hand["stages"].items()), list(ours["stages"].items())
            for row in range(max(len(left), len(right))):
                a = left[row] if row < len(left) else ("", "")
                b = right[row] if row < len(right) else ("", "")
                print(f"| {a[0]} | {a[1]} | {b[0]} | {b[1]} |")


if __name__ == "__main__":
    main()
