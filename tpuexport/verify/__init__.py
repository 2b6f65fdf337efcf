"""Verify stage: run the lowered program on CPU (TPU-faithfully and in plain f32) and compare with eager PyTorch.

Names are imported from their modules on first use (tpuexport/lazy.py)."""

from tpuexport.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "compare": ["OutputComparison", "Tolerances", "compare_output"],
    "generation": ["DEFAULT_NEW_TOKENS", "GenerationReport", "eager_references", "verify_generation"],
    "int8_kv_generation": ["INT8_KV_AGAINST", "verify_int8_kv_generation"],
    "kernels": ["KernelCheck", "verify_kernels", "kernel_check_key=check_key"],
    "padding": ["PaddingCheck", "verify_padding"],
    "row_padding": ["padding_policy"],
    "sampling": ["SamplingVerification", "verify_sampling"],
    "seq2seq": ["verify_seq2seq"],
    "paged_generation": ["paged_eager_references=eager_references", "verify_paged_generation", "verify_quantized_paged_generation"],
    "quantized_generation": ["QuantizedGenerationReport", "verify_quantized_generation"],
    "report": ["VerificationCase", "VerificationReport"],
    "sharded": ["ShardedVerification", "verify_sharded"],
    "sharded_generation": ["ShardedGenerationVerification", "verify_sharded_generation"],
    "sharded_paged": ["verify_sharded_paged"],
    "sizes": ["DEFAULT_BUDGET_FLOPS", "PlannedCase", "RunMemory", "plan_cases", "resolve_requested_sizes", "run_memory"],
    "tolerances": ["VerificationTolerances", "default_tolerances", "with_overrides"],
    "topk_ties": ["SelectionTie", "selection_ties"],
    "verification": ["ProgramRuns", "make_inputs", "verify"],
})
