"""Export stage: load a source, capture it with torch.export, name its signature.

Names are imported from their modules on first use (tpuexport/lazy.py)."""

from tpuexport.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "capturing": ["CapturedModel", "capture", "describe", "on_meta_device", "torch_dynamic_shapes", "weights_on_meta"],
    "cache_specs": ["CACHE_INPUTS", "CACHE_LAYOUTS", "CACHE_SCALE_INPUTS", "WINDOW_CACHE_INPUTS", "CONV_STATE_INPUTS", "RECURRENT_STATE_INPUTS", "INDEXER_KEYS_INPUTS",
                    "DEFAULT_CACHE_LAYOUT", "KV_CACHE_DTYPES", "SLIDING_WINDOW_CACHES", "GenerationSpec", "PagedSpec", "Seq2SeqSpec"],
    "generation": ["ENTRY_POINTS", "check_kv_cache_dtype", "check_sliding_window_cache", "entry_point_modules", "example_arguments",
                   "generation_spec"],
    "paged": ["KV_CACHES", "Step", "check_kv_cache", "check_page_options", "paged_spec", "step_example_arguments"],
    "sampling": ["Sample", "sample_example_arguments", "sample_program"],
    "seq2seq": ["is_encoder_decoder", "seq2seq_spec", "seq2seq_entry_point_modules=entry_point_modules",
                "seq2seq_example_arguments=example_arguments"],
    "checkpoints": ["Checkpoint", "open_checkpoint", "parameters_on_meta", "share_parameters", "with_checkpoint_weights"],
    "loaded": ["LoadedSource", "SourceInfo"],
    "mapped_pages": ["MappedTensors", "drop_pages_after_use"],
    "sources": ["load_source"],
    "specs": ["DimSpec", "InputSpec", "example_args", "parse_dim", "parse_input"],
})
