"""Export stage: load a source, capture it with torch.export, name its signature."""

from tpuexport.export.capture import CapturedModel, capture, describe, torch_dynamic_shapes, weights_on_meta, with_meta_inputs
from tpuexport.export.sources import LoadedSource, SourceInfo, load_source
from tpuexport.export.specs import DimSpec, InputSpec, example_args, parse_dim, parse_input

__all__ = [
    "CapturedModel",
    "DimSpec",
    "InputSpec",
    "LoadedSource",
    "SourceInfo",
    "capture",
    "describe",
    "example_args",
    "load_source",
    "parse_dim",
    "parse_input",
    "torch_dynamic_shapes",
    "weights_on_meta",
    "with_meta_inputs",
]
