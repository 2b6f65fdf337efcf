"""Shared fixtures: the examples converted once per test session (conversions take seconds)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

# One run's tests share their XLA compilations through JAX's persistent compilation cache: many
# tests convert the same tiny models, and an identical program (the same HLO, options and jax
# version) is compiled once per run instead of once per test (-27% CPU over test_quantized_generation.py).
# A fresh directory per run (inherited by pytest-xdist's workers and every child process), so each
# program still compiles once in every run; thresholds at 0, or programs that compile in under a
# second would not be kept. Runtime tests still see a cache hit as a compilation (JAX records its
# backend-compile event around the cache lookup, tpuexport/runtime/compilations.py).
if "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="tpuexport-tests-jax-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    # One OpenMP thread per process: the test processes (pyproject's --numprocesses, one per core) each
    # ran torch's eager references on as many threads as cores, whose waits spin on the core another
    # process needs. Measured on 2 cores (test_generation, test_families, test_kv_int8 and test_serve,
    # twice each way): 261 and 266 s -> 227 and 217 s, 430 and 456 -> 383 and 362 CPU-s of user time.
    # Children (compilers, TensorFlow, command lines) inherit it; a value already set is kept.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import tpuexport  # noqa: E402  (after the cache's settings: JAX reads them when it is imported)

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# benchmarks/families.py (real architectures), planted_bugs.py and chat_model.py are shared with the tests,
# and _common's example builder, free port and server.
sys.path.insert(0, str(ROOT / "benchmarks"))
import _common  # noqa: E402
from _common import build_example, free_port  # noqa: E402,F401  (re-exported to the tests)


def served(artifact: pathlib.Path, log_path: pathlib.Path, grpc_port: int = 0, options: tuple[str, ...] = ()):
    """`tpuexport serve ARTIFACT [OPTIONS]` as its own process on a free loopback port (REST; gRPC too on
    `grpc_port` unless 0), once it answers /readyz: yields its base URL; stopped with SIGTERM,
    after which it must exit 0."""
    return _common.served(["tpuexport.cli", "serve", str(artifact), "--grpc-port", str(grpc_port), *options], "/readyz", timeout=180,
                          log_path=log_path, clean_exit=True)


def twin_and_one_device_tokens(artifact: pathlib.Path, prompts: list[list[int]], new_tokens: int, devices: int = 4,
                               more: str = "") -> dict:
    """Greedy tokens streamed by a runner of the artifact in a process with `devices` forced CPU devices
    (it picks the cpu-N twin there) and by one on the `cpu` target, in that process.

    Args:
      more: Python run after both streams, with `sharded` (the twin's runner) and `state` in scope,
        adding to `state`.
    Returns:
      {"target", "devices", "compilations" (at the twin's start), "tokens": [twin's, one device's] (steps
      of [rows]), and what `more` added}.
    """
    script = (
        "import json, numpy as np, tpuexport\n"
        f"sharded, single = tpuexport.runner({str(artifact)!r}), tpuexport.runner({str(artifact)!r}, target='cpu')\n"
        f"tokens = [list(sharded.stream({prompts}, {new_tokens}, ignore_eos=True)), list(single.stream({prompts}, {new_tokens}, ignore_eos=True))]\n"
        "state = {'target': sharded.target, 'devices': len(sharded.devices), 'compilations': sharded.compilations_at_start, 'tokens': tokens}\n"
        f"{more}\n"
        "print(json.dumps(state))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=forced_devices(devices))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def forced_devices(devices: int) -> dict[str, str]:
    """This process's environment for a child that sees `devices` CPU devices (a cpu-N twin's setting)."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


def convert_example(name: str, out: pathlib.Path, **options) -> tpuexport.Artifact:
    built = build_example(name)
    return tpuexport.convert(built["model"], built["args"], built["dynamic_shapes"], out=out, **options)


@pytest.fixture(scope="session", autouse=True)
def _compilers_kept_between_conversions():
    """A test process's conversions reuse compiler processes (tpuexport.kept_compilers: about 1 s of
    CPU saved per conversion and target; the suite converts some 200 times). Conversions run as their
    own processes (the command line's tests) start theirs, as a user's conversion does."""
    with tpuexport.kept_compilers():
        yield


@pytest.fixture(scope="session")
def mlp_artifact(tmp_path_factory) -> tpuexport.Artifact:
    """examples/mlp.py for v5e and v6e, buckets batch=1,8."""
    return convert_example("mlp", tmp_path_factory.mktemp("mlp") / "mlp.tpu", target=["v5e", "v6e"], buckets={"batch": [1, 8]})


@pytest.fixture(scope="session")
def transformer_artifact(tmp_path_factory) -> tpuexport.Artifact:
    """examples/transformer.py for v5e and v6e at the example shapes."""
    return convert_example("transformer", tmp_path_factory.mktemp("transformer") / "encoder.tpu", target=["v5e", "v6e"])


@pytest.fixture(scope="session")
def plain_mlp_artifact(tmp_path_factory) -> tpuexport.Artifact:
    """examples/mlp.py for v5e at the example shapes, without the TF SavedModel (seconds to build):
    the artifact the integrity, fault and run-time input tests copy and damage."""
    return convert_example("mlp", tmp_path_factory.mktemp("plain_mlp") / "mlp.tpu", target="v5e", saved_model=False)


@pytest.fixture(scope="session")
def mlp_cpu_artifact(tmp_path_factory) -> tpuexport.Artifact:
    """examples/mlp.py for the cpu target (XLA:CPU executables the runtime loads), buckets batch=1,4,8,
    with its SavedModel; shared by the runtime and server tests."""
    return convert_example("mlp", tmp_path_factory.mktemp("mlp_cpu") / "mlp.tpu", target="cpu", buckets={"batch": [1, 4, 8]})


# The test files that take longest (per-test durations of a full run, 2026-11-30, less what the trim that followed
# took out of test_generation, test_faults, test_indexed_attention, test_kv_int8, test_quantize,
# test_quantized_generation, test_numerics, test_slices, test_cli and test_huggingface), heaviest first.
# pytest-xdist's --dist=loadfile hands files out in collection order: run alphabetically, one of
# these started last would keep one worker busy alone for minutes at the end of the run.
LONGEST_FILES = ("test_generation.py", "test_huggingface.py", "test_indexed_attention.py", "test_paged.py", "test_faults.py",
                 "test_slices.py", "test_multihost.py", "test_window_cache.py", "test_architectures.py", "test_weight_only.py",
                 "test_families.py", "test_cli.py", "test_kv_int8.py", "test_quantized_generation.py", "test_quantize.py",
                 "test_recurrent_state.py", "test_conv_state.py", "test_chunked_attention.py", "test_seq2seq.py", "test_numerics.py",
                 "test_generation_slices.py", "test_memory.py", "test_fuzz.py", "test_checkpoint.py", "test_scan.py", "test_kernels.py")


def pytest_collection_modifyitems(items):
    """Longest files first (a stable sort: the order within a file is kept)."""
    rank = {name: index for index, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_unconfigure(config):
    """The run's compilation cache goes with the run (the process that made it removes it)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
