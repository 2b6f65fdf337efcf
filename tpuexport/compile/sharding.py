"""Sharding plans: a named mesh over a slice's devices and a PartitionSpec for every weight and input.

The portable program stays device-independent; a plan is applied when the TPU compiler runs: the
compile child puts `NamedSharding(mesh, spec)` on each weight's and input's ShapeDtypeStruct and
XLA's partitioner (Shardy) propagates the layouts through the program and inserts the collectives.

What the user asks for (a `ShardingRequest`):

  mesh     axis names and sizes, "data=2,model=4"; the sizes multiply to the slice's device count.
           Default: one axis of all devices, "model" for tensor-parallel and "data" otherwise.
  preset   replicated       every weight and input whole on every device (the default)
           data-parallel    the leading (batch) dim of every input over "data"
           tensor-parallel  Megatron-style pairs over "model": the attention's q/k/v and the MLP's
                            gate/up projections split by output features (heads, columns), the
                            attention output and MLP down projections by input features (rows),
                            so each pair needs one all-reduce; the embedding table and lm_head by
                            vocabulary. Found from state_dict names (`_COLUMN_PARALLEL`,
                            `_ROW_PARALLEL`, `_VOCAB_PARALLEL`) and checked against shapes: a row-
                            parallel weight is split only when a column-parallel weight of its
                            module produces its input features. Mixture-of-experts weights
                            ([experts, out, in]: `experts.gate_up_proj`, `experts.down_proj`) the
                            same way within every expert. int8 programs' `weight_int8`
                            and `weight_scale` follow their layer. Inputs as data-parallel when
                            the mesh also has a "data" axis.
           fsdp             every weight's largest dim divisible by the "data" size over "data";
                            inputs as data-parallel
  rules    `REGEX=SPEC` over state_dict names (re.search) and `NAME=SPEC` for inputs, applied
           after the preset in order, later rules winning. SPEC lists one entry per leading dim:
           a mesh axis, `None`, or axes joined with `+` (major first); missing trailing dims are
           whole. `model,None` splits dim 0 over "model". A SPEC gives the dims of the state_dict
           tensor; for a weight the program stores in another layout (a mixture-of-experts weight
           stored transposed, lower/weight_layouts.py) it is permuted to the stored dims.

A preset leaves a weight whole when its dim does not divide evenly (recorded in the plan's notes);
an explicit rule that does not divide is an error.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable, Mapping, Sequence

import numpy as np

from tpuexport.compile.buckets import Bucket
from tpuexport.compile.hlo import element_bytes
from tpuexport.compile.targets import Target
from tpuexport.errors import TpuExportError
from tpuexport.signature import ProgramSignature, evaluate_dim

PRESETS = ("replicated", "data-parallel", "tensor-parallel", "fsdp")
DATA_AXIS = "data"
MODEL_AXIS = "model"

# One entry per dim: None (whole), a mesh axis, or several axes (major first).
DimSharding = str | tuple[str, ...] | None
Spec = tuple[DimSharding, ...]

# Linear layers whose output features are split (nn.Linear weight (out, in), bias (out,); int8 programs
# hold `weight_int8` (out, in) and a per-output-feature `weight_scale` (out,), see tpuexport.quantize).
_COLUMN_PARALLEL = re.compile(
    r"(?:^|\.)(?:q_proj|k_proj|v_proj|qkv_proj|query|key|value|gate_proj|up_proj|gate_up_proj|w1|w3|fc1|wi|wi_0|wi_1"
    r"|intermediate\.dense|c_attn|c_fc)\.(?:weight|weight_int8|weight_scale|bias)$")
# Linear layers whose input features are split (their bias and scales stay whole: applied after the all-reduce).
_ROW_PARALLEL = re.compile(
    r"(?:^|\.)(?:o_proj|out_proj|down_proj|w2|fc2|wo|attention\.output\.dense|(?<!attention\.)output\.dense|c_proj)"
    r"\.(?:weight|weight_int8)$")
# Vocabulary-sized tables (and their per-row int8 scales): split by vocabulary rows.
_VOCAB_PARALLEL = re.compile(
    r"(?:^|\.)(?:embed_tokens|wte|word_embeddings|embed_in|tok_embeddings|lm_head|embed_out)\.(?:weight|weight_int8|weight_scale)$")
_WEIGHT = re.compile(r"\.weight(?:_int8)?$")
# Mixture-of-experts weights, one [experts, out, in] tensor per projection (transformers' Mixtral, Qwen-MoE,
# ...): split per expert like their dense counterparts (every chip holds a slice of every expert). Split
# over the experts axis instead, XLA:TPU gathers the weights for the grouped matmul (Mixtral-8x7B dims, 2
# layers, v5e-8, 64 tokens: 3251 MiB temporaries per chip against 226; benchmarks/studies/experts_layout.py).
_EXPERTS_COLUMN_PARALLEL = re.compile(r"(?:^|\.)experts\.(?:gate_up_proj|gate_proj|up_proj)$")
_EXPERTS_ROW_PARALLEL = re.compile(r"(?:^|\.)experts\.down_proj$")
# GPT-2's Conv1D layers store their weight as (in, out), transposed from nn.Linear.
_TRANSPOSED = re.compile(r"(?:^|\.)(?:c_attn|c_fc|c_proj)\.weight$")


@dataclasses.dataclass(frozen=True)
class ShardingRequest:
    """What the user asked for, parsed and checked for syntax (nothing about the program yet).

    Attributes:
      mesh: (axis, size) pairs, or None for the preset's default mesh.
      preset: one of PRESETS.
      weight_rules: (regex, spec) over state_dict names, in order.
      input_rules: (input name, spec), in order.
    """

    mesh: tuple[tuple[str, int], ...] | None = None
    preset: str = "replicated"
    weight_rules: tuple[tuple[str, Spec], ...] = ()
    input_rules: tuple[tuple[str, Spec], ...] = ()


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """A resolved plan for one slice target: every weight's and input's PartitionSpec.

    Attributes:
      mesh: (axis, size) pairs; the sizes multiply to the target's device count.
      preset: the preset it started from.
      weights: (state_dict name, spec) per weight, in the program's call order.
      inputs: (input name, spec) per input, in signature order.
      rules: the explicit rules as given ("REGEX=SPEC", then "input:NAME=SPEC").
      notes: weights a preset left whole, and why.
    """

    mesh: tuple[tuple[str, int], ...]
    preset: str
    weights: tuple[tuple[str, Spec], ...]
    inputs: tuple[tuple[str, Spec], ...]
    rules: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def mesh_text(self) -> str:
        return ",".join(f"{axis}={size}" for axis, size in self.mesh)

    @property
    def devices(self) -> int:
        return math.prod(size for _, size in self.mesh)

    def to_json(self) -> dict:
        return {
            "mesh": {"axes": [axis for axis, _ in self.mesh], "shape": [size for _, size in self.mesh]},
            "preset": self.preset,
            "rules": list(self.rules),
            "weights": {name: _spec_json(spec) for name, spec in self.weights},
            "inputs": {name: _spec_json(spec) for name, spec in self.inputs},
            "notes": list(self.notes),
        }

    @classmethod
    def from_json(cls, data: dict) -> "ShardingPlan":
        def spec(entries) -> Spec:
            return tuple(tuple(entry) if isinstance(entry, list) else entry for entry in entries)

        return cls(
            tuple(zip(data["mesh"]["axes"], data["mesh"]["shape"])), data["preset"],
            tuple((name, spec(entries)) for name, entries in data["weights"].items()),
            tuple((name, spec(entries)) for name, entries in data["inputs"].items()),
            tuple(data["rules"]), tuple(data["notes"]),
        )

    def describe(self) -> str:
        split = sum(any(entry is not None for entry in spec) for _, spec in self.weights)
        return f"mesh {self.mesh_text}, {self.preset}, {split}/{len(self.weights)} weights split"


def _spec_json(spec: Spec) -> list:
    return [list(entry) if isinstance(entry, tuple) else entry for entry in spec]


def spec_axes(entry: DimSharding) -> tuple[str, ...]:
    """The mesh axes one spec entry uses, major first."""
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def parse_mesh(mesh: str | Mapping[str, int] | None) -> tuple[tuple[str, int], ...] | None:
    """Parses `--mesh data=2,model=4` (or a dict {"data": 2, "model": 4}).

    Raises:
      TpuExportError: malformed text, a repeated axis or a size below 1.
    """
    if mesh is None:
        return None
    if isinstance(mesh, str):
        items = []
        for item in mesh.split(","):
            axis, equals, size = item.partition("=")
            if not equals or not axis.strip().isidentifier() or not size.strip().isdigit():
                raise TpuExportError(f"malformed --mesh {mesh!r}: expected AXIS=SIZE,AXIS=SIZE, e.g. --mesh data=2,model=4")
            items.append((axis.strip(), int(size)))
    else:
        items = [(str(axis), int(size)) for axis, size in dict(mesh).items()]
    axes = [axis for axis, _ in items]
    if not items or len(set(axes)) != len(axes):
        raise TpuExportError(f"--mesh {mesh!r} names an axis twice or none; give each axis once, e.g. data=2,model=4")
    if any(size < 1 for _, size in items):
        raise TpuExportError(f"--mesh {mesh!r} has an axis of size 0; every axis needs at least one device")
    return tuple(items)


def parse_spec(text: str, option: str) -> Spec:
    """Parses a SPEC ("model,None", "data+model", "" for whole)."""
    if not text.strip():
        return ()
    entries: list[DimSharding] = []
    for item in text.split(","):
        item = item.strip()
        if item in ("None", "none", "-"):
            entries.append(None)
            continue
        axes = tuple(axis.strip() for axis in item.split("+"))
        if not all(axis.isidentifier() for axis in axes):
            raise TpuExportError(f"malformed {option} spec {text!r}: each dim is a mesh axis, None, or axes joined "
                                 "with +, e.g. model,None")
        entries.append(axes[0] if len(axes) == 1 else axes)
    return tuple(entries)


def parse_rule(rule: str | tuple, option: str) -> tuple[str, Spec]:
    """Parses one rule: "PATTERN=SPEC", or (pattern, spec) with spec a sequence of None / axis /
    tuple of axes, or a SPEC string.

    Raises:
      TpuExportError: malformed text or a pattern that is not a regular expression.
    """
    if isinstance(rule, str):
        pattern, equals, spec_text = rule.rpartition("=")
        if not equals or not pattern:
            raise TpuExportError(f"malformed {option} {rule!r}: expected PATTERN=SPEC, e.g. {option} 'q_proj=model,None'")
        spec = parse_spec(spec_text, option)
    else:
        pattern, given = rule
        spec = parse_spec(given, option) if isinstance(given, str) else tuple(
            tuple(entry) if isinstance(entry, (list, tuple)) else entry for entry in given)
    try:
        re.compile(pattern)
    except re.error as error:
        raise TpuExportError(f"{option} pattern {pattern!r} is not a regular expression ({error})") from None
    return pattern, spec


def make_request(mesh=None, sharding: str | None = None, rules: Iterable = (), input_rules: Iterable = ()) -> ShardingRequest:
    """Builds a ShardingRequest from the CLI's or the Python API's values.

    Args:
      mesh: "data=2,model=4", {"data": 2, "model": 4} or None.
      sharding: a preset name (PRESETS) or None for "replicated".
      rules: weight rules: "REGEX=SPEC" strings, (regex, spec) pairs, or a {regex: spec} dict.
      input_rules: input rules, in the same forms, keyed by input name.
    Raises:
      TpuExportError: an unknown preset or a malformed mesh or rule.
    """
    preset = sharding or "replicated"
    if preset not in PRESETS:
        raise TpuExportError(f"unknown sharding preset {preset!r}; use one of {', '.join(PRESETS)}")

    def parsed(given, option):
        items = given.items() if isinstance(given, Mapping) else (given or ())
        return tuple(parse_rule(rule, option) for rule in items)

    return ShardingRequest(parse_mesh(mesh), preset, parsed(rules, "--shard"), parsed(input_rules, "--shard-input"))


def plan_sharding(request: ShardingRequest, target: Target, weight_names: Sequence[str], weights: Sequence,
                  signature: ProgramSignature, buckets: Sequence[Bucket], stacked: Sequence[bool],
                  layouts: Mapping[str, tuple[int, ...]] | None = None) -> ShardingPlan:
    """Resolves a request against a slice target and the lowered program.

    Args:
      request: what the user asked for.
      target: a slice target (`target.is_slice`).
      weight_names: the program's state_dict names, in call order.
      weights: the weights' shapes and dtypes (LoweredProgram.weight_specs, or arrays: anything
        with .shape and .dtype), in call order.
      signature: the program's inputs and dims.
      buckets: the sizes that will be compiled (every split input dim must divide at each).
      stacked: per weight, whether it is a scanned run's stack of its blocks' weights (axis 0 the
        block); presets and --shard rules lay out one block's weight, and the stack axis stays
        whole (each device holds its share of every layer).
      layouts: weights stored in another layout than their state_dict tensors (LoweredProgram.
        weight_layouts): a --shard rule's dims, given in the tensor's layout, are permuted to it.
    Returns:
      The ShardingPlan.
    Raises:
      TpuExportError: the mesh's size is not the target's device count; a preset's or rule's mesh
        axis is not in the mesh; a rule matches nothing; a split dim does not divide evenly (naming
        the weight or input, the dim and the sizes); the weights' and inputs' per-device shards
        alone exceed a device's HBM (naming the largest).
    """
    mesh = resolve_mesh(request, target)
    sizes = dict(mesh)
    mesh_text = ",".join(f"{axis}={size}" for axis, size in mesh)
    shapes = [tuple(int(d) for d in w.shape) for w in weights]
    block_shapes = [shape[1:] if is_stacked else shape for shape, is_stacked in zip(shapes, stacked)]
    layouts = layouts or {}
    # Presets read state_dict names with their state_dict shapes, as rules do; their specs are then laid out as stored.
    state_shapes = [_state_dict_shape(shape, layouts.get(name))
                    for name, shape in zip(weight_names, _unpacked_shapes(weight_names, block_shapes, weights))]
    weight_specs, notes = _preset_weight_specs(request.preset, weight_names, state_shapes, sizes)
    weight_specs = [_in_layout(spec, layouts.get(name)) for name, spec in zip(weight_names, weight_specs)]
    weight_specs = _scales_follow_weights(weight_names, block_shapes, weight_specs, sizes, notes)
    input_specs = [_preset_input_spec(request.preset, spec.shape, sizes) for spec in signature.inputs]
    rules = []
    for pattern, spec in request.weight_rules:
        _check_axes(spec, sizes, f"--shard {pattern}", mesh_text)
        matched = [index for index, name in enumerate(weight_names) if re.search(pattern, name)]
        if not matched:
            shown = ", ".join(list(weight_names)[:6]) + (", ..." if len(weight_names) > 6 else "")
            raise TpuExportError(f"--shard pattern {pattern!r} matches no weight; the weights are state_dict names such as {shown}")
        for index in matched:
            fitted = _fit_spec(spec, len(block_shapes[index]), f"weight {weight_names[index]!r}", f"--shard {pattern}")
            weight_specs[index] = _in_layout(fitted, layouts.get(weight_names[index]))
        rules.append(f"{pattern}={_spec_text(spec)}")
    input_names = [spec.name for spec in signature.inputs]
    for name, spec in request.input_rules:
        _check_axes(spec, sizes, f"--shard-input {name}", mesh_text)
        if name not in input_names:
            raise TpuExportError(f"--shard-input names unknown input {name!r}; the inputs are {', '.join(input_names)}")
        index = input_names.index(name)
        input_specs[index] = _fit_spec(spec, len(signature.inputs[index].shape), f"input {name!r}", f"--shard-input {name}")
        rules.append(f"input:{name}={_spec_text(spec)}")
    weight_specs = [(None, *spec) if is_stacked and spec else spec for spec, is_stacked in zip(weight_specs, stacked)]
    for name, shape, spec in zip(weight_names, shapes, weight_specs):
        _check_divisible(f"weight {name!r}", shape, spec, sizes)
    for bucket in buckets:
        for input_spec, spec in zip(signature.inputs, input_specs):
            shape = input_spec.concrete_shape(bucket.as_dict())
            where = f"input {input_spec.name!r}" + (f" at bucket {bucket.name}" if signature.dims else "")
            _check_divisible(where, shape, spec, sizes)
    plan = ShardingPlan(tuple(mesh), request.preset, tuple(zip(weight_names, weight_specs)), tuple(zip(input_names, input_specs)),
                        tuple(rules), tuple(notes))
    for bucket in buckets:
        buffers = per_device_buffers(plan, weight_names, weights, signature, bucket)
        if sum(size for _, size in buffers) > target.hbm_bytes_per_device:
            raise TpuExportError(
                f"plan {plan.describe()} does not fit {target.name}: its weights and inputs alone take "
                f"{sum(size for _, size in buffers):,} bytes per device at bucket {bucket.name}, a device has "
                f"{target.hbm_bytes_per_device:,}; largest per device: {describe_buffers(buffers)}; split more weights "
                "(--sharding tensor-parallel or fsdp, --shard) or use a larger slice")
    return plan


def check_chip_fit(weight_names: Sequence[str], weights: Sequence, signature: ProgramSignature, target: Target,
                   buckets: Sequence[Bucket]) -> None:
    """Refuses a single-chip bucket whose weights and inputs alone exceed the chip's HBM, before
    anything is verified or compiled (a slice's plan is checked the same way by `plan_sharding`;
    the compiler's verdict with temporaries comes after compilation).

    Args:
      weight_names, weights: the weights' names and shapes/dtypes, in call order.
      signature: the program's inputs.
      target: a single chip.
      buckets: the buckets to compile.
    Raises:
      TpuExportError: a bucket's arguments do not fit, naming the largest buffers.
    """
    for bucket in buckets:
        buffers = per_device_buffers(None, weight_names, weights, signature, bucket)
        total = sum(size for _, size in buffers)
        if total > target.hbm_bytes_per_device:
            raise TpuExportError(
                f"does not fit in HBM: {target.name} bucket {bucket.name} needs {total:,} bytes for its weights and inputs alone, "
                f"HBM is {target.hbm_bytes_per_device:,}; largest arguments: {describe_buffers(buffers)}; use smaller buckets "
                "(--bucket), a slice with a sharding plan, or a target with more HBM")


def resolve_mesh(request: ShardingRequest, target: Target) -> tuple[tuple[str, int], ...]:
    """The request's mesh for a slice target (the preset's default mesh when none was given).

    Raises:
      TpuExportError: the mesh's size is not the target's device count, or the preset's axis
        ("model" for tensor-parallel, "data" for data-parallel and fsdp) is not in it.
    """
    mesh = request.mesh or ((MODEL_AXIS if request.preset == "tensor-parallel" else DATA_AXIS, target.devices),)
    sizes = dict(mesh)
    mesh_text = ",".join(f"{axis}={size}" for axis, size in mesh)
    if math.prod(sizes.values()) != target.devices:
        unit = "chips" if target.devices == target.chips else f"devices ({target.chips} chips, two devices each)"
        raise TpuExportError(f"mesh {mesh_text} has {math.prod(sizes.values())} devices but {target.name} has {target.devices} {unit}; "
                             f"give --mesh sizes that multiply to {target.devices}")
    needed = {"tensor-parallel": MODEL_AXIS, "data-parallel": DATA_AXIS, "fsdp": DATA_AXIS}.get(request.preset)
    if needed and needed not in sizes:
        raise TpuExportError(f"--sharding {request.preset} splits over a mesh axis named {needed!r}, which mesh {mesh_text} "
                             f"lacks; name an axis {needed}, e.g. --mesh {needed}={target.devices}")
    return mesh


def _unpacked_shapes(names: Sequence[str], shapes: Sequence[tuple[int, ...]], weights: Sequence) -> list[tuple[int, ...]]:
    """The weights' shapes with weight-only int4 weights (uint8 with a `<name>_scale` sibling, two
    values per byte along the last axis) at their unpacked size, so that presets recognize the
    layers they belong to; the split itself is checked on the packed shape."""
    scaled = {name.removesuffix("_scale") for name in names if name.endswith("_scale")}
    return [shape[:-1] + (shape[-1] * 2,) if name in scaled and np.dtype(weight.dtype) == np.uint8 else shape
            for name, shape, weight in zip(names, shapes, weights)]


def _scales_follow_weights(names: Sequence[str], shapes: Sequence[tuple[int, ...]], specs: list[Spec], sizes: dict[str, int],
                           notes: list[str]) -> list[Spec]:
    """Weight-only scales (`<name>_scale`, the weight's shape with its contraction axis divided by
    the group size) split as their weight is, where their dims divide; else whole (noted)."""
    index = {name: position for position, name in enumerate(names)}
    specs = list(specs)
    for position, name in enumerate(names):
        weight = index.get(name.removesuffix("_scale")) if name.endswith("_scale") else None
        if weight is None or not specs[weight] or len(shapes[position]) != len(shapes[weight]):
            continue
        spec = specs[weight]
        divides = all(shapes[position][axis] % math.prod(sizes[a] for a in spec_axes(entry)) == 0
                      for axis, entry in enumerate(spec) if entry is not None)
        if divides:
            specs[position] = spec
        else:
            specs[position] = ()
            notes.append(f"{name} {list(shapes[position])}: its weight's split {_spec_text(spec)} does not divide it, whole on every device")
    return specs


def _preset_weight_specs(preset: str, names: Sequence[str], shapes: Sequence[tuple[int, ...]],
                         sizes: dict[str, int]) -> tuple[list[Spec], list[str]]:
    specs: list[Spec] = [() for _ in names]
    notes: list[str] = []
    if preset == "fsdp":
        data = sizes[DATA_AXIS]
        for index, shape in enumerate(shapes):
            divisible = [axis for axis, size in enumerate(shape) if size % data == 0 and size >= data]
            if not divisible:
                notes.append(f"{names[index]} {list(shape)}: no dim divisible by {DATA_AXIS}={data}, whole on every device")
                continue
            axis = max(divisible, key=lambda a: (shape[a], -a))
            specs[index] = tuple(DATA_AXIS if a == axis else None for a in range(axis + 1))
    elif preset == "tensor-parallel":
        specs, notes = _tensor_parallel_specs(names, shapes, sizes[MODEL_AXIS])
    return specs, notes


def _tensor_parallel_specs(names: Sequence[str], shapes: Sequence[tuple[int, ...]], model: int) -> tuple[list[Spec], list[str]]:
    specs: list[Spec] = [() for _ in names]
    notes: list[str] = []

    def out_axis(name: str) -> int:
        return 1 if _TRANSPOSED.search(name) else 0

    # Output features of the column-parallel layers, per module (the prefix before the layer's name).
    column_outputs: dict[str, set[int]] = {}
    for name, shape in zip(names, shapes):
        if _COLUMN_PARALLEL.search(name) and _WEIGHT.search(name) and len(shape) == 2:
            column_outputs.setdefault(_module_of(name), set()).add(shape[out_axis(name)])
        elif _EXPERTS_COLUMN_PARALLEL.search(name) and len(shape) == 3:
            # A fused gate_up_proj's outputs are halved (gate times up) before down_proj reads them.
            fused = name.endswith("gate_up_proj")
            column_outputs.setdefault(_module_of(name), set()).add(shape[1] // 2 if fused else shape[1])

    def split(index: int, axis: int) -> None:
        name, shape = names[index], shapes[index]
        if shape[axis] % model:
            notes.append(f"{name} {list(shape)}: dim {axis} ({shape[axis]}) not divisible by {MODEL_AXIS}={model}, whole on every device")
            return
        specs[index] = tuple(MODEL_AXIS if a == axis else None for a in range(axis + 1))

    for index, (name, shape) in enumerate(zip(names, shapes)):
        if _VOCAB_PARALLEL.search(name) and len(shape) in (1, 2):
            split(index, 0)
        elif _COLUMN_PARALLEL.search(name) and len(shape) in (1, 2):
            split(index, out_axis(name) if len(shape) == 2 else 0)
        elif _ROW_PARALLEL.search(name) and len(shape) == 2:
            in_axis = 1 - out_axis(name)
            if shape[in_axis] not in column_outputs.get(_module_of(name), set()):
                notes.append(f"{name} {list(shape)}: no column-parallel layer of its module produces its {shape[in_axis]} "
                             "input features, whole on every device")
                continue
            split(index, in_axis)
        elif _EXPERTS_COLUMN_PARALLEL.search(name) and len(shape) == 3:
            split(index, 1)
        elif _EXPERTS_ROW_PARALLEL.search(name) and len(shape) == 3:
            if shape[2] not in column_outputs.get(_module_of(name), set()):
                notes.append(f"{name} {list(shape)}: no column-parallel expert projection of its module produces its {shape[2]} "
                             "input features, whole on every device")
                continue
            split(index, 2)
    if not any(specs):
        raise TpuExportError(
            "--sharding tensor-parallel found no attention or MLP projections to split (state_dict names ending in "
            "q_proj/k_proj/v_proj/o_proj, gate_proj/up_proj/down_proj, query/key/value, fc1/fc2, c_attn/c_fc/c_proj, ...); "
            "give explicit --shard rules")
    return specs, notes


def _module_of(name: str) -> str:
    """The module a layer belongs to: "layers.0" for "layers.0.self_attn.q_proj.weight"."""
    parts = name.split(".")
    return ".".join(parts[:-3])


def _preset_input_spec(preset: str, shape: tuple, sizes: dict[str, int]) -> Spec:
    batch_split = preset in ("data-parallel", "fsdp") or (preset == "tensor-parallel" and DATA_AXIS in sizes)
    return (DATA_AXIS,) if batch_split and shape and DATA_AXIS in sizes else ()


def _check_axes(spec: Spec, sizes: dict[str, int], option: str, mesh_text: str) -> None:
    used = [axis for entry in spec for axis in spec_axes(entry)]
    unknown = [axis for axis in used if axis not in sizes]
    if unknown:
        raise TpuExportError(f"{option} uses mesh axis {unknown[0]!r}, which mesh {mesh_text} lacks; "
                             f"use one of {', '.join(sizes)} or None")
    if len(set(used)) != len(used):
        raise TpuExportError(f"{option} uses a mesh axis twice; each axis may split one dim only")


def _fit_spec(spec: Spec, rank: int, what: str, option: str) -> Spec:
    if len(spec) > rank:
        raise TpuExportError(f"{option} gives {len(spec)} dims but {what} has rank {rank}")
    return spec


def _state_dict_shape(stored: tuple[int, ...], layout: tuple[int, ...] | None) -> tuple[int, ...]:
    """A stored array's shape as its state_dict tensor's (`layout`: the tensor's axes in stored order)."""
    if layout is None:
        return stored
    shape = [0] * len(stored)
    for size, axis in zip(stored, layout):
        shape[axis] = size
    return tuple(shape)


def _in_layout(spec: Spec, layout: tuple[int, ...] | None) -> Spec:
    """A spec over a state_dict tensor's dims as a spec over its stored array's (`layout`: the
    tensor's axes in stored order), trailing whole dims left out."""
    if layout is None:
        return spec
    full = (*spec, *(None,) * (len(layout) - len(spec)))
    permuted = [full[axis] for axis in layout]
    while permuted and permuted[-1] is None:
        permuted.pop()
    return tuple(permuted)


def _check_divisible(what: str, shape: tuple[int, ...], spec: Spec, sizes: dict[str, int]) -> None:
    for axis, entry in enumerate(spec):
        parts = math.prod(sizes[a] for a in spec_axes(entry))
        if shape[axis] % parts:
            axes = "x".join(f"{a}={sizes[a]}" for a in spec_axes(entry))
            raise TpuExportError(f"{what} dim {axis} has size {shape[axis]}, not divisible by mesh axis {axes} ({parts} parts); "
                                 "choose another mesh, bucket or rule")


def shard_shape(shape: Sequence[int], spec: Spec, sizes: dict[str, int]) -> tuple[int, ...]:
    """The shape of one device's piece of an array laid out by `spec`."""
    parts = [math.prod(sizes[a] for a in spec_axes(spec[axis])) if axis < len(spec) else 1 for axis in range(len(shape))]
    return tuple(size // part for size, part in zip(shape, parts))


def per_device_buffers(plan: ShardingPlan | None, weight_names: Sequence[str], weights: Sequence,
                       signature: ProgramSignature, bucket: Bucket) -> list[tuple[str, int]]:
    """Bytes of every weight and input one device holds at a bucket, largest first.

    Args:
      plan: the plan, or None for a single chip (everything whole).
      weight_names: the weights' state_dict names, in call order.
      weights: the weights' shapes and dtypes (ShapeDtypeStructs or arrays), in call order.
      signature: the program's inputs.
      bucket: the dim sizes.
    Returns:
      [(description, bytes)], e.g. ("weight lm_head.weight bf16[16032,2048]", 65667072).
    """
    sizes = dict(plan.mesh) if plan else {}
    weight_specs = [spec for _, spec in plan.weights] if plan else [()] * len(weights)
    input_specs = [spec for _, spec in plan.inputs] if plan else [()] * len(signature.inputs)
    buffers = []
    for name, weight, spec in zip(weight_names, weights, weight_specs):
        buffers.append(_buffer(f"weight {name}", tuple(weight.shape), np.dtype(weight.dtype).name, spec, sizes))
    for input_spec, spec in zip(signature.inputs, input_specs):
        shape = tuple(d if isinstance(d, int) else evaluate_dim(d, bucket.as_dict()) for d in input_spec.shape)
        buffers.append(_buffer(f"input {input_spec.name}", shape, input_spec.dtype, spec, sizes))
    return sorted(buffers, key=lambda item: -item[1])


_HLO_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64", "int8": "s8", "int16": "s16",
              "int32": "s32", "int64": "s64", "uint8": "u8", "uint32": "u32", "bool": "pred"}


def _buffer(label: str, shape: tuple[int, ...], dtype: str, spec: Spec, sizes: dict[str, int]) -> tuple[str, int]:
    piece = shard_shape(shape, spec, sizes)
    element = _HLO_TYPES.get(dtype, dtype)
    return f"{label} {element}[{','.join(map(str, piece))}]", int(math.prod(piece) * element_bytes(element))


def describe_buffers(buffers: Sequence[tuple[str, int]], count: int = 3) -> str:
    """The largest buffers as "weight lm_head.weight bf16[16032,2048] 62.6 MiB, ..."."""
    return ", ".join(f"{label} {size / 2**20:.1f} MiB" for label, size in buffers[:count])


def _spec_text(spec: Spec) -> str:
    return ",".join("None" if entry is None else "+".join(spec_axes(entry)) for entry in spec)
