"""Load on `tpuexport serve` (CPU runtime, loopback): throughput, latency, batch sizes, start-up time.

    python benchmarks/serve_load.py [--example mlp] [--bucket batch=1,8,32] [--clients 8] [--seconds 5] [--max-requests 4000]

Requests are one row each: the first row of the example's golden inputs (every input, by name).

Converts examples/<example>.py for the `cpu` target once (or takes --artifact), then for each
scenario starts `tpuexport serve` as its own process on free loopback ports and
  - times the start-up: from starting the process to the first 200 answer of a predict request;
  - runs N concurrent REST clients (one row per request, one keep-alive connection each) for at
    most --seconds and --max-requests requests in all, and reports requests/s, p50/p99 latency
    and the executed batch sizes (from the server's Prometheus metrics).
Scenarios: dynamic batching on (--batch-timeout-ms) and off (0), both loading the AOT executables;
then start-up only, from the StableHLO: a copy of the artifact whose compile key names another
jaxlib, served with --allow-recompile, so the server compiles every bucket before it answers.
The clients run in this process (threads) and share the machine's cores with the server.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import requests

import _common
from _common import free_port

ENV = _common.child_environment()


def convert(example: str, buckets: list[str], out: pathlib.Path) -> None:
    command = [sys.executable, "-m", "tpuexport.cli", "convert", f"{_common.EXAMPLES / example}.py:build", "--target", "cpu",
               "--no-saved-model", "-o", str(out)] + [arg for bucket in buckets for arg in ("--bucket", bucket)]
    subprocess.run(command, check=True, env=ENV, capture_output=True, timeout=1800)


class Served:
    """A `tpuexport serve` process, started and timed to its first answer."""

    def __init__(self, artifact: pathlib.Path, batch_timeout_ms: float, request: dict, model: str, extra=()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1/models/{model}:predict"
        self.log = tempfile.TemporaryFile(mode="w+")
        started = time.perf_counter()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tpuexport.cli", "serve", str(artifact), "--port", str(self.port), "--grpc-port", "0",
             "--batch-timeout-ms", str(batch_timeout_ms), *extra], stdout=self.log, stderr=subprocess.STDOUT, env=ENV)
        while True:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"the server exited: {self.log.read()[-2000:]}")
            try:
                answer = requests.post(self.url, json=request, timeout=60)
            except requests.ConnectionError:
                time.sleep(0.05)
                continue
            if answer.status_code == 200:
                break
            self.stop()
            raise SystemExit(f"the server answered {answer.status_code}: {answer.text[:300]}")
        self.startup_seconds = time.perf_counter() - started

    def metrics(self) -> str:
        return requests.get(self.url.split("/v1/")[0] + "/metrics", timeout=10).text

    def loaded_line(self) -> str:
        self.log.seek(0)
        return next((line.strip() for line in self.log if line.startswith("model ")), "")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)


def load(url: str, request: dict, clients: int, seconds: float, max_requests: int) -> tuple[list[float], float]:
    """(latencies of the successful requests, wall seconds) of `clients` threads posting `request`."""
    latencies: list[float] = []
    lock = threading.Lock()
    sent = [0]
    deadline = time.perf_counter() + seconds
    body = json.dumps(request)

    def client() -> None:
        session = requests.Session()
        while time.perf_counter() < deadline:
            with lock:
                if sent[0] >= max_requests:
                    return
                sent[0] += 1
            start = time.perf_counter()
            answer = session.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=60)
            if answer.status_code == 200:
                with lock:
                    latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies, time.perf_counter() - start


def one_row_request(artifact: pathlib.Path) -> dict:
    """A row-format request of one row: the first row of the artifact's example golden inputs."""
    from tpuexport.arrays import load_arrays

    manifest = json.loads((artifact / "manifest.json").read_text())
    golden = load_arrays((artifact / manifest["verification"]["golden"]).read_bytes())
    row = {spec["name"]: golden[f"0/input/{spec['name']}"][0].tolist() for spec in manifest["entry_points"]["serving_default"]["signature"]["inputs"]}
    return {"instances": [row]}


def batch_histogram(metrics: str) -> str:
    """Executed batches per row count range, from the cumulative tpuexport_batch_rows buckets."""
    cumulative = [(float(le), float(count)) for le, count in re.findall(r'tpuexport_batch_rows_bucket\{le="([^"]+)"[^}]*\} (\S+)', metrics)
                  if le != "+Inf"]
    parts, previous, low = [], 0.0, 1
    for le, count in cumulative:
        if count > previous:
            parts.append(f"{low}-{int(le)}:{int(count - previous)}" if low != int(le) else f"{int(le)}:{int(count - previous)}")
        previous, low = count, int(le) + 1
    return " ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", default="mlp")
    parser.add_argument("--artifact", type=pathlib.Path, help="A cpu-target artifact to serve instead of converting --example.")
    parser.add_argument("--bucket", action="append", default=None)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--max-requests", type=int, default=4000)
    parser.add_argument("--batch-timeout-ms", type=float, default=2.0)
    options = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="serve-load-") as scratch:
        artifact = options.artifact
        if artifact is None:
            artifact = pathlib.Path(scratch) / f"{options.example}.tpu"
            convert(options.example, options.bucket or ["batch=1,8,32"], artifact)
        manifest = json.loads((artifact / "manifest.json").read_text())
        model = (manifest.get("tf_serving") or {}).get("model_name") or artifact.name.split(".")[0]
        request = one_row_request(artifact)
        print(f"{artifact.name}: {options.clients} clients, one row per request, at most {options.seconds:g} s and "
              f"{options.max_requests} requests per scenario; buckets "
              f"{', '.join(b['name'] for b in manifest['targets']['cpu']['buckets'])}", flush=True)
        print(f"{'scenario':<34} {'start-up s':>10} {'requests':>8} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}  batches (rows:count)", flush=True)
        for label, timeout in ((f"dynamic batching ({options.batch_timeout_ms:g} ms)", options.batch_timeout_ms), ("no batching", 0.0)):
            served = Served(artifact, timeout, request, model)
            try:
                before = batch_histogram(served.metrics())  # the start-up request
                latencies, wall = load(served.url, request, options.clients, options.seconds, options.max_requests)
                histogram = batch_histogram(served.metrics())
            finally:
                served.stop()
            milliseconds = np.asarray(latencies) * 1e3
            print(f"{label:<34} {served.startup_seconds:>10.2f} {len(latencies):>8} {len(latencies) / wall:>8.1f} "
                  f"{np.percentile(milliseconds, 50):>8.2f} {np.percentile(milliseconds, 99):>8.2f}  {histogram} (start-up: {before})", flush=True)

        recompiled = pathlib.Path(scratch) / "recompile" / artifact.name  # the same model name
        shutil.copytree(artifact, recompiled)
        edited = json.loads((recompiled / "manifest.json").read_text())
        edited["targets"]["cpu"]["compile_key"]["versions"]["jaxlib"] = "0.0.0"
        (recompiled / "manifest.json").write_text(json.dumps(edited))
        for label, path, extra in (("from AOT executables", artifact, ()), ("from StableHLO (compiling)", recompiled, ("--allow-recompile",))):
            served = Served(path, options.batch_timeout_ms, request, model, extra)
            served.stop()
            loaded = re.search(r"in ([\d.]+) s", served.loaded_line())
            print(f"start-up {label:<28} {served.startup_seconds:6.2f} s to the first answer; runtime load "
                  f"{loaded.group(1) if loaded else '?'} s", flush=True)


if __name__ == "__main__":
    main()
