"""Verification of a text-generation artifact with an int8 KV cache (--kv-cache-dtype int8): its
prefill and decode against the same entry points run eagerly, as quantized_generation.py verifies a
PT2E artifact, and the float model's generate() measured, not gated.

The int8 cache's rounding is part of the entry points (export/generation.py quantizes on write and
dequantizes on read), so the eager entry points define exactly what the artifact computes, while
Hugging Face generate() (a float cache) does not:

  reference  the eager int8-KV prefill and decode driven greedily (each decode step fed its own
             argmax), in the cases of float generation verification (generation.py): rows of mixed
             lengths padded into a prefill bucket, written into slots in reverse order, N decode steps.
  artifact   both CPU runs teacher-forced with the reference's tokens, compared by generation.py's
             rule with the FLOAT tolerances of the program's precision: every step's logits within
             them, every step's argmax the reference's token unless a tie.
  float      generate(do_sample=False) of the float-cache model (FloatDivergence, as for weight-only
             programs): the first step where the int8-KV greedy tokens leave it, and the SQNR of the
             artifact's logits (TPU-faithful run) against its logits up to that step.
"""

from __future__ import annotations

import numpy as np

from tpuexport.lower.generation import GenerationProgram, GenerationSession
from tpuexport.verify.generation import (DEFAULT_NEW_TOKENS, GenerationCase, GenerationReport, any_batch, artifact_raised, compare_run, cpu_runs,
                                         float_divergence, plan_prompts, store_golden_case, teacher_forced_runs, verified_fills)
from tpuexport.verify.quantized_generation import greedy_logits, torch_runner
from tpuexport.verify.sizes import MAX_FILL_TEMPORARY_BYTES
from tpuexport.verify.tolerances import VerificationTolerances

# The report's `against` (what the artifact is compared with).
INT8_KV_AGAINST = "the int8-KV entry points' greedy generation, eager PyTorch"


def verify_int8_kv_generation(program: GenerationProgram, modules: dict, tolerances: VerificationTolerances,
                              float_reference: list[list[tuple[list[int], np.ndarray]]],
                              new_tokens: int = DEFAULT_NEW_TOKENS, fill_bytes: int = MAX_FILL_TEMPORARY_BYTES) -> GenerationReport:
    """Verifies an int8-KV generation program (module docstring).

    Args:
      program: the lowered generation program (with weights), spec.kv_cache_dtype "int8".
      modules: {entry point: eager module} with the artifact's int8 cache (export.entry_point_modules
        of the spec), computing with the artifact's weights (a weight-only program's rounded).
      tolerances: the float tolerances of the program's precision settings.
      float_reference: generate() of the float-cache model per case and row (eager_references).
      new_tokens: tokens generated per prompt.
      fill_bytes: the CPU temporaries a case's fill may need (generation.verified_fills).
    Returns:
      The GenerationReport, passed or not, with golden data (prompts, the reference's tokens and
      logits) that `tpuexport verify` replays with generation.py's replay_golden.
    """
    decode = program.entry_points["decode"]
    runs_programs = cpu_runs(program)
    reference_runner = torch_runner(modules)
    cases, golden = [], {}
    for index, (sizes, note) in enumerate(verified_fills(program, fill_bytes)):
        prompts, slots, steps = plan_prompts(program, sizes, new_tokens, seed=index)
        lengths = tuple(len(prompt) for prompt in prompts)
        try:
            tokens, expected = greedy_logits(GenerationSession(any_batch(program), reference_runner), prompts, slots, sizes["seq"], steps)
        except Exception as error:  # the user's model may raise anything
            cases.append(GenerationCase(sizes, lengths, tuple(slots), steps, {}, f"the eager entry points raised {type(error).__name__}: {error}",
                                        note=note))
            continue
        try:
            actual = teacher_forced_runs(program, runs_programs, prompts, slots, sizes["seq"], tokens)
        except Exception as error:  # XLA runtime errors, shape assertions
            cases.append(GenerationCase(sizes, lengths, tuple(slots), steps, {}, artifact_raised(error), note=note))
            continue
        runs = {name: compare_run(logits, expected, tokens, getattr(tolerances, name)) for name, logits in actual.items()}
        divergence = float_divergence(actual["tpu"], tokens, float_reference[index])
        stored = store_golden_case(golden, index, prompts, slots, sizes["seq"], tokens, expected)
        cases.append(GenerationCase(sizes, lengths, tuple(slots), steps, runs, golden=stored, float_divergence=divergence, note=note))
    return GenerationReport(decode.resolved_precision, decode.matmul_precision, tolerances, tuple(cases), golden, INT8_KV_AGAINST)
