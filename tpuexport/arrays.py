"""numpy <-> torch <-> safetensors, bfloat16 included (safetensors' numpy API cannot read BF16 back)."""

from __future__ import annotations

import json
import pathlib
import struct
import warnings

import ml_dtypes
import numpy as np
import safetensors.torch
import torch

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


def to_torch(array: np.ndarray) -> torch.Tensor:
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.array(array, order="C").view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(array, order="C"))


def torch_view(array: np.ndarray) -> torch.Tensor:
    """A torch tensor over the array's memory (a copy only if it is not contiguous), for reading."""
    array = np.ascontiguousarray(array)
    with warnings.catch_warnings():  # a memory-mapped array is read-only; the view is only read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        if array.dtype == np.dtype(ml_dtypes.bfloat16):
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def save_arrays(arrays: dict[str, np.ndarray]) -> bytes:
    return safetensors.torch.save({name: to_torch(array) for name, array in arrays.items()})


def load_arrays(data: bytes) -> dict[str, np.ndarray]:
    return {name: to_numpy(tensor) for name, tensor in safetensors.torch.load(data).items()}
