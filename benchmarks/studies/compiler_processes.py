"""Prints a conversion's wall seconds and how many compiler processes (compile_child.py) it started.

    python benchmarks/studies/compiler_processes.py generation   # tiny Llama text generation, v5e and cpu
    python benchmarks/studies/compiler_processes.py transformer  # examples/transformer.py forward, v5e and v6e

Run it under `/usr/bin/time -f "%e %U %S"` for the CPU time of the process and its children. The
compiler processes are counted from /proc (this process's children running compile_child.py, polled
every 20 ms; each lives for seconds), so the count is the same whatever the code that starts them.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import threading
import time
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402


def compiler_children(seen: set[int], stop: threading.Event) -> None:
    """Adds to `seen` the pid of every child of this process that runs compile_child.py, until `stop`."""
    me = str(os.getpid())
    while not stop.is_set():
        for entry in pathlib.Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
                if parent == me and b"compile_child.py" in (entry / "cmdline").read_bytes():
                    seen.add(int(entry.name))
            except (OSError, IndexError):  # it ended meanwhile
                continue
        stop.wait(0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("conversion", choices=["generation", "transformer"])
    options = parser.parse_args()
    warnings.filterwarnings("ignore")
    import tpuexport

    with tempfile.TemporaryDirectory() as scratch:
        out = pathlib.Path(scratch) / "model.tpu"
        if options.conversion == "generation":
            sys.path.insert(0, str(_common.ROOT / "tests"))
            from test_generation import tiny_llama

            model, convert = tiny_llama(), lambda: tpuexport.convert(
                model, task="text-generation", max_context=32, max_batch=2, buckets={"seq": [16]}, target=["v5e", "cpu"], out=out)
        else:
            from tpuexport.export import load_source
            from tpuexport.pipeline import ConversionOptions, run_conversion

            source = load_source(f"{_common.EXAMPLES / 'transformer'}.py:build")
            convert = lambda: run_conversion(source, ConversionOptions(("v5e", "v6e"), out))  # noqa: E731
        seen, stop = set(), threading.Event()
        watcher = threading.Thread(target=compiler_children, args=(seen, stop), daemon=True)
        watcher.start()
        start = time.perf_counter()
        convert()
        seconds = time.perf_counter() - start
        stop.set()
        watcher.join()
    print(f"{options.conversion}: conversion {seconds:.1f} s wall, {len(seen)} compiler process(es)")


if __name__ == "__main__":
    main()
