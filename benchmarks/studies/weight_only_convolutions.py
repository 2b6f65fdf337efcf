"""Weight-only convolutions: one scale per output channel or per group of the contraction?

    nice -n 10 python benchmarks/studies/weight_only_convolutions.py [--resnet-50]

For convolution weights of ResNet-50's and wav2vec2-base's shapes:
  1. SQNR (dB) of the convolution's output against the float one, on random inputs, with the
     weight rounded int8 per output channel, int4 per output channel (what tpuexport stores) and
     int4 in groups of 32/64/128 consecutive elements of the [in/groups x kernel] contraction; the
     weights are synthetic (no checkpoint is downloaded): normal (a fresh initialization), Laplace,
     and Student-t (3 degrees of freedom) times a log-normal scale per output channel (outliers
     and uneven channels, as trained weights have).
  2. Compiled for v5e (compile-only, bf16 activations): the float convolution, tpuexport's int8
     and int4 convolutions (lower/quantized_weights.quantized_convolution: integers into the
     convolution, scales on its result) and int4 in groups of 128 (dequantized before the
     convolution, since a scale along the contraction does not commute with it): XLA's argument
     bytes, temporaries, bytes accessed, and how many float arrays outside any fusion have the
     weight's number of elements (for the quantized ones: a materialized dequantized copy; for bf16, relayouts).
  3. wav2vec2's positional convolution under weight_norm, its weight computed from v (float, or
     int8 per output channel and dequantized, as tpuexport lowers it) and g: the same figures.
  --resnet-50 instead: the whole ResNet-50 (benchmarks/families.py, random weights) lowered as a
     weight-only plan and compiled for v5e at batch 2 in both modes: the element types of its
     convolution weight parameters, argument and temporary bytes, and every float array outside
     fusions whose element count is a convolution weight's (with its shape, to tell activations
     of the same size from weight copies).
"""

from __future__ import annotations

import argparse
import collections
import math
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import torch
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402
from tpuexport.lower.aten_lowerings import torchax_lowering  # noqa: E402
from tpuexport.lower.quantized_weights import QuantizedArray, quantized_convolution
from tpuexport.quantize.weight_only import WeightOnlyScheme, convolution_axes, fake_quantized, scheme_for

# name: (weight shape [out, in/groups, *kernel], groups, input shape [batch, channels, *spatial])
SHAPES = {
    "resnet-50 3x3 512->512": ((512, 512, 3, 3), 1, (8, 512, 14, 14)),
    "resnet-50 1x1 512->2048": ((2048, 512, 1, 1), 1, (8, 512, 7, 7)),
    "wav2vec2 feature conv k3 512": ((512, 512, 3), 1, (8, 512, 400)),
    "wav2vec2 pos conv g16 k128": ((768, 48, 128), 16, (8, 768, 400)),
}
DISTRIBUTIONS = {
    "normal": lambda shape: torch.randn(shape),
    "laplace": lambda shape: torch.distributions.Laplace(0.0, 1.0).sample(shape),
    "student-t x channel scale": lambda shape: (torch.distributions.StudentT(3.0).sample(shape)
                                                * torch.exp(0.5 * torch.randn(shape[0], *[1] * (len(shape) - 1)))),
}
GROUPS = (32, 64, 128)


def sqnr_db(expected: torch.Tensor, actual: torch.Tensor) -> float:
    return 10 * math.log10(float(expected.pow(2).sum() / (expected - actual).pow(2).sum()))


def torch_convolution(x, weight, groups):
    spatial = weight.dim() - 2
    padding = [size // 2 for size in weight.shape[2:]]
    return torch.ops.aten.convolution.default(x, weight, None, [1] * spatial, padding, [1] * spatial, False, [0] * spatial, groups)


def print_sqnr() -> None:
    print(f"{'weight':<30}{'distribution':<27}{'int8/ch':>8}{'int4/ch':>8}" + "".join(f"{'int4 g' + str(g):>10}" for g in GROUPS))
    torch.manual_seed(0)
    for name, (shape, groups, input_shape) in SHAPES.items():
        x = torch.randn(2, *input_shape[1:2], *[min(size, 64) for size in input_shape[2:]])
        axes = convolution_axes(len(shape))
        for label, draw in DISTRIBUTIONS.items():
            weight = draw(shape) * 0.05
            expected = torch_convolution(x, weight, groups)
            row = []
            for mode in ("int8-weight-only", "int4-weight-only"):
                scheme = scheme_for(WeightOnlyScheme(mode), shape, axes)
                row.append(sqnr_db(expected, torch_convolution(x, fake_quantized(weight, scheme, axes), groups)))
            matrix = weight.reshape(shape[0], -1)
            for group in GROUPS:
                rounded = fake_quantized(matrix, WeightOnlyScheme("int4-weight-only", group), -1).reshape(shape)
                row.append(sqnr_db(expected, torch_convolution(x, rounded, groups)))
            print(f"{name:<30}{label:<27}" + "".join(f"{value:8.1f}" for value in row[:2]) + "".join(f"{value:10.1f}" for value in row[2:]),
                  flush=True)


def compiled_figures(function, specs, kernel) -> str:
    topology = topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu", chips_per_host_bounds=(1, 1, 1))
    placed = [jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(topology.devices[0])) for shape, dtype in specs]
    compiled = jax.jit(function).trace(*placed).lower().compile()
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
    text = compiled.as_text()
    entry = text[text.index("\nENTRY"):].split("\n}")[0]
    # Any layout or grouping of the weight (kernel, matrix, per feature group) has its element count;
    # the activations of these shapes have other counts.
    results = [re.match(r"\s*(?:ROOT )?%\S+ = (?:f32|bf16)\[([\d,]*)\]", line) for line in entry.splitlines() if "parameter(" not in line]
    copies = sum(1 for result in results if result and math.prod(int(size) for size in result[1].split(",") if size) == math.prod(kernel))
    mib = 2 ** 20
    return (f"arguments {memory.argument_size_in_bytes / mib:7.2f} MiB  temporaries {memory.temp_size_in_bytes / mib:6.2f} MiB  "
            f"bytes accessed {cost.get('bytes accessed', 0) / mib:7.1f} MiB  float arrays of the weight's size outside fusions: {copies}")


def print_compiled() -> None:
    dtype = jnp.dtype(jnp.bfloat16)
    for name, (shape, groups, input_shape) in SHAPES.items():
        spatial = len(shape) - 2
        options = ([1] * spatial, [size // 2 for size in shape[2:]], [1] * spatial, False, [0] * spatial, groups)
        contraction = math.prod(shape[1:])
        x = (input_shape, jnp.bfloat16)
        print(f"{name}: weight {list(shape)}, input {list(input_shape)}", flush=True)

        def floating(x, weight):
            return torchax_lowering(torch.ops.aten.convolution.default)(x, weight, None, *options)

        print(f"  {'bf16':<20}" + compiled_figures(floating, [x, (shape, jnp.bfloat16)], shape), flush=True)

        def per_channel(bits):
            def convolution(x, values, scale):
                return quantized_convolution(x, QuantizedArray(values, scale, bits, -1, dtype, kernel=shape), None, *options)
            return convolution

        print(f"  {'int8 per channel':<20}" + compiled_figures(per_channel(8), [x, ((shape[0], contraction), jnp.int8),
                                                                                 ((shape[0], 1), jnp.bfloat16)], shape), flush=True)
        print(f"  {'int4 per channel':<20}" + compiled_figures(per_channel(4), [x, ((shape[0], contraction // 2), jnp.uint8),
                                                                                 ((shape[0], 1), jnp.bfloat16)], shape), flush=True)

        def grouped(x, values, scale):
            weight = QuantizedArray(values, scale, 4, -1, dtype, kernel=shape).dequantized()
            return torchax_lowering(torch.ops.aten.convolution.default)(x, weight, None, *options)

        print(f"  {'int4 groups of 128':<20}" + compiled_figures(grouped, [x, ((shape[0], contraction // 2), jnp.uint8),
                                                                            ((shape[0], contraction // 128), jnp.bfloat16)], shape),
              flush=True)


def print_weight_norm() -> None:
    """wav2vec2's positional convolution as its program computes it: weight = v x g / ||v|| (norm
    over all dims but the kernel's), from a float v or from v int8 per output channel, dequantized
    (what tpuexport does with a weight-normed convolution's direction)."""
    shape, groups, input_shape = SHAPES["wav2vec2 pos conv g16 k128"]
    options = ([1], [shape[2] // 2], [1], False, [0], groups)
    dtype = jnp.dtype(jnp.float32)

    def normed(x, v, g):
        weight = v * (g / jnp.sqrt(jnp.sum(v * v, axis=(0, 1), keepdims=True)))
        return torchax_lowering(torch.ops.aten.convolution.default)(x, weight, None, *options)

    x, g = (input_shape, jnp.float32), ((1, 1, shape[2]), jnp.float32)
    print(f"wav2vec2 pos conv under weight_norm (f32 model): v {list(shape)}", flush=True)
    print(f"  {'f32 v':<20}" + compiled_figures(normed, [x, (shape, jnp.float32), g], shape), flush=True)
    print(f"  {'int8 v per channel':<20}" + compiled_figures(
        lambda x, values, scale, g: normed(x, QuantizedArray(values, scale, 8, -1, dtype, kernel=shape).dequantized(), g),
        [x, ((shape[0], math.prod(shape[1:])), jnp.int8), ((shape[0], 1), jnp.bfloat16), g], shape), flush=True)


def print_resnet_50() -> None:
    from families import BASE_FAMILIES

    from tpuexport import compile as compile_stage
    from tpuexport import export as export_stage
    from tpuexport import lower as lower_stage
    from tpuexport.quantize.weight_only import check_scheme

    built = BASE_FAMILIES["resnet-50"].build()
    captured = export_stage.capture(export_stage.LoadedSource(built["model"], built["args"], built.get("dynamic_shapes"), None,
                                                              export_stage.SourceInfo("api")))
    [target] = compile_stage.resolve_targets(["v5e"])
    for mode in ("int8-weight-only", "int4-weight-only"):
        lowered = lower_stage.lower(captured.program, captured.signature, weights=False, weight_only=check_scheme(mode, 128))
        bucket = [bucket for bucket in compile_stage.make_buckets(lowered.signature, None) if dict(bucket.sizes)["batch"] == 2]
        [compiled] = compile_stage.compile_program(lowered, [target], bucket).results
        entry = compiled.hlo_text[compiled.hlo_text.index("\nENTRY"):].split("\n}")[0]
        parameters = {int(position): kind for kind, position in re.findall(r"= (\w+)\[[\d,]*\]\S* parameter\((\d+)\)", entry)}
        convolutions = {name: entry for name, entry in lowered.quantized.items() if "kernel_shape" in entry}
        kinds = collections.Counter(parameters[lowered.weight_names.index(name)] for name in convolutions)
        weight_sizes = {math.prod(entry["kernel_shape"]) for entry in convolutions.values()}
        same_size = collections.Counter(f"{kind}[{dims}]" for kind, dims in re.findall(r"= (f32|bf16)\[([\d,]*)\]\S* (?!parameter)", entry)
                                        if math.prod(int(size) for size in dims.split(",") if size) in weight_sizes)
        memory = compiled.memory
        print(f"resnet-50 {mode}: {len(convolutions)} convolution weights, parameters {dict(kinds)}; arguments "
              f"{memory['argument_bytes'] / 2**20:.1f} MiB, temporaries {memory['temp_bytes'] / 2**20:.1f} MiB; float arrays outside "
              f"fusions of a convolution weight's size: {dict(same_size) or 'none'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resnet-50", action="store_true", help="compile the whole ResNet-50 plan for v5e instead")
    if parser.parse_args().resnet_50:
        return print_resnet_50()
    print_sqnr()
    print_compiled()
    print_weight_norm()


if __name__ == "__main__":
    main()
