"""Which dim sizes verification runs: chosen by what they test, bounded by what they cost.

Always (whatever they cost):
  example   the sizes of the example inputs, with the user's own input values
  min       every dim at its minimum (size-1 broadcasting, single-token and single-image paths)
  second    for a dim the example leaves at its minimum: the minimum + 1 (every dim runs at two sizes)
  requested sizes the user asked for (--verify-size)
Then, in this order, each only if the extra cases' matmul FLOPs stay within the budget:
  max       every dim at its maximum (the ends of position tables, the largest buckets)
  max-<dim> one dim at its maximum, the others at their minimum (when "max" does not fit)
  mid       a size inside each range that differs from the example (odd where possible)
An unbounded dim's maximum counts as 4x its example size. Costs come from the program's matmul
FLOPs polynomial (lower/cost.py), so choosing sizes runs nothing. An optional case also stays within
what one run holds in memory: its inputs (MAX_OPTIONAL_INPUT_ELEMENTS) and its outputs
(RunMemory.output_bytes, counted at 4 bytes an element or more: the comparisons compute in f32).
A language model's logits are what a cheap-looking size makes large: Llama-3.2-1B's at batch 8 x seq
2048 are 8 GiB in f32 for 1.1e11 FLOPs of its 16 layers.

The per-run bounds come from the conversion's memory budget (tpuexport/memory.py): what is left of
it when verification starts (the budget minus what the process holds then: the weights, the eager
model, the libraries) is shared out by RUN_OUTPUT_FACTOR and FILL_SHARE, and capped by
MAX_OPTIONAL_OUTPUT_BYTES and MAX_FILL_TEMPORARY_BYTES, which apply as they are when the budget
leaves room for them (a 16-24 GB machine's default budget does) or is unknown.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tpuexport.safetensors_files import numpy_dtype
from tpuexport.defaults import DEFAULT_BUDGET_FLOPS
from tpuexport.errors import TpuExportError
from tpuexport.lower.cost import flops_at
from tpuexport.memory import UNKNOWN, MemoryBudget, gib
from tpuexport.signature import ProgramSignature

# Optional cases also stay below this many input elements (the eager and XLA runs hold them all).
MAX_OPTIONAL_INPUT_ELEMENTS = 1 << 24
# ... and below this many bytes of outputs per run (eager's and both program runs' are held at once).
MAX_OPTIONAL_OUTPUT_BYTES = 1 << 30
# A text-generation fill case's XLA:CPU temporaries (its prefill's attention scores over the cache
# grow with batch x seq x max context: a Llama-3.2-1B-shaped fill of 8 x 2048 in a 4096 context, 11.3 GiB).
# Larger fills are verified with fewer rows, then shorter prompts (verify/generation.py).
MAX_FILL_TEMPORARY_BYTES = 2 << 30
# An optional run holds up to this many times its outputs' f32 bytes: eager's and both program runs'
# outputs (3), and while a program runs, XLA's buffers of the outputs' size (a logits matmul's result
# before its bias, ~1). Measured (benchmarks/studies/compare_memory.py run: the verify stage's peak
# above what the process held when it started, over the "max" case's outputs): 4.4 x at 128 MiB of
# logits, 4.1 x at 512 MiB. compare_output works in chunks (7.4 MiB at peak, whatever the output);
# done whole it added 17 (20.4 x measured at 128 MiB, hence the factor 20 it replaces).
RUN_OUTPUT_FACTOR = 5
# A fill case's XLA:CPU temporaries may take this share of what is left of the budget; the rest is
# for its cache, logits and eager generate()'s own cache.
FILL_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class RunMemory:
    """What one optional verification run may hold, from the conversion's memory budget.

    Attributes:
      output_bytes: the outputs' bytes (at 4 bytes an element or more) an optional run may produce.
      fill_bytes: the XLA:CPU temporaries a text-generation fill case may need (generation.verified_fills).
      budget: the conversion's memory budget, or None for the fixed bounds alone (no budget given).
      resident_bytes: what the process held when verification started, or None where it cannot be read.
    """

    output_bytes: int = MAX_OPTIONAL_OUTPUT_BYTES
    fill_bytes: int = MAX_FILL_TEMPORARY_BYTES
    budget: MemoryBudget | None = None
    resident_bytes: int | None = None

    @property
    def budget_limits(self) -> bool:
        """Whether the budget, not the fixed bounds, set these figures."""
        return self.output_bytes < MAX_OPTIONAL_OUTPUT_BYTES or self.fill_bytes < MAX_FILL_TEMPORARY_BYTES

    def why(self) -> str:
        """What a shrunk or skipped case's reason names: the budget (when it set the bounds) or the fixed bound."""
        if not self.budget_limits:
            return "the fixed per-run bound"
        return (f"the memory budget {self.budget.describe()}, of which the process held {gib(self.resident_bytes)} "
                "when verification started")

    def to_json(self) -> dict:
        """The manifest's build "memory_budget" entry."""
        return {"budget": None if self.budget is None else self.budget.to_json(),
                "resident_bytes": UNKNOWN if self.resident_bytes is None else self.resident_bytes,
                "output_bytes": self.output_bytes, "fill_bytes": self.fill_bytes, "limited_by_budget": self.budget_limits}


FIXED_RUN_MEMORY = RunMemory()


def run_memory(budget: MemoryBudget | None, resident_bytes: int | None) -> RunMemory:
    """The per-run bounds left by `budget` to a process holding `resident_bytes` (see the module
    docstring); the fixed bounds when the budget is unknown."""
    if budget is None or budget.bytes is None:
        return RunMemory(budget=budget, resident_bytes=resident_bytes)
    left = max(0, budget.bytes - (resident_bytes or 0))
    return RunMemory(min(MAX_OPTIONAL_OUTPUT_BYTES, int(left / RUN_OUTPUT_FACTOR)), min(MAX_FILL_TEMPORARY_BYTES, int(left * FILL_SHARE)),
                     budget, resident_bytes)


@dataclasses.dataclass(frozen=True)
class PlannedCase:
    """One set of sizes to verify.

    Attributes:
      label: "example", "min", "second-<dim>", "requested", "max", "max-<dim>" or "mid".
      sizes: {dim name: size}.
      reason: why it runs ("always", "coverage", "requested", "within budget").
      flops: matmul FLOPs of one run at these sizes.
    """

    label: str
    sizes: dict[str, int]
    reason: str
    flops: float


@dataclasses.dataclass(frozen=True)
class SkippedCase:
    """An optional case not run, and why.

    Attributes:
      label: "max", "max-<dim>" or "mid".
      sizes: {dim name: size}.
      reason: what it would have cost beyond which budget or bound.
    """

    label: str
    sizes: dict[str, int]
    reason: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class CasePlan:
    """The cases to verify (the first is always "example") and the optional ones left out."""

    cases: list[PlannedCase]
    skipped: list[SkippedCase]


def plan_cases(
    signature: ProgramSignature,
    flops_expression: str,
    budget_flops: float = DEFAULT_BUDGET_FLOPS,
    requested: tuple[dict[str, int], ...] = (),
    memory: RunMemory = FIXED_RUN_MEMORY,
) -> list[PlannedCase]:
    """The cases to verify, by the rule in the module docstring (plan_verification's cases)."""
    return plan_verification(signature, flops_expression, budget_flops, requested, memory).cases


def plan_verification(
    signature: ProgramSignature,
    flops_expression: str,
    budget_flops: float = DEFAULT_BUDGET_FLOPS,
    requested: tuple[dict[str, int], ...] = (),
    memory: RunMemory = FIXED_RUN_MEMORY,
) -> CasePlan:
    """The cases to verify, by the rule in the module docstring, and the optional ones left out.

    Args:
      signature: the program's signature (dims with ranges and example sizes).
      flops_expression: the program's matmul FLOPs over the dim names.
      budget_flops: FLOPs the optional cases may add.
      requested: sizes that must be verified (each checked against the dims' ranges by the caller).
      memory: what an optional run may hold (run_memory).
    Returns:
      The CasePlan; its cases without duplicates.
    """
    cases: list[PlannedCase] = []
    skipped: list[SkippedCase] = []

    def add(label: str, sizes: dict[str, int], reason: str) -> None:
        if all(sizes != case.sizes for case in cases):
            cases.append(PlannedCase(label, dict(sizes), reason, flops_at(flops_expression, sizes)))

    add("example", signature.example_sizes(), "always")
    if not signature.dims:
        return CasePlan(cases, skipped)
    minimum = {d.name: d.min for d in signature.dims}
    ceiling = {d.name: d.max if d.max is not None else max(4 * d.example, d.min) for d in signature.dims}
    add("min", minimum, "always")
    for dim in signature.dims:
        # Only seen at its minimum so far (the example uses it too): the next size up is the cheapest second one.
        if len({case.sizes[dim.name] for case in cases}) == 1 and ceiling[dim.name] > dim.min:
            add(f"second-{dim.name}", {**minimum, dim.name: dim.min + 1}, "coverage")
    for sizes in requested:
        add("requested", sizes, "requested")

    spent = 0.0

    def add_within_budget(label: str, sizes: dict[str, int]) -> bool:
        nonlocal spent
        cost = flops_at(flops_expression, sizes)
        beyond = (f"{cost:.3g} matmul FLOPs, beyond the {budget_flops - spent:.3g} left of the FLOPs budget"
                  if spent + cost > budget_flops else beyond_memory_bound(signature, sizes, memory))
        if beyond:
            skipped.append(SkippedCase(label, dict(sizes), beyond))
            return False
        if all(sizes != case.sizes for case in cases):
            spent += cost
            add(label, sizes, "within budget")
        return True

    if not add_within_budget("max", ceiling) and len(signature.dims) > 1:
        for dim in signature.dims:
            add_within_budget(f"max-{dim.name}", {**minimum, dim.name: ceiling[dim.name]})
    example = signature.example_sizes()
    add_within_budget("mid", {d.name: _middle_size(d.min, ceiling[d.name], example[d.name]) for d in signature.dims})
    return CasePlan(cases, skipped)


def _middle_size(low: int, high: int, example: int) -> int:
    """A size inside [low, high] that differs from the example: the middle, made odd when possible."""
    middle = (low + high) // 2
    if middle % 2 == 0 and middle + 1 <= high:
        middle += 1
    if middle == example and middle + 2 <= high:
        middle += 2
    return middle


def within_memory_bound(signature: ProgramSignature, sizes: dict[str, int], memory: RunMemory = FIXED_RUN_MEMORY) -> bool:
    """Whether an optional run at `sizes` stays within MAX_OPTIONAL_INPUT_ELEMENTS and `memory.output_bytes`."""
    return not beyond_memory_bound(signature, sizes, memory)


def beyond_memory_bound(signature: ProgramSignature, sizes: dict[str, int], memory: RunMemory = FIXED_RUN_MEMORY) -> str:
    """Why an optional run at `sizes` is beyond what a run may hold ("" when it is not)."""
    elements = _input_elements(signature, sizes)
    if elements > MAX_OPTIONAL_INPUT_ELEMENTS:
        return f"{elements:,} input elements, beyond the {MAX_OPTIONAL_INPUT_ELEMENTS:,} a run may hold"
    outputs = output_bytes(signature, sizes)
    if outputs > memory.output_bytes:
        return f"outputs of {gib(outputs)}, beyond the {gib(memory.output_bytes)} a run may hold ({memory.why()})"
    return ""


def output_bytes(signature: ProgramSignature, sizes: dict[str, int]) -> int:
    """The outputs' bytes at `sizes`, at 4 bytes an element or more (compared in f32)."""
    return sum(int(np.prod(spec.concrete_shape(sizes))) * max(4, numpy_dtype(spec.dtype).itemsize) for spec in signature.outputs)


def _input_elements(signature: ProgramSignature, sizes: dict[str, int]) -> int:
    return sum(int(np.prod(spec.concrete_shape(sizes))) for spec in signature.inputs)


def resolve_requested_sizes(signature: ProgramSignature, requested: tuple[dict[str, int], ...]) -> tuple[dict[str, int], ...]:
    """Completes and checks user-requested verification sizes (dims not named keep their example size).

    Raises:
      TpuExportError: an unknown dim or a size outside its range.
    """
    known = {dim.name: dim for dim in signature.dims}
    resolved = []
    for sizes in requested:
        for name, size in sizes.items():
            dim = known.get(name)
            if dim is None:
                raise TpuExportError(f"--verify-size names unknown dim {name!r}; the program's dims are: {', '.join(known) or 'none'}")
            if not dim.accepts(size):
                raise TpuExportError(f"--verify-size {name}={size} is out of range: {name} accepts {dim.range_text}")
        resolved.append({**signature.example_sizes(), **sizes})
    return tuple(resolved)
