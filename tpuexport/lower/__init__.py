"""Lowering stage: ExportedProgram -> jax.export.Exported (StableHLO with symbolic dims); for
text generation, one LoweredProgram per entry point over shared weights (generation.py).

Names are imported from their modules on first use (tpuexport/lazy.py): the runtime takes a few
(program.py, sampling.py, seq2seq.py) without importing torch."""

from tpuexport.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "cost": ["flops_at"],
    "kernels": ["KERNEL_MODES", "NO_ATTENTION", "BucketKernels", "check_kernel_mode", "has_attention", "lower_bucket_kernels"],
    "generation": ["GenerationProgram", "GenerationSession", "check_prompts", "cpu_runner", "stream_tokens"],
    "sampling": ["GREEDY", "SampledTokens", "Sampling", "sample_reference"],
    "seq2seq": ["Seq2SeqProgram", "Seq2SeqSession"],
    "paged": ["PagedGenerationProgram", "PagedSession"],
    "program": ["DEFAULT_ENTRY_POINT", "EntryPoints", "Program", "taking_weights"],
    "programs": ["generation_program"],
    "lowering": ["PRECISIONS", "StoredState", "lower", "stored_state"],
    "lowered": ["LoweredProgram"],
    "mixed_precision": ["DEFAULT_PRECISION"],
    "matmul_precision": ["MATMUL_PRECISIONS"],
    "op_support": ["UnsupportedOperator", "find_unsupported"],
    "weight_layouts": ["in_state_layout", "in_stored_layout"],
})
