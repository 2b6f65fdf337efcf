"""Fingerprints of small conversions, to compare two checkouts bit for bit: per conversion,
the sha256 of each program weight as the artifact stores it and of each CPU output on the example
inputs, whether verification passed, and its reports and golden data (what the eager reference computed).
Written for the in-memory weights pass (session 17): the weights the artifact stores and what it
computes must not change when the route they take does; the checkpoint conversions for the shared
weights of session 18 (the eager reference reading the artifact's file, not the checkpoint's).

    PYTHONPATH=/path/to/other/checkout python benchmarks/studies/conversion_fingerprint.py before.json
    python benchmarks/studies/conversion_fingerprint.py after.json && cmp before.json after.json
    ... [--only checkpoint]

Conversions (target v5e, no SavedModel, no kernels): examples/transformer.py at precision auto and
bf16, examples/decoder.py at bf16-mixed, int8 weight-only and int4 weight-only (group 32) in bf16,
examples/cnn.py in PT2E int8, and a model with f64 and int64 buffers at bf16 (the casts a weight takes);
from a safetensors checkpoint: examples/transformer.py at auto, examples/decoder.py at bf16 and int4
weight-only, and a 2-layer Llama as text-generation (max context 64, batch 2; its weights and its
verification directory, seconds left out). --only TEXT runs the conversions whose names contain it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402  (PYTHONPATH=OTHER_CHECKOUT fingerprints that checkout's tpuexport)

import numpy as np  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402

import tpuexport  # noqa: E402


class WideBuffers(torch.nn.Module):
    """f64 weights and buffers and an int64 buffer: collect_weights narrows them, bf16 casts them."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8).double()
        self.register_buffer("offset", torch.linspace(-3, 3, 8, dtype=torch.float64) / 7)
        self.register_buffer("ids", torch.arange(8, dtype=torch.int64) * 3)

    def forward(self, x):
        return self.linear(x.double()).float() + self.offset.float() + self.ids.float()


def digest(array) -> str:
    array = np.ascontiguousarray(np.asarray(array))
    return f"{array.dtype}{list(array.shape)}:{hashlib.sha256(array.view(np.uint8).tobytes()).hexdigest()[:16]}"


def fingerprint(built: dict, **options) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        artifact = tpuexport.convert(built["model"], built["args"], built.get("dynamic_shapes"), out=pathlib.Path(directory) / "m.tpu",
                                     target="v5e", saved_model=False, kernels="none", **options)
        program = artifact.program
        outputs = program.run([arg.numpy() for arg in built["args"]])
        return {"weights": {name: digest(weight) for name, weight in zip(program.weight_names, program.weights)},
                "outputs": [digest(output) for output in outputs], "verified": artifact.manifest["verification"]["passed"],
                "verification": verification_files(artifact.path)}


def from_checkpoint(build, directory: pathlib.Path, **options) -> dict:
    """The fingerprint of `build()`'s model converted from its weights saved first as a safetensors
    checkpoint, the model built again with its parameters on the meta device."""
    built = build()
    path = directory / f"{len(list(directory.iterdir()))}.safetensors"
    safetensors.torch.save_file({name: tensor.contiguous() for name, tensor in built["model"].state_dict().items()}, str(path))
    with tpuexport.parameters_on_meta():
        on_meta = build()["model"]
    return fingerprint({**built, "model": on_meta}, checkpoint=path, **options)


def generation_fingerprint(directory: pathlib.Path) -> dict:
    path = directory / "llama.safetensors"
    state = _common.random_llama(2, 64, 64).state_dict()
    safetensors.torch.save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(path))
    with tpuexport.parameters_on_meta():
        on_meta = _common.random_llama(2, 64, 64)
    artifact = tpuexport.convert(on_meta, task="text-generation", max_context=64, max_batch=2, checkpoint=path,
                                 out=directory / "generation.tpu", target="v5e", kernels="none")
    program = artifact.generation_program.weights_program
    return {"weights": {name: digest(weight) for name, weight in zip(program.weight_names, program.weights)},
            "verified": artifact.manifest["verification"]["passed"], "verification": verification_files(artifact.path)}


def verification_files(artifact: pathlib.Path) -> dict:
    """The artifact's verification directory: its JSON reports without their timings (they differ
    from run to run), the sha256 of its other files (the golden data: the eager reference's outputs)."""
    found = {}
    for path in sorted((artifact / "verification").rglob("*")):
        if path.is_file():
            name = str(path.relative_to(artifact))
            found[name] = (without_seconds(json.loads(path.read_text())) if path.suffix == ".json"
                           else hashlib.sha256(path.read_bytes()).hexdigest()[:16])
    return found


def without_seconds(report):
    if isinstance(report, dict):
        return {key: without_seconds(value) for key, value in report.items() if "seconds" not in key}
    if isinstance(report, list):
        return [without_seconds(value) for value in report]
    return report


def cases(directory: pathlib.Path) -> dict:
    """{name: a function returning its fingerprint}."""
    transformer = lambda: _common.build_example("transformer")  # noqa: E731
    decoder = lambda: _common.build_example("decoder")  # noqa: E731
    cnn = lambda: _common.build_example("cnn")  # noqa: E731
    wide = {"model": WideBuffers(), "args": (torch.randn(2, 8, generator=torch.Generator().manual_seed(0)),)}
    return {
        "transformer-auto": lambda: fingerprint(transformer()),
        "transformer-bf16": lambda: fingerprint(transformer(), precision="bf16"),
        "decoder-bf16-mixed": lambda: fingerprint(decoder(), precision="bf16-mixed"),
        "decoder-int8-weight-only": lambda: fingerprint(decoder(), quantize="int8-weight-only"),
        "decoder-int4-weight-only-bf16": lambda: fingerprint(decoder(), quantize="int4-weight-only", group_size=32, precision="bf16"),
        "cnn-pt2e-int8": lambda: fingerprint(built := cnn(), quantize="int8", calibration=built["calibration"]),
        "wide-buffers-bf16": lambda: fingerprint(wide, precision="bf16"),
        "transformer-checkpoint-auto": lambda: from_checkpoint(transformer, directory),
        "decoder-checkpoint-bf16": lambda: from_checkpoint(decoder, directory, precision="bf16"),
        "decoder-checkpoint-int4-weight-only": lambda: from_checkpoint(decoder, directory, quantize="int4-weight-only", group_size=32),
        "llama-generation-checkpoint": lambda: generation_fingerprint(directory),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path, help="the JSON file to write")
    parser.add_argument("--only", default="", help="the conversions whose names contain this (default: all)")
    options = parser.parse_args()
    print(f"tpuexport from {pathlib.Path(tpuexport.__file__).parent}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as directory:
        results = {name: run() for name, run in cases(pathlib.Path(directory)).items() if options.only in name}
    options.out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(f"wrote {options.out}")


if __name__ == "__main__":
    main()
