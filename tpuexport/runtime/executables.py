"""Loading a serialized executable without letting its file run Python code.

`jax.experimental.serialize_executable` stores an executable as a pickle: the PJRT executable's
bytes plus jax's own descriptions of its arguments (avals, shardings, layouts). Unpickling may
call any importable function the pickle names, so before the bytes reach `deserialize_and_load`
every global they name is checked: only jax's own classes (and its `_unpickle_*` helpers), numpy's
`dtype`, ml_dtypes' scalar types (bfloat16, int4, the float8s: the dtypes of a bf16 model's
arguments) and numpy's array reconstruction (a sharded executable's mesh holds its devices in an
array; the devices themselves are persistent ids, the array's items pass the same check) may
appear, as jax writes them. Anything else (`os.system`, `builtins.eval`,
copyreg extension codes) refuses the file, naming what it asked for.
"""

from __future__ import annotations

import importlib
import pickletools

import ml_dtypes
import numpy as np
from jax.experimental import serialize_executable

from tpuexport.errors import TpuExportError

# Opcodes that push a string usable as STACK_GLOBAL's module or name.
_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}
_MEMO_GETS = {"GET", "BINGET", "LONG_BINGET"}
_EXTENSIONS = {"EXT1", "EXT2", "EXT4"}
# Opcodes that leave the stack alone (between a string push and STACK_GLOBAL).
_STACK_NEUTRAL = {"MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT", "FRAME", "PROTO"}


def pickle_globals(data: bytes) -> list[tuple[str, str]]:
    """Every (module, name) a pickle loads, without unpickling it.

    Raises:
      TpuExportError: the pickle uses copyreg extension codes (which name globals indirectly) or
        is malformed.
    """
    found, recent, memo = [], [], {}
    try:
        for opcode, argument, _ in pickletools.genops(data):
            name = opcode.name
            if name in _STRING_OPS:
                recent.append(argument)
            elif name in _MEMO_GETS:
                recent.append(memo.get(argument))
            elif name == "MEMOIZE":
                memo[len(memo)] = recent[-1] if recent else None
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[argument] = recent[-1] if recent else None
            elif name == "STACK_GLOBAL":
                found.append((str(recent[-2]), str(recent[-1])))
            elif name in ("GLOBAL", "INST"):
                module, _, attribute = argument.partition(" ")
                found.append((module, attribute))
            elif name in _EXTENSIONS:
                raise TpuExportError("an executable file names globals through copyreg extension codes; refusing to load it")
            if name not in _STRING_OPS and name not in _MEMO_GETS and name not in _STACK_NEUTRAL:
                recent.clear()
    except (ValueError, IndexError) as error:
        raise TpuExportError(f"an executable file is not a valid serialized executable ({error}); convert again") from None
    return found


# numpy's own way of pickling an array (ndarray.__reduce__), under numpy 2's and numpy 1's module names.
NUMPY_ARRAY_GLOBALS = {("numpy", "dtype"), ("numpy", "ndarray"), ("numpy._core.multiarray", "_reconstruct"),
                       ("numpy.core.multiarray", "_reconstruct")}


def _allowed(module: str, name: str) -> bool:
    """jax's classes and `_unpickle_*` helpers, numpy's dtype and array reconstruction and ml_dtypes'
    scalar types: what serialize_executable writes."""
    if (module, name) in NUMPY_ARRAY_GLOBALS:
        return True
    if module == "ml_dtypes":
        value = getattr(ml_dtypes, name, None)
        return isinstance(value, type) and issubclass(value, np.generic)
    if module != "jax" and not module.startswith(("jax.", "jaxlib.")):
        return False
    try:
        value = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    return isinstance(value, type) or name.startswith("_unpickle")


def check_pickle(data: bytes, where: str) -> None:
    """Refuses an executable file whose pickle names a global outside jax's own (see the module docstring).

    Raises:
      TpuExportError: one line naming the file and what it asks for.
    """
    refused = sorted({f"{module}.{name}" for module, name in pickle_globals(data) if not _allowed(module, name)})
    if refused:
        raise TpuExportError(f"{where} asks to load {', '.join(refused)}, which a serialized executable never does; "
                             "refusing to load it: the artifact is damaged or not from tpuexport")


def load_executable(data: bytes, in_tree, out_tree, devices: list, where: str):
    """Deserializes an executable onto the local devices after checking what its pickle loads.

    Args:
      data: the serialized executable (serialize_executable.serialize).
      in_tree, out_tree: the pytrees of its arguments and results.
      devices: the devices it runs on, as many as it was compiled for (deserialize_and_load
        otherwise loads it on every device of the backend, and a one-device executable then
        expects its arguments on all of them).
      where: the file's path in the artifact, for messages.
    Returns:
      The loaded jax.stages.Compiled.
    Raises:
      TpuExportError: the file names a global outside jax's own (see the module docstring).
    """
    check_pickle(data, where)
    return serialize_executable.deserialize_and_load(data, in_tree, out_tree, backend=devices[0].client, execution_devices=devices)
