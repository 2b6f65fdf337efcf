"""A program: named entry points over one set of weights, the unit every stage after lowering handles.

A forward model is a program with one entry point, "serving_default" (TF Serving's signature name).
A text-generation program has entry points that fill and advance a cache, the state they take and
return (generation.py, seq2seq.py); it also says how to drive them (`stream`) and what the manifest
records of its cache ("generation").
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax

from tpuexport.errors import TpuExportError

if TYPE_CHECKING:  # lowering.py imports torch, which the runtime (importing this module) does without
    from tpuexport.lower.lowered import LoweredProgram

DEFAULT_ENTRY_POINT = "serving_default"


def check_shared_weights(entry_points: dict[str, LoweredProgram]) -> None:
    """Raises TpuExportError unless the entry points take the same weights (names and shapes): an
    artifact stores one model's weights once, for all of them."""
    first, *others = entry_points.values()
    for other in others:
        if other.weight_names != first.weight_names or other.weight_specs != first.weight_specs:
            raise TpuExportError("the entry points' weights differ (names or shapes); they must share one model's weights")


def taking_weights(lowered: LoweredProgram, shared: LoweredProgram) -> LoweredProgram:
    """An entry point lowered without weights (it reads none) as one taking `shared`'s weights as
    unused arguments: every entry point is called as exported.call(weights, inputs), and the weights
    are described (names, layouts, stacks, quantization) as `shared` describes them."""
    program = lowered.exported

    def call(weights, inputs):
        return program.call([], inputs)

    exported = jax.export.export(jax.jit(call), platforms=program.platforms)(list(shared.weight_specs), list(program.in_avals))
    return dataclasses.replace(lowered, exported=exported, weight_names=shared.weight_names, weights=shared.weights, tied=dict(shared.tied),
                               quantized=dict(shared.quantized), weight_layouts=dict(shared.weight_layouts), scanned=shared.scanned)


class EntryPoints:
    """What every program is: `entry_points` ({name: LoweredProgram}, one set of weights) and the
    `state_inputs` they take and return. Subclasses are frozen dataclasses with those fields or
    properties; this base gives them the checks and views they share."""

    entry_points: dict[str, LoweredProgram]
    state_inputs: tuple[str, ...] = ()

    def __post_init__(self):
        check_shared_weights(self.entry_points)

    @property
    def state_sizes(self) -> dict[str, int]:
        """Sizes of the dims the state's shapes use (a paged cache's pages), as this program runs them."""
        return {}

    @property
    def weights_program(self) -> LoweredProgram:
        """The entry point whose weights (names, layouts, arrays) stand for all of them: they are the same
        (`check_shared_weights`); the last one's (decode's, in a generation program)."""
        return list(self.entry_points.values())[-1]

    def manifest_section(self) -> dict | None:
        """The manifest's "generation" section (what a cache-driving program records), or None."""
        return None

    def with_weights(self, weights) -> "EntryPoints":
        """The program with every entry point holding `weights` (one tuple, shared)."""
        return dataclasses.replace(self, entry_points={name: dataclasses.replace(lowered, weights=weights)
                                                       for name, lowered in self.entry_points.items()})


@dataclasses.dataclass(frozen=True)
class Program(EntryPoints):
    """A program whose entry points are called on their own, with no state between calls (a model's
    forward as "serving_default").

    Attributes:
      entry_points: {name: LoweredProgram}, the same weights.
    """

    entry_points: dict[str, LoweredProgram]

    @classmethod
    def forward(cls, lowered: LoweredProgram) -> "Program":
        """A model's forward as the one entry point "serving_default"."""
        return cls({DEFAULT_ENTRY_POINT: lowered})

