"""Importing torchax 0.0.13 under torch 2.13 and later, without changing the user's process.

Two problems, each handled only while torchax imports:

1. torchax builds op tables at import time that name ATen operators newer torch removed: 22
   named-dimension (Dimname) overloads (gone in torch 2.13) and the deprecated `aten.cholesky` and
   `aten.qr` (gone in torch 2.15, replaced by `linalg_cholesky` / `linalg_qr`, which torchax lowers
   too), so a plain `import torchax` raises AttributeError. A lookup of exactly one of those returns
   an inert placeholder instead of raising; every other missing operator or overload still raises.
   The placeholders end up only as keys of torchax's lowering registry, decomposition list and
   autocast table, which no exported graph can name, so no lowering changes. Once torchax names
   none of them, the shim does nothing.

2. torchax's import reconfigures torch for its eager tensor mode, which tpuexport does not use (it
   only runs torchax's op lowerings on JAX arrays). It renames torch's PrivateUse1 backend to "jax"
   and registers `torch.jax` as a device module; torch then takes "jax" for an available
   accelerator, and torch.compile (which eager `torch.cond` runs) fails with "PyTorch is not linked
   with support for jax devices". The rename cannot be undone (torch allows one per process), so
   both calls are skipped. It also turns off the nn.MultiheadAttention fast path, adds entries to
   torch's global decomposition table (its own DECOMPOSITIONS copy, which tpuexport passes
   explicitly, keeps them) and sets ENABLE_RUNTIME_UPTIME_TELEMETRY; all three are put back.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch
import torch._decomp

# (overload packet, overload) pairs referenced by torchax 0.0.13 and absent from torch 2.13.
REMOVED_NAMED_DIM_OVERLOADS = frozenset(
    {
        ("all", "dimname"),
        ("all", "dimname_out"),
        ("index_add", "dimname"),
        ("index_copy", "dimname"),
        ("index_copy_", "dimname"),
        ("index_fill", "Dimname_Scalar"),
        ("index_fill", "Dimname_Tensor"),
        ("index_fill_", "Dimname_Scalar"),
        ("index_fill_", "Dimname_Tensor"),
        ("norm", "names_ScalarOpt_dim"),
        ("norm", "names_ScalarOpt_dim_dtype"),
        ("norm", "names_dtype_out"),
        ("norm", "names_out"),
        ("prod", "dim_Dimname"),
        ("std", "correction_names"),
        ("std", "correction_names_out"),
        ("std", "names_dim"),
        ("std", "names_out"),
        ("std_mean", "correction_names"),
        ("std_mean", "names_dim"),
        ("unbind", "Dimname"),
    }
)

# ATen operators referenced by torchax 0.0.13 and absent from torch 2.15 (every overload with them).
REMOVED_OPERATORS = frozenset({"cholesky", "qr"})

# Set by torchax's import (os.environ.setdefault); removed again unless the user had set it.
TELEMETRY_VARIABLE = "ENABLE_RUNTIME_UPTIME_TELEMETRY"

_lock = threading.Lock()


class RemovedOverload:
    """Stands in for one removed overload; it is not an operator, so no table consumer uses it."""

    def __init__(self, packet: str, overload: str):
        self.qualified_name = f"aten::{packet}.{overload}"

    def __repr__(self) -> str:
        return f"<removed overload {self.qualified_name}>"


class RemovedOperator:
    """Stands in for one removed operator (its packet); any overload of it is a RemovedOverload."""

    def __init__(self, name: str):
        self.qualified_name = f"aten::{name}"

    def __getattr__(self, overload: str) -> RemovedOverload:
        if overload.startswith("__"):
            raise AttributeError(overload)
        return RemovedOverload(self.qualified_name.split("::")[-1], overload)

    def __repr__(self) -> str:
        return f"<removed operator {self.qualified_name}>"


@contextlib.contextmanager
def _removed_overloads_tolerated():
    """Lookups of REMOVED_NAMED_DIM_OVERLOADS and REMOVED_OPERATORS return placeholders inside the block."""
    packet_getattr = torch._ops.OpOverloadPacket.__getattr__
    namespace_getattr = torch._ops._OpNamespace.__getattr__

    def tolerant_getattr(packet, key):
        try:
            return packet_getattr(packet, key)
        except AttributeError:
            name = packet._qualified_op_name.split("::")[-1]
            if (name, key) in REMOVED_NAMED_DIM_OVERLOADS:
                return RemovedOverload(name, key)
            raise

    def tolerant_namespace_getattr(namespace, op_name):
        try:
            return namespace_getattr(namespace, op_name)
        except AttributeError:
            if namespace.name == "aten" and op_name in REMOVED_OPERATORS:
                return RemovedOperator(op_name)
            raise

    torch._ops.OpOverloadPacket.__getattr__ = tolerant_getattr
    torch._ops._OpNamespace.__getattr__ = tolerant_namespace_getattr
    try:
        yield
    finally:
        torch._ops.OpOverloadPacket.__getattr__ = packet_getattr
        torch._ops._OpNamespace.__getattr__ = namespace_getattr


def _skip(*args, **kwargs) -> None:
    """Replaces torch's backend-rename and device-module registration during torchax's import."""


@contextlib.contextmanager
def _torch_globals_kept():
    """torch's process-wide settings are the same after the block as before it (see module doc)."""
    rename_backend, register_device_module = torch.utils.rename_privateuse1_backend, torch._register_device_module
    fastpath = torch.backends.mha.get_fastpath_enabled()
    tables = {stage: dict(table) for stage, table in torch._decomp.global_decomposition_table.items()}
    telemetry = os.environ.get(TELEMETRY_VARIABLE)
    torch.utils.rename_privateuse1_backend, torch._register_device_module = _skip, _skip
    try:
        yield
    finally:
        torch.utils.rename_privateuse1_backend, torch._register_device_module = rename_backend, register_device_module
        torch.backends.mha.set_fastpath_enabled(fastpath)
        for stage, table in torch._decomp.global_decomposition_table.items():
            table.clear()
            table.update(tables.get(stage, {}))
        if telemetry is None:
            os.environ.pop(TELEMETRY_VARIABLE, None)
        else:
            os.environ[TELEMETRY_VARIABLE] = telemetry


@functools.cache
def import_torchax():
    """Imports torchax (once) and returns the module, with its ATen op registry populated.

    Returns:
      The `torchax` module; `torchax.default_env()` has run, which registers its lowerings.
    """
    with _lock, _removed_overloads_tolerated(), _torch_globals_kept():
        import torchax
        import torchax.export

        torchax.default_env()
    return torchax
