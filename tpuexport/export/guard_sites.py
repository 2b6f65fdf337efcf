"""Where torch.export guarded the input sizes: the user's source lines, recorded while it traces.

A refused dim range ("Constraints violated", constraints.explain) is explained with the lines of the
model's code where torch.export added the guards that narrowed it. torch's ShapeEnv logs each guard
it adds at INFO on the `torch.fx.experimental.symbolic_shapes` logger ("eval s27 > 4 [guard added]
..."), from inside the trace, so the Python stack at that call holds the model's frame. A filter on
that logger reads it there, around tpuexport's own export, and keeps the INFO records from torch's
stderr handler. A tiny BERT's and Llama's exports (0.6 s, 1 s) take as long with it as without, within
the timings' noise; tracing once more with `torch.export.draft_export` (twice, running every op on real
tensors too) took a tiny PEGASUS-X 80 s after its 8 s export, and the whole conversion of a tiny Grounding DINO
from 39 s to 400-580 s (MM Grounding DINO: past the sweep's 900 s limit).
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import logging
import os
import re

import torch

from tpuexport.source_lines import is_user_code

_LOGGER = "torch.fx.experimental.symbolic_shapes"
_LOGGING_DIR = os.path.dirname(logging.__file__) + os.sep
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# A backed symbol ("s27") is an input's size; an unbacked one ("u0") a value the code read: only
# guards on input sizes narrow a declared dim.
_INPUT_SIZE = re.compile(r"\bs\d+\b")
# The frames read from the first one outside torch outward: a guard added under code torch generated
# ("<eval_with_key>.5") or a library that starts with torch's path is the user's a frame or two out.
_FRAMES_READ = 3


@contextlib.contextmanager
def recorded(lines: list[str]):
    """Appends to `lines`, while the block runs, each user source line ("file.py:12 (code)") where
    torch adds a guard on an input's size, once, in trace order. The logger's level and filters are
    restored after; records it would not have passed to its handlers before still reach none."""
    logger = logging.getLogger(_LOGGER)
    level = logger.level
    sites = _GuardSites(lines, logger.getEffectiveLevel())
    logger.addFilter(sites)
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeFilter(sites)
        logger.setLevel(level)


class _GuardSites(logging.Filter):
    """Reads the guard records' stacks; passes on only the records the logger passed before."""

    def __init__(self, lines: list[str], level: int):
        super().__init__()
        self.lines, self.level = lines, level

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            self._read(record)
        except Exception:  # a filter's exception would reach the guard torch is adding, failing the export it only watches
            pass
        return record.levelno >= self.level

    def _read(self, record: logging.LogRecord) -> None:
        # ShapeEnv._log_guard: "%s %s [guard added] %s%s%s" % (prefix, guard, where, ...). Neither a runtime
        # assertion (checked when the program runs) nor a guard logged "[guard suppressed]" (never added:
        # PEGASUS-X's einsums log three lines of them) narrows a range.
        if isinstance(record.msg, str) and "[guard added]" in record.msg and isinstance(record.args, tuple) and len(record.args) > 1:
            prefix, guard = map(str, record.args[:2])
            if prefix.startswith("eval") and "[guard suppressed]" not in prefix and _INPUT_SIZE.search(guard):
                line = _user_line()
                if line is not None and line not in self.lines:
                    self.lines.append(line)


def _user_line() -> str | None:
    """The innermost user frame of the few from the first one outside torch and logging outward, or
    None when they are tpuexport's (a guard torch adds after tracing the model)."""
    frame = inspect.currentframe()
    while frame is not None and frame.f_code.co_filename.startswith((_LOGGING_DIR, _TORCH_DIR, __file__)):
        frame = frame.f_back
    for _ in range(_FRAMES_READ):
        if frame is None:
            return None
        path = frame.f_code.co_filename
        if is_user_code(path) and not os.path.abspath(path).startswith(_PACKAGE_DIR):
            return f"{path}:{frame.f_lineno} ({linecache.getline(path, frame.f_lineno).strip()})"
        frame = frame.f_back
    return None
