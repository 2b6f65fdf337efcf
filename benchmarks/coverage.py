"""Coverage of real architectures: every family in benchmarks/families.py through `tpuexport.convert`
in float, bf16, each int8 mode, and as a bf16 checkpoint. Prints one row per family and mode.

    pip install -c constraints.txt -e ".[bench]"
    python benchmarks/coverage.py                       # every family, every mode
    python benchmarks/coverage.py bert llama --modes f32,int8 --target v5e --saved-model
    python benchmarks/coverage.py --fast --json coverage.json
    python benchmarks/coverage.py llama mixtral --modes bf16-checkpoint

Mode bf16-checkpoint builds each family as users load a bf16 checkpoint (families.as_bf16_checkpoint:
bfloat16 parameters, f32 where the model keeps f32, bfloat16 float inputs) and converts it with
default options (precision auto); the row also shows the precision it resolved to, the dtypes
`Artifact.run` returns, and the dtype of any rotary table (`inv_freq`) in the artifact's weights.

Each conversion runs in its own process (a crash or leaked state cannot affect the next row), with
a single-bucket v5e compile and, unless --saved-model, no TF SavedModel. Columns: status (passed,
mismatch = verification failed, error = refused with a one-line error, crash = anything else) with
the first line of the error; convert seconds; for int8, the lowest output SQNR against the float
model, weight bytes against f32 and the share of matmul/conv FLOPs that the compiled TPU HLO runs
as s8 x s8 -> s32.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = pathlib.Path(__file__).resolve().parent
MODES = ("f32", "bf16", "int8", "int8-dynamic", "int8-weight-only", "bf16-checkpoint")
CHILD_TIMEOUT_SECONDS = 1200


def convert_one(family_name: str, mode: str, target: str, saved_model: bool, workdir: pathlib.Path) -> dict:
    """Converts one family in one mode (in this process) and returns the table row as a dict."""
    import warnings

    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(HERE))
    from families import FAMILIES, as_bf16_checkpoint

    import tpuexport

    family = FAMILIES[family_name]
    row = {"family": family_name, "kind": family.kind, "mode": mode}
    checkpoint = mode == "bf16-checkpoint"
    built = as_bf16_checkpoint(family) if checkpoint else family.build()
    quantize = mode if mode.startswith("int8") else None
    precision = "auto" if checkpoint else mode if not quantize else "f32"
    out = workdir / f"{family_name}-{mode}.tpu"
    start = time.perf_counter()
    try:
        artifact = tpuexport.convert(
            built["model"], built["args"], built["dynamic_shapes"], target=target, out=out, precision=precision,
            quantize=quantize, calibration=built["calibration"] if quantize == "int8" else None, saved_model=saved_model,
        )
    except tpuexport.VerificationError as error:
        row.update(status="mismatch", message=str(error), report=_read_json(error.report_path))
    except tpuexport.TpuExportError as error:
        row.update(status="error", message=str(error))
    except Exception as error:  # the benchmark reports what a user would see, whatever it is
        row.update(status="crash", message=f"{type(error).__name__}: {error}")
    else:
        row.update(status="passed", report=_read_json(artifact.path / artifact.manifest["verification"]["report"]))
        manifest = artifact.manifest
        row["weight_bytes"] = manifest["program"]["weight_bytes"]
        if "quantization" in manifest:
            quantization = _read_json(artifact.path / manifest["quantization"]["report"])
            row["sqnr_db"] = [o["sqnr_db"] for o in quantization["outputs"]]
            row["weight_ratio"] = quantization["weight_bytes"]["ratio"]
            row["integer_flops_fraction"] = quantization.get("integer_flops", {}).get("fraction")
        if checkpoint:
            outputs = torch_leaves(artifact.run(*built["args"]))
            program = artifact.program
            rotary = {str(spec.dtype) for name, spec in zip(program.weight_names, program.weight_specs) if "inv_freq" in name}
            row["bf16_check"] = (f"{manifest['resolved_precision']}; run gives {'/'.join(sorted({str(t.dtype).removeprefix('torch.') for t in outputs}))}"
                                 + (f"; inv_freq {'/'.join(sorted(rotary))}" if rotary else ""))
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def torch_leaves(outputs) -> list:
    from torch.utils import _pytree as pytree

    return pytree.tree_leaves(outputs)


def _read_json(path) -> dict | None:
    return json.loads(pathlib.Path(path).read_text()) if path and pathlib.Path(path).is_file() else None


def run_child(family: str, mode: str, options) -> dict:
    """Runs `convert_one` in a fresh interpreter and returns its row."""
    with tempfile.TemporaryDirectory(prefix="tpuexport-coverage-") as scratch:
        result = pathlib.Path(scratch) / "row.json"
        command = [sys.executable, str(HERE / "coverage.py"), "--child", family, mode, "--target", options.target,
                   "--result", str(result)] + (["--saved-model"] if options.saved_model else [])
        try:
            completed = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_SECONDS,
                                       env={**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}, cwd=scratch)
        except subprocess.TimeoutExpired:
            return {"family": family, "mode": mode, "status": "crash", "message": f"timed out after {CHILD_TIMEOUT_SECONDS} s"}
        if result.is_file():
            return json.loads(result.read_text())
        last = (completed.stderr.strip().splitlines() or ["no output"])[-1]
        return {"family": family, "mode": mode, "status": "crash", "message": f"exit code {completed.returncode}: {last}"}


def first_line(text: str, width: int = 110) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= width else line[: width - 1] + "…"


def format_row(row: dict) -> str:
    sqnr = row.get("sqnr_db")
    sqnr_text = f"{min(v for v in sqnr if v is not None):.1f}" if sqnr and any(v is not None for v in sqnr) else "-"
    ratio = row.get("weight_ratio")
    integer = row.get("integer_flops_fraction")
    message = "" if row["status"] == "passed" else first_line(row.get("message", ""))
    return (f"| {row['family']} | {row['mode']} | {row['status']} | {row.get('seconds', '-')} | {sqnr_text} | "
            f"{f'{ratio:.3f}' if ratio is not None else '-'} | {f'{integer:.0%}' if integer is not None else '-'} | "
            f"{row.get('bf16_check', '-')} | {message} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="family names (default: all)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--target", default="v5e")
    parser.add_argument("--saved-model", action="store_true", help="also build and check the TF SavedModel")
    parser.add_argument("--fast", action="store_true", help="only the families the test suite runs")
    parser.add_argument("--jobs", type=int, default=1, help="conversions at once (each is a process)")
    parser.add_argument("--json", type=pathlib.Path, help="write every row (with its verification report) here")
    parser.add_argument("--child", nargs=2, metavar=("FAMILY", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=pathlib.Path, help=argparse.SUPPRESS)
    options = parser.parse_args()

    if options.child:
        with tempfile.TemporaryDirectory() as workdir:
            row = convert_one(*options.child, options.target, options.saved_model, pathlib.Path(workdir))
        options.result.write_text(json.dumps(row))
        return

    sys.path.insert(0, str(HERE))
    from families import FAMILIES

    names = options.families or [name for name, family in FAMILIES.items() if family.fast or not options.fast]
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    modes = options.modes.split(",")
    jobs = [(name, mode) for name in names for mode in modes]
    print(f"{len(names)} families x {len(modes)} modes, target {options.target}"
          f"{', SavedModel' if options.saved_model else ''}\n", flush=True)
    print("| family | mode | status | seconds | int8 SQNR dB (worst output) | weights vs f32 | s8 FLOPs | bf16 checkpoint: resolved, "
          "run dtypes, rotary | first line of error |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    with ThreadPoolExecutor(max_workers=options.jobs) as pool:
        for row in pool.map(lambda job: run_child(*job, options), jobs):
            rows.append(row)
            print(format_row(row), flush=True)
    passed = {mode: sum(r["status"] == "passed" for r in rows if r["mode"] == mode) for mode in modes}
    print("\npassed: " + ", ".join(f"{mode} {count}/{len(names)}" for mode, count in passed.items()))
    if options.json:
        options.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
