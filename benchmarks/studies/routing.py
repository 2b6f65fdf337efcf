"""A mixture of experts verified at large sizes with default options: does the TPU-faithful run
route every token as eager PyTorch does? Prints, per verified case, the mismatched logits of both
runs (outliers the 1-in-10^4 allowance would have to absorb) and the matmuls pinned to highest.

    python benchmarks/studies/routing.py                 # the coverage Mixtral, up to batch 64 x seq 128
    python benchmarks/studies/routing.py --matmul-precision highest     # every matmul pinned, not only the routers' cone

The family's dims are widened to batch 1..64 so that batch 64 x seq 128 is a verified size.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="mixtral")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--matmul-precision", default="default", help="every matmul's TPU precision (the routers' stay highest)")
    options = parser.parse_args()

    import torch

    from families import FAMILIES
    from tpuexport import export as export_stage
    from tpuexport import lower as lower_stage
    from tpuexport import verify as verify_stage
    from tpuexport.export import LoadedSource, SourceInfo

    built = FAMILIES[options.family].build()
    batch = torch.export.Dim("batch", min=1, max=options.batch)
    seq = torch.export.Dim("seq", min=2, max=options.seq)
    shapes = {name: {0: batch, 1: seq} for name in built["dynamic_shapes"]}
    captured = export_stage.capture(LoadedSource(built["model"], built["args"], shapes, None, SourceInfo("api")))
    lowered = lower_stage.lower(captured.program, captured.signature, matmul_precision=options.matmul_precision)
    print(f"{options.family}: {len(lowered.decision_matmuls)} matmul(s) pinned to highest: "
          + ", ".join(f"{entry['module']} -> {entry['feeds']}" for entry in lowered.decision_matmuls))
    start = time.perf_counter()
    requested = verify_stage.resolve_requested_sizes(captured.signature, ({"batch": options.batch, "seq": options.seq},))
    report = verify_stage.verify(lowered, captured.reference, captured.example_inputs, requested_sizes=requested)
    print(f"verified in {time.perf_counter() - start:.1f} s: {'passed' if report.passed else 'FAILED'}\n")
    print("| case | sizes | logits | tpu run: outside tolerance (allowed) | max abs error | cpu run: outside tolerance |")
    print("|---|---|---|---|---|---|")
    for case in report.cases:
        if case.error:
            print(f"| {case.label} | {case.describe_sizes()} | - | error: {case.error} | | |")
            continue
        for tpu, cpu in zip(case.runs["tpu"], case.runs["cpu"]):
            print(f"| {case.label} | {case.describe_sizes()} | {tpu.elements} | {tpu.mismatched} ({tpu.allowed_mismatches}) | "
                  f"{tpu.max_abs_error:.3g} | {cpu.mismatched} |")


if __name__ == "__main__":
    main()
