"""What sampling on the device costs and saves, for the Llama-3.2-1B shape (vocabulary 128256) at batch 8.

    python benchmarks/studies/sample_step.py [--vocab 128256] [--rows 8] [--target v5e] [--verify]

Exports and lowers the sample entry point (export/sampling.py) as a conversion does, compiles it for
the target (compile-only) and prints:
  - device -> host bytes per decode step: before, decode's logits [rows, vocab] float32 (the host
    took the argmax); after, the sample step's tokens and logprobs (and the top-20 alternatives when a
    request asks for logprobs), from the compiled executables' output shapes;
  - the compiled sample step's XLA figures on the target (bytes accessed, flops, temporaries);
  - its time on this machine's XLA:CPU per mode (greedy, temperature, top-p, top-k + top-p);
  - with --verify, how long verify/sampling.py takes at this vocabulary.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402,F401

import numpy as np  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--target", default="v5e")
    parser.add_argument("--verify", action="store_true")
    options = parser.parse_args()
    from tpuexport import compile as compile_stage
    from tpuexport import export as export_stage
    from tpuexport import lower as lower_stage
    from tpuexport.verify.sampling import verify_sampling

    vocab, rows = options.vocab, options.rows
    args, shapes = export_stage.sample_example_arguments(vocab)
    captured = export_stage.capture(export_stage.LoadedSource(export_stage.Sample(vocab), args, shapes, None, export_stage.SourceInfo("api")))
    lowered = lower_stage.lower(captured.program, captured.signature, precision="f32")
    report = compile_stage.compile_program(lowered, compile_stage.resolve_targets([options.target]),
                                           compile_stage.make_buckets(lowered.signature, {"rows": [rows]}))
    (result,) = report.results
    outputs = {spec.name: int(np.prod(spec.concrete_shape({"rows": rows}))) * np.dtype(spec.dtype).itemsize for spec in lowered.signature.outputs}
    logits = rows * vocab * 4
    print(f"vocab {vocab}, {rows} rows: device -> host bytes per decode step: logits {logits:,} (before); tokens + logprobs "
          f"{outputs['tokens'] + outputs['logprobs']:,}, with the top-20 alternatives {sum(outputs.values()):,} (after): "
          f"{logits / (outputs['tokens'] + outputs['logprobs']):,.0f}x / {logits / sum(outputs.values()):,.0f}x fewer")
    cost = result.cost
    print(f"{options.target} sample {result.bucket.name}: XLA bytes accessed {cost.get('bytes_accessed', 0) / 2**20:.1f} MiB, flops "
          f"{cost.get('flops', 0):.3g}, temporaries {result.memory['temp_bytes'] / 2**20:.1f} MiB, compiled in {result.compile_seconds:.1f} s")
    rng = np.random.default_rng(0)
    scores = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    for mode, (temperature, top_p, top_k) in {"greedy": (0, 1, 0), "temperature 0.8": (0.8, 1, 0), "top-p 0.9": (0.8, 0.9, 0),
                                              "top-k 50 + top-p 0.9": (0.8, 0.9, 50)}.items():
        inputs = [scores, np.full(rows, temperature, np.float32), np.full(rows, top_p, np.float32), np.full(rows, top_k, np.int64),
                  np.arange(rows), np.arange(rows)]
        lowered.run(inputs)
        start = time.perf_counter()
        for _ in range(5):
            lowered.run(inputs)
        print(f"XLA:CPU sample step, {mode}: {(time.perf_counter() - start) / 5 * 1000:.1f} ms")
    if options.verify:
        start = time.perf_counter()
        verified = verify_sampling(lowered.run, vocab)
        print(f"verify/sampling.py at vocabulary {vocab}: {time.perf_counter() - start:.0f} s, {verified.describe()}")


if __name__ == "__main__":
    main()
