"""Prints how long `tpuexport verify` takes on the examples, with and without --recompile.

    python benchmarks/studies/verify_times.py [--target v5e] [--no-saved-model] [EXAMPLE ...]

Each example is converted once with the CLI; then `tpuexport verify ARTIFACT --json` runs as CI runs
it, in a fresh process, once plain and once with --recompile. "wall" is the whole process
(imports of torch and jax included); the other columns are each check's own seconds from the
JSON report ("-" where the check did not run).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402

TPUEXPORT = pathlib.Path(sys.executable).parent / "tpuexport"
CHECKS = ("integrity", "golden", "saved_model", "recompile")


def convert(example: str, out: pathlib.Path, targets: list[str], saved_model: bool) -> None:
    """Converts examples/<example>.py:build into `out` with the CLI.

    Args:
      example: the example's name.
      out: the artifact directory.
      targets: TPU target names.
      saved_model: also write the TF Serving SavedModel.
    """
    command = [str(TPUEXPORT), "convert", f"{_common.EXAMPLES / example}.py:build", "-o", str(out)]
    command += [option for target in targets for option in ("--target", target)]
    command += [] if saved_model else ["--no-saved-model"]
    subprocess.run(command, check=True, capture_output=True)


def timed_verify(artifact: pathlib.Path, *options: str) -> tuple[float, dict]:
    """Runs `tpuexport verify ARTIFACT --json` in a fresh process.

    Args:
      artifact: the artifact directory.
      *options: extra verify options (e.g. --recompile).
    Returns:
      (wall seconds of the process, the parsed JSON report).
    """
    start = time.perf_counter()
    completed = subprocess.run([str(TPUEXPORT), "verify", str(artifact), "--json", *options], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if completed.returncode != 0:
        sys.exit(f"verify {artifact} {' '.join(options)} exited {completed.returncode}: {completed.stderr.strip()}")
    return seconds, json.loads(completed.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples", nargs="*", default=["mlp", "cnn", "transformer"])
    parser.add_argument("--target", action="append", default=None)
    parser.add_argument("--no-saved-model", dest="saved_model", action="store_false")
    options = parser.parse_args()
    targets = options.target or ["v5e"]

    print(f"targets {', '.join(targets)}; SavedModel {'on' if options.saved_model else 'off'}; seconds")
    print(f"{'example':<12} {'mode':<12} {'wall':>6} " + " ".join(f"{name:>11}" for name in CHECKS))
    with tempfile.TemporaryDirectory() as scratch:
        for example in options.examples:
            artifact = pathlib.Path(scratch) / f"{example}.tpu"
            convert(example, artifact, targets, options.saved_model)
            for mode, extra in (("plain", ()), ("--recompile", ("--recompile",))):
                wall, report = timed_verify(artifact, *extra)
                seconds = {check["name"]: check["seconds"] for check in report["checks"] if check["status"] != "skipped"}
                columns = " ".join(f"{seconds[name]:>11.2f}" if name in seconds else f"{'-':>11}" for name in CHECKS)
                print(f"{example:<12} {mode:<12} {wall:>6.2f} {columns}", flush=True)


if __name__ == "__main__":
    main()
