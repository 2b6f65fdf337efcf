"""Compile stage: AOT TPU executables per target (a chip, or a slice with its sharding plan) and shape
bucket, with per-device memory/cost figures and, for slices, the collectives.

Names are imported from their modules on first use (tpuexport/lazy.py)."""

from tpuexport.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "aot": ["CompiledBucket", "CompileJob", "CompileReport", "EntryPointCompile", "compile_program", "compile_target"],
    "compiler_processes": ["kept_compilers"],
    "compile_envs": ["CompileEnv", "check_interpreter", "describe_versions", "installed_versions", "probe", "version_set_name"],
    "buckets": ["Bucket", "make_buckets", "parse_bucket_options"],
    "sharding": ["PRESETS", "ShardingPlan", "ShardingRequest", "check_chip_fit", "make_request", "plan_sharding", "resolve_mesh"],
    "slices": ["SLICES", "resolve_targets"],
    "targets": ["TARGETS", "Target"],
})
