"""Serving: TF Serving's REST and gRPC APIs over the runtime, with dynamic batching and metrics
(sits above the runtime; `tpuexport serve` on the command line)."""

from tpuexport.serve.server import serve

__all__ = ["serve"]
