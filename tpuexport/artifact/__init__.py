"""Artifact stage: layout, manifest, hashes, atomic writes, and reading artifacts back."""

from tpuexport.artifact.artifact import Artifact, load
from tpuexport.artifact.writer import check_destination, write_artifact

__all__ = ["Artifact", "check_destination", "load", "write_artifact"]
