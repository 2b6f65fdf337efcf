"""Running the lowered program on CPU at several dim sizes and comparing with eager PyTorch.

Sizes: the example sizes, then every dim at its minimum, and at a middle size and at its maximum
when those are cheap (inputs of at most MAX_CHEAP_ELEMENTS elements), so every dynamic dim is
exercised at two or more sizes when its range allows. Inputs at new sizes are random but
follow the example inputs: floats with their mean and spread, integers within their value
range (token ids stay valid), bools with their rate of True (an all-True mask stays all True).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils import _pytree as pytree

from tpuexport.lower import LoweredProgram
from tpuexport.signature import ProgramSignature, TensorSpec
from tpuexport.verify.compare import DEFAULT_TOLERANCES, Tolerances, compare_output
from tpuexport.verify.report import VerificationCase, VerificationReport

MAX_CHEAP_ELEMENTS = 1 << 21
MAX_GOLDEN_BYTES = 4 << 20


def verification_sizes(signature: ProgramSignature) -> list[tuple[str, dict[str, int]]]:
    """The (label, sizes) cases to verify; the first is always the example sizes."""
    example = signature.example_sizes()
    cases = [("example", example)]
    if not signature.dims:
        return cases
    minimum = {d.name: d.min for d in signature.dims}
    ceiling = {d.name: d.max if d.max is not None else max(4 * d.example, d.min) for d in signature.dims}
    middle = {d.name: _middle_size(d, ceiling[d.name]) for d in signature.dims}
    for label, sizes in (("min", minimum), ("mid", middle), ("max", ceiling)):
        if label != "min" and _input_elements(signature, sizes) > MAX_CHEAP_ELEMENTS:
            continue
        if all(sizes != seen for _, seen in cases):
            cases.append((label, sizes))
    return cases


def _middle_size(dim, ceiling: int) -> int:
    """A size inside the range that differs from the example (the range's middle when possible)."""
    middle = (dim.min + ceiling + 1) // 2
    if middle == dim.example and middle + 1 <= ceiling:
        middle += 1
    return middle


def _input_elements(signature: ProgramSignature, sizes: dict[str, int]) -> int:
    return sum(int(np.prod(spec.concrete_shape(sizes))) for spec in signature.inputs)


def make_inputs(specs: Sequence[TensorSpec], examples: Sequence[torch.Tensor], sizes: dict[str, int], seed: int) -> list[torch.Tensor]:
    """Random inputs at `sizes` that follow the example inputs' values (see module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    made = []
    for spec, example in zip(specs, examples):
        shape = spec.concrete_shape(sizes)
        if example.dtype.is_floating_point:
            values = example.detach().float()
            spread = float(values.std()) if values.numel() > 1 else 1.0
            tensor = torch.randn(shape, generator=generator) * (spread or 1.0) + float(values.mean())
        elif example.dtype == torch.bool:
            tensor = torch.rand(shape, generator=generator) < float(example.float().mean())
        else:
            low, high = int(example.min()), int(example.max())
            tensor = torch.randint(low, high + 1, shape, generator=generator)
        made.append(tensor.to(example.dtype))
    return made


def verify(
    lowered: LoweredProgram,
    reference: Callable[..., Any],
    example_inputs: Sequence[torch.Tensor],
    tolerances: Tolerances | None = None,
) -> VerificationReport:
    """Compares the lowered program with the eager model at every verification size.

    Args:
      lowered: the lowered program (runs on CPU).
      reference: the eager model (nn.Module or callable) taking the inputs positionally.
      example_inputs: the flat example inputs, in signature order.
      tolerances: None for the precision's defaults (DEFAULT_TOLERANCES).
    Returns:
      The VerificationReport, passed or not; it also carries the golden data to store.
    """
    tolerances = tolerances or DEFAULT_TOLERANCES[lowered.precision]
    signature = lowered.signature
    cases, golden = [], {}
    golden_bytes = 0
    for index, (label, sizes) in enumerate(verification_sizes(signature)):
        inputs = list(example_inputs) if label == "example" else make_inputs(signature.inputs, example_inputs, sizes, seed=index)
        case, expected = run_case(lowered, reference, inputs, label, sizes, tolerances)
        if case.error is None:
            arrays = {f"{index}/input/{s.name}": to_numpy(t) for s, t in zip(signature.inputs, inputs)}
            arrays.update({f"{index}/output/{s.name}": e for s, e in zip(signature.outputs, expected)})
            size = sum(a.nbytes for a in arrays.values())
            if index == 0 or golden_bytes + size <= MAX_GOLDEN_BYTES:
                golden.update(arrays)
                golden_bytes += size
                case = VerificationCase(case.label, case.sizes, case.outputs, case.error, golden=True)
        cases.append(case)
    return VerificationReport(lowered.precision, tolerances, tuple(cases), golden)


def run_case(lowered, reference, inputs, label, sizes, tolerances) -> tuple[VerificationCase, list[np.ndarray] | None]:
    """Runs one case.

    Returns:
      (case, eager outputs); errors from either side become the case's error (outputs None).
    """
    try:
        expected = eager_outputs(reference, inputs)
    except Exception as error:  # the user's model may raise anything
        return VerificationCase(label, sizes, (), error=f"eager PyTorch raised {type(error).__name__}: {short_error(error)}"), None
    case = compare_case(lowered, [to_numpy(t) for t in inputs], expected, label, sizes, tolerances)
    return case, (expected if case.error is None else None)


def compare_case(lowered, inputs: Sequence[np.ndarray], expected: Sequence[np.ndarray], label, sizes, tolerances) -> VerificationCase:
    """Runs the lowered program on `inputs` and compares its outputs with `expected`; a run that
    raises becomes the case's error."""
    try:
        actual = lowered.run(inputs)
    except Exception as error:  # shape assertions, XLA runtime errors
        return VerificationCase(label, sizes, (), error=f"lowered program raised {type(error).__name__}: {short_error(error)}")
    comparisons = tuple(
        compare_output(spec.name, a, e, tolerances) for spec, a, e in zip(lowered.signature.outputs, actual, expected)
    )
    return VerificationCase(label, sizes, comparisons)


def eager_outputs(reference, inputs) -> list[np.ndarray]:
    """The eager model's flat outputs as numpy arrays (bf16/f16 as float32)."""
    with torch.no_grad():
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
