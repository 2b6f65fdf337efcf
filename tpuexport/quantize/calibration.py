"""Calibration samples for static quantization: from a file, from the API, or random on request.

File format (.npz or .safetensors): one array per model input, named as the input, holding N
samples stacked on axis 0, so sample i of input `x` is `arrays["x"][i]` with the input's own
shape (dynamic dims may take any size in their range, the same size for every sample of the file).
Floating inputs need a floating array, integer inputs an integer array, bool inputs a bool array;
values are cast to the input's dtype.
"""

from __future__ import annotations

import pathlib
import zipfile
from typing import Iterable, Sequence

import numpy as np
import safetensors
import safetensors.numpy
import torch
from torch.utils import _pytree as pytree

from tpuexport.errors import TpuExportError
from tpuexport.inputs import make_inputs
from tpuexport.signature import ProgramSignature, TensorSpec

RANDOM_SAMPLES = 8


def load_calibration_file(path: pathlib.Path, signature: ProgramSignature) -> list[tuple[torch.Tensor, ...]]:
    """Reads and checks a calibration file (see the module docstring for the format).

    Args:
      path: a .npz or .safetensors file.
      signature: the model's signature (input names, shapes, dtypes, dim ranges).
    Returns:
      One tuple of input tensors per sample, in signature order.
    Raises:
      TpuExportError: unreadable file, wrong names, shapes or dtypes, or no samples.
    """
    arrays = _read_arrays(path)
    expected = [spec.name for spec in signature.inputs]
    if sorted(arrays) != sorted(expected):
        raise TpuExportError(
            f"calibration file {path} holds arrays {sorted(arrays)} but the model's inputs are {expected}; "
            "store one array per input, named as the input"
        )
    counts = {name: array.shape[0] if array.ndim else 0 for name, array in arrays.items()}
    if len(set(counts.values())) != 1 or not next(iter(counts.values())):
        raise TpuExportError(
            f"calibration file {path} has sample counts {counts} on axis 0; give every input the same number (>= 1) of samples"
        )
    where = f"calibration file {path}"
    _check_shapes(signature, [tuple(arrays[spec.name].shape[1:]) for spec in signature.inputs], where)
    columns = [_as_input(arrays[spec.name], spec, where) for spec in signature.inputs]
    return [tuple(column[index] for column in columns) for index in range(len(columns[0]))]


def _read_arrays(path: pathlib.Path) -> dict[str, np.ndarray]:
    suffix = path.suffix.lower()
    if not path.is_file():
        raise TpuExportError(f"calibration file {path} does not exist")
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                return {name: archive[name] for name in archive.files}
        if suffix == ".safetensors":
            return safetensors.numpy.load_file(str(path))
    except (OSError, ValueError, zipfile.BadZipFile, safetensors.SafetensorError) as error:
        raise TpuExportError(f"cannot read calibration file {path} ({type(error).__name__}: {_first_line(error)})") from None
    raise TpuExportError(f"calibration file {path} must be .npz or .safetensors, not {suffix or '(no suffix)'!r}")


def _as_input(stacked: np.ndarray, spec: TensorSpec, where: str) -> torch.Tensor:
    """Checks one input's stacked samples [N, *shape] and returns them as a tensor of its dtype."""
    expected_kind = _kind(getattr(torch, spec.torch_dtype))
    actual_kind = "bool" if stacked.dtype == np.bool_ else "float" if np.issubdtype(stacked.dtype, np.floating) else (
        "integer" if np.issubdtype(stacked.dtype, np.integer) else str(stacked.dtype))
    if actual_kind != expected_kind:
        raise TpuExportError(f"{where}: input {spec.name!r} is {spec.torch_dtype} but its array is {stacked.dtype}; store {expected_kind} values")
    return torch.from_numpy(np.ascontiguousarray(stacked)).to(getattr(torch, spec.torch_dtype))


def _check_shapes(signature: ProgramSignature, shapes: list[tuple[int, ...]], where: str) -> None:
    """Raises TpuExportError unless one sample's input shapes fit the signature (ranks, sizes, dims)."""
    try:
        signature.sizes_of(shapes)
    except ValueError as error:
        raise TpuExportError(f"{where}: {error}") from None


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "integer"


def check_samples(samples: Iterable, signature: ProgramSignature) -> list[tuple[torch.Tensor, ...]]:
    """Checks calibration samples given in Python (API or factory): an iterable of argument tuples.

    Args:
      samples: each item is a tuple of the model's positional inputs (a lone tensor is taken as a
        one-input tuple).
      signature: the model's signature.
    Returns:
      The samples as tuples of flat input tensors, in signature order.
    Raises:
      TpuExportError: no samples, or a sample with the wrong number, kind or shape of inputs.
    """
    checked = []
    for index, sample in enumerate(samples):
        leaves = pytree.tree_leaves(sample if isinstance(sample, (tuple, list)) else (sample,))
        where = f"calibration sample {index}"
        if len(leaves) != len(signature.inputs) or not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
            raise TpuExportError(f"{where} has {len(leaves)} value(s); give a tuple of {len(signature.inputs)} tensor(s), like args")
        tensors = []
        for spec, leaf in zip(signature.inputs, leaves):
            dtype = getattr(torch, spec.torch_dtype)
            if _kind(leaf.dtype) != _kind(dtype):
                raise TpuExportError(f"{where}: input {spec.name!r} is {spec.torch_dtype} but the sample is {leaf.dtype}")
            tensors.append(leaf.detach().to(dtype))
        _check_shapes(signature, [tuple(t.shape) for t in tensors], where)
        checked.append(tuple(tensors))
    if not checked:
        raise TpuExportError("the calibration data is empty; give at least one sample")
    return checked


def random_samples(signature: ProgramSignature, example_inputs: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """RANDOM_SAMPLES random input tuples at the example sizes that follow the example inputs' values."""
    sizes = signature.example_sizes()
    return [tuple(make_inputs(signature.inputs, example_inputs, sizes, seed=1000 + index)) for index in range(RANDOM_SAMPLES)]


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
