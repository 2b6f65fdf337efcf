"""Process-wide set-up for JAX and libtpu on a machine without accelerators.

Imported first by `tpuexport/__init__.py`: JAX must be pinned to the CPU platform before any backend
starts (with libtpu installed it would otherwise probe for a TPU), and libtpu must be allowed to load
in several processes at once (its lock file otherwise makes parallel conversions fail).
"""

from __future__ import annotations

import contextlib
import os
import tempfile

# libtpu takes a process-wide lock file; compile-only use does not need exclusive access.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")


@contextlib.contextmanager
def captured_native_stderr():
    """Sends what native code writes to file descriptor 2 into a buffer instead of the terminal.

    libtpu prints start-up warnings (TPU_ACCELERATOR_TYPE, TPU_WORKER_HOSTNAMES) straight to fd 2
    when it loads; they are meaningless for compile-only use. Yields a list that holds the captured
    text once the block exits, so a caller can still show it when something really fails.
    """
    captured: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.append(sink.read().decode(errors="replace"))
