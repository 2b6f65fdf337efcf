"""tpuexport: PyTorch model -> verified, deployable TPU artifact, built on a CPU-only machine.

    art = tpuexport.convert(model, args=(x,), dynamic_shapes=..., target="v5e", out="model.tpu")
    art.run(x)                       # the lowered StableHLO on CPU
    llm = tpuexport.convert(causal_lm, task="text-generation", max_context=2048, max_batch=8, out="llm.tpu")
    llm.generate([1, 2, 3], max_new_tokens=32)   # prefill + decode over the KV cache, on CPU
    tpuexport.load("model.tpu")      # the same Artifact type
    tpuexport.verify_artifact("model.tpu", recompile=True).passed   # the CI gate
    tpuexport.plan(meta_model, args=(x,), target="v5p-128", sharding="fsdp", out="big.tpu")  # no weights
    with tpuexport.parameters_on_meta():
        model = build()                # no parameter memory
    tpuexport.convert(model, args=(x,), checkpoint="ckpt/", out="big.tpu")  # weights streamed
    tpuexport.runner("model.tpu").run({"x": x})   # the AOT executables of this host, no compiling
    with tpuexport.kept_compilers():   # many conversions in one process: compiler processes reused
        ...

Importing tpuexport imports nothing heavy (no torch, jax or TensorFlow): each public name is
imported from its module on first use (PEP 562), so the command line answers `--help` and bad
input at once, and a process that only serves imports only what serving needs.
"""

from __future__ import annotations

import importlib

from tpuexport.errors import TpuExportError, UnsupportedOperatorsError, VerificationError

__version__ = "0.1.0"

# Public name -> the module that defines it (imported on first use).
_LAZY = {
    "SLICES": "tpuexport.compile",
    "TARGETS": "tpuexport.compile",
    "Artifact": "tpuexport.artifact",
    "load": "tpuexport.artifact",
    "CheckResult": "tpuexport.gate",
    "GateReport": "tpuexport.gate",
    "verify_artifact": "tpuexport.gate",
    "Runner": "tpuexport.runtime",
    "Sampling": "tpuexport.lower.sampling",
    "Tolerances": "tpuexport.verify",
    "parameters_on_meta": "tpuexport.export",
    "kept_compilers": "tpuexport.compile",
    "convert": "tpuexport.api",
    "plan": "tpuexport.api",
}

__all__ = [
    "SLICES",
    "TARGETS",
    "Artifact",
    "CheckResult",
    "GateReport",
    "Runner",
    "Sampling",
    "Tolerances",
    "TpuExportError",
    "UnsupportedOperatorsError",
    "VerificationError",
    "convert",
    "kept_compilers",
    "load",
    "parameters_on_meta",
    "plan",
    "runner",
    "verify_artifact",
]


def __getattr__(name: str):
    if name == "runner":  # tpuexport.runtime.open_runner, under the name users call
        from tpuexport.runtime import open_runner

        return open_runner
    if name not in _LAZY:
        raise AttributeError(f"module 'tpuexport' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
