"""safetensors files as tpuexport reads them without torch: dtype codes and a file's tensor entries
(the runtime maps an artifact's weights with these; arrays.py converts to and from torch)."""

from __future__ import annotations

import json
import pathlib
import struct

import ml_dtypes
import numpy as np

from tpuexport.errors import TpuExportError

# safetensors' dtype codes and the dtype names torch and numpy (bfloat16 from ml_dtypes) share.
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}
SAFETENSORS_CODES = {name: code for code, name in SAFETENSORS_DTYPES.items()}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a dtype name, bfloat16 included."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def read_safetensors_header(path: pathlib.Path) -> tuple[dict, int]:
    """A safetensors file's tensor entries and where its data starts, read without the data.

    Returns:
      ({name: {"dtype", "shape", "data_offsets"}}, byte offset of the data section).
    Raises:
      TpuExportError: not a safetensors file, or a dtype tpuexport does not read.
    """
    try:
        with open(path, "rb") as stream:
            (length,) = struct.unpack("<Q", stream.read(8))
            header = json.loads(stream.read(length))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as error:
        raise TpuExportError(f"cannot read {path} as safetensors ({type(error).__name__}: {error}); give a .safetensors file") from None
    header.pop("__metadata__", None)
    unknown = sorted({entry["dtype"] for entry in header.values()} - set(SAFETENSORS_DTYPES))
    if unknown:
        raise TpuExportError(f"{path} holds tensors of dtype {', '.join(unknown)}, which tpuexport does not read; "
                             f"save them as one of {', '.join(SAFETENSORS_DTYPES)}")
    return header, 8 + length
