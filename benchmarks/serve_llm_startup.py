"""Start-up of `tpuexport serve` for an LLM whose artifact carries its tokenizer: seconds from starting
the process to the first chat completion, the server's resident memory then, and which frameworks
its process mapped.

    python benchmarks/serve_llm_startup.py [--runs 3] [--layers 2] [--hidden 64]

Converts the tests' chat model (benchmarks/chat_model.py: a random-weight Llama with a byte-level
BPE tokenizer and a chat template) for the cpu target once, then starts `tpuexport serve` --runs
times, each a fresh process on a free loopback port, and times it to the first 200 answer of
POST /v1/chat/completions (greedy, 4 tokens; the chat template renders the prompt). Memory is the
server's VmRSS and VmHWM (/proc) after that answer; a framework counts as loaded when a shared
library of it (libtorch, libtensorflow) is mapped into the process.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np
import requests

import _common
from chat_model import GREEDY_PROMPT, save_chat_model

ENV = _common.child_environment()
FRAMEWORK_LIBRARIES = {"torch": "libtorch", "tensorflow": "libtensorflow"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        source, artifact = pathlib.Path(scratch) / "chatlm", pathlib.Path(scratch) / "chatlm.tpu"
        source.mkdir()
        save_chat_model(source, hidden=options.hidden, layers=options.layers)
        subprocess.run([sys.executable, "-m", "tpuexport.cli", "convert", str(source), "--task", "text-generation", "--target", "cpu",
                        "--max-context", "64", "--max-batch", "2", "--bucket", "seq=32", "--verify-new-tokens", "2", "-o", str(artifact)],
                       check=True, env=ENV, capture_output=True, timeout=1800)
        runs = [started_and_answered(artifact) for _ in range(options.runs)]
    print(f"chat llama {options.layers} layers, hidden {options.hidden}, cpu target, {options.runs} fresh servers")
    print("| run | start to first chat completion s | VmRSS MB | VmHWM MB | frameworks mapped |")
    print("|---|---|---|---|---|")
    for index, (seconds, rss, peak, frameworks) in enumerate(runs, 1):
        print(f"| {index} | {seconds:.2f} | {rss:.0f} | {peak:.0f} | {', '.join(frameworks) or 'none'} |")
    print(f"mean: {np.mean([run[0] for run in runs]):.2f} s, {np.mean([run[1] for run in runs]):.0f} MB resident")


def started_and_answered(artifact: pathlib.Path) -> tuple[float, float, float, list[str]]:
    """(seconds to the first chat completion, VmRSS MB, VmHWM MB, frameworks mapped) of one fresh server."""
    port = _common.free_port()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    request = {"model": "chatlm", "messages": GREEDY_PROMPT, "max_tokens": 4, "temperature": 0}
    with tempfile.TemporaryFile(mode="w+") as log:
        started = time.perf_counter()
        server = subprocess.Popen([sys.executable, "-m", "tpuexport.cli", "serve", str(artifact), "--port", str(port), "--grpc-port", "0"],
                                  stdout=log, stderr=subprocess.STDOUT, env=ENV)
        try:
            while True:
                if server.poll() is not None:
                    log.seek(0)
                    raise SystemExit(f"the server exited: {log.read()[-2000:]}")
                try:
                    answer = requests.post(url, json=request, timeout=60)
                except requests.ConnectionError:
                    time.sleep(0.05)
                    continue
                if answer.status_code != 200:
                    raise SystemExit(f"the server answered {answer.status_code}: {answer.text[:300]}")
                break
            seconds = time.perf_counter() - started
            status = dict(line.split(":", 1) for line in pathlib.Path(f"/proc/{server.pid}/status").read_text().splitlines() if ":" in line)
            maps = pathlib.Path(f"/proc/{server.pid}/maps").read_text()
        finally:
            server.terminate()
            server.wait(timeout=60)
    rss, peak = (int(status[field].split()[0]) / 1024 for field in ("VmRSS", "VmHWM"))  # kB in /proc
    return seconds, rss, peak, [name for name, library in FRAMEWORK_LIBRARIES.items() if library in maps]


if __name__ == "__main__":
    main()
