"""Shape buckets: the concrete sizes of the symbolic dims that get their own TPU executable.

`--bucket batch=1,8,32 --bucket seq=128,512` compiles the cartesian product (6 buckets); dims
without a --bucket keep their example size. With no --bucket at all, the one bucket is the
example shapes.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

from tpuexport.errors import TpuExportError
from tpuexport.signature import ProgramSignature


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Concrete sizes for every symbolic dim.

    Attributes:
      sizes: (dim name, size) pairs in signature order.
    """

    sizes: tuple[tuple[str, int], ...]

    @property
    def name(self) -> str:
        """A file-name-safe label, e.g. "batch8_seq128" ("static" for programs with no dims)."""
        return "_".join(f"{name}{size}" for name, size in self.sizes) or "static"

    def as_dict(self) -> dict[str, int]:
        return dict(self.sizes)


def parse_bucket_options(options) -> dict[str, list[int]]:
    """Parses --bucket values `NAME=S1,S2,...` into {name: sizes}.

    Raises:
      TpuExportError: malformed text or a dim given twice.
    """
    parsed: dict[str, list[int]] = {}
    for text in options or ():
        match = re.fullmatch(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\d+(?:\s*,\s*\d+)*)\s*", text)
        if not match:
            raise TpuExportError(f"malformed --bucket {text!r}: expected NAME=S1,S2,..., e.g. --bucket batch=1,8,32")
        if match.group(1) in parsed:
            raise TpuExportError(f"--bucket {match.group(1)} is given twice; list all its sizes in one --bucket")
        parsed[match.group(1)] = sorted({int(s) for s in match.group(2).split(",")})
    return parsed


def make_buckets(signature: ProgramSignature, requested: dict[str, list[int]] | None) -> list[Bucket]:
    """Expands requested sizes into buckets, checking names and ranges.

    Args:
      signature: the program's signature (dims with ranges and example sizes).
      requested: {dim name: sizes} or None for the example shapes.
    Returns:
      The buckets, in a stable order.
    Raises:
      TpuExportError: an unknown dim or a size outside its range.
    """
    requested = requested or {}
    known = {dim.name: dim for dim in signature.dims}
    for name, sizes in requested.items():
        dim = known.get(name)
        if dim is None:
            dims = ", ".join(known) or "none (the program is static)"
            raise TpuExportError(f"--bucket names unknown dim {name!r}; the program's dims are: {dims}")
        for size in sizes:
            if not dim.accepts(size):
                raise TpuExportError(f"bucket {name}={size} is out of range: {name} accepts {dim.range_text}")
    choices = [requested.get(dim.name, [dim.example]) for dim in signature.dims]
    names = [dim.name for dim in signature.dims]
    return [Bucket(tuple(zip(names, combo))) for combo in itertools.product(*choices)]
