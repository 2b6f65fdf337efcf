"""Weight-only int8 and int4: which weights, how they are rounded and stored, and the reference.

No PT2E: the program is exported and lowered from the float model, and at lowering the weights
chosen here become arguments of the program in their integer form (lower/quantized_weights.py
multiplies by them without a dequantized copy). Quantizing is a function of one tensor, so a
checkpoint's weights are quantized one at a time as they stream into the artifact.

Schemes (symmetric: zero point 0, the same range on both sides of zero):
  int8-weight-only  int8 in [-127, 127], one bfloat16 scale per output channel (max|w| / 127 over
                    the contraction dim)
  int4-weight-only  int4 in [-7, 7], one bfloat16 scale per `group_size` consecutive elements of
                    the contraction dim (max|w| / 7 over the group); convolution weights one per
                    output channel (below)
Each scale is rounded to bfloat16 before the weights are divided by it, so the integers are chosen
for the scale the program multiplies by (no per-channel bias from rounding the scale afterwards).

Which weights: every 2-D float weight that only matrix products read as their right-hand side
(nn.Linear, GPT-2's Conv1D, an lm_head) or that only embedding lookups read (token and position
tables, grouped along a row), or both with the same contraction axis (an embedding tied to the
lm_head); every 3-D float weight that only grouped matmuls read as their right-hand side,
transposed or not (mixture-of-experts layers: [experts, out, in] in transformers), stored int8 per
output channel in both modes (`scheme_for`: XLA's TPU compiler refuses s4 ragged_dot operands, and
int4's groups along the contraction dim could not be scaled after the grouped product); and every
float weight of 3 or more dims that only (not transposed) convolutions read as their weight
(conv1d/2d/3d [out, in/groups, *kernel], grouped and depthwise too), or that is the direction v of
a weight-normed convolution (read only by its norm and by v x g / norm, which only convolutions
read: wav2vec2's positional convolution; g stays float; the program computes the weight from the
dequantized v, a float copy as the float program makes from v). A convolution weight has one scale per
output channel in both modes, so the scale multiplies the convolution's result (an int4 group
along the contraction would not commute with it: the weight would be dequantized before the
convolution, which XLA:TPU materializes; benchmarks/studies/weight_only_convolutions.py); one whose
contraction (in/groups x kernel) has an odd number of elements is stored int8 in an int4
conversion (INT8_ODD_CONVOLUTION_REASON). `keep_float` (a regex over state_dict names) keeps
matching weights float. Others (norms, biases, transposed convolutions) stay float.

Storage (the artifact's safetensors): the weight's own name holds the integers in the weight's
layout, `<name>_scale` its scales (the weight's shape with the contraction axis divided by the group
size; per output channel int8: 1 there). A convolution weight is stored as its [out, in/groups x
kernel] matrix (`matrix_shape`: contraction axis -1, scales [out, 1]); its manifest entry gives the
kernel's shape (`kernel_shape`) and its contraction axes as `axis`. int4 is packed two values per
byte along the last axis: element 2i in the low nibble, element 2i+1 in the high nibble, each a
two's-complement 4-bit integer (the order of XLA's bitcast from u8 to s4), stored as U8 with the
last dim halved.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable, Iterator, Mapping, Sequence

import torch

from tpuexport.errors import TpuExportError

MODES = ("int8-weight-only", "int4-weight-only")
DEFAULT_GROUP_SIZE = 128
# Rows quantized at once: the rounding's f32 temporaries stay a few times this many rows, not a few
# times the weight (a 128256-row embedding in f32 is 2 GB).
ROWS_AT_ONCE = 4096
INT4_PACKING = ("two int4 per byte along the last axis: element 2i in the low nibble, element 2i+1 in the high nibble "
                "(two's complement)")

_aten = torch.ops.aten
_TRANSPOSES = (_aten.t.default, _aten.permute.default, _aten.transpose.int)
# Matrix products and the argument that is their right-hand side.
_RIGHT_HAND_SIDE = {_aten.mm.default: 1, _aten.bmm.default: 1, _aten.addmm.default: 2}
# Grouped matmuls (mixture-of-experts layers: rows times their expert's matrix, [experts, k, n] argument 1),
# torch's and transformers' stand-in for it (by name: it exists once transformers is imported).
_GROUPED_MATMULS = (_aten._grouped_mm.default,)
_GROUPED_MATMUL_NAMES = ("transformers::grouped_mm_fallback",)
_CONVOLUTION = _aten.convolution.default
# A weight's contraction: a matrix's axis (-1 or -2), or a convolution weight's axes (all but the
# output channels' first, e.g. (-3, -2, -1) for conv2d's [out, in/groups, kh, kw]), from the end.
Axis = int | tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class WeightOnlyScheme:
    """How weights are quantized.

    Attributes:
      mode: one of MODES.
      group_size: int4's elements per scale along the contraction dim (int8 has one scale per
        output channel).
      keep_float: a regex over state_dict names: matching weights stay float; None quantizes all
        weights that can be.
    """

    mode: str
    group_size: int = DEFAULT_GROUP_SIZE
    keep_float: str | None = None

    @property
    def bits(self) -> int:
        return 4 if self.mode == "int4-weight-only" else 8

    @property
    def largest(self) -> int:
        """The largest integer magnitude: 127 for int8, 7 for int4."""
        return 2 ** (self.bits - 1) - 1

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def group(self, size: int) -> int:
        """The group size along a contraction dim of `size` elements."""
        return self.group_size if self.bits == 4 else size

    def describe(self) -> str:
        if self.bits == 8:
            return "int8 symmetric weights [-127, 127], one bfloat16 scale per output channel; float compute"
        return (f"int4 symmetric weights [-7, 7] in groups of {self.group_size} along the contraction dim, one bfloat16 "
                f"scale per group (convolution weights: one per output channel); {INT4_PACKING}; float compute")


# Why a grouped matmul's weight is int8 in an int4 conversion (the manifest's entry for it says so).
INT8_GROUPED_MATMUL_REASON = ("a grouped matmul's (ragged_dot) weight: stored int8 per output channel, as XLA's TPU compiler does not "
                              "compile s4 ragged_dot operands (libtpu 0.0.42.1: 'Unsupported element type: S4')")


# Why a convolution's weight is int8 in an int4 conversion.
INT8_ODD_CONVOLUTION_REASON = ("a convolution weight whose contraction (in_channels/groups x kernel) has an odd number of elements: "
                               "stored int8 per output channel, as int4 packs two per byte along it")


def scheme_for(scheme: WeightOnlyScheme, shape: Sequence[int], axis: Axis) -> WeightOnlyScheme:
    """The scheme a chosen weight (one block's, of `shape`) is stored in.

    Returns:
      For a 3-D weight with a matrix axis (a grouped matmul's: quantizable_weights chooses no
      other), int8 per output channel whatever the mode (INT8_GROUPED_MATMUL_REASON); for a
      convolution weight, one scale per output channel in both modes (it multiplies the
      convolution's result), int8 when int4 cannot pack its contraction (INT8_ODD_CONVOLUTION_REASON);
      for any other, the conversion's scheme.
    """
    axis = as_axis(axis)
    if scheme.bits == 8:
        return scheme
    if isinstance(axis, int):
        return dataclasses.replace(scheme, mode="int8-weight-only") if len(shape) == 3 else scheme
    size = contraction_size(shape, axis)
    return dataclasses.replace(scheme, mode="int8-weight-only") if size % 2 else dataclasses.replace(scheme, group_size=size)


def int8_reason(scheme: WeightOnlyScheme, shape: Sequence[int], axis: Axis) -> str | None:
    """Why a chosen weight (one block's, of `shape`) is stored int8 in an int4 conversion, or None."""
    if scheme.bits == 8 or scheme_for(scheme, shape, axis).bits == 4:
        return None
    return INT8_GROUPED_MATMUL_REASON if isinstance(as_axis(axis), int) else INT8_ODD_CONVOLUTION_REASON


def as_axis(axis) -> Axis:
    """An Axis from its manifest form (a JSON list for a convolution weight's axes)."""
    return axis if isinstance(axis, int) else tuple(axis)


def convolution_axes(rank: int) -> tuple[int, ...]:
    """The contraction axes of a convolution weight of this rank: all but the output channels'."""
    return tuple(range(1 - rank, 0))


def contraction_size(shape: Sequence[int], axis: Axis) -> int:
    """How many elements one output of the weight contracts over (one scale group at most)."""
    axis = as_axis(axis)
    return shape[axis] if isinstance(axis, int) else math.prod(shape[len(shape) + axis[0]:])


def matrix_shape(shape: Sequence[int], axis: Axis) -> tuple[tuple[int, ...], int]:
    """The shape a weight is quantized and stored in, and its contraction axis there: a convolution
    weight as its [out, in/groups x kernel] matrix (leading stack dims kept), axis -1; others as
    they are."""
    axis = as_axis(axis)
    if isinstance(axis, int):
        return tuple(shape), axis
    return (*shape[:len(shape) + axis[0]], contraction_size(shape, axis)), -1


def check_scheme(mode: str, group_size: int) -> WeightOnlyScheme:
    """The scheme of a mode and --group-size, checked.

    Raises:
      TpuExportError: an unknown mode or a group size that is not a positive even number.
    """
    if mode not in MODES:
        raise TpuExportError(f"unknown weight-only quantization {mode!r}; use one of {', '.join(MODES)}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0 or group_size % 2:
        raise TpuExportError(f"--group-size {group_size!r} is not a positive even number; give one that divides the weights' "
                             f"contraction dims, e.g. {DEFAULT_GROUP_SIZE}")
    return WeightOnlyScheme(mode, group_size)


def quantizable_weights(program: torch.export.ExportedProgram, scheme: WeightOnlyScheme,
                        tied: Mapping[str, str]) -> dict[str, int]:
    """The weights to quantize and the axis each is grouped along (its contraction axis).

    Args:
      program: the decomposed program.
      scheme: the scheme (its keep_float regex, its group size).
      tied: {placeholder name: the weight it reads} for tied weights (lowering.tied_weights).
    Returns:
      {state_dict name: contraction axis as a negative index (-1 for nn.Linear's (out, in),
      -2 for a Conv1D's (in, out) and for stacking), or a convolution weight's contraction axes
      (convolution_axes)}, for every weight quantized; a tied weight is listed under the name the
      program stores it under. An int4 lookup table that only embedding lookups read and whose
      rows the group size does not divide stays float.
    Raises:
      TpuExportError: a quantized weight's contraction dim is not divisible by the group size, or
        an int4 weight's last dim is odd (it cannot be packed).
    """
    names = {spec.arg.name: spec.target for spec in program.graph_signature.input_specs
             if spec.kind != torch.export.graph_signature.InputKind.USER_INPUT}
    axes: dict[str, set] = {}
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in names or not node.users:
            continue  # a tied weight's other name may be read by no op (export routes every use through one)
        value = node.meta.get("val")
        name = names[node.name]
        stored = tied.get(name, name)
        floating = isinstance(value, torch.Tensor) and value.dtype.is_floating_point
        usable = floating and value.dim() in (2, 3)
        uses = {_contraction_axis(user, node, False) for user in node.users} if usable else {None}
        if usable and value.dim() == 3 and not all(_grouped_matmul_reads(user, node) for user in node.users):
            uses = {None}  # a 3-D weight is quantized for grouped matmuls and convolutions only
        if floating and value.dim() >= 3 and (all(_convolution_reads(user, node) for user in node.users)
                                              or _weight_norm_direction(node)):
            uses = {convolution_axes(value.dim())}
        if scheme.keep_float and (re.search(scheme.keep_float, name) or re.search(scheme.keep_float, stored)):
            uses = {None}
        axes.setdefault(stored, set()).update(uses)
    chosen = {name: found.pop() for name, found in axes.items() if len(found) == 1 and None not in found}
    shapes = {names[node.name]: tuple(node.meta["val"].shape) for node in program.graph.nodes if node.name in names}
    if scheme.bits == 4:
        # A lookup table whose rows are shorter than a group (T5's relative position bias: one
        # value per head) saves nothing worth a refusal: it stays float. A matmul weight is refused.
        readers: dict[str, set] = {}
        for node in program.graph.nodes:
            if node.op == "placeholder" and node.name in names:
                readers.setdefault(tied.get(names[node.name], names[node.name]), set()).update(user.target for user in node.users)
        chosen = {name: axis for name, axis in chosen.items()
                  if readers[name] != {_aten.embedding.default} or shapes[name][axis] % scheme.group_size == 0}
    for name, axis in chosen.items():
        if not isinstance(axis, int):
            continue  # a convolution weight: one scale per output channel (scheme_for), whatever its size
        size = shapes[name][axis]
        if scheme_for(scheme, shapes[name], axis).bits == 4 and size % scheme.group_size:
            raise TpuExportError(f"--group-size {scheme.group_size} does not divide weight {name!r}'s contraction dim ({size} of "
                                 f"shape {list(shapes[name])}); give a group size that divides every quantized weight's, "
                                 f"or keep it float with --keep-float")
        if scheme_for(scheme, shapes[name], axis).bits == 4 and shapes[name][-1] % 2:
            raise TpuExportError(f"int4 weight {name!r} of shape {list(shapes[name])} has an odd last dim and cannot be packed two "
                                 "per byte; keep it float with --keep-float")
    return chosen


def _contraction_axis(node: torch.fx.Node, value: torch.fx.Node, transposed: bool) -> int | None:
    """The stored weight's contraction axis (-1 or -2) as `node` uses `value` (the weight, maybe
    transposed, broadcast over leading dims or viewed as itself), or None for another use."""
    shape = tuple(value.meta["val"].shape)
    if node.target in _TRANSPOSES and node.args[0] is value and _swaps_last_two(node, len(shape)):
        following = {_contraction_axis(user, node, not transposed) for user in node.users}
        return following.pop() if len(following) == 1 else None
    if node.target in (_aten.expand.default, _aten.view.default) and node.args[0] is value:
        result = tuple(node.meta["val"].shape)
        if result[-2:] != shape[-2:] or len(shape) > 2 and result != shape:
            return None
        following = {_contraction_axis(user, node, transposed) for user in node.users}
        return following.pop() if len(following) == 1 else None
    index = 1 if is_grouped_matmul(node.target) else _RIGHT_HAND_SIDE.get(node.target)
    if index is not None and len(node.args) > index and node.args[index] is value and value not in node.args[:index]:
        # The right-hand side (k, n) contracts its first axis: the stored weight's last when transposed.
        return -1 if transposed else -2
    if node.target is _aten.embedding.default and node.args[0] is value and not transposed and value not in node.args[1:]:
        return -1  # rows are gathered: grouped along a row, as the lm_head it may be tied to contracts it
    return None


def _swaps_last_two(node: torch.fx.Node, rank: int) -> bool:
    if rank not in (2, 3):
        return False
    if node.target is _aten.permute.default:
        return [dim % rank for dim in node.args[1]] == [*range(rank - 2), rank - 1, rank - 2]
    if node.target is _aten.transpose.int:
        return sorted(dim % rank for dim in node.args[1:3]) == [rank - 2, rank - 1]
    return rank == 2


def is_grouped_matmul(target) -> bool:
    """Whether an op is a grouped matmul (torch._grouped_mm, transformers' stand-in for it)."""
    return target in _GROUPED_MATMULS or (getattr(target, "_overloadname", None) == "default"
                                          and getattr(target, "_name", None) in _GROUPED_MATMUL_NAMES)


def _grouped_matmul_reads(node: torch.fx.Node, value: torch.fx.Node) -> bool:
    """Whether `node` reads `value` as a grouped matmul's right-hand side, directly or through a
    transpose of its last two axes."""
    if node.target in _TRANSPOSES and node.args[0] is value and _swaps_last_two(node, 3):
        return bool(node.users) and all(_grouped_matmul_reads(user, node) for user in node.users)
    return is_grouped_matmul(node.target) and len(node.args) > 1 and node.args[1] is value and value not in (node.args[0], *node.args[2:])


def _convolution_reads(node: torch.fx.Node, value: torch.fx.Node) -> bool:
    """Whether `node` is a (not transposed) convolution reading `value` as its weight only: the
    output channels are then the weight's first axis, so a scale per output channel multiplies
    the convolution's result."""
    return (node.target is _CONVOLUTION and len(node.args) > 6 and node.args[1] is value and not node.args[6]
            and value is not node.args[0] and value is not node.args[2])


def _weight_norm_direction(value: torch.fx.Node) -> bool:
    """Whether `value` is the direction `v` of a weight-normed convolution (torch's weight_norm,
    wav2vec2's positional convolution): read by the norm of it and by one product, v x g / norm,
    that only convolutions read as their weight. Quantized per output channel like a convolution
    weight; the program computes the convolution's weight from the dequantized v as the float
    program does from v (a float weight the size of v each call). torch 2.15 decomposes the norm
    into v ** 2 summed, then ** 0.5; earlier torch into linalg_vector_norm(v)."""
    norms = [user for user in value.users if user.args[0] is value and (
        user.target is _aten.linalg_vector_norm.default or (user.target is _aten.pow.Tensor_Scalar and user.args[1] == 2))]
    products = [user for user in value.users if user.target is _aten.mul.Tensor and value in user.args[:2]]
    return (len(value.users) == 2 and len(norms) == 1 and len(products) == 1 and bool(products[0].users)
            and all(_convolution_reads(user, products[0]) for user in products[0].users))


def quantize_tensor(tensor: torch.Tensor, scheme: WeightOnlyScheme, axis: Axis) -> tuple[torch.Tensor, torch.Tensor]:
    """Rounds one weight (or a stack of them) to the scheme's integers.

    Args:
      tensor: the float weight; leading dims beyond the last two (a convolution weight's: beyond
        its own rank) are a stack of blocks.
      scheme: the scheme (scheme_for's, for this weight).
      axis: the contraction axis (-1 or -2), or a convolution weight's axes.
    Returns:
      (integers as int8 in the weight's shape (a convolution weight's: its matrix_shape), scales
      in the scheme's scale dtype: that shape with the contraction axis divided by the group size).
    """
    shape, axis = matrix_shape(tensor.shape, axis)
    tensor = tensor.reshape(shape)
    if tensor.dim() + axis != 0 and tensor.shape[0] > ROWS_AT_ONCE:
        parts = [quantize_tensor(rows, scheme, axis) for rows in tensor.split(ROWS_AT_ONCE)]
        return torch.cat([integers for integers, _ in parts]), torch.cat([scale for _, scale in parts])
    weights = tensor.detach().to(torch.float32)
    grouped, scale_shape = _grouped(weights, scheme, axis)
    largest = grouped.abs().amax(dim=axis, keepdim=True)
    scale = torch.where(largest > 0, largest / scheme.largest, torch.ones_like(largest)).to(scheme.scale_dtype)
    integers = torch.round(grouped / scale.to(torch.float32)).clamp(-scheme.largest, scheme.largest).to(torch.int8)
    return integers.reshape(weights.shape), scale.reshape(scale_shape)


def dequantize_tensor(integers: torch.Tensor, scale: torch.Tensor, scheme: WeightOnlyScheme, axis: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """integers x scale per group, multiplied in the wider of the scale's dtype and `dtype` and
    rounded once to `dtype` (as the program computes it).

    Returns:
      The dequantized weight in `dtype`.
    """
    product_dtype = torch.promote_types(scale.dtype, dtype)
    grouped, _ = _grouped(integers.to(product_dtype), scheme, axis)
    return (grouped * scale.to(product_dtype).unsqueeze(axis)).reshape(integers.shape).to(dtype)


def _grouped(tensor: torch.Tensor, scheme: WeightOnlyScheme, axis: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """`tensor` with `axis` split into (groups, group size), the group size last of the two (so the
    group is `axis` of the result, counted from the end), and the scales' shape."""
    shape = list(tensor.shape)
    size = shape[axis]
    group = scheme.group(size)
    position = len(shape) + axis
    grouped_shape = shape[:position] + [size // group, group] + shape[position + 1:]
    scale_shape = shape[:position] + [size // group] + shape[position + 1:]
    return tensor.reshape(grouped_shape), tuple(scale_shape)


def pack_int4(integers: torch.Tensor) -> torch.Tensor:
    """int4 values (int8 in [-8, 7]) packed two per byte along the last axis (INT4_PACKING)."""
    nibbles = integers.contiguous().view(torch.uint8) & 0x0F
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def stored_tensors(tensor: torch.Tensor, scheme: WeightOnlyScheme, axis: Axis) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight as the artifact stores it (a convolution weight as its matrix): (int8 integers or
    packed int4 bytes, scales)."""
    integers, scale = quantize_tensor(tensor, scheme, axis)
    return (pack_int4(integers) if scheme.bits == 4 else integers), scale


def fake_quantized(tensor: torch.Tensor, scheme: WeightOnlyScheme, axis: Axis) -> torch.Tensor:
    """The weight rounded to the scheme and dequantized again, in its own dtype and shape: what
    the weight-only program multiplies by."""
    shape, matrix_axis = matrix_shape(tensor.shape, axis)
    matrix = tensor.reshape(shape)
    if matrix.dim() + matrix_axis != 0 and matrix.shape[0] > ROWS_AT_ONCE:
        return torch.cat([fake_quantized(rows, scheme, matrix_axis) for rows in matrix.split(ROWS_AT_ONCE)]).reshape(tensor.shape)
    integers, scale = quantize_tensor(matrix, scheme, matrix_axis)
    return dequantize_tensor(integers, scale, scheme, matrix_axis, tensor.dtype).reshape(tensor.shape)


class DequantizedWeights(torch.overrides.TorchFunctionMode):
    """While active, every torch function given one of the chosen weight tensors gets it rounded
    to the scheme and dequantized instead (computed at each use, so no second copy of the model
    is held): eager PyTorch then computes what the weight-only program computes, without
    changing the model.

    Args:
      weights: {id(tensor): (tensor, contraction axis)} of the weights to replace.
      scheme: the scheme.
    """

    def __init__(self, weights: Mapping[int, tuple[torch.Tensor, int]], scheme: WeightOnlyScheme):
        super().__init__()
        self.weights = weights
        self.scheme = scheme

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") != "__get__":  # attribute reads (shape, dtype) see the weight itself
            args = tuple(self._replaced(argument) for argument in args)
            kwargs = {key: self._replaced(argument) for key, argument in kwargs.items()}
        return func(*args, **kwargs)

    def _replaced(self, argument):
        if type(argument) in (list, tuple):  # nn.LSTM's and nn.GRU's weights reach torch._VF as one list
            return type(argument)(self._replaced(item) for item in argument)
        entry = self.weights.get(id(argument)) if isinstance(argument, torch.Tensor) else None
        if entry is None or entry[0] is not argument:
            return argument
        with torch.no_grad():
            return fake_quantized(argument, scheme_for(self.scheme, argument.shape, entry[1]), entry[1])


class DequantizedReference:
    """The reference a weight-only program is verified against: the float model run eagerly with
    its chosen weights rounded and dequantized (DequantizedWeights).

    Args:
      model: the float reference (an nn.Module: the user's model or the checkpoint's copy).
      quantized: {state_dict name: contraction axis} (quantizable_weights).
      scheme: the scheme.
    Raises:
      TpuExportError: the model lacks a quantized weight's name.
    """

    def __init__(self, model: torch.nn.Module, quantized: Mapping[str, int], scheme: WeightOnlyScheme):
        state = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
        missing = sorted(set(quantized) - set(state))
        if missing:
            raise TpuExportError(f"the model has no weight {missing[0]!r} that its program quantizes; report this with the model to tpuexport")
        self.model = model
        self.weights = {id(state[name]): (state[name], as_axis(axis)) for name, axis in quantized.items()}
        self.scheme = scheme

    def __call__(self, *args, **kwargs):
        with DequantizedWeights(self.weights, self.scheme):
            return self.model(*args, **kwargs)


class StoredWeights:
    """A weight-only program's weights as the artifact stores them, from the float tensors (a
    checkpoint's, one at a time): integers under a quantized weight's name, scales under its
    scale name, other weights as they are.

    Args:
      quantized: the LoweredProgram's `quantized` entries ({weight name: {"axis", "scale", ...}}).
      scheme: the scheme.
    """

    def __init__(self, quantized: Mapping[str, dict], scheme: WeightOnlyScheme):
        self.quantized = quantized
        self.scheme = scheme
        self.weight_of_scale = {entry["scale"]: name for name, entry in quantized.items()}
        # Scales computed with their integers, kept until written (a 64th of an int4 weight).
        self.scales: dict[tuple[str, int], torch.Tensor] = {}

    def parts(self, name: str, tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        """The stored tensors of one program weight.

        Args:
          name: the program weight's name (a weight, or a quantized weight's scales).
          tensors: its float tensors, one per stacked block (a scale's are its weight's).
        Returns:
          One stored tensor per block, computed when asked for.
        """
        if name in self.quantized:
            axis = as_axis(self.quantized[name]["axis"])
            for index, tensor in enumerate(tensors):
                values, scale = stored_tensors(tensor, scheme_for(self.scheme, tensor.shape, axis), axis)
                self.scales[(self.quantized[name]["scale"], index)] = scale
                yield values
        elif name in self.weight_of_scale:
            axis = as_axis(self.quantized[self.weight_of_scale[name]]["axis"])
            for index, tensor in enumerate(tensors):
                scale = self.scales.pop((name, index), None)
                yield scale if scale is not None else quantize_tensor(tensor, scheme_for(self.scheme, tensor.shape, axis), axis)[1]
        else:
            yield from tensors
