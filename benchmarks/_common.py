"""What every benchmark script shares: the checkout's paths, its code first on sys.path, and the
environment of the processes the scripts start.

A yardstick in benchmarks/ imports it first (`import _common`: a script's own directory is on
sys.path); a study in benchmarks/studies/ first puts benchmarks/ there, with one line:

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
    import _common  # noqa: E402

Importing it puts the checkout's root (its tpuexport, ahead of any installed copy: the checkout's
code is what is measured) and benchmarks/ (families.py, fuzz_models.py, planted_bugs.py,
hlo_prefetch.py) on sys.path, and lets this process load libtpu beside the others that share the
machine (ALLOW_MULTIPLE_LIBTPU_LOAD, inherited by the children).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

BENCHMARKS = pathlib.Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
EXAMPLES = ROOT / "examples"

# After the script's own directory (a study's neighbours come first) and PYTHONPATH's entries
# (PYTHONPATH=OTHER_CHECKOUT measures another checkout's tpuexport, as experts_layout.py does),
# wherever they are: a study's line above has put benchmarks/ before them.
_GIVEN = {os.path.abspath(entry) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry}
_AFTER = max((index + 1 for index, entry in enumerate(sys.path) if entry and os.path.abspath(entry) in _GIVEN), default=1)
for _path in (str(BENCHMARKS), str(ROOT)):
    if _path not in sys.path:
        sys.path.insert(_AFTER, _path)
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def child_environment() -> dict[str, str]:
    """The environment of a child process (`python -m tpuexport.cli ...`, a server): this checkout's
    tpuexport and benchmarks/ first on its PYTHONPATH."""
    paths = [str(ROOT), str(BENCHMARKS), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def free_port() -> int:
    """A loopback port free now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def build_example(name: str) -> dict:
    """Calls examples/<name>.py:build() and returns what it returns (model, args, dynamic_shapes, ...)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build()


def random_llama(layers: int, hidden: int, max_context: int):
    """The generation and serving benchmarks' model: a LlamaForCausalLM with random weights (seed 0),
    vocabulary 1024, 8 attention heads over 4 kv heads, an MLP twice the hidden width."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=max_context)
    return transformers.LlamaForCausalLM(config).eval()


@contextlib.contextmanager
def served(arguments: list[str], ready_path: str, timeout: float = 600, log_path: pathlib.Path | None = None,
           clean_exit: bool = False):
    """A server started as `python -m ARGUMENTS... --port PORT` on a free loopback port, yielded as its
    base URL once GET ready_path answers 200; stopped with SIGTERM (killed after 60 s) on leaving.

    Args:
      arguments: the module and its arguments, without --port.
      ready_path: the path that answers 200 once the server is ready.
      timeout: seconds to wait for that.
      log_path: where its stdout and stderr go (a temporary file if None).
      clean_exit: whether a server that does not exit 0 on SIGTERM is an error (the tests' promise).
    Raises:
      SystemExit: the server exited or was not ready within `timeout` seconds (with its log's end).
      AssertionError: with clean_exit, the server did not exit 0 after SIGTERM.
    """
    import requests

    port = free_port()
    log = open(log_path, "w+") if log_path else tempfile.TemporaryFile(mode="w+")

    def log_end() -> str:
        log.flush()
        log.seek(0)
        return log.read()[-3000:]

    server = subprocess.Popen([sys.executable, "-m", *arguments, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                              env=child_environment())
    base = f"http://127.0.0.1:{port}"
    with log:
        try:
            deadline = time.monotonic() + timeout
            while True:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{arguments[0]} did not start: {log_end()}")
                try:
                    if requests.get(f"{base}{ready_path}", timeout=2).status_code == 200:
                        break
                except requests.ConnectionError:
                    time.sleep(0.2)
            yield base
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        if clean_exit:
            assert server.returncode == 0, f"the server exited {server.returncode} on SIGTERM: {log_end()}"
