"""Running the lowered program on CPU at several dim sizes and comparing with eager PyTorch.

Sizes: chosen by what they test and bounded by their matmul FLOPs (sizes.py); the values that
depend on positions alone (rotary tables, position embeddings) also run at every dim's largest
size, whatever the budget (positions.py). Each case runs the
program twice, TPU-faithfully and in plain f32 (tolerances.py), and compares both with the eager
outputs, computed once per case. Inputs at new sizes are random but follow the example inputs
(tpuexport/inputs.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np
import torch
from torch.utils import _pytree as pytree

from tpuexport.inputs import make_inputs
from tpuexport.lower import LoweredProgram
from tpuexport.lower.matmul_precision import MATMUL_PRECISIONS
from tpuexport.verify.compare import compare_output
from tpuexport.verify.conformance import check_ops
from tpuexport.verify.positions import verify_positions
from tpuexport.verify.report import VerificationCase, VerificationReport
from tpuexport.verify.sizes import DEFAULT_BUDGET_FLOPS, FIXED_RUN_MEMORY, PlannedCase, RunMemory, plan_verification
from tpuexport.verify.tolerances import VerificationTolerances, default_tolerances
from tpuexport.verify.topk_ties import TiesToLowestIndex
from tpuexport.verify.tpu_numerics import tpu_faithful

MAX_GOLDEN_BYTES = 4 << 20


class ProgramRuns:
    """The two CPU runs of a lowered program: TPU-faithful ("tpu") and plain f32 ("cpu").

    Attributes:
      lowered: the program.
      tpu_program: the TPU-faithful Exported; `lowered.exported` itself when the TPU computes as
        the CPU does (matmul precision "highest", bfloat16 or integer matmuls only).
    """

    def __init__(self, lowered: LoweredProgram):
        self.lowered = lowered
        self.tpu_program: jax.export.Exported = tpu_faithful(lowered.exported, MATMUL_PRECISIONS[lowered.matmul_precision])

    @property
    def runs_differ(self) -> bool:
        return self.tpu_program is not self.lowered.exported

    def run(self, inputs: Sequence[np.ndarray]) -> dict[str, list[np.ndarray]]:
        """{"tpu": outputs, "cpu": outputs}; one run when both programs are the same.

        Raises:
          TpuExportError: inputs that do not fit the signature.
        """
        cpu = self.lowered.run(inputs)
        return {"tpu": self.lowered.run(inputs, program=self.tpu_program) if self.runs_differ else cpu, "cpu": cpu}


def verify(
    lowered: LoweredProgram,
    reference: Callable[..., Any],
    example_inputs: Sequence[torch.Tensor],
    tolerances: VerificationTolerances | None = None,
    budget_flops: float = DEFAULT_BUDGET_FLOPS,
    requested_sizes: tuple[dict[str, int], ...] = (),
    check_op_by_op: bool = False,
    memory: RunMemory = FIXED_RUN_MEMORY,
) -> VerificationReport:
    """Compares the lowered program with the eager model at every planned size.

    Args:
      lowered: the lowered program (runs on CPU).
      reference: the eager model (nn.Module or callable) taking the inputs positionally.
      example_inputs: the flat example inputs, in signature order.
      tolerances: None for the defaults of the program's settings (float programs).
      budget_flops: matmul FLOPs the optional sizes may add (sizes.py).
      requested_sizes: sizes that must be verified.
      check_op_by_op: also check every op against the reference's own values at the cheapest
        case (conformance.py; for quantized programs, whose end-to-end rounding differences
        compound). Needs `lowered.graph`.
      memory: what an optional run may hold (sizes.run_memory of the conversion's memory budget).
    Returns:
      The VerificationReport, passed or not; it also carries the golden data to store.
    """
    tolerances = tolerances or default_tolerances(lowered.resolved_precision, lowered.matmul_precision, quantized=False)
    signature = lowered.signature
    runs = ProgramRuns(lowered)
    cases, golden = [], {}
    golden_bytes = 0
    plan = plan_verification(signature, lowered.matmul_flops, budget_flops, requested_sizes, memory)
    planned_cases = plan.cases
    conformance = None
    for index, planned in enumerate(planned_cases):
        inputs = list(example_inputs) if planned.label == "example" else make_inputs(signature.inputs, example_inputs, planned.sizes, seed=index)
        if check_op_by_op and planned is min(planned_cases, key=lambda case: case.flops):
            conformance = check_ops(lowered.graph, inputs, planned.sizes)
        case, expected = run_case(runs, reference, inputs, planned, tolerances)
        if case.error is None:
            arrays = {f"{index}/input/{s.name}": to_numpy(t) for s, t in zip(signature.inputs, inputs)}
            arrays.update({f"{index}/output/{s.name}": e for s, e in zip(signature.outputs, expected)})
            size = sum(a.nbytes for a in arrays.values())
            if index == 0 or golden_bytes + size <= MAX_GOLDEN_BYTES:
                golden.update(arrays)
                golden_bytes += size
                case = dataclasses.replace(case, golden=True)
        cases.append(case)
    if not check_op_by_op:  # float programs: quantized ones are checked op by op
        positions = verify_positions(lowered, example_inputs, tolerances, make_inputs)
        if positions is not None:
            cases.append(positions)
    return VerificationReport(lowered.precision, lowered.matmul_precision, tolerances, tuple(cases), golden,
                              budget_flops=budget_flops, conformance=conformance, skipped=tuple(plan.skipped))


def run_case(runs: ProgramRuns, reference, inputs, planned: PlannedCase, tolerances) -> tuple[VerificationCase, list[np.ndarray] | None]:
    """Runs one case: eager once, then both program runs.

    Returns:
      (case, eager outputs); errors from either side become the case's error (outputs None).
    """
    try:
        expected = eager_outputs(reference, inputs)
    except Exception as error:  # the user's model may raise anything
        case = VerificationCase(planned.label, planned.sizes, {}, f"eager PyTorch raised {type(error).__name__}: {short_error(error)} "
                                "(the model itself fails at these sizes: narrow its dims, --dim NAME=MIN:MAX)",
                                reason=planned.reason, flops=planned.flops)
        return case, None
    case = compare_case(runs, [to_numpy(t) for t in inputs], expected, planned, tolerances)
    return case, (expected if case.error is None else None)


def compare_case(runs: ProgramRuns, inputs: Sequence[np.ndarray], expected: Sequence[np.ndarray], planned: PlannedCase,
                 tolerances: VerificationTolerances) -> VerificationCase:
    """Runs both programs on `inputs` and compares their outputs with `expected`; a run that
    raises becomes the case's error."""
    try:
        actual = runs.run(inputs)
    except Exception as error:  # shape assertions, XLA runtime errors
        return VerificationCase(planned.label, planned.sizes, {}, f"lowered program raised {type(error).__name__}: {short_error(error)}",
                                reason=planned.reason, flops=planned.flops)
    outputs = runs.lowered.signature.outputs
    comparisons = {
        run: tuple(compare_output(spec.name, a, e, getattr(tolerances, run)) for spec, a, e in zip(outputs, actual[run], expected))
        for run in ("tpu", "cpu")
    }
    return VerificationCase(planned.label, planned.sizes, comparisons, reason=planned.reason, flops=planned.flops)


def eager_outputs(reference, inputs) -> list[np.ndarray]:
    """The eager model's flat outputs as numpy arrays (bf16/f16 as float32), top-k ties broken as XLA breaks them."""
    with torch.no_grad(), TiesToLowestIndex():
        outputs = reference(*inputs)
    return [to_numpy(t) for t in pytree.tree_leaves(outputs)]


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach()
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.float()
    return tensor.numpy()


def short_error(error: BaseException) -> str:
    """An exception's message on one line, at most 300 characters."""
    return " ".join(str(error).split())[:300]
