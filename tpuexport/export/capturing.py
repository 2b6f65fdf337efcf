"""torch.export capture: from a loaded source to a `CapturedModel` with a named signature."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import logging
import os
import re
from typing import Any, Callable

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, free_unbacked_symbols
from torch.utils import _pytree as pytree

from tpuexport.errors import TpuExportError
from tpuexport.export import constraints, guard_sites, symbolic_sizes
from tpuexport.export.checkpoints import constant_scalar, meta_copy, with_checkpoint_weights
from tpuexport.export.constant_folding import fold_constants
from tpuexport.export.loaded import LoadedSource, SourceInfo
from tpuexport.export.patch_grids import constants_read
from tpuexport.export.recurrent_layers import recurrent_layers_as_scans
from tpuexport.export.selective_scans import selective_scans_as_scans
from tpuexport.logs import EXPORT_LOGGERS, quiet_loggers
from tpuexport.signature import Placeholder, ProgramSignature, SymbolicDim, TensorSpec, artifact_dtype, parse_dim_expression
from tpuexport.source_lines import user_source


@dataclasses.dataclass(frozen=True)
class CapturedModel:
    """The export stage's result, the lowering stage's input.

    Attributes:
      program: the torch.export.ExportedProgram (eval mode, not yet decomposed).
      reference: eager callable that verification compares against (the nn.Module, or the
        program's own module when the source was already exported).
      signature: named inputs, outputs and symbolic dims.
      example_inputs: flat example input tensors, in signature order.
      source: provenance for the manifest.
      calibration: calibration samples passed through for quantization, or None.
      checkpoint_state: for a source with a checkpoint, the program's weights by state name
        (parameters, buffers and lifted constants; views of the memory-mapped checkpoint, read
        when used); None when the program holds its weights (`program.state_dict`), which for a
        checkpoint's program are on the meta device.
      keep_f32: state names of the weights of modules a Hugging Face model keeps in f32 on purpose
        (`_keep_in_fp32_modules`); --precision bf16 leaves them f32.
      notes: what the export decided for the user, one line each (dims narrowed to what the model's code takes).
    """

    program: torch.export.ExportedProgram
    reference: Callable[..., Any]
    signature: ProgramSignature
    example_inputs: tuple[torch.Tensor, ...]
    source: SourceInfo
    calibration: Any = None
    checkpoint_state: dict[str, torch.Tensor] | None = None
    keep_f32: frozenset[str] = frozenset()
    notes: tuple[str, ...] = ()


class DimsNarrowed(TpuExportError):
    """torch.export's refusal of dims the model's code takes only narrower ranges of (constraints.Explanation).

    Attributes:
      needs: what the code needs and where ("needs seq in 6..512, at modeling_vits.py:1220 (...)").
      ranges: {dim: (min, max)} that export instead.
    """

    def __init__(self, line: str, needs: str, ranges: dict[str, tuple[int, int]]):
        super().__init__(line)
        self.needs, self.ranges = needs, ranges


def capture(source: LoadedSource) -> CapturedModel:
    """Exports the model with torch.export (if it is not an ExportedProgram already); a source whose
    dims the user did not give (`LoadedSource.at_ranges`) is exported again at the ranges the model's
    code takes when torch.export finds it narrows them, which the CapturedModel's notes say.

    Args:
      source: what `load_source` (or the Python API) provided.
    Returns:
      The CapturedModel.
    Raises:
      TpuExportError: torch.export refused the model or its dynamic_shapes; the checkpoint lacks
        some of the model's weights or holds one of another shape.
    """
    # A multimodal model's checks of tensor values (that its placeholder tokens are as many as its media's
    # features) are left out of its program: XLA raises no errors, so the program could not hold them. The
    # count is in the signature, the runtime refuses a row that breaks it, and the eager reference checks.
    with value_checks_off() if source.placeholders else contextlib.nullcontext():
        try:
            return _capture(source)
        except DimsNarrowed as narrowed:
            remade = source.at_ranges(narrowed.ranges) if source.at_ranges is not None else None
            if remade is None:
                raise
            args, dynamic_shapes, exported = remade
            captured = _capture(dataclasses.replace(source, args=args, dynamic_shapes=dynamic_shapes, at_ranges=None))
            ranges = ", ".join(f"{name} {low}..{high}" for name, (low, high) in exported.items())
            return dataclasses.replace(captured, notes=(f"dims {ranges}: the model's code {narrowed.needs}",))


_VALUE_CHECKS_OFF = "TRANSFORMERS_DISABLE_TORCH_CHECK"


@contextlib.contextmanager
def value_checks_off():
    """transformers' checks of tensor values (`torch_compilable_check`: that the placeholder tokens are
    as many as the media's features) left out, as its TRANSFORMERS_DISABLE_TORCH_CHECK does, and the
    variable restored after (a value the user set is kept)."""
    if os.environ.get(_VALUE_CHECKS_OFF) is not None:
        yield
        return
    os.environ[_VALUE_CHECKS_OFF] = "1"
    try:
        yield
    finally:
        del os.environ[_VALUE_CHECKS_OFF]


def _capture(source: LoadedSource) -> CapturedModel:
    if source.checkpoint is not None:
        return _capture_with_checkpoint(source)
    if isinstance(source.model, torch.export.ExportedProgram):
        program = source.model
        reference = program.module()
        example_args = _program_example_args(program)
    else:
        model = source.model.eval()
        program = _export(model, source.args, source.dynamic_shapes)
        reference = model
        example_args = source.args
    example_inputs = tuple(pytree.tree_leaves(example_args))
    signature = describe(program, example_inputs, source.input_names, source.placeholders)
    return CapturedModel(program, reference, signature, example_inputs, source.info, source.calibration,
                         keep_f32=kept_in_f32(reference))


def _capture_with_checkpoint(source: LoadedSource) -> CapturedModel:
    """Exports a copy of the model on the meta device (no weight is read) and makes the eager
    reference from the checkpoint's memory-mapped tensors; a model whose forward makes tensor
    constants on its weights' device is exported again with the checkpoint's tensors.

    Raises:
      TpuExportError: an ExportedProgram source, a checkpoint that does not match the model, or a
        lifted constant still on the meta device (its value is nowhere).
    """
    if isinstance(source.model, torch.export.ExportedProgram):
        raise TpuExportError("a checkpoint needs an nn.Module source (an ExportedProgram carries its own weights); "
                             "give the module that the checkpoint's state_dict belongs to")
    reference = with_checkpoint_weights(source.model, source.checkpoint)
    on_meta = on_meta_device(dataclasses.replace(source, model=source.model.eval(), checkpoint=None))
    try:
        program = _export(on_meta.model, on_meta.args, on_meta.dynamic_shapes)
        weights = _program_weights(program, reference)
    except TpuExportError as error:
        if isinstance(error, DimsNarrowed) and source.at_ranges is not None:
            raise  # sizes, not values: `capture` exports again at the ranges the code takes (explaining again costs a trace)
        # A forward that reads a constant it makes on its weights' device (transformers' torch_compilable_check of a
        # tensor, D-FINE's and RT-DETR's) cannot run on the meta device: its refusal said "Cannot cast tensor(False) to
        # number", or named no line of the model's code. The export with the checkpoint's tensors says what it says.
        program = None
    if program is None or any(isinstance(tensor, torch.Tensor) and tensor.is_meta for tensor in weights.values()):
        # The forward makes tensor constants on its weights' device (Mask2Former's offset normalizer, GPT-Neo's
        # mask value, ...): exported with the checkpoint's tensors (memory-mapped, not copied), they have values.
        # Example args made on the meta device (a generation KV cache, which can exceed memory) join them on the
        # CPU uninitialized: torch.empty commits no memory until written, and tracing reads only shapes.
        args = pytree.tree_map_only(torch.Tensor, lambda tensor: torch.empty_like(tensor, device="cpu") if tensor.is_meta else tensor,
                                    source.args)
        program = _export(reference.eval(), args, source.dynamic_shapes)
        weights = _program_weights(program, reference)
    example_inputs = tuple(pytree.tree_leaves(source.args))
    signature = describe(program, example_inputs, source.input_names, source.placeholders)
    unknown = [name for name, tensor in weights.items() if isinstance(tensor, torch.Tensor) and tensor.is_meta]
    if unknown:
        raise TpuExportError(f"the model's tensor constant(s) {', '.join(unknown)} are on the meta device, so their values are "
                             "nowhere; register them as buffers (model.register_buffer) so the checkpoint can hold them")
    return CapturedModel(program, reference, signature, example_inputs, source.info, source.calibration, weights,
                         kept_in_f32(reference))


def _program_weights(program: torch.export.ExportedProgram, reference: torch.nn.Module) -> dict:
    """The program's non-input arguments by name: the reference's parameters and buffers, or the
    program's lifted constants."""
    state = {**dict(reference.named_parameters(remove_duplicate=False)), **dict(reference.named_buffers(remove_duplicate=False))}
    return {spec.target: state[spec.target] if spec.target in state else program.constants[spec.target]
            for spec in program.graph_signature.input_specs if spec.kind != torch.export.graph_signature.InputKind.USER_INPUT}


def kept_in_f32(model) -> frozenset[str]:
    """State names of the parameters and buffers in modules that a Hugging Face model (anywhere in
    `model`) names in `_keep_in_fp32_modules`, matched as transformers matches them: a listed name
    equal to one part of the dotted module path.

    Args:
      model: the eager model (an nn.Module; anything else has none).
    Returns:
      Their full state names in `model`.
    """
    if not isinstance(model, torch.nn.Module):
        return frozenset()
    kept = set()
    for prefix, module in model.named_modules():
        listed = set(getattr(module, "_keep_in_fp32_modules", None) or ())
        if not listed:
            continue
        for name, _ in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
            if listed & set(name.split(".")[:-1]):
                kept.add(f"{prefix}.{name}" if prefix else name)
    return frozenset(kept)


def weights_on_meta(model) -> bool:
    """Whether a model's weights live on the meta device (shapes without values: it can be
    planned and compiled, not run).

    Args:
      model: an nn.Module (its parameters and buffers) or an ExportedProgram (its state and
        lifted constants).
    Returns:
      True when any of them is a meta tensor.
    """
    if isinstance(model, torch.export.ExportedProgram):
        tensors = [*model.state_dict.values(), *model.constants.values()]
    else:
        tensors = [*model.parameters(), *model.buffers()]
    return any(isinstance(tensor, torch.Tensor) and tensor.is_meta for tensor in tensors)


def on_meta_device(source: LoadedSource) -> LoadedSource:
    """The source wholly on the meta device when some of its weights are there.

    torch.export refuses to mix devices (an nn.Linear with meta weights called on a CPU tensor
    fails), and a model exported without weights needs only shapes and dtypes. A model with some
    real tensors (buffers computed when it was built) is copied, so the user's stays as it was.

    Args:
      source: the loaded source.
    Returns:
      `source` unchanged, or a copy whose model and example args are on the meta device.
    """
    if isinstance(source.model, torch.export.ExportedProgram) or not weights_on_meta(source.model):
        return source
    model = source.model
    if not all(tensor.is_meta for tensor in (*model.parameters(), *model.buffers())):
        model = meta_copy(model)
    args = pytree.tree_map_only(torch.Tensor, lambda tensor: tensor.to("meta"), source.args)
    return dataclasses.replace(source, model=model, args=args)


@contextlib.contextmanager
def _quiet_export():
    """torch.export prints the partial graph of a failed trace to stderr, and logs the traceback of a
    failing fake-tensor operator: the error tpuexport reports says it in one line."""
    with quiet_loggers(*EXPORT_LOGGERS, level=logging.CRITICAL), contextlib.redirect_stderr(io.StringIO()):
        yield


def _scalar_value(value: int, dtype: torch.dtype, module: torch.nn.Module) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


@contextlib.contextmanager
def _scalar_buffers_as_constants(model: torch.nn.Module):
    """Integer scalar buffers that are constants of the model's code (constant_scalar) read, while
    exporting, as tensors made in the forward from their numbers. torch.export lifts a buffer to an
    input of the program, whose value it does not know: a size computed from one (EnCodec's
    `F.pad(x, (padding_total, extra_padding))`, modeling_encodec.py:160, Mimi's, Pocket TTS's and
    WavTokenizer's alike) was an unbacked symbol, and the model was refused as branching on tensor
    values. A tensor made from a number is a constant: the sizes are numbers, as when run eagerly.
    Each module's buffers and class are as they were afterwards."""
    swapped = []  # (module, its class, its buffers)
    for module in model.modules():
        names = [name for name, tensor in module._buffers.items() if tensor is not None and constant_scalar(module, name, tensor)]
        if not names:
            continue
        swapped.append((module, type(module), dict(module._buffers)))
        constants = {name: property(functools.partial(_scalar_value, module._buffers[name].item(), module._buffers[name].dtype))
                     for name in names}
        for name in names:
            del module._buffers[name]
        module.__class__ = type(type(module).__name__, (type(module),), constants)
    try:
        yield
    finally:
        for module, original, buffers in reversed(swapped):
            module.__class__ = original
            module._buffers = buffers


@contextlib.contextmanager
def _unchanged_module_casts_skipped():
    """A forward that casts one of its own modules to the dtype and device it already has (Switch
    Transformers' router: `self.classifier = self.classifier.to(self.dtype)`, modeling_switch_transformers.py:99)
    is a no-op eagerly, but under torch.export `Module._apply` swaps each parameter for its converted
    self and fails ("_apply(): Couldn't swap Linear.weight"). Such a cast is skipped while exporting; one
    that changes a tensor still fails as before."""
    original = torch.nn.Module._apply

    def apply_unless_unchanged(module, fn, recurse=True):
        if all(fn(tensor) is tensor for tensor in (*module.parameters(recurse=recurse), *module.buffers(recurse=recurse))):
            return module
        return original(module, fn, recurse)

    torch.nn.Module._apply = apply_unless_unchanged
    try:
        yield
    finally:
        torch.nn.Module._apply = original


def _export(model: torch.nn.Module, args, dynamic_shapes) -> torch.export.ExportedProgram:
    guarded_at: list[str] = []  # where the model's code guarded the sizes, should torch.export refuse a declared range
    try:
        with torch.no_grad(), _quiet_export(), _unchanged_module_casts_skipped(), _scalar_buffers_as_constants(model), \
                recurrent_layers_as_scans(), selective_scans_as_scans(), guard_sites.recorded(guarded_at), constants_read() if getattr(model, "constants", None) else contextlib.nullcontext():
            program = torch.export.export(model, args, dynamic_shapes=dynamic_shapes)
    except Exception as error:  # torch.export raises UserError, ConstraintViolationError, TypeError, ...
        with _quiet_export():
            explanation = constraints.explain(model, args, dynamic_shapes, str(error), guarded_at)
            explained = explanation.line if explanation else symbolic_sizes.explain(error)
        if explained:  # the line names the architecture, as every other refusal of torch.export's does
            line = explained.replace("torch.export:", f"torch.export{_described(model)}:", 1)
            if explanation and explanation.ranges:
                raise DimsNarrowed(line, explanation.needs, explanation.ranges) from None
            raise TpuExportError(line) from None
        message = " ".join(str(error).split())
        if isinstance(error, GuardOnDataDependentSymNode):
            raise TpuExportError(
                f"torch.export failed{_described(model)}: its forward branches on tensor values ({message[:300]}), which torch.export "
                "cannot trace (e.g. a Python loop over the experts that tokens chose); that code needs tensor ops or torch.cond"
            ) from None
        eager_error = _eager_failure_alike(model, args, error)
        if eager_error is not None:
            raise TpuExportError(
                f"the model's own forward fails{_described(model)} at the example sizes ({_shapes(args)}), run without "
                f"torch.export: {eager_error[:300]}; these inputs do not suit it (it may take others, or other sizes): give them "
                "with --dim, or its own inputs from a file.py:factory") from None
        raise TpuExportError(
            f"torch.export failed{_described(model)}: {message[:400]}; check the example args and dynamic_shapes / --dim ranges"
        ) from None
    if getattr(model, "constants", None):  # sizes computed from a vision tower's grid: numbers from here on
        program = fold_constants(program)
    _without_dead_code(program)
    _refuse_sizes_from_values(model, program)
    _refuse_random_draws(model, program)
    return program


def _refuse_random_draws(model: torch.nn.Module, program: torch.export.ExportedProgram) -> None:
    """Refuses a forward that draws random numbers (an op torch tags nondeterministic_seeded: ViTMAE's
    masking noise, `torch.rand` at modeling_vit_mae.py:264, was refused as "lowering failed ...
    'NoneType' object has no attribute 'get_and_rotate_prng_key'"): no two runs agree, so the program
    cannot be verified against eager PyTorch. Dropout and RReLU in eval mode (their `train` or
    `training` argument false) and attention without dropout (`dropout_p` 0) draw nothing.

    Raises:
      TpuExportError: naming the first such op's line of the model's code.
    """
    for node in program.graph.nodes:
        tags = getattr(node.target, "tags", ())
        if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in tags:
            continue
        schema = node.target._schema.arguments
        arguments = ({a.name: a.default_value for a in schema if a.has_default_value()} | dict(zip((a.name for a in schema), node.args))
                     | node.kwargs)
        if arguments.get("train") is False or arguments.get("training") is False or arguments.get("dropout_p") == 0:
            continue
        raise TpuExportError(
            f"torch.export{_described(model)}: its forward draws random numbers ({node.target}) at {user_source(node)}, so no two "
            "runs agree and the program cannot be verified against eager PyTorch; give those values as an input instead (a "
            "file.py:factory whose forward takes them, as ViTMAE's takes noise=)")


_ASSERTIONS = (torch.ops.aten._assert_scalar.default, torch.ops.aten.sym_constrain_range_for_size.default,
               torch.ops.aten.sym_constrain_range.default)


def _without_dead_code(program: torch.export.ExportedProgram) -> None:
    """Drops, in place, the tensors sized by values that no output depends on, with torch.export's
    assertions on their sizes (which alone keep them in the graph): the arguments of a value check that
    value_checks_off left unmade (Audio Flamingo 3's `inputs_embeds[mask].numel() == features.numel()`,
    computed before the disabled check returns)."""
    graph = program.graph
    live = _ancestors([node for node in graph.nodes if node.op == "output"])
    dead_by_values = {node for node in graph.nodes if node not in live and _sized_by_values(node)}
    if not dead_by_values:
        return
    for node in reversed(list(graph.nodes)):
        if node.target in _ASSERTIONS and node not in live and _ancestors([node]) & dead_by_values:
            graph.erase_node(node)
    graph.eliminate_dead_code()
    program.graph_module.recompile()


def _ancestors(nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """The nodes and every node they read, transitively."""
    seen, stack = set(nodes), list(nodes)
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def _sized_by_values(node: torch.fx.Node) -> bool:
    """Whether the node's tensor has a size torch.export names by a symbol of its own (an unbacked `u0`)."""
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and any(isinstance(size, torch.SymInt) and free_unbacked_symbols(size) for size in value.shape)


def _refuse_sizes_from_values(model: torch.nn.Module, program: torch.export.ExportedProgram) -> None:
    """Refuses a program with a tensor whose size torch.export could only name by a symbol of its
    own (an unbacked `u0`): the size comes from tensor values (`.tolist()` or `nonzero()` sizing a
    split, as JetMoE's experts take the tokens routed to each), which no input size bounds and a
    TPU program, whose shapes follow its inputs' sizes, cannot have.

    Raises:
      TpuExportError: naming the first such tensor's line of the model's code.
    """
    for node in program.graph.nodes:
        if _sized_by_values(node):
            raise TpuExportError(
                f"torch.export{_described(model)}: its code sizes a tensor by tensor values, at {user_source(node)} (e.g. tokens "
                "split among experts by their counts), which a TPU program cannot have (its shapes follow its inputs' sizes); "
                "that code needs fixed-size tensor ops (e.g. every expert over every token, weighted by the router)")


def _eager_failure_alike(model: torch.nn.Module, args, error: Exception) -> str | None:
    """What the model run eagerly at the example args (on fake tensors: shapes only) raises, in one
    line, when it is what torch.export raised (or what a check that failed bare under torch.export
    says, _BARE_CHECK): then the inputs do not suit the model, and no tracing is to blame. Sizes do
    not count in the comparison: where
    torch.export's message names a symbolic size (Siglip2 given images for its flattened patches:
    "[672*s99, 224] X [768, 64]"), the eager run's names its value ("[1344, 224] X [768, 64]")."""
    from torch._subclasses import fake_tensor

    from tpuexport.export.generation import _EntryPoint

    try:  # on fake tensors, as torch.export traces: the same kernels' messages, whether the weights are in memory or not
        with torch.no_grad(), _quiet_export(), fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
            model(*args)
    except Exception as eager_error:  # whatever the model raises, compared with torch.export's
        message = " ".join(str(eager_error).split())
        if type(eager_error) is type(error) and _SIZES.sub("#", str(eager_error)) == _SIZES.sub("#", str(error)):
            return message
        if _BARE_CHECK in str(error):
            return f"{type(eager_error).__name__}: {message}"
        # A kernel refusing the shapes eagerly, in other words than torch.export's trace did (split_with_sizes'
        # "expects split_sizes to sum exactly to 4" where torch.export says "Split sizes add up to 8"): the inputs
        # do not suit the model. What fake tensors cannot run (values read in Python) is no such failure.
        # Only the model's own forward: a generation entry point's failure may be tpuexport's (its cache's shapes).
        fake_limits = (fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException,
                       fake_tensor.UnsupportedOperatorException, fake_tensor.UnsupportedFakeTensorException)
        if isinstance(eager_error, (RuntimeError, ValueError, IndexError)) and not isinstance(eager_error, fake_limits) \
                and not re.search(r"meta|fake|data.dependent|symbolic|unbacked", message, re.IGNORECASE) \
                and not isinstance(model, _EntryPoint):
            return f"{type(eager_error).__name__}: {message}"
    return None


# A check failing under torch.export at the example sizes: transformers' `torch_compilable_check` traces as a bare
# `torch._check(cond)` and raises its message (MuseSpark's audio: "`input_values` length 16000 is not a multiple of
# 1920") only when run eagerly, so the eager run's error is what the check says.
_BARE_CHECK = "Expected cond to be True, but got False"


# A size in an error message, concrete (1344) or symbolic (672*s99, s99 + 1).
_SIZES = re.compile(r"\w*\d[\w*+\-/]*(?: [+\-] [\w*]*\d[\w*]*)*")


def _shapes(args) -> str:
    """The example args' shapes, "[2, 16], [2, 3, 224, 224]"."""
    return ", ".join(str(list(tensor.shape)) for tensor in pytree.tree_leaves(args) if isinstance(tensor, torch.Tensor))


def _described(model: torch.nn.Module) -> str:
    """" on Class (model_type)" for the outermost Hugging Face model within `model` (a task's forward or
    an entry point wraps it), so that the line names the architecture, and the inputs a Hugging Face
    task's forward gave it (a model may need others); "" for other models."""
    given = getattr(model, "input_names", None)
    for module in model.modules():
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        if isinstance(model_type, str):
            return f" on {type(module).__name__} ({model_type}{', given ' + ', '.join(given) if given else ''})"
    return ""


def _program_example_args(program: torch.export.ExportedProgram):
    if program.example_inputs is None:
        raise TpuExportError("the saved program has no example inputs; re-save it with torch 2.5 or newer")
    args, kwargs = program.example_inputs
    if kwargs:
        raise TpuExportError("the saved program takes keyword inputs; export it with positional inputs only")
    return args


def describe(
    program: torch.export.ExportedProgram,
    example_inputs: tuple[torch.Tensor, ...],
    input_names: tuple[str, ...] | None = None,
    placeholders: dict[str, tuple[Placeholder, ...]] | None = None,
) -> ProgramSignature:
    """Reads the named signature out of an ExportedProgram.

    Args:
      program: the exported program.
      example_inputs: flat example inputs (their sizes are the dims' example values).
      input_names: names that replace the forward parameter names, or None.
      placeholders: LoadedSource.placeholders, recorded on their inputs.
    Returns:
      The ProgramSignature.
    """
    graph_inputs = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    user_nodes = [graph_inputs[name] for name in program.graph_signature.user_inputs]
    names = list(input_names) if input_names else [node.name for node in user_nodes]
    if len(names) != len(user_nodes) or len(example_inputs) != len(user_nodes):
        raise TpuExportError(
            f"the model takes {len(user_nodes)} tensor input(s) but {len(names)} were described; match --input to forward()"
        )
    symbol_names = _name_symbols(program, user_nodes, names)

    def spec(name, value) -> TensorSpec:
        shape = tuple(_dim_expression(size, symbol_names) for size in value.shape)
        torch_dtype = str(value.dtype).removeprefix("torch.")
        return TensorSpec(name, shape, artifact_dtype(torch_dtype), torch_dtype)

    inputs = tuple(dataclasses.replace(spec(name, node.meta["val"]), placeholders=(placeholders or {}).get(name, ()))
                   for name, node in zip(names, user_nodes))
    output_node = next(node for node in program.graph.nodes if node.op == "output")
    mutated = len(program.graph_signature.buffers_to_mutate)
    output_values = [node.meta["val"] for node in output_node.args[0][mutated:]]
    tree = program.call_spec.out_spec
    outputs = tuple(spec(name, value) for name, value in zip(_output_names(tree, len(output_values)), output_values))

    dims = []
    for symbol, name in symbol_names.items():
        if any(dim.name == name for dim in dims):
            continue
        bounds = program.range_constraints[symbol]
        upper = None if not bounds.upper.is_finite else int(bounds.upper)
        # JAX symbolic dims are >= 1; torch.export reports 0 for a Dim without an explicit min.
        lower = max(int(bounds.lower), 1)
        dims.append(SymbolicDim(name, lower, upper, _example_size(symbol, user_nodes, example_inputs)))
    return ProgramSignature(inputs, outputs, tuple(dims), pytree.treespec_dumps(tree))


def _name_symbols(program, user_nodes, input_names) -> dict[sympy.Symbol, str]:
    """Maps each free symbol of the inputs to the user's dim name, in order of first use.

    torch.export numbers its symbols (s27, s77); the names given to torch.export.Dim survive
    only in the shape environment's debug names, and not at all in a reloaded .pt2, where the
    fallback is `<input>_dim<axis>` of the symbol's first plain occurrence.
    """
    debug_names = _shape_env_debug_names(user_nodes)
    names: dict[sympy.Symbol, str] = {}
    # Symbols of one torch.export.Dim keep its one name: torch 2.13 gives each input its own symbol
    # for a Dim whose range is [1, 2] (the inputs still share the dim, as the user declared).
    user_named = {symbol for symbol in debug_names}
    for input_name, node in zip(input_names, user_nodes):
        for axis, size in enumerate(node.meta["val"].shape):
            if not isinstance(size, torch.SymInt):
                continue
            expression = size.node.expr
            for symbol in sorted(expression.free_symbols, key=str):
                if symbol not in names:
                    fallback = f"{input_name}_dim{axis}" if expression == symbol else f"{input_name}_dim{axis}_{symbol}"
                    names[symbol] = _identifier(debug_names.get(symbol) or fallback)
    for symbol in program.range_constraints:
        # An unbacked symbol is a value the program computes (a multimodal model's count of placeholder
        # tokens), not a size of its inputs: no dim.
        if isinstance(symbol, sympy.Symbol) and symbol not in names and not free_unbacked_symbols(symbol):
            names[symbol] = _identifier(debug_names.get(symbol) or str(symbol))
    taken: set[str] = set()
    declared = {debug_names[symbol] for symbol in names if symbol in user_named}
    for symbol, name in names.items():
        if symbol in user_named and name in declared:
            taken.add(name)
            continue
        unique, counter = name, 1
        while unique in taken:
            counter += 1
            unique = f"{name}_{counter}"
        names[symbol] = unique
        taken.add(unique)
    return names


def _shape_env_debug_names(user_nodes) -> dict[sympy.Symbol, str]:
    """The torch.export.Dim names of the shape environment's symbols.

    A dim used directly is named after its input axis's source; a dim used only inside an
    expression (`4*h`) has no axis of its own, and its source is a constant holding the Dim's name.
    """
    from torch._dynamo.source import ConstantSource

    for node in user_nodes:
        for size in node.meta["val"].shape:
            if isinstance(size, torch.SymInt):
                shape_env = size.node.shape_env
                debug = getattr(shape_env, "source_name_to_debug_name", {}) or {}
                found = {}
                for symbol, sources in getattr(shape_env, "var_to_sources", {}).items():
                    for source in sources:
                        if source.name in debug:
                            found[symbol] = debug[source.name]
                            break
                        if isinstance(source, ConstantSource):
                            found[symbol] = source.source_name
                            break
                return found
    return {}


def _identifier(text: str) -> str:
    cleaned = re.sub(r"\W", "_", text)
    return cleaned if re.match(r"[A-Za-z_]", cleaned) else f"d_{cleaned}"


def _dim_expression(size, symbol_names) -> int | str:
    if not isinstance(size, torch.SymInt):
        return int(size)
    expression = size.node.expr
    if expression.is_number:
        return int(expression)
    return str(expression.subs({symbol: sympy.Symbol(name) for symbol, name in symbol_names.items()}))


def _example_size(symbol, user_nodes, example_inputs) -> int:
    """The dim's size in the example inputs, read off an input axis that is the dim itself or a
    multiple of it plus a constant (`4*h`: torch.export's way to say a size is a multiple of 4)."""
    for node, tensor in zip(user_nodes, example_inputs):
        for axis, size in enumerate(node.meta["val"].shape):
            if not isinstance(size, torch.SymInt) or size.node.expr.free_symbols != {symbol}:
                continue
            expression = size.node.expr
            coefficient, offset = expression.coeff(symbol), expression.subs(symbol, 0)
            if expression == coefficient * symbol + offset:
                return int((int(tensor.shape[axis]) - offset) / coefficient)
    raise TpuExportError(f"dim {symbol} appears only in expressions of several dims; give it an input axis of its own "
                         "(or a multiple of it, e.g. 4*h)")


def _output_names(tree, count: int) -> list[str]:
    """Output names from the output pytree: dict keys where there are some, output_<i> otherwise."""
    leaves_with_paths, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(count)), tree))
    names = []
    for index, (path, _) in enumerate(leaves_with_paths):
        keys = [str(entry.key) for entry in path if isinstance(entry, pytree.MappingKey)]
        names.append(_identifier("_".join(keys)) if keys else f"output_{index}")
    return names


def torch_dynamic_shapes(signature: ProgramSignature) -> list[dict[int, torch.export.Dim] | None]:
    """The inverse of `describe` for dims: torch.export dynamic_shapes entries, one per flat input.

    One Dim per name, so inputs that share a dim share it again; a derived dim such as "2*seq" is
    rebuilt as the same linear expression of its Dim (torch.export accepts a*dim + b).

    Args:
      signature: a program's signature.
    Returns:
      One {axis: Dim} dict per input (None for an input with static shape), in signature order.
    """
    dims = {dim.name: torch.export.Dim(dim.name, min=dim.min, max=dim.max) for dim in signature.dims}

    def torch_dim(size: str):
        if size in dims:
            return dims[size]
        expression = parse_dim_expression(size)
        (symbol,) = expression.free_symbols
        return int(expression.coeff(symbol)) * dims[str(symbol)] + int(expression.subs(symbol, 0))

    entries = []
    for spec in signature.inputs:
        entry = {axis: torch_dim(size) for axis, size in enumerate(spec.shape) if isinstance(size, str)}
        entries.append(entry or None)
    return entries

