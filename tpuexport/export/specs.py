"""Command-line dim and input specs: `--dim batch=1:64` and `--input x:batch,3,224,224:float32`.

Grammar (also in docs/cli.md):
  --dim   NAME=MIN:MAX            a symbolic dim with its inclusive range, 1 <= MIN <= MAX
  --input NAME:D0,D1,...[:DTYPE]  one model input; each Di is an integer or a --dim name;
                                  DTYPE is a torch dtype name (float32 by default)
Inputs are passed to the model positionally, in the order given.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from tpuexport.errors import TpuExportError

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}


@dataclasses.dataclass(frozen=True)
class DimSpec:
    """A named symbolic dim: sizes MIN..MAX (inclusive) are accepted by the artifact."""

    name: str
    min: int
    max: int

    @property
    def example(self) -> int:
        # torch.export specializes dims whose example size is 0 or 1, so trace with at least 2.
        return min(max(self.min, 2), self.max)


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One model input: its name, its dims (ints or DimSpec names) and its torch dtype."""

    name: str
    dims: tuple[int | str, ...]
    dtype: torch.dtype


def parse_dim(text: str) -> DimSpec:
    """Parses `NAME=MIN:MAX`.

    Args:
      text: the --dim value.
    Returns:
      The DimSpec.
    Raises:
      TpuExportError: the text does not follow the grammar or the range is empty.
    """
    match = re.fullmatch(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not match:
        raise TpuExportError(f"malformed --dim {text!r}: expected NAME=MIN:MAX, e.g. --dim batch=1:64")
    name, low, high = match.group(1), int(match.group(2)), int(match.group(3))
    if not 1 <= low <= high:
        raise TpuExportError(f"--dim {text!r} has an empty range: need 1 <= MIN <= MAX, e.g. --dim {name}=1:64")
    return DimSpec(name, low, high)


def parse_input(text: str, dims: dict[str, DimSpec]) -> InputSpec:
    """Parses `NAME:D0,D1,...[:DTYPE]`.

    Args:
      text: the --input value.
      dims: the --dim specs by name; every non-integer Di must be one of them.
    Returns:
      The InputSpec.
    Raises:
      TpuExportError: malformed text, unknown dim name or unknown dtype.
    """
    parts = text.split(":")
    if len(parts) not in (2, 3) or not _IDENTIFIER.match(parts[0].strip()):
        raise TpuExportError(
            f"malformed --input {text!r}: expected NAME:D0,D1,...[:DTYPE], e.g. --input x:batch,3,32,32:float32"
        )
    name = parts[0].strip()
    dtype_name = parts[2].strip() if len(parts) == 3 else "float32"
    if dtype_name not in _DTYPES:
        raise TpuExportError(f"--input {name}: unknown dtype {dtype_name!r}; use one of {', '.join(_DTYPES)}")
    shape: list[int | str] = []
    for raw in parts[1].split(","):
        item = raw.strip()
        if item.isdigit():
            shape.append(int(item))
        elif item in dims:
            shape.append(item)
        else:
            raise TpuExportError(
                f"--input {name}: dim {item!r} is neither an integer nor a --dim name; add --dim {item}=MIN:MAX"
                if _IDENTIFIER.match(item)
                else f"malformed --input {text!r}: dim {item!r} must be an integer or a --dim name"
            )
    return InputSpec(name, tuple(shape), _DTYPES[dtype_name])


def example_args(inputs: list[InputSpec], dims: list[DimSpec]):
    """Builds example arguments and torch.export dynamic_shapes from command-line specs.

    Args:
      inputs: the input specs, in the model's positional order.
      dims: the dim specs they refer to.
    Returns:
      (args, dynamic_shapes): a tuple of example tensors and a matching tuple of
      {axis: torch.export.Dim} dicts, the form torch.export.export takes.
    """
    by_name = {d.name: d for d in dims}
    torch_dims = {d.name: torch.export.Dim(d.name, min=d.min, max=d.max) for d in dims}
    generator = torch.Generator().manual_seed(0)
    args, dynamic_shapes = [], []
    for spec in inputs:
        shape = [by_name[d].example if isinstance(d, str) else d for d in spec.dims]
        if spec.dtype.is_floating_point:
            tensor = torch.randn(shape, generator=generator).to(spec.dtype)
        elif spec.dtype == torch.bool:
            tensor = torch.randint(0, 2, shape, generator=generator).bool()
        else:
            tensor = torch.randint(0, 10, shape, generator=generator).to(spec.dtype)
        args.append(tensor)
        dynamic_shapes.append({axis: torch_dims[d] for axis, d in enumerate(spec.dims) if isinstance(d, str)} or None)
    return tuple(args), tuple(dynamic_shapes)
