"""TPU kernels per shape bucket: each bucket's TPU program lowered again at its static shapes, with
JAX's Pallas flash-attention kernel in place of the attention ops whose mask it can express.

The portable program stays symbolic and kernel-free (it is what CPU verification, TensorFlow and
every other platform run); Pallas kernels are not shape-polymorphic ("Symbolic dimension
comparison 's' < '128' is inconclusive") and run on CPU only in interpret mode. So for a bucket:

  kernel_graph   a copy of the decomposed graph in which each scaled_dot_product_attention whose
                 mask is a causal part and/or per-key and per-query parts becomes
                 `tpuexport::attention_kernel(q, k, v, key_valid, query_valid, causal, scale)`.
                 The mask's parts are found in the graph: it is an AND of terms; a term computed
                 from the bucket's sizes alone (positions from arange) is evaluated here, at the
                 bucket's sizes, and must be all true or exactly the causal triangle; a term read
                 from the inputs (padding) must be [batch, 1, 1, k] or [batch, 1, q, 1]. A float
                 (additive) mask is taken when it is computed from sizes alone and holds only 0
                 and -inf / the dtype's lowest value: the boolean mask it is.
  lower again    the copy lowered at the bucket's static input shapes, for TPU only; the lowering
                 of each attention_kernel (lower/attention.py) uses the kernel where it pays
                 (plan_kernel: enough keys, a block size dividing the sequence) and records a
                 KernelUse either way.

A bucket where no attention op uses the kernel keeps the portable program (its executable is the
kernel-free one, byte for byte), and says why.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import jax
import torch
import torch.nn.functional as F

from tpuexport.errors import TpuExportError
from tpuexport.lower.attention import KERNEL_MIN_KEYS, recording_kernel_uses
from tpuexport.lower.graph_passes import attention_nodes
from tpuexport.lower.lowered import LoweredProgram
from tpuexport.lower.lowering import lower_decomposed
from tpuexport.lower.matmul_precision import decision_matmuls
from tpuexport.signature import ProgramSignature

aten = torch.ops.aten
KERNEL_MODES = ("auto", "none")
KERNEL_PLATFORMS = ("tpu",)


@torch.library.custom_op("tpuexport::attention_kernel", mutates_args=())
def attention_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_valid: torch.Tensor | None,
                     query_valid: torch.Tensor | None, causal: bool, scale: float | None) -> torch.Tensor:
    """scaled_dot_product_attention with its boolean mask given as parts: causal, keys every query
    may see ([batch, 1, 1, k]) and queries that see anything ([batch, 1, q, 1]). Lowered by
    lower/attention.py (the flash kernel where it applies); this is its eager meaning."""
    mask = None
    if key_valid is not None or query_valid is not None:
        parts = [part for part in (key_valid, query_valid) if part is not None]
        mask = parts[0] if len(parts) == 1 else parts[0] & parts[1]
        if causal:
            mask = mask & torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
                                          enable_gqa=key.shape[-3] != query.shape[-3])


@attention_kernel.register_fake
def _(query, key, value, key_valid, query_valid, causal, scale):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


@dataclasses.dataclass(frozen=True)
class BucketKernels:
    """One bucket's kernel lowering.

    Attributes:
      sizes: the bucket's dim sizes.
      exported: the TPU program at the bucket's static shapes with the kernels (called like the
        portable one: weights, then inputs), or None when the bucket keeps the portable program.
      uses: every attention op's KernelUse (a scanned layer's once), kernel or not.
      reason: why the bucket keeps the portable program (None when it has kernels).
      unmatched: why some attention ops keep XLA's attention while others use the kernel, or None.
    """

    sizes: dict[str, int]
    exported: jax.export.Exported | None
    uses: tuple = ()
    reason: str | None = None
    unmatched: str | None = None

    @property
    def kernels(self) -> tuple:
        return tuple(use for use in self.uses if use.kernel)

    def to_json(self) -> dict:
        entry = {"program": "static with kernels" if self.exported is not None else "portable",
                 "attention": [use.to_json() for use in self.uses]}
        return entry | ({"reason": self.reason} if self.reason else {}) | ({"other_attention": self.unmatched} if self.unmatched else {})


def check_kernel_mode(mode: str) -> str:
    """Returns `mode` if it is one of KERNEL_MODES.

    Raises:
      TpuExportError: another value.
    """
    if mode not in KERNEL_MODES:
        raise TpuExportError(f"unknown --kernels {mode!r}; use one of {', '.join(KERNEL_MODES)}")
    return mode


NO_ATTENTION = "the program has no scaled_dot_product_attention"


def has_attention(lowered: LoweredProgram) -> bool:
    """Whether the program (lowered in this process) has an attention op a kernel might compute."""
    return lowered.graph is not None and any(node.target is aten.scaled_dot_product_attention.default
                                             for module in lowered.graph.graph_module.modules()
                                             if isinstance(module, torch.fx.GraphModule) for node in module.graph.nodes)


def lower_bucket_kernels(lowered: LoweredProgram, sizes: dict[str, int], interpret: bool = False) -> BucketKernels:
    """Lowers one bucket again with TPU kernels where they apply and pay.

    Args:
      lowered: the portable program, lowered in this process (its decomposed graph and options in memory).
      sizes: the bucket's dim sizes.
      interpret: export for CPU with the kernels in Pallas's interpret mode instead of for TPU:
        the same program, runnable here (`lowered.run(inputs, program=result.exported)`), for checks.
    Returns:
      The BucketKernels: a static TPU program when at least one attention op uses the kernel, else
      the reason it keeps the portable program.
    """
    if lowered.graph is None or not lowered.lowering_options:
        return BucketKernels(sizes, None, reason="the program was read back from an artifact: kernels are chosen while converting")
    if lowered.precision == "bf16-mixed":
        return BucketKernels(sizes, None, reason="precision bf16-mixed casts attention operands per op: kernels not supported there yet")
    graph, skipped = kernel_graph(lowered.graph, lowered.signature, sizes)
    if graph is None:
        return BucketKernels(sizes, None, reason=skipped or NO_ATTENTION)
    options = lowered.lowering_options
    avals = [jax.ShapeDtypeStruct(spec.concrete_shape(sizes), spec.dtype) for spec in lowered.signature.inputs]
    if interpret:
        from jax.experimental.pallas import tpu as pltpu  # Pallas loads only where kernels are used

        # Pallas's plain interpreter (the kernel as a jitted scan over its grid: `pallas_call(interpret=True)`);
        # the TPU interpreter (InterpretParams) calls back to the host, which jax.export cannot serialize.
        interpreting = pltpu.force_tpu_interpret_mode(True)
    else:
        interpreting = contextlib.nullcontext()
    with recording_kernel_uses() as uses, interpreting:
        static = lower_decomposed(graph, lowered.signature, lowered.precision, lowered.matmul_precision, options["scan"], False,
                                  options["weight_only"], options["keep_f32"], avals, ("cpu",) if interpret else KERNEL_PLATFORMS)
    if static.weight_names != lowered.weight_names or static.weight_specs != lowered.weight_specs:
        return BucketKernels(sizes, None, tuple(uses), "lowered again, the program's weights came out in another order or "
                                                      "layout than the portable program's")
    if not any(use.kernel for use in uses):
        reasons = sorted({use.reason for use in uses})
        return BucketKernels(sizes, None, tuple(uses), "; ".join(reasons) + (f"; {skipped}" if skipped else ""))
    return BucketKernels(sizes, static.exported, tuple(uses), None, skipped)


def kernel_graph(program: torch.export.ExportedProgram, signature: ProgramSignature,
                 sizes: dict[str, int]) -> tuple[torch.export.ExportedProgram | None, str | None]:
    """A copy of the decomposed program with each attention whose mask has kernel form as an
    attention_kernel op (see the module docstring).

    Args:
      program: the decomposed program (after sink_attention_masks; not changed).
      signature: its signature (the inputs' dims, for the sizes of the bucket).
      sizes: the bucket's dim sizes.
    Returns:
      (the copy, or None when no attention op has kernel form; why some attention op does not,
      or None).
    """
    module = copy.deepcopy(program.graph_module)
    shapes = _input_shapes(program, signature, sizes)
    symbols = _symbol_sizes(module.graph, shapes)
    reasons, rewritten = set(), 0
    graph = module.graph
    feeding_decisions = decision_matmuls(graph)
    for attention in attention_nodes(graph):
        if attention in feeding_decisions and attention.args[0].meta["val"].dtype == torch.float32:
            reasons.add("it feeds a discrete decision (e.g. a mixture of experts' routing): its f32 dots are pinned to highest "
                        "precision, which the kernel does not compute")
            continue
        keys = _static_size(attention.args[1].meta["val"].shape[-2], symbols)
        if keys is not None and keys < KERNEL_MIN_KEYS:  # plan_kernel would say so after tracing the bucket again
            reasons.add(f"{keys} keys: below {KERNEL_MIN_KEYS} XLA's fused attention reads fewer bytes than the kernel")
            continue
        form = _mask_form(attention, shapes)
        if isinstance(form, str):
            reasons.add(form)
            continue
        causal, key_valid, query_valid, scale = form
        query, key, value = attention.args[:3]
        with graph.inserting_before(attention):
            kernel = graph.call_function(torch.ops.tpuexport.attention_kernel.default,
                                         (query, key, value, key_valid, query_valid, causal, scale))
        kernel.meta = dict(attention.meta)
        attention.replace_all_uses_with(kernel)
        graph.erase_node(attention)
        rewritten += 1
    reason = "; ".join(sorted(reasons)) or None
    if not rewritten:
        return None, reason
    graph.eliminate_dead_code()
    module.recompile()
    return program._update(module, program.graph_signature), reason


def _input_shapes(program: torch.export.ExportedProgram, signature: ProgramSignature, sizes: dict[str, int]) -> dict[str, tuple]:
    """{placeholder name: its static shape} of the user inputs at the bucket's sizes."""
    names = [spec.arg.name for spec in program.graph_signature.input_specs
             if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    return {name: spec.concrete_shape(sizes) for name, spec in zip(names, signature.inputs)}


def _symbol_sizes(graph: torch.fx.Graph, shapes: dict[str, tuple]) -> dict:
    """{sympy symbol of an input dim: its size in the bucket}, from the user inputs' symbolic shapes."""
    symbols = {}
    for node in graph.nodes:
        if node.op == "placeholder" and node.name in shapes:
            for size, static in zip(node.meta["val"].shape, shapes[node.name]):
                if isinstance(size, torch.SymInt):
                    symbols[size.node.expr] = static
    return symbols


def _static_size(size, symbols: dict) -> int | None:
    """A graph size (an int or a SymInt over the inputs' dims) at the bucket, or None if unknown."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expression = size.node.expr
    expression = expression.xreplace(symbols) if hasattr(expression, "xreplace") else expression
    return int(expression) if getattr(expression, "is_number", True) else None


class _DataDependent(Exception):
    """A mask term reads an input's values (not only sizes): it cannot be evaluated here."""


def _mask_form(attention: torch.fx.Node, shapes: dict[str, tuple]):
    """(causal, key_valid node or None, query_valid node or None, scale) of an attention op whose mask
    the kernel expresses, else the reason (a string) it does not."""
    args = list(attention.args) + [None] * (6 - len(attention.args))
    mask = attention.kwargs.get("attn_mask", args[3])
    causal = bool(attention.kwargs.get("is_causal", args[5] or False))
    dropout = attention.kwargs.get("dropout_p", args[4] or 0.0)
    scale = attention.kwargs.get("scale")
    query = attention.args[0].meta.get("val")
    if dropout or query is None or query.dim() != 4:
        return "attention over other than [batch, heads, seq, dim] operands"
    if mask is None:
        return causal, None, None, scale
    value = mask.meta.get("val")
    if value is None:
        return "an attention mask of unknown type"
    evaluated: dict = {}
    if value.dtype != torch.bool:
        visible = _additive_mask_visible(mask, shapes, evaluated)
        if visible is None:
            return "a float attention mask (added to the scores) other than 0 or the dtype's lowest value from sizes alone"
        terms = [visible]
    else:
        terms = _and_terms(mask)
    key_terms, query_terms = [], []
    for term in terms:
        try:
            constant = term if isinstance(term, torch.Tensor) else _evaluate(term, shapes, evaluated)
        except _DataDependent:
            term_shape = [str(size) for size in term.meta["val"].shape]
            if len(term_shape) != 4 or term_shape[1] != "1":
                return "a mask per head or of another rank than 4"
            if term_shape[2] == "1":
                key_terms.append(term)
            elif term_shape[3] == "1":
                query_terms.append(term)
            else:
                return "a [q, k] mask computed from the inputs' values (not causal plus padding)"
            continue
        constant = torch.as_tensor(constant, dtype=torch.bool)
        if bool(constant.all()):
            continue
        q_len, k_len = (int(size) for size in constant.shape[-2:]) if constant.dim() >= 2 else (0, 0)
        triangle = torch.ones(q_len, k_len, dtype=torch.bool).tril()
        if constant.dim() >= 2 and bool((constant == triangle).all()):
            causal = True
            continue
        return "a mask other than causal and padding (e.g. a sliding window)"
    if len(key_terms) > 1 or len(query_terms) > 1:
        return "several per-key or per-query mask terms"
    return causal, (key_terms or [None])[0], (query_terms or [None])[0], scale


def _additive_mask_visible(mask: torch.fx.Node, shapes: dict[str, tuple], evaluated: dict) -> torch.Tensor | None:
    """The keys a float mask lets each query see, when the mask is computed from sizes alone and
    holds only 0 (seen) and the dtype's lowest value or -inf (hidden): adding the lowest value
    gives its scores a softmax weight of exactly 0, as a kernel's mask does (the entry points of
    text generation build their causal masks so, as transformers' models do). Else None."""
    try:
        constant = torch.as_tensor(_evaluate(mask, shapes, evaluated))
    except _DataDependent:
        return None
    hidden = constant <= torch.finfo(constant.dtype).min
    if not bool(((constant == 0) | hidden).all()):
        return None
    return ~hidden


_AND_OPS = (aten.bitwise_and.Tensor, aten.logical_and.default)


def _and_terms(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The terms of a mask that is an AND of terms (through broadcasts)."""
    if node.target is aten.expand.default:
        return _and_terms(node.args[0])
    if node.target in _AND_OPS:
        return [term for operand in node.args for term in _and_terms(operand)]
    return [node]


def _evaluate(node, shapes: dict[str, tuple], evaluated: dict):
    """The value of a graph value computed from sizes alone (arange, comparisons of positions), in torch.

    Raises:
      _DataDependent: it reads an input's or a weight's values.
    """
    if not isinstance(node, torch.fx.Node):
        if isinstance(node, (list, tuple)):
            return type(node)(_evaluate(item, shapes, evaluated) for item in node)
        return node
    if node in evaluated:
        return evaluated[node]
    if node.op != "call_function":
        raise _DataDependent(node.name)
    if node.target is aten.sym_size.int:
        source, dim = node.args
        if source.name not in shapes:
            raise _DataDependent(node.name)
        value = shapes[source.name][dim]
    else:
        args = _evaluate(node.args, shapes, evaluated)
        kwargs = {name: _evaluate(item, shapes, evaluated) for name, item in node.kwargs.items()}
        if "device" in kwargs:  # a program captured on the meta device builds its positions there: here they need values
            kwargs["device"] = torch.device("cpu")
        try:
            value = node.target(*args, **kwargs)
        except Exception as error:  # an op that cannot run on concrete values here: treat it as reading data
            raise _DataDependent(node.name) from error
    evaluated[node] = value
    return value
