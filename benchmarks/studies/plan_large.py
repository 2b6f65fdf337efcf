"""Plans without weights for Llama-3-sized decoders: peak memory and wall time of `tpuexport.plan`.

    python benchmarks/studies/plan_large.py [CASE ...]        # cases: 8b-v5e-8-tp, 70b-v5p-128-tp, 70b-v5p-128-fsdp

Each model is transformers' LlamaForCausalLM built on the meta device (no weight exists anywhere,
nothing is downloaded) with Llama 3's shapes, bfloat16:

  8B   hidden 4096, 32 layers, 32 query / 8 key-value heads, MLP 14336, vocabulary 128256
  70B  hidden 8192, 80 layers, 64 query / 8 key-value heads, MLP 28672, vocabulary 128256

and planned for one bucket: the 8B for `v5e-8` tensor-parallel (model=8) at batch 1 x seq 2048; the
70B for `v5p-128` (64 devices) tensor-parallel (model=64) at batch 1 x seq 2048, and fsdp (data=64:
each device holds 1/64 of every weight and one sequence) at batch 64 x seq 2048.

Each case runs in its own process, so its figures are its own. Printed per case: wall time, CPU
time (user + system of the process and its children: unlike wall time, independent of other work on
the machine), the stages' seconds, peak RSS of the planning process and of its largest child (the TPU compiler;
`resource.getrusage` ru_maxrss of RUSAGE_SELF and RUSAGE_CHILDREN), their sum (a bound on the
peak of both together), and per bucket XLA's per-device argument / output / temporary / total bytes
against a device's HBM and the collectives. A plan that does not fit prints its one-line error.
"""

from __future__ import annotations

import json
import pathlib
import resource
import subprocess
import sys
import tempfile
import time
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402

LLAMA_3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False)
LLAMA_3_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                   num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False)
# name: (config, target, sharding preset, mesh, buckets)
CASES = {
    "8b-v5e-8-tp": (LLAMA_3_8B, "v5e-8", "tensor-parallel", "model=8", {"batch": [1], "seq": [2048]}),
    "70b-v5p-128-tp": (LLAMA_3_70B, "v5p-128", "tensor-parallel", "model=64", {"batch": [1], "seq": [2048]}),
    "70b-v5p-128-fsdp": (LLAMA_3_70B, "v5p-128", "fsdp", "data=64", {"batch": [64], "seq": [2048]}),
}


def run_case(name: str) -> dict:
    """Plans one case in this process.

    Returns:
      JSON-ready figures: seconds, stages, peak RSS, per-bucket memory, or the error.
    """
    import tpuexport
    from families import bf16_llama

    config, target, preset, mesh, buckets = CASES[name]
    start = time.perf_counter()
    model, args, shapes = bf16_llama(config, device="meta")
    parameters = sum(p.numel() for p in model.parameters())
    stages = {}
    result = {"case": name, "parameters": parameters, "target": target, "sharding": preset, "mesh": mesh, "buckets": buckets}
    with tempfile.TemporaryDirectory() as scratch:
        try:
            artifact = tpuexport.plan(model, args, shapes, target=target, sharding=preset, mesh=mesh, buckets=buckets,
                                      precision="bf16", out=pathlib.Path(scratch) / "plan.tpu",
                                      progress=lambda stage, seconds, detail: stages.__setitem__(stage, (round(seconds, 1), detail)))
            result["targets"] = artifact.manifest["targets"]
            result["weight_bytes"] = artifact.manifest["program"]["weight_bytes"]
            result["files"] = sorted(artifact.manifest["files"])
        except tpuexport.TpuExportError as error:
            result["error"] = str(error)
    result["seconds"] = time.perf_counter() - start
    result["stages"] = stages
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    result["peak_rss_self"], result["peak_rss_children"] = own.ru_maxrss * 1024, children.ru_maxrss * 1024
    # CPU seconds do not depend on what else runs on the shared cores; wall time does.
    result["cpu_seconds"] = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    return result


def report(result: dict) -> None:
    """Prints one case's figures."""
    gib = 2**30
    print(f"\n{result['case']}: {result['parameters'] / 1e9:.2f}B parameters on the meta device, {result['target']} "
          f"{result['sharding']} (mesh {result['mesh']}), bucket {result['buckets']}")
    print(f"  wall time {result['seconds']:.1f} s, CPU time {result['cpu_seconds']:.1f} s (process and children); peak RSS: planning process {result['peak_rss_self'] / gib:.2f} GiB, "
          f"largest child (TPU compiler) {result['peak_rss_children'] / gib:.2f} GiB, sum {(result['peak_rss_self'] + result['peak_rss_children']) / gib:.2f} GiB")
    for stage, (seconds, detail) in result["stages"].items():
        print(f"    {stage:<36} {seconds:7.1f} s  {detail}")
    if "error" in result:
        print(f"  error: {result['error']}")
        return
    print(f"  weights (not allocated) {result['weight_bytes'] / gib:.2f} GiB; artifact files: {', '.join(result['files'])}")
    for target, entry in result["targets"].items():
        for bucket in entry["buckets"]:
            memory = bucket["memory"]
            print(f"  {target} {bucket['name']}: per device arguments {memory['argument_bytes'] / gib:.2f} GiB, outputs "
                  f"{memory['output_bytes'] / gib:.2f} GiB, temporaries {memory['temp_bytes'] / gib:.2f} GiB, total "
                  f"{memory['total_bytes'] / gib:.2f} GiB of {entry.get('hbm_bytes_per_device', entry['hbm_bytes']) / gib:.0f} GiB "
                  f"({'fits' if bucket['fits_in_hbm'] else 'does not fit'}); flops per device {bucket['cost']['flops']:.3g}")
            for kind, collective in bucket.get("collectives", {}).items():
                print(f"    {kind:<20} x{collective['count']:<4} {collective['bytes'] / gib:8.2f} GiB per device")


def main() -> None:
    names = sys.argv[1:] or list(CASES)
    if names[0] == "--child":
        warnings.filterwarnings("ignore")
        print(json.dumps(run_case(names[1])))
        return
    unknown = [name for name in names if name not in CASES]
    if unknown:
        sys.exit(f"unknown case {unknown[0]!r}; cases: {', '.join(CASES)}")
    for name in names:
        child = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True, text=True)
        if child.returncode != 0:
            print(f"\n{name}: the planning process failed (exit {child.returncode}): {child.stderr.strip().splitlines()[-1:]}")
            continue
        report(json.loads(child.stdout.strip().splitlines()[-1]))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
