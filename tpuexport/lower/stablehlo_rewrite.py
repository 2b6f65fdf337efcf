"""Rewriting the StableHLO module inside a `jax.export.Exported`, op by op.

jax.export serializes the lowered module as a versioned portable artifact. Some properties are
best set on the module itself rather than while tracing, because they must hold for every op no
matter which library call emitted it: the matmul precision of every dot and convolution (pinned in
the artifact), and the TPU's operand rounding (emulated for verification on CPU). A rewrite keeps
the module's signature, so the Exported's other fields (avals, trees, platforms) stay valid.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from jax._src.interpreters import mlir as jax_mlir
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo

MATMUL_OPS = ("stablehlo.dot_general", "stablehlo.convolution")


def rewrite_matmuls(
    exported: jax.export.Exported, rewrite: Callable[[ir.Operation], None], module_attributes: dict[str, str] | None = None,
) -> jax.export.Exported:
    """Calls `rewrite` on every dot_general and convolution of the module, in every function and region.

    Args:
      exported: the program.
      rewrite: edits one op in place; it may insert ops before it (the insertion point is the op)
        and replace its operands, attributes or uses.
      module_attributes: string attributes to set on the module ({name: value}), or None.
    Returns:
      A new Exported whose module is the rewritten one (rewrite_module).
    """

    def edit(module: ir.Module) -> None:
        for op in ops_named(module, MATMUL_OPS):
            with ir.InsertionPoint(op):
                rewrite(op)
        for name, value in (module_attributes or {}).items():
            module.operation.attributes[name] = ir.StringAttr.get(value)

    return rewrite_module(exported, edit)


def rewrite_module(exported: jax.export.Exported, edit: Callable[[ir.Module], None], **fields) -> jax.export.Exported:
    """The program with its module edited in place by `edit` (in an MLIR context with an unknown location).

    Args:
      exported: the program.
      edit: changes the parsed module.
      fields: other Exported fields to replace (e.g. in_avals, when the edit changes the signature).
    Returns:
      A new Exported whose module is the edited one, serialized for the same StableHLO
      compatibility window jax.export uses.
    """
    with jax_mlir.make_ir_context() as context, ir.Location.unknown():
        # Read straight into this context: Exported.mlir_module() prints the module for a parse here,
        # which took about 2% of the test suite's CPU time (the same module, locations included).
        module = stablehlo.deserialize_portable_artifact(context, bytes(exported.mlir_module_serialized))
        edit(module)
        target = stablehlo.get_version_from_compatibility_requirement(stablehlo.StablehloCompatibilityRequirement.WEEK_4)
        serialized = stablehlo.serialize_portable_artifact(module, target)
    return dataclasses.replace(exported, mlir_module_serialized=serialized, **fields)


def ops_named(module: ir.Module, names: tuple[str, ...]) -> list[ir.Operation]:
    """Every op of the module named one of `names`, in every function and region, in walk order
    (collected first, so that the caller may edit or erase them)."""
    found: list[ir.Operation] = []

    def collect(op: ir.Operation) -> ir.WalkResult:
        if op.name in names:
            found.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(collect)
    return found


def operand_element_types(op: ir.Operation) -> list[ir.Type]:
    """The element types of a dot's or convolution's two operands."""
    return [ir.RankedTensorType(operand.type).element_type for operand in list(op.operands)[:2]]


def producer(value: ir.Value) -> ir.Operation | None:
    """The op that defines `value`, None for a block argument."""
    owner = value.owner
    return owner.operation if isinstance(owner, (ir.Operation, ir.OpView)) else None
