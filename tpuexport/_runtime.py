"""Process-wide set-up for JAX and libtpu on a machine without accelerators.

Imported first by `tpuexport/__init__.py`: JAX must be pinned to the CPU platform before any backend
starts (with libtpu installed it would otherwise probe for a TPU), and libtpu must be allowed to load
in several processes at once (its lock file otherwise makes parallel conversions fail).
"""

from __future__ import annotations

import os

# libtpu takes a process-wide lock file; compile-only use does not need exclusive access.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")

