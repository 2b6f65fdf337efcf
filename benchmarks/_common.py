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

import importlib.util
import os
import pathlib
import socket
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
EXAMPLES = ROOT / "examples"

# After the script's own directory (a study's neighbours come first) and PYTHONPATH's entries
# (PYTHONPATH=OTHER_CHECKOUT measures another checkout's tpuexport, as experts_layout.py does).
_AFTER = 1 + len([entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry])
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
