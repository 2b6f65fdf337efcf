"""Where text-generation verification spends its time and memory, at a Llama shape (issue #20).

Builds transformers' LlamaForCausalLM at Llama-3.2-1B's shape (benchmarks/studies/generation.py) with random
bf16 weights and N layers, captures and lowers its prefill and decode entry points as a bf16
conversion does, then runs `verify_generation` alone (no TPU compile beside it) under cProfile and
samples the process's resident memory:

    python benchmarks/studies/generation_verify.py [--layers 2] [--max-context 4096] [--max-batch 8] [--prefill-seq 128]

Printed: verify's wall and process CPU seconds, and within it the XLA:CPU compiles (count, seconds),
the entry points' executions (prefill and decode calls, seconds), Hugging Face generate(), the
comparisons; peak RSS before and during verify (VmHWM reset before it, so the peak is verify's own).
"""

from __future__ import annotations

import argparse
import cProfile
import pathlib
import pstats
import resource
import sys
import threading
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402
from generation import meta_llama, model_config  # noqa: E402


class MemorySampler(threading.Thread):
    """The process's resident set every `interval` seconds (Linux /proc), its maximum kept."""

    def __init__(self, interval: float = 0.05):
        super().__init__(daemon=True)
        self.interval, self.peak, self.running = interval, 0, True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, resident_bytes())
            time.sleep(self.interval)


def resident_bytes() -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def generation_program(model: torch.nn.Module, max_batch: int, max_context: int, prefill_seq: tuple[int, ...]):
    """The model's GenerationProgram as `convert(task="text-generation", precision="bf16")` lowers it
    (prefill batches 1 and max_batch): the pipeline's passes through weights."""
    import tempfile

    from tpuexport import export as export_stage
    from tpuexport import pipeline

    options = pipeline.ConversionOptions((), pathlib.Path(tempfile.mkdtemp()) / "program.tpu", buckets={"seq": list(prefill_seq)},
                                         precision="bf16", task="text-generation", max_batch=max_batch, max_context=max_context)
    with pipeline.passes(export_stage.LoadedSource(model, None, None, None, export_stage.SourceInfo("api")), options, "weights") as conversion:
        return conversion.program  # its weights memory-mapped from the scratch file (kept while mapped)


def seconds_in(stats: pstats.Stats, function: str, filename: str = "") -> tuple[int, float]:
    """(calls, cumulative seconds) of every profiled function of this name (in a file ending so)."""
    calls, seconds = 0, 0.0
    for (path, _, name), (_, total_calls, _, cumulative, _) in stats.stats.items():
        if name == function and path.endswith(filename):
            calls, seconds = calls + total_calls, seconds + cumulative
    return calls, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--prefill-seq", default="128")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--top", action="store_true", help="also print the profile's 25 functions of most own time")
    options = parser.parse_args()

    from tpuexport.verify import verify_generation

    start = time.perf_counter()
    torch.manual_seed(0)
    model = meta_llama(model_config(options.shape, options.layers), "cpu")
    program = generation_program(model, options.max_batch, options.max_context, tuple(int(s) for s in options.prefill_seq.split(",")))
    print(f"model built, exported and lowered: {time.perf_counter() - start:.1f} s; RSS {resident_bytes() / 2**30:.2f} GiB, "
          f"peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB", flush=True)
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM: the peak below is verify's
    sampler = MemorySampler()
    sampler.start()
    before_rss, cpu_before, wall_before = resident_bytes(), time.process_time(), time.perf_counter()
    profile = cProfile.Profile()
    report = profile.runcall(verify_generation, program, model, None, options.new_tokens)
    wall, cpu = time.perf_counter() - wall_before, time.process_time() - cpu_before
    sampler.running = False
    sampler.join()
    peak = max(sampler.peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    stats = pstats.Stats(profile)
    spec = program.spec
    print(f"{options.shape} x {options.layers} layers, bf16, cache {spec.max_batch} x {spec.max_context} "
          f"({spec.cache_bytes / 2**30:.2f} GiB keys+values), prefill {program.fill_buckets()}; passed {report.passed}, "
          f"tokens compared {report.tokens_compared()}")
    print(f"verify: wall {wall:.1f} s, process CPU {cpu:.1f} s; RSS before {before_rss / 2**30:.2f} GiB, peak during "
          f"{peak / 2**30:.2f} GiB (+{(peak - before_rss) / 2**30:.2f})")
    rows = [("XLA:CPU compile", "compile", "stages.py"), ("entry point runs (all)", "run", "lowering.py"),
            ("  prefill", "prefill", "lower/generation.py"), ("  decode", "decode", "lower/generation.py"),
            ("eager generate()", "eager_generate", "verify/generation.py"), ("compare_run", "compare_run", "verify/generation.py"),
            ("tpu_faithful rewrite", "tpu_faithful", "tpu_numerics.py")]
    print("| part | calls | seconds (cumulative) |\n|---|---|---|")
    for label, function, filename in rows:
        calls, seconds = seconds_in(stats, function, filename)
        print(f"| {label} | {calls} | {seconds:.1f} |")
    if options.top:
        stats.sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
