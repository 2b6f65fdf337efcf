"""Lowering stage: ExportedProgram -> jax.export.Exported (StableHLO with symbolic dims); for
text generation, one LoweredProgram per entry point over shared weights (generation.py)."""

from tpuexport.lower.cost import flops_at
from tpuexport.lower.kernels import KERNEL_MODES, NO_ATTENTION, BucketKernels, check_kernel_mode, has_attention, lower_bucket_kernels
from tpuexport.lower.generation import GenerationProgram, GenerationSession, check_prompts, cpu_runner, stream_tokens
from tpuexport.lower.sampling import GREEDY, SampledTokens, Sampling, sample_reference
from tpuexport.lower.seq2seq import Seq2SeqProgram, Seq2SeqSession
from tpuexport.lower.paged import PagedGenerationProgram, PagedSession
from tpuexport.lower.program import DEFAULT_ENTRY_POINT, EntryPoints, Program, taking_weights
from tpuexport.lower.programs import generation_program
from tpuexport.lower.lowering import PRECISIONS, LoweredProgram, StoredState, lower
from tpuexport.lower.mixed_precision import DEFAULT_PRECISION
from tpuexport.lower.matmul_precision import MATMUL_PRECISIONS
from tpuexport.lower.op_support import UnsupportedOperator, find_unsupported
from tpuexport.lower.weight_layouts import in_state_layout, in_stored_layout

__all__ = ["DEFAULT_ENTRY_POINT", "EntryPoints", "Program", "taking_weights", "GREEDY", "SampledTokens", "Sampling", "sample_reference", "generation_program", "KERNEL_MODES", "NO_ATTENTION", "BucketKernels", "check_kernel_mode", "has_attention", "lower_bucket_kernels", "DEFAULT_PRECISION", "MATMUL_PRECISIONS", "PRECISIONS", "StoredState", "GenerationProgram", "GenerationSession", "Seq2SeqProgram", "Seq2SeqSession", "PagedGenerationProgram", "PagedSession", "LoweredProgram", "UnsupportedOperator",
           "check_prompts", "cpu_runner", "find_unsupported", "flops_at", "in_state_layout", "in_stored_layout", "lower",
           "stream_tokens"]
