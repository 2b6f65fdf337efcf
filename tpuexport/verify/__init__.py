"""Verify stage: run the lowered program on CPU (TPU-faithfully and in plain f32) and compare with eager PyTorch."""

from tpuexport.verify.compare import OutputComparison, Tolerances, compare_output
from tpuexport.verify.generation import DEFAULT_NEW_TOKENS, GenerationReport, eager_references, verify_generation
from tpuexport.verify.int8_kv_generation import INT8_KV_AGAINST, verify_int8_kv_generation
from tpuexport.verify.kernels import KernelCheck, verify_kernels
from tpuexport.verify.kernels import check_key as kernel_check_key
from tpuexport.verify.padding import PaddingCheck, padding_policy, verify_padding
from tpuexport.verify.sampling import SamplingVerification, verify_sampling
from tpuexport.verify.seq2seq import verify_seq2seq
from tpuexport.verify.paged_generation import eager_references as paged_eager_references
from tpuexport.verify.paged_generation import verify_paged_generation
from tpuexport.verify.quantized_generation import QuantizedGenerationReport, verify_quantized_generation
from tpuexport.verify.report import VerificationCase, VerificationReport
from tpuexport.verify.sharded import ShardedVerification, verify_sharded
from tpuexport.verify.sharded_generation import ShardedGenerationVerification, verify_sharded_generation
from tpuexport.verify.sharded_paged import verify_sharded_paged
from tpuexport.verify.sizes import DEFAULT_BUDGET_FLOPS, PlannedCase, RunMemory, plan_cases, resolve_requested_sizes, run_memory
from tpuexport.verify.tolerances import VerificationTolerances, default_tolerances, with_overrides
from tpuexport.verify.verification import ProgramRuns, make_inputs, verify

__all__ = [
    "DEFAULT_NEW_TOKENS",
    "GenerationReport",
    "eager_references",
    "KernelCheck",
    "kernel_check_key",
    "verify_kernels",
    "verify_generation",
    "verify_seq2seq",
    "verify_paged_generation",
    "paged_eager_references",
    "verify_sampling",
    "SamplingVerification",
    "verify_int8_kv_generation",
    "INT8_KV_AGAINST",
    "DEFAULT_BUDGET_FLOPS",
    "OutputComparison",
    "PaddingCheck",
    "padding_policy",
    "PlannedCase",
    "ProgramRuns",
    "ShardedVerification",
    "ShardedGenerationVerification",
    "Tolerances",
    "VerificationCase",
    "VerificationReport",
    "VerificationTolerances",
    "compare_output",
    "default_tolerances",
    "make_inputs",
    "plan_cases",
    "resolve_requested_sizes",
    "RunMemory",
    "run_memory",
    "verify",
    "verify_padding",
    "verify_quantized_generation",
    "QuantizedGenerationReport",
    "verify_sharded",
    "verify_sharded_generation",
    "verify_sharded_paged",
    "with_overrides",
]
