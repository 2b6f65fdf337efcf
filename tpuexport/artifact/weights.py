"""The artifact's weights file: written one tensor at a time, read back as memory maps.

The file is safetensors. The writer never holds more than one source tensor and its cast copy,
so a model larger than the machine's memory streams from its checkpoint into the artifact. The
reader maps the file instead of reading it: arrays are file-backed pages, and a 64-byte-aligned
array is run by XLA:CPU in place (jax.device_put does not copy it), so verifying or running a
large artifact does not hold its weights twice.
"""

from __future__ import annotations

import json
import pathlib
import struct
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np

from tpuexport.errors import TpuExportError
from tpuexport.safetensors_files import SAFETENSORS_CODES, SAFETENSORS_DTYPES, numpy_dtype, read_safetensors_header

# Writing weights (a conversion) casts torch tensors; reading them (`map_weights`, the runtime) needs no torch.
if TYPE_CHECKING:
    import torch

# XLA:CPU takes host arrays aligned to this many bytes without a copy.
ALIGNMENT = 64


def write_weights(path: pathlib.Path, names: Sequence[str], specs: Sequence, parts: Callable[[str], Iterable[torch.Tensor]]) -> int:
    """Writes weights to a safetensors file, one source tensor at a time.

    Args:
      path: the file to write.
      names: the weights' names, in the program's call order.
      specs: each weight's shape and dtype (jax.ShapeDtypeStruct), the dtype it is stored in.
      parts: for a weight's name, the tensors that make it up in order, each cast to the
        weight's dtype as it is written: one tensor, or a scanned run's blocks' tensors, which
        stacked on a new first axis make the weight.
    Returns:
      The bytes of tensor data written.
    Raises:
      TpuExportError: a weight's parts do not hold as many elements as its shape.
    """
    import torch  # only writing needs torch (the module imports it for annotations alone)

    sizes = [int(np.prod(spec.shape)) * np.dtype(spec.dtype).itemsize for spec in specs]
    # Tensors whose size keeps the next one aligned first: every tensor then starts aligned up to
    # the first odd-sized one.
    order = sorted(range(len(names)), key=lambda index: sizes[index] % ALIGNMENT != 0)
    header, offset = {}, 0
    for index in order:
        header[names[index]] = {"dtype": SAFETENSORS_CODES[np.dtype(specs[index].dtype).name], "shape": list(specs[index].shape),
                                "data_offsets": [offset, offset + sizes[index]]}
        offset += sizes[index]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGNMENT)  # the data section starts aligned
    with open(path, "wb") as stream:
        stream.write(struct.pack("<Q", len(text)))
        stream.write(text)
        for index in order:
            dtype = getattr(torch, np.dtype(specs[index].dtype).name)
            written = 0
            for part in parts(names[index]):
                flat = part.detach().to(dtype).contiguous().reshape(-1)
                if not flat.numel():
                    continue  # an empty tensor (a constant the model's code lifts empty) has no bytes, and stride 0
                data = flat.view(torch.uint8).numpy()
                stream.write(data)
                written += data.nbytes
            if written != sizes[index]:
                raise TpuExportError(f"weight {names[index]!r} got {written} bytes from its tensors, its shape "
                                     f"{tuple(specs[index].shape)} needs {sizes[index]}; give the checkpoint of this model")
    return offset


def write_arrays(path: pathlib.Path, names: Sequence[str], arrays: Sequence[np.ndarray]) -> int:
    """Writes in-memory weights (numpy arrays, bfloat16 included) as `write_weights` does, one array
    at a time through a torch view of its memory: no copy of the model is built (safetensors' own
    save builds the whole file in memory, and converting each array copies it again).

    Returns:
      The bytes of tensor data written.
    """
    from tpuexport.arrays import torch_view  # torch, which only writing needs

    by_name = dict(zip(names, arrays))
    return write_weights(path, names, arrays, lambda name: (torch_view(by_name[name]),))


def map_weights(path: pathlib.Path) -> dict[str, np.ndarray]:
    """The arrays of a safetensors file as read-only views of one memory map (nothing is read yet).

    Returns:
      {name: array} in the file's dtypes, bfloat16 included.
    """
    header, data_start = read_safetensors_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start) if path.stat().st_size > data_start else np.empty(0, np.uint8)
    arrays = {}
    for name, entry in header.items():
        start, end = entry["data_offsets"]
        arrays[name] = data[start:end].view(numpy_dtype(SAFETENSORS_DTYPES[entry["dtype"]])).reshape(entry["shape"])
    return arrays
