"""Compiler processes (compile_child.py): one per target and conversion, or kept between conversions.

A compiler process reads one JSON request per line on stdin and answers each with events on stdout,
the last one "finished" (it stops earlier at an "error", or dies). By default a conversion starts
one per target and closes its stdin after the request, so the process ends with it.

Within `kept_compilers()`, a process that finished its request is kept (the few most recently used),
and the next conversion in this process for the same target, interpreter and compiler settings sends
its request there. Starting one (importing jax, loading libtpu, making the topology) costs about 1 s of
CPU, more than compiling a small entry point: a process converting many small models (a test suite,
a sweep over buckets or options) saves that per target and conversion. A kept process holds jax (and
libtpu, for TPU targets) in memory, 0.2-0.4 GB resident each, until the block ends; every executable still
comes from its compiler, never from a cache.
"""

from __future__ import annotations

import collections
import contextlib
import json
import pathlib
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

CHILD_SCRIPT = pathlib.Path(__file__).with_name("compile_child.py")


class CompilerProcess:
    """One compiler process: requests in, events out.

    Attributes:
      key: what a kept process is reused for: (interpreter, target name, `compiler_settings`).
      process: the Popen.
      finished: its last request ended with "finished" (it can take another).
    """

    def __init__(self, key: tuple, python: str, environment: dict):
        self.key = key
        self.stderr = tempfile.TemporaryFile()  # libtpu's start-up warnings: read for crash reports only
        self.process = subprocess.Popen([python, "-I", str(CHILD_SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.stderr, text=True, env=environment)
        self.finished = False

    def send(self, request: dict, last: bool) -> None:
        """Writes `request`; with `last`, closes stdin after it (the process ends once it is done)."""
        self.finished = False
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            if last:
                self.process.stdin.close()
        except BrokenPipeError:  # it died before reading the request; its exit status says how
            with contextlib.suppress(BrokenPipeError):
                self.process.stdin.close()

    def events(self) -> Iterator[dict]:
        """The request's events up to "finished" (not yielded), or up to the end of its output."""
        for line in self.process.stdout:
            event = json.loads(line)
            if event["event"] == "finished":
                self.finished = True
                return
            yield event

    def stderr_text(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")

    def end(self, kill: bool = False) -> int:
        """Ends the process (closing its stdin, or killing it) and returns its exit status."""
        if kill and self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(BrokenPipeError, OSError):
            self.process.stdin.close()
        self.process.stdout.close()
        returncode = self.process.wait()
        self.stderr.close()
        return returncode


class KeptCompilers:
    """Compiler processes kept for reuse, the `processes` most recently used.

    Kept processes are started from one long-lived thread of this object: a compiler process dies
    with the thread that started it (compile_child.die_with_parent), and a conversion's compile
    threads end with the conversion.
    """

    def __init__(self, processes: int):
        self.processes = processes
        self.idle: collections.deque[CompilerProcess] = collections.deque()
        self.lock = threading.Lock()
        self.starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tpu-compiler-starter")

    def take(self, key: tuple, python: str, environment: dict) -> CompilerProcess:
        """An idle process for `key`, or a new one."""
        with self.lock:
            dead = [compiler for compiler in self.idle if compiler.process.poll() is not None]
            for compiler in dead:
                self.idle.remove(compiler)
            found = next((compiler for compiler in self.idle if compiler.key == key), None)
            if found is not None:
                self.idle.remove(found)
        for compiler in dead:
            compiler.end()
        return found or self.starter.submit(CompilerProcess, key, python, environment).result()

    def give_back(self, compiler: CompilerProcess) -> None:
        """Keeps a process that finished its request; ends the least recently used beyond `processes`."""
        with self.lock:
            self.idle.append(compiler)
            surplus = [self.idle.popleft() for _ in range(max(0, len(self.idle) - self.processes))]
        for old in surplus:
            old.end()

    def close(self) -> None:
        with self.lock:
            idle, self.idle = list(self.idle), collections.deque()
        for compiler in idle:
            compiler.end()
        self.starter.shutdown()


# The environment variables that jax, XLA, libtpu and their thread pools read: a kept process serves
# requests whose environment has the same ones (others, such as pytest's per-test variable, change
# what no compiler reads).
COMPILER_VARIABLE_PREFIXES = ("XLA_", "JAX_", "LIBTPU", "TPU_", "TF_", "ALLOW_MULTIPLE_LIBTPU_LOAD", "OMP_", "LD_LIBRARY_PATH", "LD_PRELOAD")


def compiler_settings(environment: dict) -> tuple:
    """The part of a compiler process's environment that a kept one must share to serve a request."""
    return tuple(sorted((name, value) for name, value in environment.items() if name.startswith(COMPILER_VARIABLE_PREFIXES)))


_KEPT: list[KeptCompilers] = []  # the innermost active kept_compilers() block's last


@contextlib.contextmanager
def kept_compilers(processes: int = 3):
    """Within this block, conversions in this process reuse compiler processes (see the module
    docstring); at its end they are ended. Nested blocks keep their own.

    Args:
      processes: how many idle processes to keep (e.g. one per target converted for).
    """
    if processes < 1:
        raise ValueError(f"processes={processes}: keep at least 1 compiler process")
    kept = KeptCompilers(processes)
    _KEPT.append(kept)
    try:
        yield kept
    finally:
        _KEPT.remove(kept)
        kept.close()


def compiler_for(key: tuple, python: str, environment: dict) -> tuple[CompilerProcess, KeptCompilers | None]:
    """A process for one request: an idle kept one or a new one (kept afterwards within
    `kept_compilers()`), and the KeptCompilers to give it back to (None: end it after the request)."""
    kept = _KEPT[-1] if _KEPT else None
    if kept is None:
        return CompilerProcess(key, python, environment), None
    return kept.take(key, python, environment), kept
