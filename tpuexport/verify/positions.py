"""The model's position tables verified at the largest sizes the artifact accepts.

A rotary table in the wrong dtype (an `inv_freq` rounded to bfloat16: 0.89 rad of angle error at
position 2047) barely moves a small model's logits, and the full model at its longest sequence is
beyond verification's budget for anything large (Llama-3.2-1B at 1 x 8192: 2e13 FLOPs). The values
that depend on positions alone are cheap at any length, though: every value the program computes
from its weights and the dims' sizes only, not from an input's values (rotary cos/sin, position
embeddings, a learned position table's rows). This module finds those tables where they enter the
rest of the model (tables with one dim-sized axis: a (seq, seq) mask grows as the square and is left
to the end-to-end cases), builds the subgraph that computes them, and runs it at every dim's largest size
(an unbounded dim: 4 x its example), lowered with the artifact's own weights and precision, against
the same subgraph run by PyTorch with the model's own tensors. Both runs (TPU-faithful, plain f32)
are compared under the conversion's tolerances, as a case labelled "positions".
"""

from __future__ import annotations

import math

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpuexport.arrays import to_numpy
from tpuexport.lower import LoweredProgram, in_state_layout
from tpuexport.lower.lowering import _TracingInterpreter, module_path
from tpuexport.lower.matmul_precision import MATMUL_PRECISIONS, pin_matmul_precision
from tpuexport.lower.quantized_weights import QuantizedArray
from tpuexport.lower.mixed_precision import input_compute_dtype
from tpuexport.verify.compare import compare_output
from tpuexport.verify.conformance import UNINITIALIZED
from tpuexport.verify.report import VerificationCase
from tpuexport.verify.tolerances import VerificationTolerances
from tpuexport.verify.tpu_numerics import tpu_faithful

LABEL = "positions"
# The inputs this case makes at the largest sizes stay below this (about 1 GiB in f32).
MAX_POSITION_INPUT_ELEMENTS = 1 << 28
_USER_INPUT = torch.export.graph_signature.InputKind.USER_INPUT


def position_tables(program: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    """The floating values computed from weights and sizes alone, where other values first use them.

    Args:
      program: the decomposed program (LoweredProgram.graph).
    Returns:
      The table nodes with exactly one axis sized by a dim, in graph order.
    """
    user_inputs = {spec.arg.name for spec in program.graph_signature.input_specs if spec.kind == _USER_INPUT}
    size_only: dict[torch.fx.Node, bool] = {}
    for node in program.graph.nodes:
        if node.op == "placeholder":
            size_only[node] = node.name not in user_inputs
        elif node.op == "call_function" and getattr(node.target, "overloadpacket", None) in UNINITIALIZED:
            # Memory a later op writes (DeepSeek-V3's keys: `new_empty`, then its halves copied in): its
            # values are whatever the allocator left, so neither it nor what reads it is a table.
            size_only[node] = False
        elif node.op == "call_function":
            size_only[node] = node.target is torch.ops.aten.sym_size.int or all(size_only.get(n, False) for n in node.all_input_nodes)
        else:
            size_only[node] = False
    tables = []
    for node, only_sizes in size_only.items():
        value = node.meta.get("val")
        if (node.op == "call_function" and only_sizes and isinstance(value, torch.Tensor) and value.dtype.is_floating_point
                and sum(isinstance(size, torch.SymInt) for size in value.shape) == 1
                and any(not size_only.get(user, False) for user in node.users)):
            tables.append(node)
    return tables


def _subgraph(program: torch.export.ExportedProgram, tables: Sequence[torch.fx.Node]) -> tuple[torch.fx.GraphModule, list[str]]:
    """A GraphModule computing `tables` from the placeholders they need (in the program's order).

    Returns:
      (module, names of its placeholders).
    """
    needed, pending = set(), list(tables)
    while pending:
        node = pending.pop()
        if node not in needed:
            needed.add(node)
            pending.extend(node.all_input_nodes)
    graph, copied = torch.fx.Graph(), {}
    for node in program.graph.nodes:
        if node in needed:
            copied[node] = graph.node_copy(node, lambda argument: copied[argument])
    graph.output(tuple(copied[table] for table in tables))
    placeholders = [node.name for node in program.graph.nodes if node in needed and node.op == "placeholder"]
    return torch.fx.GraphModule(program.graph_module, graph), placeholders


def _input_elements(signature, sizes: dict[str, int]) -> int:
    return sum(math.prod(spec.concrete_shape(sizes)) for spec in signature.inputs)


def verify_positions(lowered: LoweredProgram, example_inputs: Sequence[torch.Tensor], tolerances: VerificationTolerances,
                     make_inputs) -> VerificationCase | None:
    """Runs the position tables at every dim's largest size, lowered and in PyTorch, and compares them.

    Args:
      lowered: the lowered program (with `graph` and weights).
      example_inputs: the example inputs (new inputs follow them; only their shapes matter here).
      tolerances: the conversion's tolerances of both runs.
      make_inputs: verification.make_inputs (inputs at given sizes).
    Returns:
      The "positions" case, or None when the program has no dims, no position tables, tables
      whose weights are not in memory (a checkpoint's program), or a table subgraph that PyTorch or
      the lowering cannot run on its own (the end-to-end cases still cover it).
    """
    program, signature = lowered.graph, lowered.signature
    if program is None or not signature.dims:
        return None
    sizes = {d.name: d.max if d.max is not None else max(4 * d.example, d.min) for d in signature.dims}
    batch = signature.batch_dim()
    if batch is not None and _input_elements(signature, sizes) > MAX_POSITION_INPUT_ELEMENTS:
        sizes[batch] = signature.dim(batch).min  # positions are the same in every row; memory is not
    if _input_elements(signature, sizes) > MAX_POSITION_INPUT_ELEMENTS:
        return None
    specs = {spec.arg.name: spec for spec in program.graph_signature.input_specs}
    state = {**program.state_dict, **program.constants}
    tables = position_tables(program)
    if not tables or any(state[specs[node.name].target].is_meta for table in tables for node in _placeholders_of(table)
                         if specs[node.name].kind != _USER_INPUT):
        return None
    inputs = dict(zip((spec.arg.name for spec in program.graph_signature.input_specs if spec.kind == _USER_INPUT),
                      make_inputs(signature.inputs, example_inputs, sizes, seed=0)))
    module, placeholders = _subgraph(program, tables)
    try:
        with torch.no_grad():
            expected = [_float_numpy(value) for value in
                        module(*(inputs[name] if name in inputs else _reference_weight(lowered, state, specs[name].target)
                                 for name in placeholders))]
        actual = _lowered_tables(lowered, module, placeholders, inputs, specs)
    except Exception:  # a subgraph cut out of its model may need what the cut left out; the full cases cover it
        return None
    names = [f"{table.name} ({module_path(table) or '<root>'})" for table in tables]
    runs = {run: tuple(compare_output(name, _float_numpy(value), wanted, getattr(tolerances, run))
                       for name, value, wanted in zip(names, actual[run], expected))
            for run in ("tpu", "cpu")}
    return VerificationCase(LABEL, sizes, runs, reason="position tables at the largest sizes")


def _lowered_tables(lowered: LoweredProgram, module: torch.fx.GraphModule, placeholders: list[str], inputs: dict, specs: dict) -> dict:
    """The tables computed by the lowering of `module` with the artifact's weights and precision:
    {"cpu": plain XLA:CPU, "tpu": TPU-faithful}, each a list of arrays."""
    arguments = [jnp.asarray(to_numpy(inputs[name])) if name in inputs else artifact_weight(lowered, specs[name].target)
                 for name in placeholders]
    compute_dtype = input_compute_dtype(lowered.precision)

    def tables_fn(arguments):
        arguments = [argument.astype(compute_dtype) if name in inputs and compute_dtype is not None
                     and jnp.issubdtype(argument.dtype, jnp.floating) else argument
                     for name, argument in zip(placeholders, arguments)]
        return list(_TracingInterpreter(module, lowered.precision).run(*arguments))

    exported = jax.export.export(jax.jit(tables_fn), platforms=("cpu",))([jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arguments])
    exported = pin_matmul_precision(exported, MATMUL_PRECISIONS[lowered.matmul_precision])
    tpu = tpu_faithful(exported, MATMUL_PRECISIONS[lowered.matmul_precision])
    return {"cpu": jax.jit(exported.call)(arguments), "tpu": jax.jit(tpu.call)(arguments)}


def _placeholders_of(table: torch.fx.Node) -> set[torch.fx.Node]:
    found, pending, seen = set(), [table], set()
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            found.add(node)
        pending.extend(node.all_input_nodes)
    return found


def artifact_weight(lowered: LoweredProgram, state_name: str) -> np.ndarray:
    """One weight as the artifact's program computes with it, by state name, in the state_dict
    tensor's layout: a scanned block's from its stack, a tied one from the weight it is, a
    weight-only one dequantized (its integers times its scales)."""
    state_name = lowered.tied.get(state_name, state_name)
    for name, array in zip(lowered.weight_names, lowered.weights):
        parts = lowered.weight_parts[name]
        if state_name in parts:
            if name in lowered.quantized:
                array = _dequantized(lowered, name, array)
            return in_state_layout(array[parts.index(state_name)] if len(parts) > 1 else array, lowered.weight_layouts.get(name))
    raise KeyError(state_name)


def _dequantized(lowered: LoweredProgram, name: str, values) -> np.ndarray:
    entry = lowered.quantized[name]
    scale = lowered.weights[lowered.weight_names.index(entry["scale"])]
    dtype = jnp.bfloat16 if lowered.resolved_precision == "bf16" else jnp.float32
    return np.asarray(QuantizedArray(jnp.asarray(values), jnp.asarray(scale), entry["bits"], entry["axis"], dtype).dequantized())


def _reference_weight(lowered: LoweredProgram, state: dict, state_name: str) -> torch.Tensor:
    """A weight for PyTorch's run of the tables: the model's own, or for a weight-only weight what
    the program computes with (its dequantized values: the tables are compared with the weights the
    artifact holds, as the other cases compare with the dequantized model)."""
    tensor = state[state_name]
    stored = lowered.tied.get(state_name, state_name)
    if not any(stored in lowered.weight_parts[name] for name in lowered.quantized):
        return tensor
    return torch.from_numpy(np.asarray(artifact_weight(lowered, state_name), np.float32)).to(tensor.dtype)


def _float_numpy(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().float().numpy()
    return np.asarray(value).astype(np.float32)
