"""What verifying a text-generation artifact's slice plans costs: the "verify sharded" pass
(verify/sharded_generation.py) next to the single-device generation verification, per plan.

Llama-3.2-1B's whole shape does not fit a CPU verification in reasonable time, so the model keeps
its proportions at a smaller width: transformers' LlamaForCausalLM, hidden 512, 16 heads over 8 kv
heads (GQA, head_dim 32), MLP 2048, vocabulary 16384, N layers (2 by default), random f32 weights.
It is converted for text generation on a v5e-8 slice once per plan: tensor-parallel (model=8:
one kv head per chip), data-parallel (data=8: one cache slot per chip), and both (model=4,data=2).

    python benchmarks/studies/sharded_generation.py [--layers 2] [--max-context 256] [--max-batch 8] [--prefill-seq 64] [--plans tp,dp,tp-dp]

Printed per plan: the conversion's stage seconds (verify = the single-device generation verification
with generate(); verify sharded = this pass: the child process, its XLA:CPU compiles of both
entry points in both runs, prefill and the decode steps on 8 CPU devices), the collectives found in
each entry point's CPU program, whether the cache was resharded between calls, the worst logits
error of the sharded run against generate(). The machine's load average is printed too: the
seconds scale with it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402

CONFIG = dict(vocab_size=16384, hidden_size=512, intermediate_size=2048, num_attention_heads=16, num_key_value_heads=8, head_dim=32,
              max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=500000.0)
PLANS = {"tp": ("tensor-parallel", "model=8"), "dp": ("data-parallel", "data=8"), "tp-dp": ("tensor-parallel", "model=4,data=2")}


def convert(layers: int, plan: str, max_context: int, max_batch: int, prefill_seq: int) -> dict:
    """Converts the model for v5e-8 with one plan; returns the figures printed."""
    import transformers

    import tpuexport

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, num_hidden_layers=layers)).eval()
    sharding, mesh = PLANS[plan]
    stages = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        artifact = tpuexport.convert(model, task="text-generation", max_context=max_context, max_batch=max_batch, target="v5e-8",
                                     sharding=sharding, mesh=mesh, buckets={"seq": [prefill_seq], "batch": [max_batch]},
                                     out=pathlib.Path(scratch) / "lm.tpu",
                                     progress=lambda stage, seconds, detail: stages.__setitem__(stage, round(seconds, 1)))
        [sharded] = artifact.manifest["verification"]["sharded"]
        report = json.loads((artifact.path / "verification" / "report.json").read_text())
    [full] = report["sharded"]
    return {
        "plan": f"{sharding} {mesh}",
        "seconds": round(time.perf_counter() - start, 1),
        "verify_seconds": stages["verify"],
        "verify_sharded_seconds": next(seconds for stage, seconds in stages.items() if stage.startswith("verify sharded")),
        "case": sharded["case"],
        "collectives": {entry: {kind: value["count"] for kind, value in kinds.items()} for entry, kinds in sharded["collectives"].items()},
        "resharded_calls": sharded["resharded_calls"],
        "cache_spec": full["inputs"]["decode"]["cache_k"],
        "worst_relative_rms": {run: entry["logits"]["relative_rms_error"] for run, entry in full["case"]["runs"].items()},
        "tokens_compared": full["case"]["runs"]["cpu"]["tokens_compared"],
        "stages": stages,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-context", type=int, default=256)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--prefill-seq", type=int, default=64)
    parser.add_argument("--plans", default="tp,dp,tp-dp")
    arguments = parser.parse_args()
    print(f"Llama {CONFIG['hidden_size']} wide, {arguments.layers} layers, {CONFIG['num_attention_heads']}/{CONFIG['num_key_value_heads']} "
          f"heads, vocab {CONFIG['vocab_size']}; max context {arguments.max_context}, max batch {arguments.max_batch}, prefill "
          f"{arguments.max_batch} x {arguments.prefill_seq}; v5e-8 (8 CPU devices); load average {os.getloadavg()[0]:.1f}", flush=True)
    for plan in arguments.plans.split(","):
        figures = convert(arguments.layers, plan, arguments.max_context, arguments.max_batch, arguments.prefill_seq)
        print(f"{figures['plan']}: cache {figures['cache_spec']}; verify {figures['verify_seconds']} s, verify sharded "
              f"{figures['verify_sharded_seconds']} s (conversion {figures['seconds']} s); {figures['case']['label']}, lengths "
              f"{figures['case']['lengths']}, {figures['tokens_compared']} tokens; sharded vs generate() relative RMS "
              + ", ".join(f"{run} {error:.1e}" for run, error in figures["worst_relative_rms"].items())
              + f"; resharded calls {figures['resharded_calls'] or 'none'}", flush=True)
        for entry, kinds in figures["collectives"].items():
            print(f"    {entry}: " + (", ".join(f"{kind} x{count}" for kind, count in kinds.items()) or "no collectives"), flush=True)
        print(f"    stages: {figures['stages']}", flush=True)


if __name__ == "__main__":
    main()
