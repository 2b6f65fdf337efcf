"""A checkpoint's pages given back to the system once read: what keeps a conversion's resident memory
near its artifact's weights when the eager reference reads a checkpoint the artifact does not hold.

A checkpoint's tensors are views into private maps of its files (checkpoints.py). A page the process
has read stays resident (RssFile) as long as the map does. The weights pass reads each tensor once,
and an eager reference reads every weight at each forward, so the whole checkpoint stays resident:
for an 8B model with int4 weights, its 15 GiB of bf16 beside the artifact's 3.9 GiB. The kernel may
drop those clean pages under pressure, but they count against a runner's memory limit.
madvise(MADV_DONTNEED) drops a tensor's pages from the process once it is read; the next read maps
them again from the page cache (a minor fault per few pages, no disk read while the kernel keeps the
file cached).

Only the whole pages of a tensor whose bytes lie in one of the checkpoint's maps are dropped, and only
while the tensor is held, so that the map cannot have gone and its addresses been reused for memory
the process owns (where MADV_DONTNEED would zero it). A page the process wrote would lose the write
(the maps are private, copy-on-write): nothing writes them, they are the weights.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from collections.abc import Iterable

import torch

from tpuexport.export.checkpoints import Checkpoint

_MADV_DONTNEED = 4  # Linux's value; other systems keep the pages (nothing to drop there)


class MappedTensors:
    """Tensors of a checkpoint's maps whose pages can be dropped; holds them (module docstring).

    Args:
      checkpoint: the checkpoint whose maps count (those it has now).
      tensors: any tensors; those outside its maps are not kept.
    """

    def __init__(self, checkpoint: Checkpoint, tensors: Iterable[torch.Tensor]):
        regions = checkpoint.mapped_regions()
        inside = [tensor for tensor in {id(tensor): tensor for tensor in tensors}.values()
                  if any(start <= tensor.data_ptr() and _end(tensor) <= end for start, end in regions)]
        # Views hold the maps; the page ranges are read now, once. At a drop, the tensors given may be
        # other memory: a Parameter pointed elsewhere (`.data =`), or one a torch function mode active
        # in the forward substitutes (verification's DequantizedWeights answers its data_ptr() with a
        # rounded copy's), where dropping pages would zero memory the process owns.
        self.tensors = [tensor.detach() for tensor in inside]
        self.pages = [(first, last - first) for first, last in map(_whole_pages, inside) if last > first]

    def drop(self) -> None:
        """Drops the resident pages wholly inside each tensor."""
        advise = _madvise()
        for start, length in self.pages if advise is not None else ():
            advise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_DONTNEED)


def drop_pages_after_use(modules: Iterable[torch.nn.Module], checkpoint: Checkpoint) -> list:
    """Makes each module that holds checkpoint tensors of its own (parameters, buffers) drop their
    pages after each of its forwards.

    Returns:
      The hooks' handles: remove them when the modules' reads end (the modules may be the user's).
    """
    handles = []
    for module in {id(module): module for root in modules for module in root.modules()}.values():
        mapped = MappedTensors(checkpoint, [*module.parameters(recurse=False), *module.buffers(recurse=False)])
        if mapped.pages:
            handles.append(module.register_forward_hook(lambda *_, mapped=mapped: mapped.drop()))
    return handles


def _whole_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """The first and past-the-last addresses of the whole pages a tensor's bytes cover."""
    return -(-tensor.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE, _end(tensor) // mmap.PAGESIZE * mmap.PAGESIZE


def _end(tensor: torch.Tensor) -> int:
    """Where the bytes a tensor spans end (a strided view's last element included)."""
    if tensor.numel() == 0:
        return tensor.data_ptr()
    return tensor.data_ptr() + (1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))) * tensor.element_size()


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    advise = ctypes.CDLL(None, use_errno=True).madvise
    advise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return advise
