"""TPU generations tpuexport compiles for: one chip each, with its published figures.

Figures are per chip, from Google Cloud's TPU documentation pages (cited per row):
HBM capacity, peak bf16 and int8 compute, and HBM bandwidth. The topology name is what
libtpu's compile-only `get_topology_desc` accepts; no TPU is needed to compile for it.
"""

from __future__ import annotations

import dataclasses

from tpuexport.errors import TpuExportError

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Target:
    """One single-chip TPU target.

    Attributes:
      name: the name users pass to --target (e.g. "v5e").
      generation: a human name ("TPU v5e").
      topology: libtpu topology name for one chip.
      hbm_bytes: HBM capacity per chip, in bytes.
      peak_bf16_tflops: peak dense bf16 compute per chip.
      peak_int8_tops: peak int8 compute per chip (None where not published).
      hbm_gbps: HBM bandwidth per chip, GB/s.
      source: the page the figures come from.
    """

    name: str
    generation: str
    topology: str
    hbm_bytes: int
    peak_bf16_tflops: float
    peak_int8_tops: float | None
    hbm_gbps: float
    source: str


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


def resolve_targets(names) -> list[Target]:
    """Looks up target names (a string or a list), keeping order and dropping repeats.

    Raises:
      TpuExportError: an unknown name, or none at all.
    """
    if isinstance(names, str):
        names = [names]
    resolved: list[Target] = []
    for name in names:
        target = TARGETS.get(str(name).lower().removeprefix("tpu"))
        if target is None:
            raise TpuExportError(f"unknown target {name!r}; use one of {', '.join(TARGETS)} (see `tpuexport targets`)")
        if target not in resolved:
            resolved.append(target)
    if not resolved:
        raise TpuExportError(f"no target given; pass --target with one of {', '.join(TARGETS)}")
    return resolved
