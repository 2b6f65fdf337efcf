"""Runtime: an artifact's AOT executables loaded on this host without compiling, requests padded to
buckets (sits above the stages; tpuexport.serve builds on it)."""

from tpuexport.lower.program import DEFAULT_ENTRY_POINT
from tpuexport.runtime.entry_points import BucketEntry, EntryPoint, choose_bucket, entry_points
from tpuexport.runtime.processes import Cluster, ProcessLost
from tpuexport.runtime.runner import Execution, PreparedRequest, Runner, open_runner

__all__ = [
    "DEFAULT_ENTRY_POINT",
    "BucketEntry",
    "Cluster",
    "EntryPoint",
    "Execution",
    "PreparedRequest",
    "ProcessLost",
    "Runner",
    "choose_bucket",
    "entry_points",
    "open_runner",
]
