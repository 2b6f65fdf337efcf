"""The program as XLA:CPU runs it (verification, Artifact.run): the same function, written so that
XLA:CPU updates a bfloat16 KV cache in place instead of passing over the whole cache per write.

XLA:CPU computes no bfloat16 op natively: its float normalization widens each one to f32 between
two converts. A `dynamic_update_slice` of a bfloat16 cache becomes convert(whole cache) -> update
-> convert back, which is no longer an in-place update but a loop over every element of the cache,
and XLA fuses one decode step's chain of writes (every layer's, every row's) into that loop: each
element of both caches goes through layers x rows nested updates, a cost that grows with the
square of the layer count; prefill's row loop passes over the whole cache once per row and layer
(benchmarks/results/studies/generation_verify_cost.txt). Disabling the normalization is no way out: XLA:CPU
then has no bfloat16 dot.

An update moves bits only. Here every bfloat16 dynamic_update_slice is done on the values' 16-bit
patterns (bitcast_convert to ui16 and back, exact both ways), a while loop whose body returns such
an update carries that array as ui16, and the program's state arrays (an input and an output of the
same name, the KV cache) are taken and returned as ui16: the bitcast pairs between them cancel, so
XLA:CPU sees ui16 updates of an argument and does them in place. It is the same function, bit for
bit. TPUs compile the artifact's own program; this one is never written to an artifact.

Its dots also read transposed weights in place, and products of a single row take a second, zero
row (cpu_dots.py), instead of XLA:CPU writing each such weight out in f32 first. The first write
into the state waits for the program's other results (_writes_after_reads), so that XLA:CPU updates
the state in place instead of copying it whole.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo

from tpuexport.lower.cpu_dots import fold_transposes_into_dots, pad_single_row_dots
from tpuexport.lower.stablehlo_rewrite import ops_named, producer, rewrite_module


@dataclasses.dataclass(frozen=True)
class CpuProgram:
    """A program rewritten for XLA:CPU.

    Attributes:
      exported: the program to compile.
      bits_inputs: positions (among the user inputs, after the weights) of the inputs it takes as
        uint16 bit patterns of their bfloat16 values.
      bits_outputs: positions of the outputs it returns as uint16 bit patterns.
    """

    exported: jax.export.Exported
    bits_inputs: tuple[int, ...] = ()
    bits_outputs: tuple[int, ...] = ()


def state_positions(input_names: Sequence[str], output_names: Sequence[str], input_dtypes: Sequence[str]) -> list[tuple[int, int]]:
    """(input position, output position) of every bfloat16 input that is also an output of the
    same name: state the program updates (a text-generation entry point's KV cache)."""
    outputs = {name: position for position, name in enumerate(output_names)}
    return [(position, outputs[name]) for position, (name, dtype) in enumerate(zip(input_names, input_dtypes))
            if name in outputs and np.dtype(dtype) == jax.numpy.bfloat16]


def cpu_program(exported: jax.export.Exported, weights: int, state: Sequence[tuple[int, int]]) -> CpuProgram:
    """The program with its bfloat16 updates done on bit patterns and its dots reading their weights
    in place (module docstring).

    Args:
      exported: the program, called as (weights, inputs).
      weights: how many weight arguments come before the inputs.
      state: (input position, output position) pairs taken and returned as bit patterns
        (state_positions).
    Returns:
      The CpuProgram; `exported` itself, unchanged, when it updates no bfloat16 array and rewrites
      no dot.
    """
    kept = sorted(exported.module_kept_var_idx)
    state = [(position, output) for position, output in state if weights + position in kept]  # an unused input stays as it is
    updates: list[ir.Operation] = []
    dots_rewritten: list[int] = []

    def edit(module: ir.Module) -> None:
        dots_rewritten.append(fold_transposes_into_dots(module) + pad_single_row_dots(module))
        updates.extend(op for op in ops_named(module, ("stablehlo.dynamic_update_slice",))
                       if isinstance(ir.RankedTensorType(op.result.type).element_type, ir.BF16Type))
        for update in updates:
            _update_as_bits(update)
        for loop in ops_named(module, ("stablehlo.while",)):
            _carry_updates_as_bits(loop)
        if updates:
            main, results = _main(module), [output for _, output in state]
            _writes_after_reads(main, _state_as_bits(main, [weights + position for position, _ in state], results, kept), results)

    avals_in, avals_out = list(exported.in_avals), list(exported.out_avals)
    for position, output in state:
        avals_in[weights + position] = avals_in[weights + position].update(dtype=np.dtype(np.uint16))
        avals_out[output] = avals_out[output].update(dtype=np.dtype(np.uint16))
    rewritten = rewrite_module(exported, edit, in_avals=tuple(avals_in), out_avals=tuple(avals_out))
    if not updates:  # the state stays bfloat16, as the Exported's own signature has it
        return CpuProgram(dataclasses.replace(rewritten, in_avals=exported.in_avals, out_avals=exported.out_avals)
                          if dots_rewritten[0] else exported)
    return CpuProgram(rewritten, tuple(position for position, _ in state), tuple(output for _, output in state))


def _update_as_bits(op: ir.Operation) -> None:
    """One bfloat16 dynamic_update_slice done on ui16 (its result bitcast back to bfloat16)."""
    with ir.InsertionPoint(op):
        operand, update, *starts = op.operands
        bits = stablehlo.dynamic_update_slice(_bitcast(operand, _unsigned16()), _bitcast(update, _unsigned16()), starts)
        op.result.replace_all_uses_with(_bitcast(bits, ir.BF16Type.get()))
    op.erase()


def _carry_updates_as_bits(loop: ir.Operation) -> None:
    """Carries as ui16 every bfloat16 value of the while loop that its body returns as a bitcast of ui16
    (an update done on bits): the loop's operand, region arguments, body result and loop result."""
    body = loop.regions[1].blocks[0]
    returned = list(_terminator(body).operands)
    for position, value in enumerate(returned):
        made_by = producer(value)
        if made_by is None or made_by.name != "stablehlo.bitcast_convert" or not isinstance(
                ir.RankedTensorType(value.type).element_type, ir.BF16Type):
            continue
        with ir.InsertionPoint(loop):
            loop.operands[position] = _bitcast(loop.operands[position], _unsigned16())
        for region in loop.regions:
            _argument_as_bits(region.blocks[0].arguments[position], region.blocks[0])
        terminator = _terminator(body)
        with ir.InsertionPoint(terminator):
            terminator.operands[position] = _bitcast(terminator.operands[position], _unsigned16())
        _result_as_bits(loop.results[position], loop)


def _state_as_bits(main: ir.Operation, arguments: list[int], results: list[int], kept: Sequence[int]) -> list[ir.BlockArgument]:
    """The main function's state arguments and results as ui16; returns those block arguments.

    Args:
      main: the module's public main function.
      arguments: the state's positions among the program's arguments (weights, then inputs).
      results: the state's positions among its results.
      kept: the Exported's module_kept_var_idx, sorted (the arguments the module keeps; `arguments` are among them).
    """
    block = main.regions[0].blocks[0]
    leading = len(block.arguments) - len(kept)  # the platform index, when the program has several platforms
    state = [block.arguments[leading + kept.index(argument)] for argument in arguments]
    for argument in state:
        _argument_as_bits(argument, block)
    terminator = _terminator(block)
    with ir.InsertionPoint(terminator):
        for result in results:
            terminator.operands[result] = _bitcast(terminator.operands[result], _unsigned16())
    main.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(
        [argument.type for argument in block.arguments], [operand.type for operand in terminator.operands]))
    return state


def _writes_after_reads(main: ir.Operation, state: list[ir.BlockArgument], results: list[int]) -> None:
    """Makes the first write into each state argument wait for the program's other results (an
    optimization_barrier of the written array with them).

    A decode step reads every layer's cache as it received it and writes the step's keys after its
    last layer (export/generation.py), so the writes can update the donated cache in place. A TPU
    compiles it so; XLA:CPU's copy insertion orders ops by their data alone, finds no path from the
    last layer's read to the first write, and copies the whole cache first (the Llama-3.2-1B decode
    step's 1 GiB of temporaries at batch 8 x 4096). The logits depend on every layer's read, so a
    write that depends on them comes after every read.
    """
    block = main.regions[0].blocks[0]
    order = {op: index for index, op in enumerate(block.operations)}
    terminator = _terminator(block)
    others = [value for position, value in enumerate(terminator.operands) if position not in results]
    for argument in state:
        writes = [op for op in block.operations if op.operation.name == "stablehlo.dynamic_update_slice"
                  and _bits_of(op.operation.operands[0]) == argument]
        if not writes:
            continue
        first = min(writes, key=order.__getitem__).operation
        before = [value for value in others if (made_by := producer(value)) is not None and order.get(made_by, len(order)) < order[first]]
        if not before:
            continue
        with ir.InsertionPoint(first):
            barrier = stablehlo.OptimizationBarrierOp([first.operands[0], *before])
        first.operands[0] = barrier.results[0]


def _bits_of(value: ir.Value) -> ir.Value:
    """The value that `value` reinterprets through a chain of bitcast_converts (`value` itself when it
    is not a bitcast_convert's result)."""
    while (made_by := producer(value)) is not None and made_by.name == "stablehlo.bitcast_convert":
        value = made_by.operands[0]
    return value


def _argument_as_bits(argument: ir.BlockArgument, block: ir.Block) -> None:
    """A bfloat16 block argument retyped ui16; its uses read it through a bitcast back."""
    argument.set_type(_retyped(argument.type, _unsigned16()))
    with ir.InsertionPoint.at_block_begin(block):
        value = _bitcast(argument, ir.BF16Type.get())
    argument.replace_all_uses_except(value, producer(value))


def _result_as_bits(result: ir.OpResult, op: ir.Operation) -> None:
    """A bfloat16 op result retyped ui16; its uses read it through a bitcast back (placed after the op)."""
    result.set_type(_retyped(result.type, _unsigned16()))
    with ir.InsertionPoint(op):
        value = _bitcast(result, ir.BF16Type.get())
    cast = producer(value)
    cast.move_after(op)
    result.replace_all_uses_except(value, cast)


def _main(module: ir.Module) -> ir.Operation:
    return next(op.operation for op in module.body.operations
                if op.operation.name == "func.func" and ir.StringAttr(op.operation.attributes["sym_name"]).value == "main")


def _terminator(block: ir.Block) -> ir.Operation:
    operations = block.operations
    return operations[len(operations) - 1].operation


def _unsigned16() -> ir.Type:
    return ir.IntegerType.get_unsigned(16)


def _retyped(value_type: ir.Type, element_type: ir.Type) -> ir.RankedTensorType:
    tensor = ir.RankedTensorType(value_type)
    return ir.RankedTensorType.get(tensor.shape, element_type, tensor.encoding)


def _bitcast(value: ir.Value, element_type: ir.Type) -> ir.Value:
    """`value` reinterpreted as `element_type` (of the same width), shape and encoding kept."""
    return stablehlo.BitcastConvertOp(_retyped(value.type, element_type), value).result
