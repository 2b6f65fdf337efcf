"""Op-by-op conformance of a quantized program: every op's lowering, fed the reference's own inputs.

A deep int8 network cannot be checked end to end against its PT2E model elementwise: an int32
accumulator is exact where the PT2E model sums dequantized values in float, so some requantized
activation lands on the other side of a rounding boundary (or a tie: torch computes dynamic scales
in float64, the TPU in float32), and the one-step difference compounds through the layers
(measured: 26 dB SQNR against the PT2E model after 12 ViT-base layers, for a correct lowering). A
real lowering bug (a scale off by one step, a dropped bias, a zero point off by one) is smaller than
that in many outputs. So each op is checked on its own instead: the decomposed program runs in
torch (the PT2E model's arithmetic), and every op's JAX lowering, all in one jitted function, gets
exactly the torch values of that op's inputs. Float results must match within FLOAT_RULE;
integer results (quantized activations) may differ by one step on ties, on at most
`MAX_TIE_FRACTION` of the elements.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils import _pytree as pytree

from tpuexport.lower.op_support import lowering_for
from tpuexport.verify.compare import Tolerances

# Share of a quantized activation's elements allowed to round the other way (by one step).
MAX_TIE_FRACTION = 1e-3
# The rule for float results (benchmarks/studies/int8_errors.py, op-by-op rows, 6 tiny families x 3 modes):
# correct lowerings err up to 5.3e-5 normalized (wav2vec2: erf and group norms reassociated), the
# smallest planted bug (a scale off by one int8 step) 5.8e-3; this sits ten times from each.
FLOAT_RULE = Tolerances(atol=1e-5, rtol=5e-4, scale_tol=5e-4)
# Ops whose results are uninitialized memory (written by a later op): nothing to compare.
UNINITIALIZED = {torch.ops.aten.empty, torch.ops.aten.empty_permuted, torch.ops.aten.empty_strided,
                 torch.ops.aten.empty_like, torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided}


@dataclasses.dataclass(frozen=True)
class OpConformance:
    """The ops of one program checked against the reference's values.

    Attributes:
      ops: number of ops checked.
      failures: one line per op that does not conform (node name, op, how far off).
      worst_float_error: largest max |a - e| / (|e| + rms(e)) of any float op result.
      worst_tie_fraction: largest share of elements of an integer result that differ by one.
      sizes: the dim sizes the check ran at.
    """

    ops: int
    failures: tuple[str, ...]
    worst_float_error: float
    worst_tie_fraction: float
    sizes: dict[str, int]

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "passed": self.passed}


def check_ops(program: torch.export.ExportedProgram, inputs, sizes: dict[str, int], tolerances: Tolerances = FLOAT_RULE) -> OpConformance:
    """Checks every op of the decomposed program against torch, op by op.

    Args:
      program: the decomposed program the lowering traced (LoweredProgram.graph).
      inputs: user inputs (torch tensors).
      sizes: the dim sizes of `inputs` (for the report).
      tolerances: the rule for float results.
    Returns:
      The OpConformance.
    """
    state = {**program.state_dict, **program.constants}
    weights = [state[spec.target] for spec in program.graph_signature.input_specs
               if spec.kind != torch.export.graph_signature.InputKind.USER_INPUT]
    values = _torch_values(program, [*weights, *inputs])
    nodes = [node for node in program.graph.nodes
             if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and lowering_for(node.target) is not None
             and node.target.overloadpacket not in UNINITIALIZED]
    producers = sorted({arg for node in nodes for arg in _argument_nodes(node)}, key=lambda n: n.name)
    # Sizes (sym_size results) and other non-tensor values stay Python constants: traced, they
    # could not give shapes.
    constants = {producer: values[producer] for producer in producers if not isinstance(values[producer], torch.Tensor)}
    tensors = [producer for producer in producers if producer not in constants]
    arrays = [_to_jax(values[producer]) for producer in tensors]

    def all_ops(operands):
        bound = {**constants, **dict(zip(tensors, operands))}
        results = []
        for node in nodes:
            lowering = lowering_for(node.target)
            args, kwargs = pytree.tree_map_only(torch.fx.Node, lambda n: bound[n], (node.args, node.kwargs))
            results.append(getattr(lowering, "func", lowering)(*args, **kwargs))
        return results

    outputs = jax.jit(all_ops)(arrays)
    failures, worst_float, worst_ties = [], 0.0, 0.0
    for node, output in zip(nodes, outputs):
        for actual, expected in zip(pytree.tree_leaves(output), pytree.tree_leaves(values[node])):
            if not isinstance(expected, torch.Tensor):
                continue
            problem, float_error, ties = _compare(np.asarray(actual), expected.detach(), tolerances)
            worst_float, worst_ties = max(worst_float, float_error), max(worst_ties, ties)
            if problem:
                failures.append(f"{node.name} ({node.target}): {problem}")
    return OpConformance(len(nodes), tuple(failures), worst_float, worst_ties, dict(sizes))


def _torch_values(program: torch.export.ExportedProgram, arguments) -> dict:
    values = {}

    class Recording(torch.fx.Interpreter):
        def run_node(self, node):
            values[node] = super().run_node(node)
            return values[node]

        def call_function(self, target, args, kwargs):
            try:
                return super().call_function(target, args, kwargs)
            except RuntimeError as error:
                # Some CPU kernels (native_group_norm) require a contiguous input that the
                # decomposed graph, run op by op, does not always give them (eager PyTorch ran the
                # undecomposed model); their values do not depend on the layout.
                if "is_contiguous" not in str(error):
                    raise
                contiguous = lambda tensor: tensor.contiguous()  # noqa: E731
                return super().call_function(target, *pytree.tree_map_only(torch.Tensor, contiguous, (args, kwargs)))

    with torch.no_grad():
        Recording(program.graph_module).run(*arguments, enable_io_processing=False)
    return values


def _argument_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [arg for arg in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(arg, torch.fx.Node)]


def _to_jax(value: torch.Tensor):
    narrower = {torch.int64: torch.int32, torch.float64: torch.float32}.get(value.dtype)
    tensor = value.detach().to(narrower) if narrower else value.detach()
    if tensor.dtype == torch.bfloat16:
        return jnp.asarray(tensor.float().numpy()).astype(jnp.bfloat16)
    return jnp.asarray(tensor.numpy())


def _compare(actual: np.ndarray, expected: torch.Tensor, tolerances: Tolerances) -> tuple[str | None, float, float]:
    """(what is wrong or None, normalized float error, share of integer elements off by one)."""
    reference = expected.float().numpy() if expected.dtype == torch.bfloat16 else expected.numpy()
    if actual.shape != reference.shape:
        return f"shape {actual.shape}, expected {reference.shape}", 0.0, 0.0
    if np.issubdtype(reference.dtype, np.floating):
        a, e = actual.astype(np.float64), reference.astype(np.float64)
        finite = np.isfinite(e) & np.isfinite(a)
        scale = float(np.sqrt(np.mean(np.square(e[finite])))) if finite.any() else 0.0
        # Masked attention scores are -inf on both sides; inf - inf is NaN and isclose handles it.
        with np.errstate(invalid="ignore"):
            error = float((np.abs(a - e) / (np.abs(e) + scale + 1e-30))[finite].max(initial=0.0))
            bound = tolerances.atol + tolerances.rtol * np.abs(e) + tolerances.scale_tol * scale
            outside = int((~np.isclose(a, e, atol=0, rtol=0, equal_nan=True) & ~(np.abs(a - e) <= bound)).sum())
        return (f"{outside}/{e.size} elements outside {tolerances.describe()} (max normalized error {error:.2e})" if outside else None,
                error, 0.0)
    difference = np.abs(actual.astype(np.int64) - reference.astype(np.int64))
    if reference.dtype == np.int64 and actual.dtype == np.int32:
        # The program computes in 32-bit integers, as the TPU does; an int64 value beyond that range
        # (T5 casts log(0) = -inf to int64 for positions a later `where` discards) cannot match.
        info = np.iinfo(np.int32)
        difference = np.where((reference < info.min) | (reference > info.max), 0, difference)
    ties = float((difference > 0).mean()) if difference.size else 0.0
    if difference.max(initial=0) > 1 or ties > MAX_TIE_FRACTION:
        return f"{int((difference > 0).sum())}/{difference.size} integers differ, by up to {int(difference.max())}", 0.0, ties
    return None, 0.0, ties
