"""Vision towers over flattened patches and their grid: Qwen2-VL's and its descendants' (Qwen3-VL,
Qwen3.5, GLM-4V, GLM-OCR, LFM3-VL, Kimi K2.5, HunyuanVL, ...), whose forward takes an image as its
patches, `hidden_states` or `pixel_values` [patches, channels x temporal patch x patch x patch],
and `grid_thw` [images, 3]: each image's frames, rows and columns of patches.

The tower computes its positions, windows and attention boundaries from the grid's values, in Python
(`for t, h, w in grid_thw`, `cu_seqlens.tolist()`): sizes from tensor values, which one exported
program cannot hold when the grid is an input. tpuexport converts such a tower at one image size:
the grid is a constant of the program (`named_forward`'s constants), made in the forward from its
numbers, and torch.export reads its values while tracing (`constants_read`). The artifact's one input
is the patches of one image of that size, as the model's image processor writes them for it.

SigLIP 2's NaFlex towers take a batch of images alike: `pixel_values` [images, patches, channels x
patch x patch], each image's `spatial_shapes` [rows, columns] and a `pixel_attention_mask` over the
patches its image fills. Converted at one image size, the shapes are a constant, one row that every
image of the batch shares, and no mask is given (every patch is the image's); the artifact's one
input is the images' patches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging

import torch
from torch.overrides import TorchFunctionMode

from tpuexport.errors import TpuExportError
from tpuexport.export.specs import DimSpec
from tpuexport.logs import EXPORT_LOGGERS, quiet_loggers

GRID_INPUTS = ("grid_thw", "image_grid_thw", "spatial_shapes")
PATCH_INPUTS = ("hidden_states", "pixel_values")
# The largest tensor made from constants whose values torch.export keeps while tracing: a grid, the
# boundaries and positions a tower computes from it (a 1024-patch image's [1024, 2] positions).
_CONSTANT_ELEMENTS = 1 << 16


@dataclasses.dataclass(frozen=True)
class PatchGrid:
    """How a tower takes an image: its inputs' names and its patches' sizes.

    Attributes:
      patches_input, grid_input: the forward's names for the patches and the grid.
      patch: a patch's height and width in pixels; temporal: frames per patch (2 for Qwen's video-ready
        towers, whose image patches repeat the frame); channels: colour channels; merge: patches merged
        into one output token per side (the grid's rows and columns are multiples of it).
      merge_input: the forward's name for each image's merge size, where it takes one (VideoLLaMA 3's
        merge_sizes), else None.
      window: (merge size, window size, patch size) as the tower passes them to transformers'
        `get_vision_window_index`, where it attends within windows it finds so (Qwen2.5-VL, EXAONE 4.5,
        Muse: its own attributes, which Muse's merge size of 1 there sets apart from its config's), else None.
        Its windows are then computed here, eagerly, and given as the helper's precomputed kwargs: it
        selects them with a boolean mask over a fresh `arange`, whose values torch.export does not keep.
      mask_input: the forward's name for the mask of the patches an image fills (NaFlex's
        pixel_attention_mask: all of them at the one size, so none is given), where it takes one, else
        None. Such a tower takes a batch of images ([images, patches, ...]) and its grid is [rows,
        columns] an image.
    """

    patches_input: str
    grid_input: str
    patch: int
    temporal: int
    channels: int
    merge: int
    merge_input: str | None = None
    window: tuple[int, int, int] | None = None
    mask_input: str | None = None

    def constants(self, height: int, width: int) -> dict[str, torch.Tensor | None]:
        """The inputs the program fixes for one image of height x width pixels: its grid (and merge
        size, windows; a NaFlex tower no mask: None)."""
        grid = torch.tensor(self.grid(height, width))
        constants = {self.grid_input: grid, **({self.merge_input: torch.tensor([self.merge])} if self.merge_input else {})}
        if self.mask_input:  # every patch is the image's: no mask, which transformers reads as all patches attended and pooled
            constants[self.mask_input] = None
        if self.window:
            from transformers.vision_utils import get_vision_window_index

            constants["window_index"], constants["cu_window_seqlens"] = get_vision_window_index(grid, *self.window)
        return constants

    def grid(self, height: int, width: int) -> list[list[int]]:
        """grid_thw of one image of height x width pixels (NaFlex's spatial_shapes: its rows and columns)."""
        rows, columns = height // self.patch, width // self.patch
        return [[rows, columns]] if self.mask_input else [[1, rows, columns]]

    def layouts(self, height: int, width: int) -> tuple[tuple[int | str, ...], ...]:
        """The shapes an image's patches may take, tried in order: flattened (Qwen's), one patch an
        image ([patches, channels, patch, patch]: Kimi's), or with its frames; a NaFlex tower's, a batch
        of flattened images ["batch", patches, channels x patch x patch]."""
        patches, pixels = (height // self.patch) * (width // self.patch), self.patch * self.patch
        if self.mask_input:
            return (("batch", patches, self.channels * pixels),)
        return ((patches, self.channels * self.temporal * pixels), (patches, self.channels, self.patch, self.patch),
                (patches, self.channels, self.temporal, self.patch, self.patch))

    def image_size(self, config, dims: list[DimSpec]) -> tuple[int, int]:
        """(height, width) in pixels: --dim height=H:H / width=W:W, else the config's image_size, else
        224 rounded to whole merged patches.

        Raises:
          TpuExportError: a size that is not fixed, or not whole merged patches.
        """
        unit = self.patch * self.merge
        recorded = _setting(config, "image_size")
        default = recorded if isinstance(recorded, int) and recorded % unit == 0 else max(unit, round(224 / unit) * unit)
        sizes = {"height": default, "width": default}
        for dim in dims:
            if dim.name == "batch" and self.mask_input:  # a NaFlex tower's images, any range
                continue
            if dim.name not in sizes:
                names = "batch, height, width (images, and one image's pixels)" if self.mask_input else "height, width (one image's pixels)"
                raise TpuExportError(f"--dim {dim.name} is not a dim of this model; its dims are {names}")
            if dim.min != dim.max or dim.min % unit:
                raise TpuExportError(f"--dim {dim.name}={dim.min}:{dim.max}: this vision tower converts at one image size, in whole "
                                     f"merged patches of {unit} pixels; give --dim {dim.name}=N:N with N a multiple of {unit}")
            sizes[dim.name] = dim.min
        return sizes["height"], sizes["width"]


def patch_grid(model: torch.nn.Module) -> PatchGrid | None:
    """How a vision tower over flattened patches and their grid takes an image, or None for any other model."""
    parameters = list(inspect.signature(model.forward).parameters)
    grid_input = next((name for name in GRID_INPUTS if name in parameters), None)
    config = model.config
    patch = _setting(config, "patch_size")
    if not parameters or parameters[0] not in PATCH_INPUTS or grid_input is None or "input_ids" in parameters or not patch:
        return None
    merge = _setting(config, "spatial_merge_size", "merge_kernel_size", "merge_size") or 1
    window = tuple(getattr(model, name, None) for name in ("spatial_merge_size", "window_size", "patch_size"))
    windowed = hasattr(inspect.getmodule(type(model)), "get_vision_window_index") and all(isinstance(size, int) for size in window)
    return PatchGrid(parameters[0], grid_input, _number(patch), _number(_setting(config, "temporal_patch_size", "patch_temporal") or 1),
                     _number(_setting(config, "in_channels", "in_chans", "num_channels") or 3), _number(merge),
                     "merge_sizes" if "merge_sizes" in parameters else None, window if windowed else None,
                     "pixel_attention_mask" if grid_input == "spatial_shapes" and "pixel_attention_mask" in parameters else None)


def _number(value) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def _setting(config, *names):
    """The first of the named fields the config (or its vision_config) records."""
    for source in (config, getattr(config, "vision_config", None)):
        for name in names:
            value = getattr(source, name, None)
            if value is not None:
                return value
    return None


def failure_on(forward: torch.nn.Module, args: tuple) -> str | None:
    """What a tower (`named_forward` with its grid among the constants) raises on these patches, or
    None when it runs, computed on shapes alone (on_cpu_fakes)."""
    try:
        on_cpu_fakes(forward, *args)
    except Exception as error:  # whatever the tower raises on patches it does not take
        return f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
    return None


def on_cpu_fakes(module: torch.nn.Module, *args, method: str = "forward", constants: dict[str, torch.Tensor] | None = None, **kwargs):
    """`module.<method>(*args, **kwargs, **constants)` on shapes alone, with the module's weights as
    fake CPU tensors, those on the meta device too: the constants (made in it from their values, which
    are read: constants_read), and those a forward makes on the CPU (a tower's grid), must meet them
    on one device, since moving a constant to the meta device loses its values. Fake tensors log the
    traceback of an operator that fails on them: a failure here is an answer, not news."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    caller = _MethodCall(module, method)
    tensors = {**dict(caller.named_parameters(remove_duplicate=False)), **dict(caller.named_buffers(remove_duplicate=False))}
    fakes = {name: FakeTensor(mode, tensor, torch.device("cpu")) if tensor.is_meta else mode.from_tensor(tensor)
             for name, tensor in tensors.items()}
    with torch.no_grad(), quiet_loggers(*EXPORT_LOGGERS, level=logging.CRITICAL), constants_read(), mode:
        # Every name of a tied weight has its fake (remove_duplicate=False): no tying to do (it refuses a tie given twice).
        return torch.func.functional_call(caller, fakes, args, {**kwargs, **made_from_numbers(constants or {})}, tie_weights=False)


def made_from_numbers(constants: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """The constants as tensors made from their numbers where this is called (in a forward being
    traced): such tensors' values are what torch.export keeps (constants_read), unlike a tensor's
    passed in or held by a module, which it lifts to an input of unknown value. None stays None."""
    return {name: None if value is None else torch.tensor(value.tolist(), dtype=value.dtype) for name, value in constants.items()}


class _MethodCall(torch.nn.Module):
    """Calls one method of a module as its forward (torch.func.functional_call calls forwards)."""

    def __init__(self, module: torch.nn.Module, method: str):
        super().__init__()
        self.module, self.method = module, method

    def forward(self, *args, **kwargs):
        return getattr(self.module, self.method)(*args, **kwargs)


@contextlib.contextmanager
def constants_read():
    """torch.export (its fake tensors) keeping the values of the tensors a forward computes from
    constants only, up to _CONSTANT_ELEMENTS elements, as it keeps a scalar's: the grid's rows, the
    attention boundaries a tower computes from them, are then numbers while tracing, and the sizes
    computed from them too. Fake tensors keep one element's value only (torch's CONSTANT_NUMEL_LIMIT,
    which no option sets); restored on exit. A range of known numbers (`torch.arange(n)`) is made from
    them (_RangesFromNumbers): a fake `arange` keeps no values, and a boolean mask comparing it with a
    grid's numbers (LFM2-VL's tokens of each image) would select an unknown count."""
    from torch._subclasses import fake_tensor

    kept = getattr(fake_tensor, "CONSTANT_NUMEL_LIMIT", None)
    if kept is None:  # a torch without it: the grid's values stay unknown, and the tower is refused as sizing tensors by values
        yield
        return
    fake_tensor.CONSTANT_NUMEL_LIMIT = max(kept, _CONSTANT_ELEMENTS)
    try:
        with _RangesFromNumbers():
            yield
    finally:
        fake_tensor.CONSTANT_NUMEL_LIMIT = kept


class _RangesFromNumbers(TorchFunctionMode):
    """`torch.arange` of Python ints as a tensor made from its numbers (on the CPU: a constant moved to
    the meta device loses its values), up to _CONSTANT_ELEMENTS of them; any other call as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.arange and args and all(type(arg) is int for arg in args) and len(range(*args)) <= _CONSTANT_ELEMENTS \
                and set(kwargs) <= {"dtype", "device"}:
            return torch.tensor(list(range(*args)), dtype=kwargs.get("dtype") or torch.int64)
        return func(*args, **kwargs)
