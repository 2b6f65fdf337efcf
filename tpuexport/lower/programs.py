"""A generation program read back from its manifest section, whose "kind" names its type."""

from __future__ import annotations

from tpuexport.lower.generation import GenerationProgram
from tpuexport.lower.lowered import LoweredProgram
from tpuexport.lower.paged import PagedGenerationProgram
from tpuexport.lower.seq2seq import Seq2SeqProgram

# The manifest's "generation"["kind"] (a decoder's section predates the key) -> the program type.
GENERATION_PROGRAMS = {"decoder": GenerationProgram, "encoder-decoder": Seq2SeqProgram, "paged": PagedGenerationProgram}


def generation_program(section: dict, entry_points: dict[str, LoweredProgram]) -> GenerationProgram | Seq2SeqProgram | PagedGenerationProgram:
    """The program that drives `entry_points`, from the manifest's "generation" section."""
    return GENERATION_PROGRAMS[section.get("kind", "decoder")].from_manifest(section, entry_points)
