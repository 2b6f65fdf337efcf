"""Compile stage: AOT TPU executables per target and shape bucket, with memory/cost figures."""

from tpuexport.compile.aot import CompiledBucket, CompileJob, CompileReport, compile_program, compile_target
from tpuexport.compile.buckets import Bucket, make_buckets, parse_bucket_options
from tpuexport.compile.targets import TARGETS, Target, resolve_targets

__all__ = [
    "TARGETS",
    "Bucket",
    "CompileJob",
    "CompileReport",
    "CompiledBucket",
    "Target",
    "compile_program",
    "compile_target",
    "make_buckets",
    "parse_bucket_options",
    "resolve_targets",
]
