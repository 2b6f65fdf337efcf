"""Ahead-of-time TPU compilation through libtpu's compile-only topologies (no TPU needed).

For each target and bucket the lowered program is compiled by XLA's TPU compiler for one chip;
the executable is serialized, and XLA's own memory and cost analyses give the figures for the
report and the HBM-fit verdict.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
from typing import Callable

import jax
from jax.experimental import serialize_executable, topologies
from jax.sharding import SingleDeviceSharding

from tpuexport._runtime import captured_native_stderr
from tpuexport.compile.buckets import Bucket
from tpuexport.compile.targets import Target
from tpuexport.errors import TpuExportError
from tpuexport.lower import LoweredProgram


@dataclasses.dataclass(frozen=True)
class CompiledBucket:
    """One TPU executable and what XLA says about it.

    Attributes:
      target: the Target it was compiled for.
      bucket: the concrete dim sizes.
      executable: the serialized PJRT executable (loadable only on a real TPU of that kind).
      compile_seconds: wall time of lowering + compiling.
      memory: bytes from `memory_analysis()`: argument, output, temp, alias, generated_code and
        their total (argument + output + temp + generated_code - alias).
      cost: `cost_analysis()` figures: flops, bytes_accessed, optimal_seconds (XLA's estimate).
      fingerprint: sha256 of the compiled HLO text, to detect compiler drift later.
      hlo_text: the compiled HLO text (TPU layouts and op types), kept in memory only.
    """

    target: Target
    bucket: Bucket
    executable: bytes
    compile_seconds: float
    memory: dict[str, int]
    cost: dict[str, float]
    fingerprint: str
    hlo_text: str

    @property
    def fits_in_hbm(self) -> bool:
        return self.memory["total_bytes"] <= self.target.hbm_bytes


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """The compile stage's result: one CompiledBucket per (target, bucket), targets outermost."""

    results: tuple[CompiledBucket, ...]

    def for_target(self, name: str) -> list[CompiledBucket]:
        return [r for r in self.results if r.target.name == name]


@functools.cache
def topology_device(target: Target):
    """The first device of a one-chip compile-only topology (loads libtpu on first use, quietly)."""
    with captured_native_stderr() as noise:
        try:
            topology = topologies.get_topology_desc(
                topology_name=target.topology, platform="tpu", chips_per_host_bounds=(1, 1, 1)
            )
        except Exception as error:
            raise TpuExportError(
                f"libtpu cannot describe {target.topology} ({' '.join(str(error).split())[:200]}); "
                "reinstall with `pip install -c constraints.txt -e .`"
            ) from None
    del noise  # libtpu's start-up warnings about TPU_ACCELERATOR_TYPE and friends
    return topology.devices[0]


def compile_program(
    lowered: LoweredProgram,
    targets: list[Target],
    buckets: list[Bucket],
    on_compiled: Callable[[CompiledBucket], None] | None = None,
) -> CompileReport:
    """Compiles the lowered program for every target and bucket.

    Args:
      lowered: the lowering stage's result.
      targets: TPU targets.
      buckets: concrete dim sizes, one executable each.
      on_compiled: called after each executable (for progress output).
    Returns:
      The CompileReport.
    Raises:
      TpuExportError: XLA refused to compile, or a bucket does not fit in a chip's HBM (all such
        buckets are named).
    """
    results = []
    for target in targets:
        for bucket in buckets:
            result = compile_bucket(lowered, target, bucket)
            results.append(result)
            if on_compiled:
                on_compiled(result)
    misfits = [r for r in results if not r.fits_in_hbm]
    if misfits:
        listed = "; ".join(
            f"{r.target.name} bucket {r.bucket.name} needs {r.memory['total_bytes']:,} bytes, HBM is {r.target.hbm_bytes:,}"
            for r in misfits
        )
        raise TpuExportError(f"does not fit in HBM: {listed}; use smaller buckets or a target with more HBM")
    return CompileReport(tuple(results))


def compile_bucket(lowered: LoweredProgram, target: Target, bucket: Bucket) -> CompiledBucket:
    """Compiles one executable; see `compile_program`."""
    sharding = SingleDeviceSharding(topology_device(target))
    sizes = bucket.as_dict()
    weights = [jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding) for w in lowered.weights]
    inputs = [
        jax.ShapeDtypeStruct(spec.concrete_shape(sizes), spec.dtype, sharding=sharding) for spec in lowered.signature.inputs
    ]
    start = time.perf_counter()
    with captured_native_stderr():
        try:
            compiled = jax.jit(lowered.exported.call).trace(weights, inputs).lower().compile()
        except Exception as error:  # XLA raises XlaRuntimeError and others
            message = " ".join(str(error).split())
            if "RESOURCE_EXHAUSTED" in message:
                # XLA's TPU compiler checks temporaries against the chip's usable HBM itself.
                raise TpuExportError(
                    f"does not fit in HBM: {target.name} bucket {bucket.name} ({message[:240]}); chip HBM is "
                    f"{target.hbm_bytes:,} bytes; use smaller buckets or a target with more HBM"
                ) from None
            raise TpuExportError(f"XLA could not compile for {target.name} bucket {bucket.name}: {message[:300]}") from None
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    memory = {
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "temp_bytes": int(stats.temp_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes),
        "generated_code_bytes": int(stats.generated_code_size_in_bytes),
    }
    memory["total_bytes"] = (
        memory["argument_bytes"] + memory["output_bytes"] + memory["temp_bytes"]
        + memory["generated_code_bytes"] - memory["alias_bytes"]
    )
    analysis = compiled.cost_analysis() or {}
    if isinstance(analysis, list):  # older jax returned one dict per computation
        analysis = analysis[0] if analysis else {}
    cost = {
        "flops": float(analysis.get("flops", 0.0)),
        "bytes_accessed": float(analysis.get("bytes accessed", 0.0)),
        "optimal_seconds": float(analysis.get("optimal_seconds", 0.0)),
    }
    hlo_text = compiled.as_text()
    executable, _, _ = serialize_executable.serialize(compiled)
    return CompiledBucket(
        target, bucket, bytes(executable), seconds, memory, cost,
        hashlib.sha256(hlo_text.encode()).hexdigest(), hlo_text,
    )
