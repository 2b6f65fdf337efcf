"""Importing torchax 0.0.13 under torch 2.13.

torchax builds op tables at import time that name 22 named-dimension (Dimname) ATen overloads
which torch 2.13 removed, so a plain `import torchax` raises AttributeError. While torchax
imports, and only then, a lookup of exactly one of those overloads returns an inert placeholder
instead of raising; every other missing overload still raises. The placeholders end up only in
torchax's decomposition list and autocast table, whose consumers skip objects that are not
operators, so no lowering changes. Once torchax names none of them, the shim does nothing.
"""

from __future__ import annotations

import functools
import threading

import torch

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

_lock = threading.Lock()


class RemovedOverload:
    """Stands in for one removed overload; it is not an operator, so no table consumer uses it."""

    def __init__(self, packet: str, overload: str):
        self.qualified_name = f"aten::{packet}.{overload}"

    def __repr__(self) -> str:
        return f"<removed overload {self.qualified_name}>"


@functools.cache
def import_torchax():
    """Imports torchax (once) and returns the module, with its ATen op registry populated.

    Returns:
      The `torchax` module; `torchax.default_env()` has run, which registers its lowerings.
    """
    with _lock:
        packet_getattr = torch._ops.OpOverloadPacket.__getattr__

        def tolerant_getattr(packet, key):
            try:
                return packet_getattr(packet, key)
            except AttributeError:
                name = packet._qualified_op_name.split("::")[-1]
                if (name, key) in REMOVED_NAMED_DIM_OVERLOADS:
                    return RemovedOverload(name, key)
                raise

        torch._ops.OpOverloadPacket.__getattr__ = tolerant_getattr
        try:
            import torchax
            import torchax.export
        finally:
            torch._ops.OpOverloadPacket.__getattr__ = packet_getattr
    torchax.default_env()
    return torchax
