"""A ~1B decoder converted with its weights streamed from a sharded safetensors checkpoint: peak
memory and wall time of `tpuexport convert --checkpoint` (and a Llama-3-8B-shaped one, --shape llama-3-8b).

    python benchmarks/studies/streamed_conversion.py [--shape llama-3.2-1b|llama-3-8b] [--dtype f32|bf16] [--layers N]
                                             [--precision bf16] [--no-saved-model] [--keep DIR] [--memory-limit GIB]
                                             [--quantize int4-weight-only [--group-size 128]]
                                             [--task text-generation [--max-context 2048] [--max-batch 1] [--prefill-seq 128]]

The model is transformers' LlamaForCausalLM with Llama-3.2-1B's shapes (hidden 2048, 16 layers,
32 query / 8 key-value heads, MLP 8192, vocabulary 128256, tied embeddings: 1.24B parameters,
4.94 GB in f32) or, with --shape llama-3-8b, Llama-3-8B's (hidden 4096, 32 layers, 32 / 8 heads,
MLP 14336, untied: 8.03B parameters, 16.1 GB in bf16), random weights (nothing is downloaded).
The benchmark first writes its checkpoint as Hugging Face does (`model-0000k-of-0000n.safetensors`
shards of at most 2 GB and `model.safetensors.index.json`, in --dtype: f32, or bf16 as Llama 3 is
published; the factory then builds the model in that dtype, so no tensor is cast into memory),
then runs the CLI on it in a child process:

    tpuexport convert benchmarks/studies/streamed_conversion.py:build --checkpoint DIR --target v5e --precision bf16

(the factory builds the model from the config; within --checkpoint its parameters are on the meta
device). With --task text-generation the factory is `build_lm` (the causal LM itself) and the
conversion is `--task text-generation --max-context N --max-batch B --bucket seq=S`: prefill and
decode entry points over a KV cache, the weights streamed once for both, verified against
generate() of the model whose parameters are the checkpoint's memory maps. The child and its children are sampled every 50 ms from /proc: VmRSS, and its two parts,
RssAnon (memory the process owns: what must fit in RAM) and RssFile (pages of memory-mapped files:
the checkpoint and the artifact's weights, which the kernel reads on first touch and drops under
memory pressure). Printed: the peaks of the converting process and of each child (the TPU compiler,
the TensorFlow process that builds the SavedModel), as GiB and as ratios to the f32 and bf16 model, the
wall time, and the stages' seconds from the artifact's manifest.

`python benchmarks/studies/streamed_conversion.py --run-generation ARTIFACT` runs a text-generation
artifact's prefill and one decode step on XLA:CPU (as verification does) and prints each one's peak
own memory.

--memory-limit runs the conversion in a memory cgroup (v1, /sys/fs/cgroup/memory; needs root) with
that limit on everything it and its children hold, page cache included: a limit below the f32
model's size shows that the file-backed pages are given back under pressure, i.e. that a model
larger than the machine's memory converts.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402

CONFIG_VARIABLE = "TPUEXPORT_STREAMED_CONFIG"
LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=True)
LLAMA_3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False, rope_theta=500000.0)
SHAPES = {"llama-3.2-1b": LLAMA_3_2_1B, "llama-3-8b": LLAMA_3_8B}
DTYPES = {"f32": "float32", "bf16": "bfloat16"}
SHARD_BYTES = 2 * 2**30
CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup/memory")


def llama(config: dict, dtype: str = "float32"):
    """The decoder in `dtype` (a torch dtype's name), wrapped to take input_ids and return logits
    (its parameters wherever the caller's context puts them)."""
    import torch
    import transformers

    from families import Outputs

    torch.set_default_dtype(getattr(torch, dtype))
    try:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    return Outputs(model, ("input_ids",), ("logits",), use_cache=False), torch


def build():
    """The factory the CLI calls (the config comes from the benchmark through the environment)."""
    built = json.loads(os.environ[CONFIG_VARIABLE])
    model, torch = llama(built["config"], built["dtype"])
    batch = torch.export.Dim("batch", min=1, max=8)
    seq = torch.export.Dim("seq", min=2, max=2048)
    input_ids = torch.randint(3, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"model": model, "args": (input_ids,), "dynamic_shapes": {"input_ids": {0: batch, 1: seq}}}


def build_lm():
    """The factory of a text-generation conversion: the causal LM itself (the entry points make their own inputs)."""
    built = json.loads(os.environ[CONFIG_VARIABLE])
    model, _ = llama(built["config"], built["dtype"])
    return model.model


def write_checkpoint(config: dict, dtype: str, directory: pathlib.Path) -> tuple[int, int]:
    """Writes a random-weight checkpoint in `dtype` (a torch dtype's name) in Hugging Face's sharded
    layout, one shard in memory at a time.

    Returns:
      (parameters, bytes on disk).
    """
    import safetensors.torch
    import torch

    with torch.device("meta"):
        model = __import__("transformers").LlamaForCausalLM(__import__("transformers").LlamaConfig(**config))
    element_bytes = getattr(torch, dtype).itemsize
    # The shards are planned from the shapes first (a shard's file name holds the shard count), so
    # each one is generated and written in turn and only one is ever in memory.
    shards, shard, shard_bytes = [], [], 0
    for name, parameter in model.state_dict().items():  # tied lm_head.weight: saved once, as Hugging Face does
        if config.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        size = parameter.numel() * element_bytes
        if shard and shard_bytes + size > SHARD_BYTES:
            shards.append(shard)
            shard, shard_bytes = [], 0
        shard.append((name, parameter.shape))
        shard_bytes += size
    if shard:
        shards.append(shard)
    generator = torch.Generator().manual_seed(0)
    weight_map, count = {}, 0
    for index, names in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in names:
            tensor = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=generator) * 0.02
            tensors[name] = tensor.to(getattr(torch, dtype))
            count += tensor.numel()
        safetensors.torch.save_file(tensors, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return count, sum(path.stat().st_size for path in directory.glob("*.safetensors"))


def run_generation(artifact: pathlib.Path) -> None:
    """Runs a text-generation artifact's prefill (one 99-token prompt at its first prefill bucket) and
    one decode step on XLA:CPU, as verification does, printing the seconds and this process's peak
    own (anon) memory of each: where a conversion's verify stage spends its memory."""
    import tpuexport
    from tpuexport.lower.generation import GenerationSession

    peak = {"anon": 0}
    stopped = threading.Event()

    def sample() -> None:
        while not stopped.is_set():
            peak["anon"] = max(peak["anon"], _status(os.getpid())["anon"])
            stopped.wait(0.02)

    threading.Thread(target=sample, daemon=True).start()
    program = tpuexport.load(artifact).generation_program
    session = GenerationSession(program)
    print(f"artifact loaded: own memory {_status(os.getpid())['anon'] / 2**30:.2f} GiB", flush=True)
    for name, step in (("prefill", lambda: session.prefill([list(range(1, 100))], [0], seq=program.spec.prefill_buckets[0])),
                       ("decode", lambda: session.decode([5] * program.spec.max_batch, [99] * program.spec.max_batch))):
        for what in ("compile and run", "run again"):
            peak["anon"], start = 0, time.perf_counter()
            step()
            print(f"{name} on XLA:CPU ({what}): {time.perf_counter() - start:.1f} s, peak own memory {peak['anon'] / 2**30:.2f} GiB",
                  flush=True)
    stopped.set()


def _status(pid: int) -> dict[str, int] | None:
    try:
        text = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    kib = lambda key: int(fields.get(key, "0 kB").split()[0]) * 1024  # noqa: E731
    return {"name": fields["Name"].strip(), "ppid": int(fields["PPid"]), "rss": kib("VmRSS"), "anon": kib("RssAnon"), "file": kib("RssFile")}


class TreeSampler(threading.Thread):
    """Samples the memory of a process and its descendants until stopped; keeps each one's peaks."""

    def __init__(self, root: int):
        super().__init__(daemon=True)
        self.root = root
        self.peaks: dict[int, dict] = {}
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            statuses = {int(entry.name): _status(int(entry.name)) for entry in pathlib.Path("/proc").iterdir() if entry.name.isdigit()}
            tree, added = {self.root}, True
            while added:
                children = {pid for pid, status in statuses.items() if status and status["ppid"] in tree}
                added = bool(children - tree)
                tree |= children
            for pid in tree:
                status = statuses.get(pid)
                if status:
                    peak = self.peaks.setdefault(pid, {"name": status["name"], "rss": 0, "anon": 0, "file": 0})
                    for key in ("rss", "anon", "file"):
                        peak[key] = max(peak[key], status[key])
            self.stopped.wait(0.05)


def memory_cgroup(limit_bytes: int) -> pathlib.Path:
    """A new memory cgroup (v1) with that limit; the caller moves the process in and removes it."""
    group = CGROUP_ROOT / f"tpuexport-streamed-{os.getpid()}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
    except OSError as error:
        sys.exit(f"--memory-limit needs a writable cgroup v1 memory hierarchy at {CGROUP_ROOT} ({error})")
    return group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=tuple(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="f32", help="the checkpoint's and the model's dtype")
    parser.add_argument("--layers", type=int, help="fewer layers than the shape's")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--no-saved-model", dest="saved_model", action="store_false")
    parser.add_argument("--keep", type=pathlib.Path, help="keep the checkpoint and artifact in this directory")
    parser.add_argument("--memory-limit", type=float, metavar="GIB", help="run the conversion in a memory cgroup with this limit")
    parser.add_argument("--quantize", choices=("int8-weight-only", "int4-weight-only"), help="quantize the weights as they stream")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--task", choices=("forward", "text-generation"), default="forward")
    parser.add_argument("--max-context", type=int, default=2048, help="text-generation: the KV cache's positions per slot")
    parser.add_argument("--max-batch", type=int, default=1, help="text-generation: the KV cache's slots (decode's batch)")
    parser.add_argument("--prefill-seq", default="128", help="text-generation: prefill's prompt-length buckets (--bucket seq=...)")
    options = parser.parse_args()
    config = dict(SHAPES[options.shape], num_hidden_layers=options.layers or SHAPES[options.shape]["num_hidden_layers"])
    dtype = DTYPES[options.dtype]
    work = options.keep or pathlib.Path(tempfile.mkdtemp(prefix="streamed-"))
    checkpoint, artifact = work / "checkpoint", work / "model.tpu"
    try:
        if not (checkpoint / "model.safetensors.index.json").exists():
            checkpoint.mkdir(parents=True, exist_ok=True)
            start = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--write-checkpoint", json.dumps(config), dtype, str(checkpoint)], check=True)
            print(f"checkpoint written in {time.perf_counter() - start:.0f} s", flush=True)
        index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        disk_bytes = sum((checkpoint / shard).stat().st_size for shard in shards)
        parameters = index["metadata"].get("parameters") or disk_bytes // 4
        f32_bytes, bf16_bytes = parameters * 4, parameters * 2

        generation = options.task == "text-generation"
        factory = f"{pathlib.Path(__file__).resolve()}:{'build_lm' if generation else 'build'}"
        command = [sys.executable, "-m", "tpuexport.cli", "convert", factory, "--checkpoint",
                   str(checkpoint), "--target", "v5e", "--precision", options.precision, "--out", str(artifact), "--force"]
        if generation:  # no SavedModel is written for text generation
            command += ["--task", "text-generation", "--max-context", str(options.max_context), "--max-batch", str(options.max_batch),
                        "--bucket", f"seq={options.prefill_seq}"]
        elif not options.saved_model:
            command.append("--no-saved-model")
        if options.quantize:
            command += ["--quantize", options.quantize, "--group-size", str(options.group_size)]
        environment = dict(os.environ, **{CONFIG_VARIABLE: json.dumps({"config": config, "dtype": dtype})})
        group = memory_cgroup(int(options.memory_limit * 2**30)) if options.memory_limit else None
        # A cached page is charged to the cgroup that read it first: evict the checkpoint from
        # the page cache, so the conversion reads (and is charged for) every page itself.
        for shard in shards:
            descriptor = os.open(checkpoint / shard, os.O_RDONLY)
            os.fsync(descriptor)
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(descriptor)
        start = time.perf_counter()
        process = subprocess.Popen(command, env=environment, cwd=_common.ROOT,
                                   preexec_fn=(lambda: (group / "cgroup.procs").write_text(str(os.getpid()))) if group else None)
        sampler = TreeSampler(process.pid)
        sampler.start()
        code = process.wait()
        wall = time.perf_counter() - start
        sampler.stopped.set()
        sampler.join()
        if group:
            limited = (f"under a memory limit of {options.memory_limit:g} GiB (cgroup, page cache included): peak charged "
                       f"{int((group / 'memory.max_usage_in_bytes').read_text()) / 2**30:.2f} GiB, limit hit "
                       f"{(group / 'memory.failcnt').read_text().strip()} times")
            group.rmdir()
            print(limited)
        if code:
            sys.exit(f"the conversion failed with exit code {code}")

        manifest = json.loads((artifact / "manifest.json").read_text())
        gib = lambda value: f"{value / 2**30:.2f} GiB"  # noqa: E731
        print(f"\nconverted as {options.task}" + (f": max context {options.max_context}, max batch {options.max_batch}, prefill seq "
                                                  f"{options.prefill_seq}" if generation else ""))
        print(f"model: {options.shape} shape, {config['num_hidden_layers']} layers, {parameters / 1e9:.2f}B parameters, "
              f"f32 {gib(f32_bytes)}, bf16 {gib(bf16_bytes)}; checkpoint {len(shards)} shards ({options.dtype}), {gib(disk_bytes)} on disk; "
              f"artifact weights ({options.quantize or options.precision}) {gib((artifact / manifest['program']['weights']).stat().st_size)}")
        if options.quantize:
            quantization = manifest["quantization"]
            print(f"{options.quantize}: {len(quantization['weights'])} weights quantized, weight bytes {quantization['weight_bytes']['ratio']}x "
                  f"f32, SQNR vs float {[(o['name'], o['sqnr_db']) for o in quantization['outputs']]}")
        if options.quantize or generation:
            for bucket in manifest["targets"]["v5e"]["buckets"]:
                accessed = bucket["cost"].get("bytes_accessed")
                print(f"v5e {bucket.get('entry_point', '')} {bucket['name']}: {bucket['memory']['argument_bytes'] / 2**30:.2f} GiB arguments, "
                      f"{bucket['memory']['temp_bytes'] / 2**30:.2f} GiB temporaries, {bucket['memory']['total_bytes'] / 2**30:.2f} GiB in all; "
                      f"XLA bytes accessed {'unknown' if accessed is None else gib(accessed)}")
        print(f"wall time {wall:.0f} s; stages: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in manifest["build"]["stage_seconds"].items()))
        verification = manifest["verification"]
        print(f"verified sizes: {[case['sizes'] for case in verification['cases']]}; passed {verification['passed']}"
              + (f"; {verification['tokens_compared']} tokens compared with generate(), {verification['ties']} tie(s)" if generation else ""))
        if generation and options.quantize:
            divergence = json.loads((artifact / verification["report"]).read_text())["float_divergence"]
            print(f"vs the float model's generate(): first differing step {divergence['first'] and divergence['first']['step']}, "
                  f"logits SQNR {divergence['sqnr_db']} dB")
        print(f"\n{'process':<28}{'peak RSS':>12}{'anon':>12}{'file-backed':>14}{'RSS / f32 model':>18}{'anon / f32':>12}"
              f"{'RSS / bf16':>12}{'anon / bf16':>13}")
        main_peak = sampler.peaks.pop(process.pid)
        rows = [("converting process", main_peak)] + [(f"child {peak['name']} ({pid})", peak) for pid, peak in sampler.peaks.items()
                                                        if peak["rss"] > 64 * 2**20]
        for label, peak in rows:
            print(f"{label:<28}{gib(peak['rss']):>12}{gib(peak['anon']):>12}{gib(peak['file']):>14}"
                  f"{peak['rss'] / f32_bytes:>18.2f}{peak['anon'] / f32_bytes:>12.2f}{peak['rss'] / bf16_bytes:>12.2f}{peak['anon'] / bf16_bytes:>13.2f}")
    finally:
        if not options.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run-generation"]:
        run_generation(pathlib.Path(sys.argv[2]))
    elif sys.argv[1:2] == ["--write-checkpoint"]:
        count, _ = write_checkpoint(json.loads(sys.argv[2]), sys.argv[3], pathlib.Path(sys.argv[4]))
        index = pathlib.Path(sys.argv[4]) / "model.safetensors.index.json"
        index.write_text(json.dumps(dict(json.loads(index.read_text()), metadata={"parameters": count}), indent=1))
    else:
        main()
