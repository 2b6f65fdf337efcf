"""Multi-chip TPU slices, named as Cloud TPU names its accelerator types, mapped to libtpu topologies.

The number in a Cloud TPU accelerator type counts different things per generation:

  v5e  `v5litepod-N` (also written `v5e-N`)  N chips, one TensorCore each; v5e-8 is 2x4
  v6e  `v6e-N`                               N chips, one TensorCore each; v6e-8 is 2x4
  v5p  `v5p-N`                               N TensorCores, two per chip: v5p-8 is 4 chips (2x2x1);
                                             JAX sees one device per chip (megacore)
  7x   `tpu7x-N` (also `7x-N`)               N TensorCores, two per chip: tpu7x-8 is 4 chips (2x2x1);
                                             JAX sees each TensorCore as a device with half the
                                             chip's HBM (Ironwood's two chiplets)
  v4   `v4-N`                                N TensorCores, two per chip; refused, see below

Every topology listed builds with libtpu's compile-only `get_topology_desc` on this CPU-only
machine with the device count given here (tests/test_slices.py checks each one).

`cpu-N` (N >= 2) is a slice's CPU twin: the same program compiled with the same mesh and sharding
plan for N XLA:CPU devices of the build host (`XLA_FLAGS=--xla_force_host_platform_device_count=N`
in the compiler's process and in the process that runs it), so that a sharded executable is
loaded, placed and run on a machine without a TPU. `--target v5e-8 --target cpu-8` give both the
same plan; each device's "memory" is the host's, divided by N.

`cpu-PxK` (P >= 2 processes of K devices each) is the multi-host twin: the same plan over P*K CPU
devices spread over P processes under jax.distributed (CPU collectives over gloo), as a slice of P
hosts runs. Its executables name the devices as the processes see them (process p's devices are
ids p*2048 + 0..K-1), so they load only in P such processes, not in one process of P*K devices:
compile_child.py compiles them against P in-process CPU clients joined by a loopback coordinator
(docs/multihost.md).

v4 slices are refused: libtpu's compile-only v4 topology has one device per TensorCore, while v4
slices run in megacore mode, one device per chip (JAX's own mesh_utils refuses per-core v4
devices), so an executable compiled for it would not load on a v4 slice. The single-chip `v4`
target is unchanged.
"""

from __future__ import annotations

import dataclasses
import math
import re

from tpuexport.compile.targets import CPU_TARGET, TARGETS, Target
from tpuexport.errors import TpuExportError

# Per generation: what the name's number counts, devices per chip in JAX, {number: chip grid}.
# Shapes are Cloud TPU's default topology for each accelerator type.
_SLICE_SHAPES = {
    "v5e": ("chips", 1, {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}),
    "v6e": ("chips", 1, {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}),
    "v5p": ("TensorCores", 1, {8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4", 256: "4x4x8"}),
    "7x": ("TensorCores", 2, {8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4"}),
}
# Slices whose Cloud TPU machine holds more chips than libtpu's compile-only topology puts on a host:
# v5litepod-8 and v6e-8 are one VM of 8 chips (ct5lp-hightpu-8t, ct6e-standard-8t), while libtpu
# splits a 2x4 grid into two hosts of 2x2 (whose processes the manifest records, device_processes).
_ONE_HOST_OF_EIGHT = {("v5e", 8): (2, 4, 1), ("v6e", 8): (2, 4, 1)}
# Other spellings Cloud TPU uses for the same slices.
_ALIASES = {"v5litepod": "v5e"}
_SLICE_NAME = re.compile(r"([a-z0-9]+)-(\d+)")
# The largest cpu-N: as many devices as the largest slice (v5e-256, v6e-256).
MAX_CPU_DEVICES = 256


def cpu_twin(devices: int, processes: int = 1) -> Target:
    """The `cpu-N` target, XLA:CPU over `devices` host devices, or with `processes` > 1 the `cpu-PxK`
    target over that many processes of devices // processes each (see the module docstring)."""
    per_process = devices // processes
    name = f"cpu-{processes}x{per_process}" if processes > 1 else f"cpu-{devices}"
    how = f"{processes} processes x {per_process}" if processes > 1 else f"x{devices}"
    return dataclasses.replace(CPU_TARGET, name=name, generation=f"XLA:CPU {how} (the build host's, forced)",
                               hbm_bytes=CPU_TARGET.hbm_bytes // devices, chips=devices, devices=devices, name_counts="devices",
                               processes=processes)


def _slice(chip: Target, number: int, grid: str, name_counts: str, devices_per_chip: int) -> Target:
    chips = math.prod(int(side) for side in grid.split("x"))
    return dataclasses.replace(
        chip, name=f"{chip.name}-{number}", topology=f"{chip.topology.split(':')[0]}:{grid}",
        chips=chips, devices=chips * devices_per_chip, name_counts=name_counts, host_bounds=_ONE_HOST_OF_EIGHT.get((chip.name, number)),
    )


SLICES: dict[str, Target] = {
    target.name: target
    for chip_name, (name_counts, devices_per_chip, shapes) in _SLICE_SHAPES.items()
    for number, grid in shapes.items()
    for target in [_slice(TARGETS[chip_name], number, grid, name_counts, devices_per_chip)]
}


def resolve_targets(names) -> list[Target]:
    """Looks up target names (a string or a list): single chips ("v5e"), slices ("v5e-8",
    "v5litepod-8", "tpu7x-8"), "cpu" (XLA:CPU, targets.CPU_TARGET) and CPU twins of slices ("cpu-8"),
    keeping order and dropping repeats.

    Raises:
      TpuExportError: an unknown name (naming the sizes its generation has), a v4 slice (see the
        module docstring), or no name at all.
    """
    if isinstance(names, str):
        names = [names]
    resolved: list[Target] = []
    for name in names:
        target = _lookup(str(name))
        if target not in resolved:
            resolved.append(target)
    if not resolved:
        raise TpuExportError(f"no target given; pass --target with one of {', '.join(TARGETS)} or a slice such as v5e-8")
    return resolved


def _lookup(name: str) -> Target:
    if name.lower() == CPU_TARGET.name:
        return CPU_TARGET
    twin = re.fullmatch(r"cpu-(\d+)", name.lower())
    if twin:
        if not 2 <= int(twin.group(1)) <= MAX_CPU_DEVICES:
            raise TpuExportError(f"{name}: a CPU twin spans 2 to {MAX_CPU_DEVICES} devices (cpu-8 for v5e-8); for one device use cpu")
        return cpu_twin(int(twin.group(1)))
    hosts = re.fullmatch(r"cpu-(\d+)x(\d+)", name.lower())
    if hosts:
        processes, per_process = int(hosts.group(1)), int(hosts.group(2))
        if processes < 2 or per_process < 1 or processes * per_process > MAX_CPU_DEVICES:
            raise TpuExportError(f"{name}: a multi-process CPU twin cpu-PxK runs P >= 2 processes of K >= 1 devices, at most "
                                 f"{MAX_CPU_DEVICES} devices in all (cpu-2x4 for two hosts of four chips); on one process use cpu-N")
        return cpu_twin(processes * per_process, processes)
    key = name.lower().removeprefix("tpu")
    match = _SLICE_NAME.fullmatch(key)
    if match:
        key = f"{_ALIASES.get(match.group(1), match.group(1))}-{match.group(2)}"
    target = TARGETS.get(key) or SLICES.get(key)
    if target is not None:
        return target
    generation = match.group(1) if match else None
    generation = _ALIASES.get(generation, generation)
    if generation == "v4":
        raise TpuExportError(
            f"v4 slices ({name}) are not supported: libtpu's compile-only v4 topology has one device per TensorCore "
            "while v4 slices run in megacore mode (one device per chip), so its executables would not load; "
            "use a v5p, v6e, v5e or 7x slice, or the single-chip target v4")
    if generation in _SLICE_SHAPES:
        name_counts, _, shapes = _SLICE_SHAPES[generation]
        sizes = ", ".join(f"{generation}-{number}" for number in shapes)
        raise TpuExportError(f"unknown slice {name!r}; {generation} slices (the number counts {name_counts}) are: {sizes}")
    raise TpuExportError(f"unknown target {name!r}; use one of {', '.join(TARGETS)}, a slice such as v5e-8, v5p-8, "
                         "v6e-8, 7x-8 (see `tpuexport targets`), or cpu")
