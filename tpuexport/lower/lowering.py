"""Lowering: a CapturedModel becomes a `jax.export.Exported` for CPU and TPU, plus its weights.

Passes, in order:
  reshape_views      views that torch's decompositions could not stride become reshapes
  decompose          torch's core ATen decompositions (custom operators through their
                     definitions), then torchax's own; scaled_dot_product_attention is kept
                     whole and lowered by attention.py
  expand_convolution_arguments  one stride/padding/dilation per spatial dim
  fold_constant_assertions  runtime assertions on the program's constants (torch.distributions'
                     parameter checks) evaluated once and dropped (assertions.py)
  check_operators    every operator without a lowering, reported at once with user source lines
  unmerge_batched_matmuls  bmm over merged (batch, heads) dims back to one matmul over both, so
                     that sharding propagation sees them (after the FLOPs are counted on the bmm)
                     (linear layers' mm/addmm over merged [batch * seq, in] views are traced as a
                     dot over the unmerged tensor: graph_passes.merged_matmul_operand)
  sink_attention_masks  each attention's [q, k] mask recomputed next to it from its per-query and
                     per-key parts, so that XLA fuses it with the softmax (graph_passes.py)
  group_repeated_kv  attention gets the key/value heads its model repeated to the query heads, with
                     enable_gqa (the lowering groups query heads; graph_passes.py)
  collect_weights    parameters, buffers and constants in the program's placeholder order (for a
                     plan, collect_weight_specs: their shapes and dtypes only, nothing read)
  transposed_weights  mixture-of-experts weights that only grouped matmuls read transposed are
                     stored transposed, as the TPU's grouped matmul reads them (weight_layouts.py)
  find_runs          runs of identical blocks (a model's layers), their weights stacked (scan.py)
  trace_and_export   torchax's interpreter traced by jax.export with one-scope symbolic dims, each
                     run of blocks as one jax.lax.scan
  pin_precision      the matmul precision written on every dot and convolution, HIGHEST on those
                     that feed a top-k, sort or argmax (matmul_precision.py)
and, beside the program, its matmul FLOPs as a polynomial in the dims (cost.py).
With a weight-only scheme (quantize/weight_only.py), the chosen weights become integer and scale
arguments after collect_weights (their arrays quantized here; in a conversion, by the weights pass) and
the traced ops read them as integers (quantized_weights.py).
"""

from __future__ import annotations

import collections.abc
import contextlib
import copy
import dataclasses
import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpuexport.arrays import to_numpy
from tpuexport.errors import TpuExportError, UnsupportedOperatorsError
from tpuexport.export.guards import narrowed_range
from tpuexport.lower.assertions import fold_constant_assertions
from tpuexport.lower.cost import matmul_flops_expression
from tpuexport.lower.custom_ops import custom_operator_decompositions
from tpuexport.lower.lowered import LoweredProgram
from tpuexport.lower.graph_passes import (expand_convolution_arguments, group_repeated_kv, index_masks_at_known_counts, merged_matmul_operand,
                                          reads_heads_last, reshape_views, sink_attention_masks, unmerge_batched_matmuls)
from tpuexport.lower.matmul_precision import DECISION_SCOPE, MATMUL_PRECISIONS, decision_matmuls, pin_matmul_precision
from tpuexport.lower.mixed_precision import (PRECISIONS, cast_arguments, cast_result, input_compute_dtype, is_quantization_op,
                                             kept_f32_meetings, stored_dtype, stored_weight)
from tpuexport.lower.registry import own_lowering
from tpuexport.lower.scan import ScannedRun, find_runs, run_scan, stack_weights
from tpuexport.lower.op_support import find_unsupported
from tpuexport.source_lines import user_source
from tpuexport.lower.quantized_weights import QuantizedArray, call_with_quantized, dequantize_all, holds_quantized
from tpuexport.lower.shapes import symbolic_input_avals
from tpuexport.lower.torchax_import import import_torchax
from tpuexport.lower.weight_layouts import SWAPPED, TransposedWeight, call_with_transposed, in_stored_layout, transposed_weights
from tpuexport.signature import ProgramSignature, artifact_dtype

PLATFORMS = ("cpu", "tpu")


def lower(
    program: torch.export.ExportedProgram, signature: ProgramSignature, precision: str = "auto", matmul_precision: str = "default",
    scan: bool = True,
    weights: bool = True,
    weight_only=None,
    keep_f32: frozenset[str] = frozenset(),
) -> LoweredProgram:
    """Lowers an exported program to StableHLO through torchax's op library.

    Args:
      program: the torch.export program (eval mode).
      signature: its named signature (from the export stage).
      precision: "auto" (the model's own dtypes), "f32", "bf16" (weights and compute in bfloat16,
        but for state kept in f32) or "bf16-mixed" (autocast-like); see mixed_precision.py.
        Outputs in the model's dtypes either way.
      matmul_precision: the TPU arithmetic of dots and convolutions, pinned in the program
        ("default", "high" or "highest").
      scan: lower runs of identical blocks (a model's layers) as one jax.lax.scan each, their
        weights stacked (scan.py); False lowers every block on its own.
      weights: False lowers from the weights' shapes and dtypes alone (a plan: no weight is read,
        so the program's weights may be on the meta device); the result has `weights` None.
      weight_only: a quantize.weight_only.WeightOnlyScheme, or None: its chosen weights become
        integer and scale arguments (quantized here when `weights`).
      keep_f32: state_dict names of weights the model keeps in f32 on purpose beyond its
        non-persistent f32 buffers (a Hugging Face model's `_keep_in_fp32_modules`; export stage).
    Returns:
      The LoweredProgram.
    Raises:
      UnsupportedOperatorsError: operators with no lowering (all listed).
      TpuExportError: decomposition or tracing failed, an unknown precision, or a group size that
        does not divide a quantized weight.
    """
    if precision not in PRECISIONS:
        raise TpuExportError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    if matmul_precision not in MATMUL_PRECISIONS:
        raise TpuExportError(f"unknown matmul precision {matmul_precision!r}; use one of {', '.join(MATMUL_PRECISIONS)}")
    decomposed = fold_constant_assertions(index_masks_at_known_counts(expand_convolution_arguments(decompose(reshape_views(program)))))
    check_operators(decomposed)
    # torch's FLOP counter knows bmm, not the matmul the next pass makes of it.
    flops = matmul_flops_expression(decomposed, signature)
    decomposed = group_repeated_kv(sink_attention_masks(unmerge_batched_matmuls(decomposed)))
    lowered = lower_decomposed(decomposed, signature, precision, matmul_precision, scan, weights, weight_only, keep_f32)
    return dataclasses.replace(lowered, matmul_flops=flops)


def lower_decomposed(decomposed: torch.export.ExportedProgram, signature: ProgramSignature, precision: str, matmul_precision: str,
                     scan: bool, weights: bool, weight_only, keep_f32: frozenset[str], input_avals: list | None = None,
                     platforms: tuple[str, ...] = PLATFORMS) -> LoweredProgram:
    """The passes of `lower` from find_runs on, over a program already decomposed and rewritten.

    Args:
      decomposed: the program after sink_attention_masks (or a copy rewritten further, such as a
        bucket's kernel graph, lower/kernels.py).
      signature, precision, matmul_precision, scan, weights, weight_only, keep_f32: as for `lower`.
      input_avals: the inputs' shapes and dtypes, or None for the signature's symbolic dims.
      platforms: what the program is exported for.
    Returns:
      The LoweredProgram (matmul_flops left empty; `lower` sets it), remembering these options
      (`lowering_options`) so that a bucket can be lowered again at its static shapes.
    """
    runs = find_runs(decomposed) if scan else ()
    tied = tied_weights(decomposed, runs)
    transposed = transposed_weights(decomposed, tied)
    if weights:
        names, arrays = collect_weights(decomposed, precision, keep_f32)
    else:
        names, arrays = collect_weight_specs(decomposed, precision, keep_f32)
    arrays = tuple(in_stored_layout(array, SWAPPED if name in transposed else None) for name, array in zip(names, arrays))
    kept = [index for index, name in enumerate(names) if name not in tied]
    stacked_names, stacked = stack_weights(tuple(names[index] for index in kept), tuple(arrays[index] for index in kept), runs)
    originals = {weight.name: weight.originals for run in runs for weight in run.weights}
    layouts = {name: SWAPPED for name in stacked_names if originals.get(name, (name,))[0] in transposed}
    quantized = {}
    if weight_only is not None:
        stacked_names, stacked, quantized = _quantize_weights(decomposed, weight_only, tied, runs, stacked_names, stacked, weights,
                                                              layouts)
        layouts.update({entry["scale"]: layouts[name] for name, (entry, _) in quantized.items() if name in layouts})
    specs = tuple(jax.ShapeDtypeStruct(array.shape, array.dtype) for array in stacked)
    kept = frozenset(_kept_placeholders(decomposed, keep_f32)) if precision == "bf16" else frozenset()
    decisions = decision_matmuls(decomposed.graph)
    exported, before_scan = trace_and_export(decomposed, signature, names, stacked_names, specs, precision, runs, tied,
                                             kept_f32_meetings(decomposed.graph, kept), frozenset(decisions), quantized,
                                             input_avals, platforms, layouts)
    pinned_ops: set[str] = set()
    exported = pin_matmul_precision(exported, MATMUL_PRECISIONS[matmul_precision], pinned_ops)
    pinned = tuple({"op": node.name, "module": module_path(node), "feeds": feeds, "precision": "highest"}
                   for node, feeds in decisions.items() if node.name in pinned_ops)
    options = {"scan": scan, "weight_only": weight_only, "keep_f32": keep_f32}
    return LoweredProgram(exported, stacked_names, stacked if weights else None, signature, precision, matmul_precision, "",
                          decomposed, tuple(run.to_json(before_scan[run.last_op]) for run in runs), tied, pinned,
                          {name: entry for name, (entry, _) in quantized.items()}, layouts, options)




def _quantize_weights(program, scheme, tied, runs, names, arrays, with_arrays: bool, layouts: dict[str, tuple[int, ...]]):
    """The program's weights with the scheme's chosen ones as integers, each followed by its scales.

    Args:
      program: the decomposed program.
      scheme: the WeightOnlyScheme.
      tied: the tied weights; runs: the scanned runs.
      names, arrays: the weights in call order (stacked), arrays or (for `with_arrays` False)
        ShapeDtypeStructs.
      with_arrays: whether `arrays` are arrays to quantize.
      layouts: the weights stored transposed (weight_layouts.py): quantized in that layout, along
        the contraction axis as stored.
    Returns:
      (names, arrays or specs, {weight name: (manifest entry, the float dtype it computes in)}).
    """
    from tpuexport.quantize import weight_only  # torch only; loaded for weight-only conversions

    chosen = weight_only.quantizable_weights(program, scheme, tied)
    originals = {weight.name: weight.originals for run in runs for weight in run.weights}
    new_names, new_arrays, quantized = [], [], {}
    for name, array in zip(names, arrays):
        axes = {chosen.get(original) for original in originals.get(name, (name,))}
        axis = axes.pop() if len(axes) == 1 else None
        if axis is not None and name in layouts:
            axis = {-1: -2, -2: -1}[axis]  # the last two axes are stored swapped
        if axis is None:
            new_names.append(name)
            new_arrays.append(array)
            continue
        scale_name = f"{name}_scale"
        block_shape = tuple(array.shape[1:] if name in originals else array.shape)
        stored = weight_only.scheme_for(scheme, block_shape, axis)
        if with_arrays:
            values, scale = weight_only.stored_tensors(torch.from_numpy(np.asarray(array, np.float32)), stored, axis)
            new_arrays += [values.numpy(), to_numpy(scale)]
        else:
            new_arrays += list(quantized_specs(array.shape, stored, axis))
        new_names += [name, scale_name]
        entry = {"mode": stored.mode, "bits": stored.bits, "axis": axis if isinstance(axis, int) else list(axis),
                 "group_size": stored.group(weight_only.contraction_size(block_shape, axis)), "scale": scale_name}
        if not isinstance(axis, int):
            entry["kernel_shape"] = list(block_shape)  # stored as its [out, in/groups x kernel] matrix
        reason = weight_only.int8_reason(scheme, block_shape, axis)
        if reason:
            entry["reason"] = reason
        quantized[name] = (entry, jnp.dtype(array.dtype))
    return tuple(new_names), tuple(new_arrays), quantized


def quantized_specs(shape: tuple[int, ...], scheme, axis) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """The integer and scale arguments' shapes and dtypes of a weight of `shape` (quantize/weight_only.py's storage)."""
    from tpuexport.quantize.weight_only import matrix_shape  # torch only; loaded for weight-only conversions

    shape, axis = matrix_shape(shape, axis)
    values_shape = (*shape[:-1], shape[-1] // 2) if scheme.bits == 4 else tuple(shape)
    scale_shape = list(shape)
    scale_shape[axis] //= scheme.group(shape[axis])
    return (jax.ShapeDtypeStruct(values_shape, jnp.uint8 if scheme.bits == 4 else jnp.int8),
            jax.ShapeDtypeStruct(tuple(scale_shape), jnp.bfloat16))


def module_path(node: torch.fx.Node) -> str:
    """The dotted path of the module an op comes from ("" for the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def tied_weights(program: torch.export.ExportedProgram, runs: tuple[ScannedRun, ...] = ()) -> dict[str, str]:
    """Placeholders whose tensor is an earlier placeholder's (tied weights: torch.export lifts a
    module's shared parameter once per name), {name: the earlier name}. Weights of scanned runs
    are left alone (each block's stack holds its own)."""
    in_runs = {original for run in runs for weight in run.weights for original in weight.originals}
    first_name: dict[int, str] = {}
    tied = {}
    for name, tensor, _ in _weight_tensors(program):
        if name in in_runs:
            continue
        if id(tensor) in first_name:
            tied[name] = first_name[id(tensor)]
        else:
            first_name[id(tensor)] = name
    return tied


# Decompositions of programs that hold no weights, by program object: the sample entry point's program
# is one object per vocabulary size in a process (export/sampling.py sample_program), and decomposing it
# (retracing torch.cond's branches) takes about a second in every text-generation conversion; a copy of
# the kept one takes 0.02 s. Each caller gets its own copy: some passes after decomposition rewrite the
# program in place (graph_passes.py).
_DECOMPOSED_WITHOUT_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decompose(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Runs torch's default decompositions, with library custom operators decomposed through what
    defines them (lower/custom_ops.py), and torchax's extra ones (`_torchax_extra_decompositions`);
    once per program object for a program holding no weights.

    Raises:
      TpuExportError: decomposition failed; when it is a custom operator's decomposition that fails
        (the rest decompose without it), the message names the operator.
    """
    if program.state_dict or program.constants:
        return _decompose(program)
    if program not in _DECOMPOSED_WITHOUT_WEIGHTS:
        _DECOMPOSED_WITHOUT_WEIGHTS[program] = _decompose(program)
    return copy.deepcopy(_DECOMPOSED_WITHOUT_WEIGHTS[program])


def _decompose(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    custom = custom_operator_decompositions(program)

    def decomposed(extra: dict) -> torch.export.ExportedProgram:
        table = torch.export.default_decompositions()
        # Kept whole: lowered as attention is written in JAX (attention.py), not as torch's math.
        del table[torch.ops.aten.scaled_dot_product_attention.default]
        table.update(extra)
        table.update(_torchax_extra_decompositions())
        return program.run_decompositions(table)

    try:
        return decomposed(custom)
    except Exception as error:  # torch's decomposition passes raise many kinds
        message = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    untraceable = []
    if custom and _succeeds(lambda: decomposed({})):
        untraceable = [operator._name for operator, decomposition in custom.items()
                       if not _succeeds(lambda: decomposed({operator: decomposition}))]
    if untraceable:
        raise TpuExportError(
            f"custom operator(s) {', '.join(untraceable)} could not be traced through their Python implementation "
            f"({message}); register a decomposition without data-dependent Python (.tolist(), .item(), branches on "
            "tensor values) with torch._decomp.register_decomposition") from None
    raise TpuExportError(f"torch could not decompose the program ({message}); simplify the failing op") from None


@functools.cache
def _torchax_extra_decompositions() -> dict:
    """torchax's decompositions of the ops torch's default table does not have, to run in the same
    pass as torch's.

    torchax's exporter runs its table as a second pass after torch's. One pass with this part of it
    gives the same program (decompositions apply again to the ops they emit) at half the cost: each
    pass retraces the whole program. The ops torch's table has stay torch's: the first pass
    decomposed them, so torchax's versions (a few, such as std, differ) never ran.
    """
    default = torch.export.default_decompositions()
    return {operator: decomposition for operator, decomposition in import_torchax().decompositions.DECOMPOSITIONS.items()
            if operator not in default}


def _succeeds(attempt) -> bool:
    try:
        attempt()
    except Exception:  # any failure answers the question
        return False
    return True


def check_operators(program: torch.export.ExportedProgram) -> None:
    """Raises UnsupportedOperatorsError listing every operator without a lowering."""
    unsupported = find_unsupported(program.graph_module)
    if unsupported:
        raise UnsupportedOperatorsError(unsupported)


def collect_weights(program: torch.export.ExportedProgram, precision: str,
                    keep_f32: frozenset[str] = frozenset()) -> tuple[tuple[str, ...], tuple[np.ndarray, ...]]:
    """Parameters, buffers and lifted constants in placeholder order, as numpy arrays.

    Args:
      program: the decomposed program.
      precision: one of PRECISIONS.
      keep_f32: names of weights the model keeps in f32 beyond its non-persistent f32 buffers.
    Returns:
      (names, arrays), stored in the precision's dtypes (mixed_precision.stored_weight). 64-bit
      weights become 32-bit (JAX runs with 32-bit defaults, like the TPU).
    """
    state = StoredState(program, precision, keep_f32)
    return tuple(state), tuple(state[name] for name in state)


def stored_state(lowered: LoweredProgram) -> "StoredState":
    """The weights of the torch program `lowered` traced, by state name, as it stores them (read when
    asked for): what the weights pass writes into the artifact for a model held in memory."""
    if lowered.graph is None:
        raise TpuExportError("this program was read back from an artifact: its weights are the artifact's")
    return StoredState(lowered.graph, lowered.precision, lowered.lowering_options.get("keep_f32", frozenset()))


class StoredState(collections.abc.Mapping):
    """A program's weights by state name, in placeholder order, each read from its tensor when asked
    for and stored in the precision's dtype (mixed_precision.stored_weight): a view of the tensor's
    memory where that is its own dtype, so the weights pass (pipeline.py) writes a model held in
    memory into the artifact one weight at a time, as it streams a checkpoint, without a copy of it.

    Args:
      program: the decomposed program (its state_dict and constants hold the tensors).
      precision: one of PRECISIONS; keep_f32: as for `collect_weights`.
    """

    def __init__(self, program: torch.export.ExportedProgram, precision: str, keep_f32: frozenset[str] = frozenset()):
        kept = _kept_placeholders(program, keep_f32).values()
        self._tensors = {name: (tensor, quantization_input or name in kept) for name, tensor, quantization_input in _weight_tensors(program)}
        self._precision = precision

    def __getitem__(self, name: str) -> np.ndarray:
        tensor, kept = self._tensors[name]
        return stored_weight(_to_numpy(tensor.detach()), self._precision, kept)

    def tensor(self, name: str) -> torch.Tensor:
        """The weight's tensor as the program holds it (before any cast)."""
        return self._tensors[name][0]

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _kept_placeholders(program: torch.export.ExportedProgram, keep_f32: frozenset[str]) -> dict[str, str]:
    """The weights the model keeps in f32 on purpose (mixed_precision's rule): {placeholder node
    name: state name} of its non-persistent f32 buffers and of the weights named in `keep_f32`."""
    kept = {}
    for spec in program.graph_signature.input_specs:
        if spec.kind not in (torch.export.graph_signature.InputKind.BUFFER, torch.export.graph_signature.InputKind.PARAMETER):
            continue
        tensor = program.state_dict.get(spec.target, program.constants.get(spec.target))
        non_persistent = spec.kind == torch.export.graph_signature.InputKind.BUFFER and spec.persistent is False
        if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 and (non_persistent or spec.target in keep_f32):
            kept[spec.arg.name] = spec.target
    return kept


def collect_weight_specs(program: torch.export.ExportedProgram, precision: str,
                         keep_f32: frozenset[str] = frozenset()) -> tuple[tuple[str, ...], tuple[jax.ShapeDtypeStruct, ...]]:
    """What `collect_weights` would return, as shapes and dtypes only: no tensor is read, so the
    weights may be on the meta device (a plan of a model larger than this machine's memory).

    Returns:
      (names, ShapeDtypeStructs), in the dtypes `collect_weights` would store.
    """
    kept = _kept_placeholders(program, keep_f32)
    names, specs = [], []
    for name, tensor, quantization_input in _weight_tensors(program):
        exported_dtype = jnp.dtype(artifact_dtype(str(tensor.dtype).removeprefix("torch.")))
        names.append(name)
        specs.append(jax.ShapeDtypeStruct(tuple(tensor.shape), stored_dtype(exported_dtype, tensor.dim(), precision,
                                                                            quantization_input or name in kept.values())))
    return tuple(names), tuple(specs)


def _weight_tensors(program: torch.export.ExportedProgram) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, whether a quantization op reads it) per parameter, buffer and lifted constant,
    in placeholder order.

    Raises:
      TpuExportError: the program holds a non-tensor constant.
    """
    state = {**program.state_dict, **program.constants}
    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    found = []
    for spec in program.graph_signature.input_specs:
        if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT:
            continue
        tensor = state[spec.target]
        if not isinstance(tensor, torch.Tensor):
            raise TpuExportError(f"the program holds a non-tensor constant {spec.target!r}; tpuexport lowers tensor state only")
        quantization_input = any(is_quantization_op(user.target) for user in placeholders[spec.arg.name].users)
        found.append((spec.target, tensor, quantization_input))
    return found


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    array = to_numpy(tensor)
    narrower = {np.dtype(np.int64): np.int32, np.dtype(np.float64): np.float32}.get(array.dtype)
    return array if narrower is None else array.astype(narrower)


class _TracingInterpreter:
    """torchax's interpreter, remembering which node it is on so a failure can name it, running
    tpuexport's own lowerings (lower/registry.py) before torchax's, casting each op's operands and
    result as the precision computes them (mixed_precision.py), handing subgraphs (torch.cond's
    branches) to the lowerings as functions of JAX arrays run by the same interpreter, and computing
    each run of identical blocks as one scan at the run's last op (its other ops are skipped)."""

    def __init__(self, graph_module, precision: str = "auto", runs: tuple[ScannedRun, ...] = (), meetings: frozenset = frozenset(),
                 decisions: frozenset = frozenset()):
        torchax = import_torchax()
        base = torchax.export.JaxInterpreter
        owner = self
        run_at = {run.last_op: run for run in runs}
        skipped = frozenset().union(*(run.ops for run in runs))

        class Interpreter(base):
            def run_node(self, node):
                owner.node = node
                if node in run_at:
                    outputs, owner.before_scan[node] = run_scan(run_at[node], self.env.__getitem__, self.call_node, owner.weights)
                    self.env.update(outputs)
                    return outputs.get(node)
                if node in skipped:
                    return None
                value = super().run_node(node)
                if node.op == "placeholder" and isinstance(value, jax.Array):  # ops record theirs in call_function
                    owner.shapes[node] = value.shape
                return value

            def call_node(self, node, args, kwargs):
                """One op of a scan body, run as run_node would run it."""
                owner.node = node
                return self.call_function(node.target, args, kwargs)

            def call_function(self, target, args, kwargs):
                if any(isinstance(arg, TransposedWeight) for arg in args):
                    done, value = call_with_transposed(target, args)
                    if done:
                        return value
                    args = value
                # A matmul feeding a decision is traced under a scope its StableHLO ops keep, so it is pinned
                # HIGHEST (a weight-only router's product too).
                decision = owner.node in decisions
                if holds_quantized(args, kwargs):
                    if target is torch.ops.aten.convolution.default:  # which does not promote mixed operands
                        args, kwargs = cast_arguments(precision, target, args, kwargs, owner.node in meetings)
                    with jax.named_scope(DECISION_SCOPE + owner.node.name) if decision else contextlib.nullcontext():
                        value = call_with_quantized(target, args, kwargs)
                    if value is not None:
                        return value if isinstance(value, QuantizedArray) else cast_result(precision, target, value)
                    args, kwargs = dequantize_all(args), dict(zip(kwargs, dequantize_all(tuple(kwargs.values()))))
                args, kwargs = cast_arguments(precision, target, args, kwargs, owner.node in meetings)
                own = own_lowering(target)
                scope = jax.named_scope(DECISION_SCOPE + owner.node.name) if decision else contextlib.nullcontext()
                node = owner.node
                unmerged = merged_matmul_operand(node)
                if unmerged is not None and unmerged[1] in owner.shapes:  # a linear layer over [batch, seq, in]
                    position, source = unmerged
                    merged_rows = args[position].shape[0]
                    unmerged_matrix = args[position].reshape(*owner.shapes[source][:-1], args[position].shape[-1])
                    args = (*args[:position], unmerged_matrix, *args[position + 1:])
                else:
                    merged_rows = None
                if target is torch.ops.aten.scaled_dot_product_attention.default and reads_heads_last(node):
                    kwargs = {**kwargs, "read_heads_last": True}
                with scope:
                    result = own(*args, **kwargs) if own is not None else super().call_function(target, args, kwargs)
                if merged_rows is not None:
                    result = result.reshape(merged_rows, result.shape[-1])
                result = cast_result(precision, target, result)
                if isinstance(result, jax.Array):
                    owner.shapes[node] = result.shape
                return result

            def get_attr(self, target, args, kwargs):
                value = super().get_attr(target, args, kwargs)
                if isinstance(value, torch.fx.GraphModule):
                    return lambda *operands: Interpreter(value).run(*operands, enable_io_processing=False)
                return value

        self.node = None
        self.weights: dict = {}  # the program's weights by name while tracing, stacked ones among them
        self.before_scan: dict = {}  # {run's last op: blocks run on their own before its scan}
        # {op: its value's shape as last traced} (a scan body's ops too): a linear layer's dot is
        # traced over its input's unmerged dims (graph_passes.merged_matmul_operand).
        self.shapes: dict = {}
        self.interpreter = Interpreter(graph_module)
        # A scan reads values computed outside its run after their last use in graph order
        # (the ops that used them are skipped), so no value is dropped early.
        self.interpreter.garbage_collect_values = False

    def run(self, *args):
        return self.interpreter.run(*args, enable_io_processing=False)


def trace_and_export(program, signature, placeholder_names, weight_names, weight_specs, precision,
                     runs: tuple[ScannedRun, ...] = (), tied: dict[str, str] | None = None,
                     kept_meetings: frozenset = frozenset(), decisions: frozenset = frozenset(),
                     quantized: dict[str, tuple[dict, jnp.dtype]] | None = None, input_avals: list | None = None,
                     platforms: tuple[str, ...] = PLATFORMS,
                     layouts: dict[str, tuple[int, ...]] | None = None) -> tuple[jax.export.Exported, dict]:
    """Traces torchax's interpreter over the graph under jax.export for CPU and TPU.

    Args:
      program: the decomposed program.
      signature: its named signature.
      placeholder_names: state_dict names of the program's weight placeholders, in order.
      weight_names: names of the program's weights, in call order (stacked ones for runs).
      weight_specs: the weights' shapes and dtypes (anything with .shape and .dtype), in call order.
      precision: one of PRECISIONS.
      runs: runs of identical blocks to lower as scans (their weights among `weight_names`).
      tied: placeholders that read another weight ({name: the weight's name}; tied_weights).
      kept_meetings: ops where values computed from kept f32 state meet others (bf16 rounds them
        there; mixed_precision.kept_f32_meetings).
      decisions: matmul nodes that feed a discrete decision (traced under DECISION_SCOPE).
      quantized: weight-only weights, {name: (manifest entry, float dtype)}: the weight and its
        scales reach the ops as one QuantizedArray.
      input_avals: the inputs' shapes and dtypes, or None for the signature's symbolic dims.
      platforms: what to export for (PLATFORMS; a program with TPU kernels is TPU-only).
      layouts: weights stored transposed ({name: layout}, weight_layouts.py): the transpose that
        reads one gets its stored array (a quantized one's QuantizedArray starts transposed).
    Returns:
      (the Exported, called as `call(weights_list, inputs_list)`; {run's last op: how many of its
      blocks run before its scan}).
    """
    mutations = len(program.graph_signature.buffers_to_mutate)
    output_dtypes = [jnp.dtype(spec.dtype) for spec in signature.outputs]
    compute_dtype = input_compute_dtype(precision)
    tracer = _TracingInterpreter(program.graph_module, precision, runs, kept_meetings, decisions)

    def program_fn(weights_list, inputs_list):
        if compute_dtype is not None:
            inputs_list = [x.astype(compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != compute_dtype else x
                           for x in inputs_list]
        tracer.weights = dict(zip(weight_names, weights_list))
        for name, (entry, dtype) in (quantized or {}).items():
            kernel = tuple(entry["kernel_shape"]) if "kernel_shape" in entry else None  # a convolution's, stored as a matrix
            tracer.weights[name] = QuantizedArray(tracer.weights.pop(name), tracer.weights.pop(entry["scale"]), entry["bits"],
                                                  entry["axis"] if kernel is None else -1, dtype, name in (layouts or {}), kernel)
        for name in (layouts or {}):  # float weights; a quantized one's QuantizedArray is transposed
            if name in tracer.weights and not isinstance(tracer.weights[name], QuantizedArray):
                tracer.weights[name] = TransposedWeight(tracer.weights[name])
        # A stacked block weight's own placeholder is read by no op that runs, so it gets None.
        placeholders = [tracer.weights.get((tied or {}).get(name, name)) for name in placeholder_names]
        outputs = tracer.run(*placeholders, *inputs_list)[mutations:]
        return [jnp.asarray(out).astype(dtype) for out, dtype in zip(outputs, output_dtypes)]

    weight_avals = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in weight_specs]
    input_avals = symbolic_input_avals(signature) if input_avals is None else input_avals
    try:
        exported = jax.export.export(jax.jit(program_fn), platforms=platforms)(weight_avals, input_avals)
        return exported, dict(tracer.before_scan)
    except Exception as error:  # torchax op implementations raise many kinds while tracing
        node = tracer.node
        where = f" at {node.target} from {user_source(node)}" if node is not None else ""
        # torch.fx appends the node and a traceback ("While executing %expand ..."), both named here already.
        message = " ".join(str(error).split()).split(" While executing ")[0][:300]
        narrowed = narrowed_range(program, signature)
        if "shape polymorphism" in message.lower() and signature.dims:
            # JAX traced the program but cannot lower one of its ops over symbolic sizes (FNet's FFT over seq).
            where = " in JAX's lowering of the traced program" if node is not None and node.op == "output" else where
            static = " or ".join(f"--dim {dim.name}={dim.max}:{dim.max}" for dim in signature.dims)
            fix = f"JAX lowers that op at fixed sizes only: make the dims it runs over static ({static}, or several; any one size each)"
        elif narrowed:
            fix = (f"torch.export fixed a size computed from the example inputs, so its program only holds at some sizes ({narrowed}): "
                   "give example inputs where no such size is 1 (a sliced or pooled length), or narrow the dim's range")
        else:
            fix = "this op or shape pattern is not supported yet"
        raise TpuExportError(f"lowering failed{where}: {type(error).__name__}: {message}; {fix}") from None
