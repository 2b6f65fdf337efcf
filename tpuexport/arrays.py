"""numpy <-> torch <-> safetensors, bfloat16 included (safetensors' numpy API cannot read BF16 back)."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import safetensors.torch
import torch


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
