"""Compile stage: AOT TPU executables per target (a chip, or a slice with its sharding plan) and shape
bucket, with per-device memory/cost figures and, for slices, the collectives."""

from tpuexport.compile.aot import CompiledBucket, CompileJob, CompileReport, EntryPointCompile, compile_program, compile_target
from tpuexport.compile.compile_envs import CompileEnv, check_interpreter, describe_versions, installed_versions, probe, version_set_name
from tpuexport.compile.buckets import Bucket, make_buckets, parse_bucket_options
from tpuexport.compile.sharding import PRESETS, ShardingPlan, ShardingRequest, check_chip_fit, make_request, plan_sharding, resolve_mesh
from tpuexport.compile.slices import SLICES, resolve_targets
from tpuexport.compile.targets import TARGETS, Target

__all__ = [
    "PRESETS",
    "SLICES",
    "TARGETS",
    "Bucket",
    "CompileEnv",
    "CompileJob",
    "CompileReport",
    "CompiledBucket",
    "EntryPointCompile",
    "ShardingPlan",
    "ShardingRequest",
    "Target",
    "check_chip_fit",
    "check_interpreter",
    "describe_versions",
    "installed_versions",
    "compile_program",
    "compile_target",
    "make_buckets",
    "make_request",
    "parse_bucket_options",
    "plan_sharding",
    "probe",
    "resolve_mesh",
    "resolve_targets",
    "version_set_name",
]
