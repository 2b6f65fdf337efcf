"""Verification of an int8 (PT2E) text-generation artifact: its prefill and decode against the
PT2E-converted entry points, by the rule forward int8 programs are verified with; the float
model's logits over the same tokens for the quantization report.

Greedy parity with the float model is not expected from int8 arithmetic, so, as for a forward int8
program, the reference is the PT2E-converted model run eagerly (its int8 rounding modelled in
float), and the float model gives the SQNR of the quantization report:

  reference  the PT2E-converted prefill and decode run eagerly, greedily (each decode step fed its
             own argmax), in the same cases as float generation verification (generation.py):
             rows of mixed lengths, padded into a prefill bucket, written into slots in reverse
             order, then N decode steps.
  artifact   both CPU runs teacher-forced with the reference's tokens, compared by generation.py's
             rule with the int8 tolerances (tolerances.QUANTIZED): the logits of every step within
             them, and every step's argmax the reference's token unless the two logits lie within
             that tolerance of each other (a tie).
  op by op   every op of each entry point's program against the PT2E model's own values at the
             first case's inputs (conformance.py), as for forward int8.
  float      the float model's forward over each prompt followed by the reference's tokens (no
             cache, no entry point): the SQNR of the artifact's logits against it, and the first
             step where the float model would pick another token (where free-running int8 greedy
             generation first departs from the float model's). Reported, not a pass condition.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch.utils import _pytree as pytree

from tpuexport import arrays
from tpuexport.lower.generation import GenerationProgram, GenerationSession, Runner
from tpuexport.verify.compare import sqnr_db
from tpuexport.verify.conformance import OpConformance, check_ops
from tpuexport.verify.generation import (GenerationCase, GenerationReport, any_batch, artifact_raised, compare_run, cpu_runs, plan_prompts,
                                         store_golden_case, teacher_forced_runs, verified_fills)
from tpuexport.verify.sizes import MAX_FILL_TEMPORARY_BYTES
from tpuexport.verify.tolerances import VerificationTolerances
from tpuexport.verify.topk_ties import TiesToLowestIndex


RULE = " ".join(__doc__[__doc__.index("Greedy parity"):].split())


@dataclasses.dataclass(frozen=True)
class QuantizedGenerationReport(GenerationReport):
    """A GenerationReport against the PT2E entry points, with the op-by-op checks and the float comparison.

    Attributes:
      conformance: {entry point: OpConformance}.
      float_comparison: {"logits": {"sqnr_db", "pt2e_sqnr_db", "cpu_sqnr_db"}, "first_divergence":
        [{"case", "row", "step"}]} (module docstring; step None: no divergence within the case's tokens).
      rule: how the program was compared (this module's docstring, or a paged step's).
    """

    conformance: dict[str, OpConformance] = dataclasses.field(default_factory=dict)
    float_comparison: dict = dataclasses.field(default_factory=dict)
    rule: str = RULE

    @property
    def passed(self) -> bool:
        return super().passed and all(check.passed for check in self.conformance.values())

    def failure_summary(self, hint: bool = True) -> str:
        clauses = [] if super().passed else [super().failure_summary(hint)]
        for name, check in self.conformance.items():
            if not check.passed:
                clauses.append(f"{len(check.failures)} op(s) of {name} do not reproduce the reference given its own inputs: "
                               + "; ".join(check.failures[:5]))
        return "; ".join(clauses) or "generation matches"

    def to_json(self) -> dict:
        return {**super().to_json(), "rule": self.rule,
                "conformance": {name: check.to_json() for name, check in self.conformance.items()},
                "float_comparison": self.float_comparison}


def torch_runner(modules: dict, record: dict | None = None) -> Runner:
    """Runs entry points as torch modules (the PT2E-converted ones), numpy in and out.

    Args:
      modules: {entry point: module taking its inputs in signature order}.
      record: a dict that receives each entry point's first inputs (torch tensors), or None.
    """

    def run(name: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
        # bfloat16 in and out as bfloat16 (an int8 KV cache's scales in a bf16 model are state: an f32
        # copy would come back as f32 scales); the logits are float32 already.
        tensors = [arrays.to_torch(np.asarray(array)) for array in inputs]
        if record is not None:
            record.setdefault(name, tensors)
        with torch.no_grad(), TiesToLowestIndex():
            return [arrays.to_numpy(output.detach()) for output in pytree.tree_leaves(modules[name](*tensors))]

    return run


def greedy_logits(session: GenerationSession, prompts, slots, seq: int, steps: int) -> tuple[list[list[int]], np.ndarray]:
    """Greedy generation through `session`: (each row's tokens, its logits [rows, steps, vocab])."""
    spec = session.program.spec
    logits = [[row] for row in session.prefill(prompts, slots, seq=seq)]
    tokens = [[int(row[0].argmax())] for row in logits]
    for step in range(1, steps):
        step_tokens = np.zeros(spec.max_batch, np.int64)
        positions = np.zeros(spec.max_batch, np.int64)
        for row, slot in enumerate(slots):
            step_tokens[slot], positions[slot] = tokens[row][-1], len(prompts[row]) + step - 1
        step_logits = session.decode(step_tokens, positions)
        for row, slot in enumerate(slots):
            logits[row].append(step_logits[slot])
            tokens[row].append(int(step_logits[slot].argmax()))
    return tokens, np.stack([np.stack(row) for row in logits]).astype(np.float32)


def float_logits(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The float model's next-token logits after the prompt and each of `tokens` but the last: [steps, vocab]."""
    sequence = torch.tensor([list(prompt) + list(tokens[:-1])])
    with torch.no_grad(), TiesToLowestIndex():
        logits = model(input_ids=sequence, attention_mask=torch.ones_like(sequence)).logits[0]
    return logits[len(prompt) - 1:].float().numpy()


def verify_quantized_generation(program: GenerationProgram, model: torch.nn.Module, references: dict,
                                tolerances: VerificationTolerances, new_tokens: int,
                                fill_bytes: int = MAX_FILL_TEMPORARY_BYTES) -> QuantizedGenerationReport:
    """Verifies an int8 generation program (module docstring).

    Args:
      program: the lowered int8 generation program (with weights).
      model: the float Hugging Face causal LM.
      references: {entry point: its PT2E-converted module}.
      tolerances: the int8 tolerances (default_tolerances(..., quantized=True)).
      new_tokens: tokens generated per prompt.
      fill_bytes: the CPU temporaries a case's fill may need (generation.verified_fills).
    Returns:
      The report, passed or not, with golden data (prompts, the reference's tokens and logits)
      that `tpuexport verify` replays with generation.py's replay_golden.
    """
    decode = program.entry_points["decode"]
    runs_programs = cpu_runs(program)
    first_inputs: dict[str, list[torch.Tensor]] = {}
    reference_runner = torch_runner(references, first_inputs)
    cases, golden = [], {}
    artifact_logits, pt2e_logits, cpu_logits, float_values, divergences = [], [], [], [], []
    for index, (sizes, note) in enumerate(verified_fills(program, fill_bytes)):
        prompts, slots, steps = plan_prompts(program, sizes, new_tokens, seed=index)
        lengths = tuple(len(prompt) for prompt in prompts)
        tokens, expected = greedy_logits(GenerationSession(any_batch(program), reference_runner), prompts, slots, sizes["seq"], steps)
        try:
            actual = teacher_forced_runs(program, runs_programs, prompts, slots, sizes["seq"], tokens)
        except Exception as error:  # XLA runtime errors, shape assertions
            cases.append(GenerationCase(sizes, lengths, tuple(slots), steps, {}, artifact_raised(error), note=note))
            continue
        runs = {name: compare_run(logits, expected, tokens, getattr(tolerances, name)) for name, logits in actual.items()}
        for row, prompt in enumerate(prompts):
            reference = float_logits(model, prompt, tokens[row])
            float_values.append(reference)
            artifact_logits.append(actual["tpu"][row])
            cpu_logits.append(actual["cpu"][row])
            pt2e_logits.append(expected[row])
            departs = [step for step in range(steps) if int(reference[step].argmax()) != tokens[row][step]]
            divergences.append({"case": index, "row": row, "step": departs[0] if departs else None})
        stored = store_golden_case(golden, index, prompts, slots, sizes["seq"], tokens, expected)
        cases.append(GenerationCase(sizes, lengths, tuple(slots), steps, runs, golden=stored, note=note))
    conformance = {name: check_ops(program.entry_points[name].graph, inputs, op_sizes(program.entry_points[name], inputs))
                   for name, inputs in first_inputs.items()}
    comparison = {
        "rule": "SQNR of the artifact's teacher-forced logits (TPU-faithful run; cpu: plain f32 run; pt2e: the PT2E model) against "
                "the float model's forward over the same prompt and tokens, over every verified step; first_divergence: the first "
                "step where the float model's argmax is not the int8 greedy token (null: none)",
        "logits": {"sqnr_db": sqnr_db(float_values, artifact_logits), "cpu_sqnr_db": sqnr_db(float_values, cpu_logits),
                   "pt2e_sqnr_db": sqnr_db(float_values, pt2e_logits)},
        "first_divergence": divergences,
    }
    return QuantizedGenerationReport(decode.resolved_precision, decode.matmul_precision, tolerances, tuple(cases), golden,
                                     "the PT2E-converted entry points' greedy generation, eager PyTorch", conformance, comparison)


def op_sizes(lowered, inputs: list[torch.Tensor]) -> dict[str, int]:
    """The dim sizes of an entry point's inputs (for the op-by-op report)."""
    return lowered.signature.sizes_of([tuple(tensor.shape) for tensor in inputs])
