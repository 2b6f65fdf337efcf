"""Where a conversion's memory goes: each case converted in a child process of its own, its peak
resident memory per stage (the manifest's build.stage_memory, tpuexport/memory.py) printed as a table.

    nice -n 10 python benchmarks/conversion_memory.py [CASE ...] [--layers N] [--max-batch B] [--max-seq S]
                                                      [--max-context C] [--cap GB] [--arrays] [--work DIR]
    python benchmarks/conversion_memory.py --cpu-plan [--layers N] [--max-context C]

The cases (issue #36), Llama models with random weights (studies/streamed_conversion.py's shapes and
checkpoint writer; nothing is downloaded), target v5e (--target), no SavedModel, verification on:
  llama1b-forward-memory          Llama-3.2-1B-shaped, bf16, built in memory; dims batch <= 64, seq <= 8192
                                  (--max-batch, --max-seq), one bucket batch 8 x seq 2048
  llama1b-forward-checkpoint      the same, its weights streamed from a bf16 safetensors checkpoint
                                  written first (in a process of its own, not measured)
  llama1b-generation-checkpoint   text-generation from the checkpoint: max context 4096 (--max-context), batch 8
  llama8b-checkpoint-bf16         Llama-3-8B-shaped, forward as the 1B one, from a bf16 checkpoint
  llama8b-checkpoint-int4         the same, int4 weight-only (group 128), quantized as the weights stream

--layers N builds N layers instead of the shape's 16 / 32 (the table says which ran): the full-size
cases need a quiet machine (the 1B one was OOM-killed at 23.4 GB). Each child is watched every
50 ms: when its resident memory and its children's together pass --cap GB (default 20), it is killed
and its row says "exceeded N GB in stage S", so this process is never the one the kernel kills.

Per stage the table gives the converting process's peak (its total, and its anonymous and
memory-mapped parts: they may peak at different moments) and the largest child process (the TPU
compiler); per case the overall peak, peak / weights and wall seconds. --arrays also lists, at the
end of each stage, the largest live JAX arrays (jax.live_arrays()) and torch tensors (by storage).
--cpu-plan prints, instead, the text-generation case's executables' XLA:CPU memory analysis (a plan for
the cpu target: nothing runs), what each fill bucket's verification run will need.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import _common

sys.path.insert(0, str(_common.BENCHMARKS / "studies"))
import streamed_conversion  # noqa: E402  (the Llama shapes, the model and the checkpoint writer)

# Arrays smaller than this are not listed by --arrays.
LISTED_ARRAY_BYTES = 16 * 2**20
SAMPLE_SECONDS = 0.05


@dataclasses.dataclass(frozen=True)
class Case:
    """One conversion measured.

    Attributes:
      shape: a streamed_conversion.SHAPES name; checkpoint: weights streamed from a safetensors
      checkpoint (else built in memory); task: "forward" or "text-generation"; quantize: a weight-only mode or None.
    """

    shape: str
    checkpoint: bool
    task: str = "forward"
    quantize: str | None = None


CASES = {
    "llama1b-forward-memory": Case("llama-3.2-1b", checkpoint=False),
    "llama1b-forward-checkpoint": Case("llama-3.2-1b", checkpoint=True),
    "llama1b-generation-checkpoint": Case("llama-3.2-1b", checkpoint=True, task="text-generation"),
    "llama8b-checkpoint-bf16": Case("llama-3-8b", checkpoint=True),
    "llama8b-checkpoint-int4": Case("llama-3-8b", checkpoint=True, quantize="int4-weight-only"),
}


def convert_case(request: dict) -> None:
    """In the child: builds the case's model and converts it, appending JSON lines to
    request["progress"] as it goes (the parent reads them, also when it had to kill the child):
    the model's weight bytes, each stage's start, and each stage's end with its seconds, peak memory
    and (with --arrays) largest arrays; at last the verified sizes and the wall seconds."""
    import torch

    import tpuexport
    from tpuexport.tasks import conversion

    case = CASES[request["case"]]
    config = dict(streamed_conversion.SHAPES[case.shape], num_hidden_layers=request["layers"])
    progress = open(request["progress"], "a", buffering=1)
    write = lambda **event: progress.write(json.dumps(event) + "\n")  # noqa: E731
    clocks = []
    starting = conversion.StageClock.start

    def start(clock, name: str) -> None:  # the benchmark's own record of which stage runs
        clocks[:] = [clock]
        write(event="start", stage=name)
        starting(clock, name)

    conversion.StageClock.start = start
    measure_verification_cases(write, request["arrays"])

    def ended(stage: str, seconds: float, detail: str) -> None:
        peak = clocks[0].memory.get(stage) if clocks else None
        write(event="end", stage=stage, seconds=seconds, memory=peak.to_json() if peak else {},
              arrays=largest_arrays() if request["arrays"] else [])

    if case.checkpoint:
        with tpuexport.parameters_on_meta():
            model, _ = streamed_conversion.llama(config, "bfloat16")
    else:
        model, _ = streamed_conversion.llama(config, "bfloat16")
    write(event="model", weight_bytes=sum(tensor.numel() * tensor.element_size() for tensor in model.parameters()))  # tied: once
    options = dict(target=request["target"], out=pathlib.Path(request["out"]), overwrite=True, saved_model=False, progress=ended,
                   checkpoint=pathlib.Path(request["checkpoint"]) if case.checkpoint else None, quantize=case.quantize)
    start_time = time.perf_counter()
    if case.task == "text-generation":
        artifact = tpuexport.convert(model.model, task="text-generation", max_context=request["max_context"], max_batch=8, **options)
    else:
        batch = torch.export.Dim("batch", min=1, max=request["max_batch"])
        seq = torch.export.Dim("seq", min=2, max=request["max_seq"])
        input_ids = torch.randint(3, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
        artifact = tpuexport.convert(model, (input_ids,), {"input_ids": {0: batch, 1: seq}}, buckets={"batch": [8], "seq": [2048]},
                                     **options)
    manifest = artifact.manifest
    write(event="end", stage="write (to the manifest)", seconds=0.0, memory=manifest["build"]["stage_memory"]["write"], arrays=[])
    write(event="done", seconds=time.perf_counter() - start_time, verified=[case["sizes"] for case in manifest["verification"].get("cases", [])])


def measure_verification_cases(write, arrays: bool) -> None:
    """Each forward verification case (verification.run_case), the position check and each
    generation run (a fill bucket's teacher-forced logits in a session of its own) measured on its
    own, reported as "case" events: which case of the verify stage holds the memory (with `arrays`,
    the largest arrays alive as the case ends: a generation run's session still holds its cache)."""
    from tpuexport.memory import MemoryMonitor
    from tpuexport.verify import generation, verification

    monitor = MemoryMonitor().__enter__()  # sampled for the child's life
    run_case, verify_positions = verification.run_case, verification.verify_positions

    def measured(label, sizes, run):
        window = monitor.open()
        start = time.perf_counter()
        outcome = run()
        write(event="case", label=label, sizes=sizes, seconds=time.perf_counter() - start, memory=monitor.close(window).to_json(),
              arrays=largest_arrays() if arrays else [])
        return outcome

    verification.run_case = lambda runs, reference, inputs, planned, tolerances: measured(
        planned.label, planned.sizes, lambda: run_case(runs, reference, inputs, planned, tolerances))
    verification.verify_positions = lambda *args: measured("positions", None, lambda: verify_positions(*args))
    teacher_forced_logits = generation.teacher_forced_logits
    generation.teacher_forced_logits = lambda session, prompts, slots, seq, eager_tokens: measured(
        "generation run", {"seq": seq, "prompts": len(prompts), "steps": len(eager_tokens[0])},
        lambda: teacher_forced_logits(session, prompts, slots, seq, eager_tokens))


def largest_arrays(count: int = 6) -> list[str]:
    """The largest live JAX arrays and torch tensors (one per storage), as "jax bf16[16,2048,8192] 0.50 GiB
    in model.weights" (the file mapped where the data lies) or "... anonymous"."""
    import gc

    import jax
    import torch

    mappings = file_mappings()
    found = [(array.nbytes, f"jax {array.dtype}{list(array.shape)}", array.unsafe_buffer_pointer()) for array in jax.live_arrays()
             if array.nbytes >= LISTED_ARRAY_BYTES and len(array.devices()) == 1]
    storages = {}
    for thing in gc.get_objects():
        # Real tensors only: export's fake and functional tensors have no data.
        if type(thing) in (torch.Tensor, torch.nn.Parameter) and thing.device.type == "cpu":
            storage = thing.untyped_storage()
            if storage.nbytes() >= LISTED_ARRAY_BYTES:
                storages[storage.data_ptr()] = (storage.nbytes(), f"torch {str(thing.dtype).removeprefix('torch.')}{list(thing.shape)}",
                                                storage.data_ptr())
    found += storages.values()
    where = lambda address: next((f"in {name}" for start, end, name in mappings if start <= address < end), "anonymous")  # noqa: E731
    return [f"{text} {size / 2**30:.2f} GiB {where(address)}" for size, text, address in sorted(found, reverse=True)[:count]]


def file_mappings() -> list[tuple[int, int, str]]:
    """The process's file-backed mappings: (start, end, file name)."""
    mappings = []
    for line in pathlib.Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = (int(part, 16) for part in fields[0].split("-"))
            mappings.append((start, end, pathlib.Path(fields[5]).name))
    return mappings


def write_checkpoint(shape: str, layers: int, work: pathlib.Path) -> pathlib.Path:
    """The bf16 checkpoint of the shape at `layers` (written once per work directory, in a child process)."""
    directory = work / f"checkpoint-{shape}-{layers}"
    if not (directory / "model.safetensors.index.json").exists():
        directory.mkdir(parents=True, exist_ok=True)
        config = dict(streamed_conversion.SHAPES[shape], num_hidden_layers=layers)
        subprocess.run([sys.executable, streamed_conversion.__file__, "--write-checkpoint", json.dumps(config), "bfloat16", str(directory)],
                       check=True, env=_common.child_environment())
    return directory


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and its descendants (0 once gone)."""
    total = 0
    try:
        total += int(next(line for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines()
                          if line.startswith("VmRSS:")).split()[1]) * 1024
        children = [int(child) for thread in os.listdir(f"/proc/{pid}/task")
                    for child in pathlib.Path(f"/proc/{pid}/task/{thread}/children").read_text().split()]
    except (OSError, StopIteration):
        return total
    return total + sum(tree_rss(child) for child in children)


def print_cpu_plan(options) -> None:
    """--cpu-plan: the text-generation case planned for the cpu target (no weights, nothing run), each
    executable's XLA:CPU memory analysis: what generation verification's CPU runs of each fill bucket need
    before any of them runs. A bucket beyond the machine's memory is refused (the error says by how much)."""
    import tpuexport

    config = dict(streamed_conversion.SHAPES["llama-3.2-1b"], num_hidden_layers=options.layers or 16)
    with tpuexport.parameters_on_meta():
        model, _ = streamed_conversion.llama(config, "bfloat16")
    with tempfile.TemporaryDirectory() as directory:
        try:
            artifact = tpuexport.convert(model.model, task="text-generation", max_context=options.max_context, max_batch=8, target="cpu",
                                         weights=False, out=pathlib.Path(directory) / "plan.tpu")
        except tpuexport.TpuExportError as error:
            print(f"\ntext-generation on XLA:CPU, {config['num_hidden_layers']} layers, max context {options.max_context}: {error}")
            return
        print(f"\ntext-generation on XLA:CPU, {config['num_hidden_layers']} layers, max context {options.max_context}, batch 8 "
              "(XLA's memory analysis per executable, GiB):")
        print(f"  {'entry point':<12}{'bucket':<22}{'arguments':>10}{'temporaries':>13}{'outputs':>9}")
        for bucket in artifact.manifest["targets"]["cpu"]["buckets"]:
            memory = bucket["memory"]
            print(f"  {bucket['entry_point']:<12}{bucket['name']:<22}{gib(memory['argument_bytes']):>10}{gib(memory['temp_bytes']):>13}"
                  f"{gib(memory['output_bytes']):>9}")


def read_progress(progress: pathlib.Path) -> dict:
    """What the child reported: weight_bytes, stages {name: end event}, running (stages started and
    not ended), and once done its seconds and verified sizes."""
    result = {"stages": {}, "running": [], "cases": []}
    for line in progress.read_text().splitlines():
        event = json.loads(line)
        kind = event.pop("event")
        if kind == "start":
            result["running"].append(event["stage"])
        elif kind == "end":
            result["stages"][event["stage"]] = event
            if event["stage"] in result["running"]:
                result["running"].remove(event["stage"])
        elif kind == "case":
            result["cases"].append(event)
        else:
            result.update(event)
    return result


def measure(name: str, options, work: pathlib.Path) -> dict:
    """Runs one case in a child process under the cap; returns its result (or why it has none)."""
    case = CASES[name]
    layers = options.layers or streamed_conversion.SHAPES[case.shape]["num_hidden_layers"]
    checkpoint = write_checkpoint(case.shape, layers, work) if case.checkpoint else None
    scratch = pathlib.Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))
    progress = scratch / "progress.jsonl"
    request = {"case": name, "layers": layers, "max_batch": options.max_batch, "max_seq": options.max_seq, "max_context": options.max_context,
               "arrays": options.arrays, "target": options.target, "checkpoint": str(checkpoint) if checkpoint else None, "out": str(scratch / "model.tpu"),
               "progress": str(progress)}
    progress.touch()
    log = open(scratch / "log.txt", "w+")
    child = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(request)], stdout=log, stderr=subprocess.STDOUT,
                             env=_common.child_environment(), start_new_session=True)
    cap, exceeded, tree_peak = options.cap * 2**30, None, 0
    while child.poll() is None:
        rss = tree_rss(child.pid)
        tree_peak = max(tree_peak, rss)
        if rss > cap:
            exceeded = f"exceeded {options.cap:g} GB in stage {' + '.join(read_progress(progress)['running']) or 'start-up'}"
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            break
        time.sleep(SAMPLE_SECONDS)
    result = {"case": name, "layers": layers, "tree_peak": tree_peak, **read_progress(progress)}
    if exceeded:
        result["failed"] = exceeded
    elif child.returncode:
        log.seek(0)
        result["failed"] = f"exit code {child.returncode}: {log.read().strip().splitlines()[-1:]}"
    shutil.rmtree(scratch, ignore_errors=True)
    return result


def gib(count) -> str:
    return "unknown" if count in (None, "unknown") else f"{count / 2**30:.2f}"


def print_case(result: dict) -> None:
    """The case's stages as they ended (also those before a kill), with --arrays their largest arrays."""
    print(f"\n{result['case']} ({result['layers']} layers): weights {gib(result.get('weight_bytes'))} GiB; "
          + (result["failed"] if "failed" in result else f"verified sizes {result['verified']}, {result['seconds']:.0f} s")
          + f"; process tree peak {gib(result['tree_peak'])} GiB (sampled every {SAMPLE_SECONDS * 1000:.0f} ms by this script)")
    print(f"  {'stage':<28}{'seconds':>9}{'process GiB':>13}{'anon':>8}{'mapped':>8}{'largest child':>15}")
    for stage, ended in result["stages"].items():
        peak = ended["memory"]
        if not peak:  # an event, not a stage (one executable compiled): timed, its memory is the compile stage's
            print(f"  {stage:<28}{ended['seconds']:>9.1f}{'-':>13}")
            continue
        print(f"  {stage:<28}{ended['seconds']:>9.1f}{gib(peak.get('process_bytes')):>13}{gib(peak.get('anonymous_bytes')):>8}"
              f"{gib(peak.get('mapped_bytes')):>8}{gib(peak.get('child_bytes')):>15}")
        for line in ended["arrays"]:
            print(f"      {line}")
        if stage == "verify":
            print_verification_cases(result["cases"])
    if "verify" not in result["stages"] and result["cases"]:
        print("  verify (not ended)")
        print_verification_cases(result["cases"])


def print_verification_cases(cases: list[dict]) -> None:
    for case in cases:
        peak = case["memory"]
        print(f"    {'case ' + case['label'] + (' ' + str(case['sizes']) if case['sizes'] else ''):<26}{case['seconds']:>9.1f}"
              f"{gib(peak.get('process_bytes')):>13}{gib(peak.get('anonymous_bytes')):>8}{gib(peak.get('mapped_bytes')):>8}")
        for line in case.get("arrays", []):
            print(f"        {line}")


def summary_row(result: dict) -> str:
    """| case | layers | weights | process peak (stage) | anon / mapped peaks | largest child | peak / weights | seconds |"""
    peaks = {stage: ended["memory"] for stage, ended in result["stages"].items()
             if ended["memory"].get("process_bytes") not in (None, "unknown")}
    if "verify" not in peaks:  # stopped within verify: its cases so far
        peaks.update({f"verify ({case['label']} {case['sizes']})": {**case["memory"], "child_bytes": 0} for case in result["cases"]})
    head = f"| {result['case']} | {result['layers']} | {gib(result.get('weight_bytes'))} |"
    if not peaks:
        return f"{head} {result.get('failed', 'unknown')} | | | | |"
    stage, peak = max(peaks.items(), key=lambda item: item[1]["process_bytes"])
    anonymous = max(peak["anonymous_bytes"] for peak in peaks.values())
    mapped = max(peak["mapped_bytes"] for peak in peaks.values())
    child = max(peak["child_bytes"] for peak in peaks.values())
    largest = f"{gib(peak['process_bytes'])} in {stage}" + (f"; then {result['failed']}" if "failed" in result else "")
    seconds = f"{result['seconds']:.0f}" if "seconds" in result else "-"
    return (f"{head} {largest} | {gib(anonymous)} / {gib(mapped)} | {gib(child)} | {peak['process_bytes'] / result['weight_bytes']:.1f} | "
            f"{seconds} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", choices=[[], *CASES], default=[], metavar="CASE", help=f"{', '.join(CASES)} (default: all)")
    parser.add_argument("--layers", type=int, help="layers of each model (default: the shape's: 16 for 1B, 32 for 8B)")
    parser.add_argument("--max-batch", type=int, default=64, help="forward: the batch dim's largest size")
    parser.add_argument("--max-seq", type=int, default=8192, help="forward: the seq dim's largest size")
    parser.add_argument("--max-context", type=int, default=4096, help="text-generation: the KV cache's positions")
    parser.add_argument("--target", default="v5e", help="the TPU target compiled for (the 8B bf16 case's 15 GiB of weights need "
                                                         "more HBM than v5e's 16 GiB at the bucket: v6e or v5p)")
    parser.add_argument("--cap", type=float, default=20.0, help="GB a case's processes may hold before it is killed")
    parser.add_argument("--arrays", action="store_true", help="list the largest live arrays at the end of each stage")
    parser.add_argument("--work", type=pathlib.Path, help="keep checkpoints here (default: a temporary directory)")
    parser.add_argument("--cpu-plan", action="store_true", help="only print the text-generation case's XLA:CPU memory analysis per "
                                                               "executable (planned from shapes: nothing runs)")
    options = parser.parse_args()
    if options.cpu_plan:
        print_cpu_plan(options)
        return
    work = options.work or pathlib.Path(tempfile.mkdtemp(prefix="conversion-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    print(f"{datetime.datetime.now():%Y-%m-%d %H:%M}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores; "
          f"layers {options.layers or 'full'}, forward dims batch <= {options.max_batch}, seq <= {options.max_seq} (bucket 8 x 2048), "
          f"generation max context {options.max_context}, batch 8; target {options.target}; cap {options.cap:g} GB", flush=True)
    results = []
    try:
        for name in options.cases or list(CASES):
            results.append(measure(name, options, work))
            print_case(results[-1])
            sys.stdout.flush()
    finally:
        if not options.work:
            shutil.rmtree(work, ignore_errors=True)
    print("\n| case | layers | weights GiB | process peak GiB (stage) | anon / mapped peak GiB | largest child GiB | peak / weights | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for result in results:
        print(summary_row(result))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        convert_case(json.loads(sys.argv[2]))
    else:
        main()
