"""Artifact stage: layout, manifest, hashes, atomic writes, and reading artifacts back.

Names are imported from their modules on first use (tpuexport/lazy.py)."""

from tpuexport.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "artifact": ["Artifact", "load"],
    "huggingface": ["huggingface_writer"],
    "weights": ["ALIGNMENT", "map_weights", "write_weights"],
    "writer": ["check_destination", "kernels_writer", "sibling_prefix", "write_artifact"],
})
