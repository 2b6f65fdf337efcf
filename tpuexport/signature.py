"""The program's interface as every stage sees it: named inputs, outputs and symbolic dims.

Shapes are tuples whose entries are ints or dim expressions over the dim names ("batch",
"2*seq"); the names are the user's (from torch.export.Dim) so that manifests, MLIR and
reports speak of `batch`, not `s77`.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np
import sympy

# JAX runs with 32-bit defaults, like the TPU: 64-bit model inputs become 32-bit in the artifact.
_ARTIFACT_DTYPES = {"int64": "int32", "float64": "float32", "uint64": "uint32"}


def artifact_dtype(torch_dtype_name: str) -> str:
    """The dtype the artifact uses for a tensor the model declares as `torch_dtype_name`."""
    return _ARTIFACT_DTYPES.get(torch_dtype_name, torch_dtype_name)


@dataclasses.dataclass(frozen=True)
class SymbolicDim:
    """One symbolic dim shared by every tensor that uses it.

    Attributes:
      name: the user's name for it (a Python identifier).
      min: smallest accepted size.
      max: largest accepted size, or None when torch.export left it unbounded.
      example: the size it had in the example inputs.
    """

    name: str
    min: int
    max: int | None
    example: int

    @property
    def range_text(self) -> str:
        """The accepted sizes as "MIN..MAX" ("MIN..inf" when unbounded)."""
        return f"{self.min}..{self.max if self.max is not None else 'inf'}"

    def accepts(self, size: int) -> bool:
        return self.min <= size and (self.max is None or size <= self.max)


@dataclasses.dataclass(frozen=True)
class Placeholder:
    """Tokens a multimodal model replaces by the features of one image, clip or audio clip.

    Attributes:
      token: the token id (the config's image_token_id, video_token_id, audio_token_id, ...).
      count: how many of it each row of the token input holds: the features one item of `media`
        makes, a number the program cannot check (it depends on the tokens' values).
      media: the input whose features they stand for ("pixel_values", "input_features", ...).
    """

    token: int
    count: int
    media: str


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One input or output tensor.

    Attributes:
      name: forward parameter name for inputs; dict key or output_<i> for outputs.
      shape: ints and dim expressions over SymbolicDim names.
      dtype: dtype inside the artifact (numpy name, e.g. "float32", "int32", "bool").
      torch_dtype: dtype the PyTorch model uses (e.g. "int64"); outputs are returned in it.
      placeholders: a multimodal model's token input: the media tokens each of its rows holds.
    """

    name: str
    shape: tuple[int | str, ...]
    dtype: str
    torch_dtype: str
    placeholders: tuple[Placeholder, ...] = ()

    def concrete_shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        """The shape at the given dim sizes (every dim this tensor uses must be in `sizes`)."""
        return tuple(d if isinstance(d, int) else evaluate_dim(d, sizes) for d in self.shape)


# The functions of sizes torch's (Min, FloorDiv, ...) and JAX's (min, floordiv, ...) dim expressions call.
_SIZE_FUNCTIONS = {"Min": sympy.Min, "Max": sympy.Max, "min": sympy.Min, "max": sympy.Max, "Mod": sympy.Mod, "mod": sympy.Mod,
                   "FloorDiv": lambda a, b: sympy.floor(a / b), "floordiv": lambda a, b: sympy.floor(a / b)}


@functools.lru_cache(maxsize=None)
def parse_dim_expression(expression: str) -> sympy.Expr:
    """A dim expression ("2*seq + 1") as a sympy expression whose every name is a plain symbol.

    Plain `sympy.sympify` reads some names as its own functions and constants (`sequence`, `beta`,
    `gamma`, `N`, `E`, `I`, ...), so a dim of that name would not be a symbol. A name called is a
    function: torch's and JAX's min, max, floor division and modulo of sizes (a block loop's
    `Min(256, seq)`, MiniMax's lightning attention).
    """
    names = {name: sympy.Symbol(name) for name in re.findall(r"\b([A-Za-z_]\w*)\b(?!\s*\()", expression)}
    return sympy.sympify(expression, locals={**_SIZE_FUNCTIONS, **names})


def evaluate_dim(expression: str, sizes: dict[str, int]) -> int:
    """Evaluates a dim expression such as "2*seq" at concrete sizes."""
    parsed = parse_dim_expression(expression)
    return int(parsed.subs({sympy.Symbol(name): value for name, value in sizes.items()}))


@dataclasses.dataclass(frozen=True)
class ProgramSignature:
    """Everything about a program's interface that outlives the torch objects.

    Attributes:
      inputs: the flat user inputs, in call order.
      outputs: the flat outputs, in order.
      dims: the symbolic dims the shapes refer to.
      output_tree: torch pytree spec (JSON, torch.utils._pytree.treespec_dumps) that rebuilds
        the model's output structure (dict, tuple, single tensor) from the flat outputs.
    """

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    dims: tuple[SymbolicDim, ...]
    output_tree: str

    def dim(self, name: str) -> SymbolicDim:
        return next(d for d in self.dims if d.name == name)

    def sizes_of(self, shapes: list[tuple[int, ...]]) -> dict[str, int]:
        """Reads the dim sizes from concrete input shapes and checks them against the signature.

        Args:
          shapes: one shape per input, in signature order.
        Returns:
          {dim name: size}.
        Raises:
          ValueError: one line naming the input, axis and dim that do not fit (rank, a fixed
            size, two inputs disagreeing on a shared dim, a derived dim, or a range).
        """
        sizes: dict[str, int] = {}
        names = {d.name for d in self.dims}
        for spec, shape in zip(self.inputs, shapes):
            if len(shape) != len(spec.shape):
                raise ValueError(f"input {spec.name!r} has rank {len(shape)}, expected {len(spec.shape)} {list(spec.shape)}")
            for axis, (declared, actual) in enumerate(zip(spec.shape, shape)):
                if declared in names:
                    if sizes.setdefault(declared, actual) != actual:
                        raise ValueError(
                            f"input {spec.name!r} axis {axis} is {actual} but {declared} is {sizes[declared]} in another input"
                        )
        # A dim that no axis holds alone is solved from one holding a multiple of it ("4*h").
        for spec, shape in zip(self.inputs, shapes):
            for axis, (declared, actual) in enumerate(zip(spec.shape, shape)):
                if isinstance(declared, int) or declared in names:
                    continue
                symbols = parse_dim_expression(declared).free_symbols
                if len(symbols) != 1 or str(next(iter(symbols))) in sizes:
                    continue
                (symbol,) = symbols
                solutions = sympy.solve(parse_dim_expression(declared) - actual, symbol)
                if len(solutions) != 1 or not solutions[0].is_integer:
                    raise ValueError(f"input {spec.name!r} axis {axis} is {actual}, which is not {declared} for any whole {symbol}")
                sizes[str(symbol)] = int(solutions[0])
        for dim in self.dims:
            size = sizes.get(dim.name)
            if size is not None and not dim.accepts(size):
                raise ValueError(f"{dim.name}={size} is out of range: {dim.name} accepts {dim.range_text}")
        for spec, shape in zip(self.inputs, shapes):
            for axis, (declared, actual) in enumerate(zip(spec.shape, shape)):
                expected = declared if isinstance(declared, int) else evaluate_dim(declared, sizes)
                if expected != actual:
                    raise ValueError(f"input {spec.name!r} axis {axis} is {actual}, expected {declared} = {expected}")
        return sizes

    def batch_dim(self) -> str | None:
        """The dim requests can be batched and padded along, or None.

        Returns:
          The name of the symbolic dim that is dim 0 of the first input, when it is also dim 0 of
          every input and output; else None (static shapes, or no shared leading dim).
        """
        tensors = (*self.inputs, *self.outputs)
        if not self.inputs or not all(spec.shape for spec in tensors):
            return None
        leading = self.inputs[0].shape[0]
        if leading not in {dim.name for dim in self.dims}:
            return None
        return leading if all(spec.shape[0] == leading for spec in tensors) else None

    def placeholder_error(self, arrays) -> str | None:
        """Why the token rows among `arrays` (the inputs' values, in order) do not hold the placeholder
        tokens their input must (TensorSpec.placeholders), in one line naming the first such row; None
        when they do. The program cannot check it (a multimodal model checks it from the tokens'
        values, which XLA cannot raise on), and a row that broke it would be given another row's media
        features, or none."""
        for spec, array in zip(self.inputs, arrays):
            for placeholder in spec.placeholders:
                found = (np.asarray(array) == placeholder.token).sum(axis=-1).reshape(-1)
                wrong = np.flatnonzero(found != placeholder.count)
                if wrong.size:
                    return (f"{spec.name} row {wrong[0]} holds {found[wrong[0]]} placeholder tokens {placeholder.token} (where "
                            f"{placeholder.media}'s features go); the model takes exactly {placeholder.count} per row, as its "
                            "processor writes them")
        return None

    def example_sizes(self) -> dict[str, int]:
        return {d.name: d.example for d in self.dims}

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        for entry in (*data["inputs"], *data["outputs"]):
            if not entry["placeholders"]:
                del entry["placeholders"]  # only a multimodal model's token input has them
        return data

    @classmethod
    def from_json(cls, data: dict) -> "ProgramSignature":
        def tensor(entry):
            placeholders = tuple(Placeholder(**placeholder) for placeholder in entry.get("placeholders", ()))
            return TensorSpec(entry["name"], tuple(entry["shape"]), entry["dtype"], entry["torch_dtype"], placeholders)

        return cls(
            inputs=tuple(tensor(t) for t in data["inputs"]),
            outputs=tuple(tensor(t) for t in data["outputs"]),
            dims=tuple(SymbolicDim(**d) for d in data["dims"]),
            output_tree=data["output_tree"],
        )
