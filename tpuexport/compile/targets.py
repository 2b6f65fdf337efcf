"""TPU generations tpuexport compiles for, one chip each, with its published figures.

Figures are per chip, from Google Cloud's TPU documentation pages (cited per row):
HBM capacity, peak bf16 and int8 compute, and HBM bandwidth. The topology name is what
libtpu's compile-only `get_topology_desc` accepts; no TPU is needed to compile for it.
Multi-chip slices (`v5e-8`, ...) are Targets too, built from these rows in slices.py.

One more target is not a TPU: `cpu` compiles the same buckets with XLA:CPU for the build host, so
that the runtime's load-without-compiling path (tpuexport.runtime) runs and is tested on machines
without a TPU. Its "HBM" is the host's physical memory; it has no published peak figures.
"""

from __future__ import annotations

import dataclasses
import os

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Target:
    """A TPU target: one chip, or a slice of several chips (slices.py).

    Attributes:
      name: the name users pass to --target (e.g. "v5e", "v5e-8").
      generation: a human name ("TPU v5e").
      topology: libtpu topology name (one chip, or the slice's chip grid such as "v5e:2x4").
      hbm_bytes: HBM capacity per chip, in bytes.
      peak_bf16_tflops: peak dense bf16 compute per chip.
      peak_int8_tops: peak int8 compute per chip (None where not published).
      hbm_gbps: HBM bandwidth per chip, GB/s.
      source: the page the figures come from.
      chips: chips in the target (1 for a single chip).
      devices: JAX devices the program is partitioned over: the chips, or two per chip on TPU7x,
        whose chip is two devices with half its HBM each. A single-chip target compiles for one
        device standing for the whole chip.
      name_counts: what the number in a slice's name counts, "chips" or "TensorCores".
      platform: the XLA platform compiled for, "tpu" or "cpu" (CPU_TARGET).
      processes: the processes (hosts) a CPU twin runs as under jax.distributed, `devices //
        processes` devices each (`cpu-PxK`, slices.py); 1 otherwise. A TPU slice's hosts are
        libtpu's topology's, recorded per target in the manifest when it compiles.
      host_bounds: the chips of one host as libtpu's `chips_per_host_bounds`, where Cloud TPU's
        hosts differ from libtpu's default for the topology (slices.py); None for the default.
    """

    name: str
    generation: str
    topology: str
    hbm_bytes: int
    peak_bf16_tflops: float
    peak_int8_tops: float | None
    hbm_gbps: float
    source: str
    chips: int = 1
    devices: int = 1
    name_counts: str = "chips"
    platform: str = "tpu"
    processes: int = 1
    host_bounds: tuple[int, int, int] | None = None

    @property
    def is_slice(self) -> bool:
        return self.chips > 1

    @property
    def hbm_bytes_per_device(self) -> int:
        """The HBM one device's program may use: the chip's, or its share on multi-device chips."""
        return self.hbm_bytes * self.chips // self.devices


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("v4", "TPU v4", "v4:1x1x1", 32 * GIB, 275, 275, 1200, "https://cloud.google.com/tpu/docs/v4"),
        Target("v5e", "TPU v5e", "v5e:1x1", 16 * GIB, 197, 393, 819, "https://cloud.google.com/tpu/docs/v5e"),
        Target("v5p", "TPU v5p", "v5p:1x1x1", 95 * GIB, 459, 918, 2765, "https://cloud.google.com/tpu/docs/v5p"),
        Target("v6e", "TPU v6e (Trillium)", "v6e:1x1", 32 * GIB, 918, 1836, 1638, "https://cloud.google.com/tpu/docs/v6e"),
        Target("7x", "TPU7x (Ironwood)", "tpu7x:1x1x1", 192 * GIB, 2307, None, 7380, "https://cloud.google.com/tpu/docs/tpu7x"),
    )
}



def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# XLA:CPU executables for the build host's CPU (see the module docstring); not a TPU, so it is not
# in TARGETS (which `tpuexport targets` lists) but resolve_targets accepts its name.
CPU_TARGET = Target("cpu", "XLA:CPU (the build host)", "cpu", _host_memory_bytes(), 0.0, None, 0.0,
                    "https://openxla.org/xla", platform="cpu")
