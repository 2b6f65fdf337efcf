"""What comparing an output and a whole optional verification run hold, relative to the outputs'
f32 bytes: the figures verify/sizes.py's RUN_OUTPUT_FACTOR comes from.

    python benchmarks/studies/compare_memory.py compare [MIB ...]   # default 64 512
    nice -n 10 python benchmarks/studies/compare_memory.py run [MIB ...]   # default 128 512

compare: compare_output on a MIB-MiB f32 output (random values; the actual one off by a little,
with NaNs, infinities and zeros), its peak Python-allocated memory (tracemalloc: numpy's arrays,
not the inputs it is given) and seconds.
run: a conversion (in a child process of its own) of a model whose outputs dwarf its weights and
FLOPs (an embedding and a head over a 20,000-token vocabulary), with dims whose "max" case has
MIB MiB of f32 logits and a memory budget that lets it run; the verify stage's peak resident
memory above what the process held when verification started (the manifest's
build.memory_budget.resident_bytes), over those outputs' bytes.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile
import time
import tracemalloc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402

import numpy as np  # noqa: E402

MIB = 2**20
VOCABULARY = 20000


def measure_compare(mib: int) -> None:
    from tpuexport.verify.compare import Tolerances, compare_output

    generator = np.random.default_rng(0)
    expected = generator.standard_normal(mib * MIB // 4, dtype=np.float32).reshape(-1, 1000 if mib * MIB // 4 % 1000 == 0 else 1024)
    actual = expected + np.float32(1e-5) * generator.standard_normal(expected.shape, dtype=np.float32)
    for array in (expected, actual):
        array.reshape(-1)[::9973] = 0.0
    actual.reshape(-1)[::100003] = np.nan
    expected.reshape(-1)[::200003] = np.inf
    tracemalloc.start()
    start = time.perf_counter()
    result = compare_output("logits", actual, expected, Tolerances(atol=1e-4, rtol=1e-4, scale_tol=1e-4, min_fraction=0.99))
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"compare_output {mib} MiB f32 output: peak {peak / MIB:.1f} MiB = {peak / expected.nbytes:.2f} x its f32 bytes, "
          f"{seconds:.2f} s (mismatched {result.mismatched}, sqnr {result.sqnr_db})", flush=True)


def measure_run(mib: int) -> None:
    """Runs the conversion in a child process and prints its figures."""
    rows = 8
    seq = mib * MIB // (rows * VOCABULARY * 4)
    child = subprocess.run([sys.executable, __file__, "_run", str(rows), str(seq)], capture_output=True, text=True)
    if child.returncode:
        print(f"run {mib} MiB: failed\n{child.stderr[-3000:]}", flush=True)
        return
    figures = json.loads(child.stdout.strip().splitlines()[-1])
    held = figures["resident_bytes"]
    over = figures["verify_peak"] - held
    print(f"optional run with {figures['output_bytes'] / MIB:.0f} MiB of f32 outputs ({rows} x {seq} x {VOCABULARY}): verify peak "
          f"{figures['verify_peak'] / 2**30:.2f} GiB, {held / 2**30:.2f} GiB held when verification started, "
          f"+{over / MIB:.0f} MiB = {over / figures['output_bytes']:.2f} x its outputs; cases {figures['cases']}", flush=True)


def _run_child(rows: int, seq: int) -> None:
    import torch

    import tpuexport
    from tpuexport.memory import resident_bytes

    class LanguageModelHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCABULARY, 8)
            self.head = torch.nn.Linear(8, VOCABULARY)

        def forward(self, input_ids):
            return self.head(self.embed(input_ids))

    torch.manual_seed(0)
    dims = {"input_ids": {0: torch.export.Dim("batch", min=1, max=rows), 1: torch.export.Dim("seq", min=2, max=seq)}}
    with tempfile.TemporaryDirectory() as work:
        artifact = tpuexport.convert(LanguageModelHead().eval(), (torch.randint(0, VOCABULARY, (2, 16)),), dims, target="v5e",
                                     out=pathlib.Path(work) / "head.tpu", buckets={"batch": [2], "seq": [16]}, saved_model=False,
                                     memory_budget_gb=(resident_bytes() + 64 * 10**9) / 1e9)
        budget = artifact.manifest["build"]["memory_budget"]
        cases = [case["label"] for case in artifact.manifest["verification"]["cases"]]
        assert "max" in cases, artifact.manifest["verification"]["skipped"]
        print(json.dumps({"resident_bytes": budget["resident_bytes"], "verify_peak": artifact.records.stage_memory["verify"].process_bytes,
                          "output_bytes": rows * seq * VOCABULARY * 4, "cases": cases}))


def main() -> None:
    if sys.argv[1] == "_run":
        _run_child(int(sys.argv[2]), int(sys.argv[3]))
        return
    mode, sizes = sys.argv[1], [int(size) for size in sys.argv[2:]]
    for mib in sizes or ((64, 512) if mode == "compare" else (128, 512)):
        (measure_compare if mode == "compare" else measure_run)(mib)


if __name__ == "__main__":
    main()
