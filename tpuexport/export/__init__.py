"""Export stage: load a source, capture it with torch.export, name its signature."""

from tpuexport.export.capture import CapturedModel, capture, describe, on_meta_device, torch_dynamic_shapes, weights_on_meta
from tpuexport.export.generation import (CACHE_INPUTS, CACHE_LAYOUTS, CACHE_SCALE_INPUTS, WINDOW_CACHE_INPUTS, DEFAULT_CACHE_LAYOUT, ENTRY_POINTS, KV_CACHE_DTYPES,
                                         SLIDING_WINDOW_CACHES, GenerationSpec, check_kv_cache_dtype, check_sliding_window_cache, entry_point_modules, example_arguments, generation_spec)
from tpuexport.export.paged import KV_CACHES, PagedSpec, Step, check_kv_cache, check_page_options, paged_spec, step_example_arguments
from tpuexport.export.sampling import Sample, sample_example_arguments, sample_program
from tpuexport.export.seq2seq import Seq2SeqSpec, is_encoder_decoder, seq2seq_spec
from tpuexport.export.seq2seq import entry_point_modules as seq2seq_entry_point_modules
from tpuexport.export.seq2seq import example_arguments as seq2seq_example_arguments
from tpuexport.export.checkpoints import Checkpoint, open_checkpoint, parameters_on_meta, share_parameters, with_checkpoint_weights
from tpuexport.export.loaded import LoadedSource, SourceInfo
from tpuexport.export.mapped_pages import MappedTensors, drop_pages_after_use
from tpuexport.export.sources import load_source
from tpuexport.export.specs import DimSpec, InputSpec, example_args, parse_dim, parse_input

__all__ = [
    "KV_CACHES",
    "PagedSpec",
    "Step",
    "check_kv_cache",
    "check_page_options",
    "paged_spec",
    "step_example_arguments",
    "Sample",
    "sample_example_arguments",
    "sample_program",
    "CACHE_INPUTS",
    "CACHE_LAYOUTS",
    "CACHE_SCALE_INPUTS",
    "WINDOW_CACHE_INPUTS",
    "KV_CACHE_DTYPES",
    "check_kv_cache_dtype",
    "SLIDING_WINDOW_CACHES",
    "check_sliding_window_cache",
    "DEFAULT_CACHE_LAYOUT",
    "ENTRY_POINTS",
    "GenerationSpec",
    "entry_point_modules",
    "example_arguments",
    "generation_spec",
    "Seq2SeqSpec",
    "is_encoder_decoder",
    "seq2seq_spec",
    "seq2seq_entry_point_modules",
    "seq2seq_example_arguments",
    "CapturedModel",
    "Checkpoint",
    "DimSpec",
    "InputSpec",
    "LoadedSource",
    "MappedTensors",
    "SourceInfo",
    "capture",
    "describe",
    "drop_pages_after_use",
    "example_args",
    "load_source",
    "on_meta_device",
    "open_checkpoint",
    "parse_dim",
    "parse_input",
    "parameters_on_meta",
    "share_parameters",
    "torch_dynamic_shapes",
    "weights_on_meta",
    "with_checkpoint_weights",
]
