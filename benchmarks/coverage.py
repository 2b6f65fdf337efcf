"""Coverage of real architectures: every family in benchmarks/families.py through the command line,
as a user runs it, in float, bf16, each int8 mode, int4 weight-only and as a bf16 checkpoint. Prints one row per
family, task choice and mode.

    pip install -c constraints.txt -e ".[bench]"
    python benchmarks/coverage.py                       # every family, every mode, --task auto
    python benchmarks/coverage.py bert llama --modes f32,int8 --tasks auto,explicit --target v5e --saved-model
    python benchmarks/coverage.py --fast --json coverage.json

A transformers family is written with save_pretrained into a temporary directory and converted with
`tpuexport convert DIR --task auto` (or its explicit task) and its --dim ranges: no Python of the
user's. Static int8 calibrates on random inputs (--random-calibration). A family that is not a
transformers model (the diffusers UNet) converts from its factory, `families.py:NAME`.

Each conversion runs in its own process, with a single-bucket v5e compile and, unless --saved-model,
no TF SavedModel. Columns: the task converted (as --task auto resolved it) and the --task given;
status (passed, mismatch = verification failed, exit 1; error = refused with a one-line error,
exit 2; crash = anything else) with the last line of stderr; convert seconds (the whole command);
for int8 and int4, the lowest output SQNR against the float model, weight bytes against f32 and, for
PT2E int8, the share of matmul/conv FLOPs that the compiled TPU HLO runs as s8 x s8 -> s32
(int4-weight-only uses --group-size 32, which divides the tiny families' width).

Modes "generate-f32", "generate-bf16", "generate-int8-weight-only", "generate-int4-weight-only"
(--group-size 32) and "generate-int8-kv" (the model's dtypes, --kv-cache-dtype int8; parity against
the eager int8-cache entry points) convert the decoder families' directories with `--task text-generation` (max
context 64, max batch 2, prefill bucket batch 2 x seq 16 with rows of different lengths, 32 new
tokens compared with generate(do_sample=False)). They print after the other modes, in a table of
their own: greedy parity (a weight-only artifact against generate() with its rounded weights), the
tokens compared and the ties; for weight-only, against the float model's generate(): the first step
where greedy tokens differ ("none": the same 32 tokens) and the logits SQNR up to that step, and the
weight bytes against f32. The encoder-decoder families (t5, bart, whisper) have rows in generate-f32
and generate-bf16: encode and decode entry points (source bucket batch 2 x seq 16, sources of
different lengths; Whisper: encode batch 2 of different random audio features, its fixed length; 32
new tokens from the decoder start token). Other kinds have no row in these modes. With `--kv-cache
paged` they convert with pages of 4 positions and one step bucket of 16 tokens x 2 rows instead
(verify/paged_generation.py: a prompt prefilled in chunks beside a decoding row).

Mode "bf16-checkpoint" writes the transformers families' directories in bfloat16 (as most
checkpoints are published; non-persistent buffers such as rotary `inv_freq` are not in a checkpoint)
and converts them with default options (precision auto); a causal LM converts as the generate modes
do (--task text-generation, no --precision). The row says what the precision resolved to, the
dtypes a forward artifact's `Artifact.run` returns on the first golden inputs (a text-generation
artifact's: the logits and KV cache of one prefill), and the dtype of any rotary table in the
artifact's weights. The diffusers UNet (a factory, no checkpoint) has no row in
this mode.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import _common

HERE = _common.BENCHMARKS
MODES = ("f32", "bf16", "int8", "int8-dynamic", "int8-weight-only", "int4-weight-only", "bf16-checkpoint")
# int4 groups must divide the tiny families' widths (64); 128, the default, does not.
INT4_GROUP_SIZE = 32
CHECKPOINT_MODE = "bf16-checkpoint"
GENERATION_MODES = ("generate-f32", "generate-bf16", "generate-int8-weight-only", "generate-int4-weight-only", "generate-int8-kv")
INT8_KV_MODE = "generate-int8-kv"  # the model's dtypes with an int8 KV cache (--kv-cache-dtype int8)
# Encoder-decoders generate in float only (their entry points are not quantized yet).
FLOAT_GENERATION_MODES = ("generate-f32", "generate-bf16")
GENERATION_NEW_TOKENS = 32
TASK_CHOICES = ("auto", "explicit")
CHILD_TIMEOUT_SECONDS = 1200
STATUS_OF_EXIT_CODE = {0: "passed", 1: "mismatch", 2: "error"}


def save_family(family_name: str, directory: pathlib.Path, dtype_name: str) -> None:
    """Writes a transformers family with save_pretrained in `dtype_name` (run in a child process)."""
    import torch
    from families import FAMILIES

    FAMILIES[family_name].save(directory, getattr(torch, dtype_name))


def bf16_check(artifact_dir: pathlib.Path) -> dict:
    """What a bf16 checkpoint's artifact computes in (run in a child process): the resolved
    precision, the dtypes its outputs come back in and any rotary table's dtype.

    A forward artifact runs `Artifact.run` on its first golden inputs; a text-generation artifact
    (no `run`: prefill and decode entry points) runs one prefill of its first compiled batch and
    reports its logits' and KV cache's dtypes.
    """
    import numpy as np
    import torch
    from torch.utils import _pytree as pytree

    import tpuexport
    from tpuexport.arrays import to_torch
    from tpuexport.lower.generation import GenerationSession

    artifact = tpuexport.load(artifact_dir)
    if artifact.task == "text-generation":
        generation = artifact.generation_program
        session = GenerationSession(generation)
        rows = generation.prefill_batches[0]
        logits = session.prefill([[1, 2, 3]] * rows, list(range(rows)))
        outputs = {"logits": logits, "cache": session.cache[0]}
        program, via = generation.weights_program, "prefill"
        dtypes = [f"{name} {np.asarray(array).dtype}" for name, array in outputs.items()]
    else:
        _, inputs, _ = artifact.golden_cases()[0]
        input_dtypes = [spec.torch_dtype for spec in artifact.signature.inputs]
        outputs = pytree.tree_leaves(artifact.run(*(to_torch(array).to(getattr(torch, dtype)) for array, dtype in zip(inputs, input_dtypes))))
        program, via = artifact.program, "run"
        dtypes = sorted({str(output.dtype).removeprefix("torch.") for output in outputs})
    return {"resolved_precision": artifact.manifest["resolved_precision"], "via": via, "run_dtypes": dtypes,
            "rotary_dtypes": sorted({str(spec.dtype) for name, spec in zip(program.weight_names, program.weight_specs) if "inv_freq" in name})}


def convert_command(family, source: str, mode: str, task_choice: str, out: pathlib.Path, options) -> list[str]:
    """The `tpuexport convert` command line of one row. A decoder family's task (text-generation,
    also what --task auto gives it) is the prefill/decode artifact in every mode: its sizes are
    --max-context/--max-batch/--bucket, not --dim."""
    command = [sys.executable, "-m", "tpuexport.cli", "convert", source, "-o", str(out), "--target", options.target]
    generation = mode in GENERATION_MODES or family.task == "text-generation"
    if family.save is not None:
        asked = "text-generation" if mode in GENERATION_MODES else family.task if task_choice == "explicit" else "auto"
        command += ["--task", asked]
        if not generation:
            command += [option for dim in family.dims for option in ("--dim", dim)]
    numerics = mode.removeprefix("generate-")
    if mode == INT8_KV_MODE:
        command += ["--kv-cache-dtype", "int8"]
    elif numerics.startswith(("int8", "int4")):
        command += ["--quantize", numerics] + (["--random-calibration"] if numerics == "int8" and family.save is not None else [])
        command += ["--group-size", str(INT4_GROUP_SIZE)] if numerics == "int4-weight-only" else []
    elif mode != CHECKPOINT_MODE:  # a bf16 checkpoint converts with default options
        command += ["--precision", numerics]
    if generation:
        # A source or prompt bucket where the family's inputs have a seq dim (Whisper's audio features have a fixed length).
        seq_bucket = ["--bucket", "seq=16"] if any(dim.startswith("seq=") for dim in family.dims) else []
        buckets = (["--kv-cache", "paged", "--page-size", "4", "--bucket", "tokens=16", "--bucket", "rows=2"] if options.kv_cache == "paged"
                   else ["--bucket", "batch=2", *seq_bucket])
        return command + ["--max-context", "64", "--max-batch", "2", *buckets, "--verify-new-tokens", str(GENERATION_NEW_TOKENS),
                          "--no-saved-model"]
    return command + ([] if options.saved_model else ["--no-saved-model"])


def run_row(family_name: str, mode: str, task_choice: str, options) -> dict:
    """Converts one family in one mode with the command line and returns the table row."""
    from families import FAMILIES

    family = FAMILIES[family_name]
    row = {"family": family_name, "kind": family.kind, "task": family.task or "-", "asked": task_choice if family.save else "factory",
           "mode": mode}
    environment = _common.child_environment()
    with tempfile.TemporaryDirectory(prefix="tpuexport-coverage-") as scratch:
        scratch = pathlib.Path(scratch)
        out = scratch / f"{family_name}-{mode}.tpu"
        try:
            if family.save is not None:
                source = str(scratch / family_name)
                dtype = "bfloat16" if mode == CHECKPOINT_MODE else "float32"
                subprocess.run([sys.executable, str(HERE / "coverage.py"), "--save", family_name, source, dtype], check=True,
                               capture_output=True, timeout=options.child_timeout, env=environment)
            else:
                source = f"{HERE / 'families.py'}:{family.build.__name__}"
            start = time.perf_counter()
            completed = subprocess.run(convert_command(family, source, mode, task_choice, out, options), capture_output=True, text=True,
                                       timeout=options.child_timeout, env=environment, cwd=scratch)
        except subprocess.TimeoutExpired:
            return {**row, "status": "crash", "message": f"timed out after {options.child_timeout} s"}
        except subprocess.CalledProcessError as error:
            return {**row, "status": "crash", "message": f"save_pretrained failed: {(error.stderr or b'').decode().strip()[-200:]}"}
        row["seconds"] = round(time.perf_counter() - start, 2)
        row["status"] = STATUS_OF_EXIT_CODE.get(completed.returncode, "crash")
        if row["status"] == "mismatch" and "verification failed" not in completed.stderr:
            row["status"] = "crash"  # Python's own exit code for an uncaught exception is 1 too
        if row["status"] != "passed":
            row["message"] = (completed.stderr.strip().splitlines() or [f"exit code {completed.returncode}"])[-1]
            report = sorted(scratch.glob("*.verification-report.json"))
            row["report"] = _read_json(report[0]) if report else None
            return row
        manifest = json.loads((out / "manifest.json").read_text())
        row["task"] = manifest.get("huggingface", {}).get("task", row["task"])
        row["report"] = _read_json(out / manifest["verification"]["report"])
        row["weight_bytes"] = manifest["program"]["weight_bytes"]
        if "tokens_compared" in manifest["verification"]:
            row["tokens_compared"] = manifest["verification"]["tokens_compared"]
            row["ties"] = manifest["verification"]["ties"]
        if mode in GENERATION_MODES:
            row["float_divergence"] = (row["report"] or {}).get("float_divergence")
            if "weight_bytes" in manifest.get("quantization", {}):  # weight-only (an int8 KV cache alone has no weight section)
                row["weight_ratio"] = manifest["quantization"]["weight_bytes"]["ratio"]
        elif "quantization" in manifest:  # PT2E's report is a file; weight-only's is the manifest section itself
            section = manifest["quantization"]
            quantization = _read_json(out / section["report"]) if "report" in section else section
            row["sqnr_db"] = [o["sqnr_db"] for o in quantization["outputs"]]
            row["weight_ratio"] = quantization["weight_bytes"]["ratio"]
            row["integer_flops_fraction"] = quantization.get("integer_flops", {}).get("fraction")
            row["first_divergence"] = quantization.get("first_divergence")  # int8 text generation
        if mode == CHECKPOINT_MODE:
            checked = subprocess.run([sys.executable, str(HERE / "coverage.py"), "--bf16-check", str(out)], capture_output=True, text=True,
                                     timeout=options.child_timeout, env=environment)
            row["bf16_check"] = (json.loads(checked.stdout.strip().splitlines()[-1]) if checked.returncode == 0
                                 else {"error": (checked.stderr.strip().splitlines() or ["no output"])[-1]})
    return row


def _generates(family, mode: str) -> bool:
    """Whether a generate-* mode has a row for the family: decoders in every mode, encoder-decoders
    (encode/decode entry points) in the float modes."""
    return family.kind == "decoder" or (family.kind == "encoder-decoder" and mode in FLOAT_GENERATION_MODES)


def _read_json(path) -> dict | None:
    return json.loads(pathlib.Path(path).read_text()) if path and pathlib.Path(path).is_file() else None


def first_line(text: str, width: int = 110) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= width else line[: width - 1] + "…"


def format_row(row: dict) -> str:
    sqnr = row.get("sqnr_db")
    sqnr_text = f"{min(v for v in sqnr if v is not None):.1f}" if sqnr and any(v is not None for v in sqnr) else "-"
    ratio = row.get("weight_ratio")
    integer = row.get("integer_flops_fraction")
    message = "" if row["status"] == "passed" else first_line(row.get("message", ""))
    checked = row.get("bf16_check")
    if checked:
        message = checked.get("error") or (f"resolved {checked['resolved_precision']}; {checked.get('via', 'run')} gives "
                                           f"{'/'.join(checked['run_dtypes'])}"
                                           + (f"; inv_freq {'/'.join(checked['rotary_dtypes'])}" if checked["rotary_dtypes"] else ""))
    if "tokens_compared" in row and sqnr:  # int8 text generation: verified against its PT2E entry points
        steps = [entry["step"] for entry in row.get("first_divergence") or []]
        message = message or (f"{row['tokens_compared']} tokens vs PT2E, {row['ties']} ties; first step off the float argmax per row: "
                              f"{', '.join('none' if step is None else str(step) for step in steps)}")
    elif "tokens_compared" in row:  # a decoder's bf16 checkpoint (a text-generation artifact)
        parity = {"passed": "yes", "mismatch": "no"}.get(row["status"], row["status"])
        return (f"| {row['family']} | {row['task']} | {row['asked']} | {row['mode']} | greedy parity {parity} | {row.get('seconds', '-')} | "
                f"{row.get('tokens_compared', '-')} tokens compared, {row.get('ties', '-')} ties | - | - | {message} |")
    return (f"| {row['family']} | {row['task']} | {row['asked']} | {row['mode']} | {row['status']} | {row.get('seconds', '-')} | {sqnr_text} | "
            f"{f'{ratio:.3f}' if ratio is not None else '-'} | {f'{integer:.0%}' if integer is not None else '-'} | {message} |")


GENERATION_HEADER = ("| family | mode | greedy parity | seconds | tokens compared | ties | vs float: first differing step | "
                     "vs float: logits SQNR dB | weights vs f32 | error (last line) |\n|---|---|---|---|---|---|---|---|---|---|")


def format_generation_row(row: dict) -> str:
    """A generate-* row of the text-generation table (GENERATION_HEADER)."""
    parity = {"passed": "yes", "mismatch": "no"}.get(row["status"], row["status"])
    divergence = row.get("float_divergence")
    first, sqnr = "-", "-"
    if divergence:
        first = "none" if divergence["first"] is None else f"step {divergence['first']['step']} (row {divergence['first']['row']})"
        sqnr = "identical" if divergence["sqnr_db"] is None else f"{divergence['sqnr_db']:.1f}"
    ratio = row.get("weight_ratio")
    message = "" if row["status"] == "passed" else first_line(row.get("message", ""))
    return (f"| {row['family']} | {row['mode']} | {parity} | {row.get('seconds', '-')} | {row.get('tokens_compared', '-')} | "
            f"{row.get('ties', '-')} | {first} | {sqnr} | {f'{ratio:.3f}' if ratio is not None else '-'} | {message} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="family names (default: all)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES + GENERATION_MODES)} (generate-*: decoder families; "
                                                            "generate-f32/bf16: encoder-decoders too)")
    parser.add_argument("--tasks", default="auto", help=f"comma-separated --task choices, from {', '.join(TASK_CHOICES)}")
    parser.add_argument("--target", default="v5e")
    parser.add_argument("--saved-model", action="store_true", help="also build and check the TF SavedModel")
    parser.add_argument("--fast", action="store_true", help="only the families the test suite runs")
    parser.add_argument("--kv-cache", choices=("static", "paged"), default="static",
                        help="generate-* modes: the KV cache (paged: pages of 4, one step bucket of 16 tokens x 2 rows)")
    parser.add_argument("--jobs", type=int, default=1, help="conversions at once (each is a process)")
    parser.add_argument("--json", type=pathlib.Path, help="write every row (with its verification report) here")
    parser.add_argument("--child-timeout", type=float, default=CHILD_TIMEOUT_SECONDS,
                        help="seconds one row's process may take (a shared machine needs more)")
    parser.add_argument("--save", nargs=3, metavar=("FAMILY", "DIR", "DTYPE"), help=argparse.SUPPRESS)
    parser.add_argument("--bf16-check", type=pathlib.Path, help=argparse.SUPPRESS)
    options = parser.parse_args()

    if options.save:
        save_family(options.save[0], pathlib.Path(options.save[1]), options.save[2])
        return
    if options.bf16_check:
        print(json.dumps(bf16_check(options.bf16_check)))
        return

    from families import FAMILIES

    names = options.families or [name for name, family in FAMILIES.items() if family.fast or not options.fast]
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    modes = options.modes.split(",")
    task_choices = options.tasks.split(",")
    if set(task_choices) - set(TASK_CHOICES):
        parser.error(f"unknown --tasks {options.tasks}; use {', '.join(TASK_CHOICES)}")
    # A family that is not a transformers model converts once, from its factory.
    jobs = [(name, mode, choice) for name in names for choice in (task_choices if FAMILIES[name].save else task_choices[:1])
            for mode in modes if (mode not in GENERATION_MODES or (_generates(FAMILIES[name], mode) and FAMILIES[name].save))
            and (mode != CHECKPOINT_MODE or FAMILIES[name].save)]
    print(f"{len(names)} families x {len(modes)} modes x --task {'/'.join(task_choices)}, target {options.target}"
          f"{', SavedModel' if options.saved_model else ''}", flush=True)
    rows = []
    # The other modes' table first, then the text-generation table (its own columns).
    for table_jobs, header, formatter in (
            ([job for job in jobs if job[1] not in GENERATION_MODES],
             "| family | task | --task | mode | status | seconds | int8 SQNR dB (worst output) | weights vs f32 | s8 FLOPs | "
             "error (last line), or bf16 checkpoint: resolved precision, run dtypes, rotary table |\n|---|---|---|---|---|---|---|---|---|---|",
             format_row),
            ([job for job in jobs if job[1] in GENERATION_MODES], GENERATION_HEADER, format_generation_row)):
        if not table_jobs:
            continue
        print("\n" + header, flush=True)
        with ThreadPoolExecutor(max_workers=options.jobs) as pool:
            for row in pool.map(lambda job: run_row(*job, options), table_jobs):
                rows.append(row)
                print(formatter(row), flush=True)
    passed = {(mode, choice): [r["status"] == "passed" for r in rows if r["mode"] == mode and r["asked"] in (choice, "factory")]
              for mode in modes for choice in task_choices}
    print("\npassed: " + ", ".join(f"{mode} --task {choice} {sum(seen)}/{len(seen)}" for (mode, choice), seen in passed.items()))
    if options.json:
        options.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
