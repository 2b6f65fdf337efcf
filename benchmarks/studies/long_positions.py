"""Which sizes verification runs for a Llama-3.2-1B-shaped bf16 model (dims batch 1..64 x seq
2..8192) and what they cost: the planned full-model cases with their matmul FLOPs and why they run,
and the position-table check at every dim's largest size, timed.

    python benchmarks/studies/long_positions.py

The model is built on the meta device and its parameters become zero-stride CPU views (no 2.5 GB of
random weights; a program exported on the meta device would compute its tables on the meta device
too): the full-model cases are planned, not run (their FLOPs say what they would cost); the rotary
table is computed as transformers computes it, so the position check runs for real: its seconds and
the process's peak RSS are printed, and it runs again with the planted bug (the artifact's inv_freq
rounded to bfloat16), which must fail.
"""

from __future__ import annotations

import dataclasses
import pathlib
import resource
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=500000.0)


def main() -> None:
    import torch

    from families import bf16_llama
    from tpuexport import export as export_stage
    from tpuexport import lower as lower_stage
    from tpuexport.export import LoadedSource, SourceInfo
    from tpuexport.verify import DEFAULT_BUDGET_FLOPS, default_tolerances, plan_cases
    from tpuexport.verify.positions import position_tables, verify_positions

    model, args, shapes = bf16_llama(LLAMA_1B, device="meta")
    rotary = model.model.model.rotary_emb
    # The rotary table is the one state the position check reads: computed on the CPU as the model's own init does.
    inv_freq = type(rotary)(rotary.config).inv_freq
    rotary.register_buffer("inv_freq", inv_freq, persistent=False)
    rotary.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
    for module in model.modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(torch.zeros((), dtype=parameter.dtype).expand(parameter.shape), requires_grad=False))
    start = time.perf_counter()
    captured = export_stage.capture(LoadedSource(model, args, shapes, None, SourceInfo("api")))
    lowered = lower_stage.lower(captured.program, captured.signature, weights=False)
    print(f"exported and lowered from weight shapes in {time.perf_counter() - start:.1f} s; "
          f"precision {lowered.precision} ({lowered.resolved_precision}); dims "
          + ", ".join(f"{d.name} {d.range_text}" for d in captured.signature.dims))
    print(f"\nfull-model cases (budget {DEFAULT_BUDGET_FLOPS / 1e9:.0f} GFLOP for the optional ones):\n")
    print("| case | sizes | matmul GFLOP | why |")
    print("|---|---|---|---|")
    for case in plan_cases(captured.signature, lowered.matmul_flops):
        print(f"| {case.label} | {case.sizes} | {case.flops / 1e9:.1f} | {case.reason} |")
    for label, sizes in (("batch 1 at full length", {"batch": 1, "seq": 8192}), ("every dim at its maximum", {"batch": 64, "seq": 8192})):
        print(f"| (not run: {label}) | {sizes} | {lower_stage.flops_at(lowered.matmul_flops, sizes) / 1e9:.0f} | beyond the budget |")

    tables = position_tables(lowered.graph)
    # Only the tables' weights are read: the others stay shapes.
    names = {name for name, parts in lowered.weight_parts.items() if any("rotary_emb" in part for part in parts)}
    weights = tuple(inv_freq.numpy() if name in names else None for name in lowered.weight_names)
    with_tables = dataclasses.replace(lowered, weights=weights)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    tolerances = default_tolerances(lowered.resolved_precision, "default", False)

    def zeros(specs, examples, sizes, seed):  # token ids do not reach the position tables; only their shapes count
        return [torch.zeros(spec.concrete_shape(sizes), dtype=torch.long) for spec in specs]

    case = verify_positions(with_tables, captured.example_inputs, tolerances, zeros)
    seconds = time.perf_counter() - start
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the process's peak so far, in KiB on Linux
    print(f"\nposition tables ({len(tables)} found): case {case.label if case else 'none'} at {case.sizes if case else '-'}, "
          f"{'passed' if case and case.passed else 'FAILED'} in {seconds:.1f} s; the process's peak RSS {rss_after / 2**20:.2f} GiB "
          f"({rss_before / 2**20:.2f} GiB before the case, which grew it by {max(0, rss_after - rss_before) / 2**20:.2f} GiB)")
    if case:
        print("\n| table | elements | tpu run: max abs error, outside tolerance | cpu run: max abs error, outside tolerance |\n|---|---|---|---|")
        for tpu, cpu in zip(case.runs["tpu"], case.runs["cpu"]):
            print(f"| {tpu.name} | {tpu.elements} | {tpu.max_abs_error:.3g}, {tpu.mismatched} | {cpu.max_abs_error:.3g}, {cpu.mismatched} |")

    # The planted bug: the artifact's inv_freq rounded to bfloat16 (the model's own stays f32).
    planted = dataclasses.replace(lowered, weights=tuple(inv_freq.to(torch.bfloat16).float().numpy() if name in names else None
                                                         for name in lowered.weight_names))
    bugged = verify_positions(planted, captured.example_inputs, tolerances, zeros)
    outside = sum(output.mismatched for output in bugged.runs["tpu"])
    elements = sum(output.elements for output in bugged.runs["tpu"])
    print(f"\nplanted bug (the artifact's inv_freq rounded to bfloat16): case {'passed' if bugged.passed else 'FAILED'}; tpu run "
          f"{outside} of {elements} elements outside tolerance, max abs error {max(o.max_abs_error for o in bugged.runs['tpu']):.3g}")


if __name__ == "__main__":
    main()
