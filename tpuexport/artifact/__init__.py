"""Artifact stage: layout, manifest, hashes, atomic writes, and reading artifacts back."""

from tpuexport.artifact.artifact import Artifact, load
from tpuexport.artifact.huggingface import huggingface_writer
from tpuexport.artifact.weights import ALIGNMENT, map_weights, write_weights
from tpuexport.artifact.writer import check_destination, kernels_writer, sibling_prefix, write_artifact

__all__ = ["ALIGNMENT", "Artifact", "check_destination", "huggingface_writer", "kernels_writer", "load", "map_weights", "sibling_prefix", "write_artifact",
           "write_weights"]
