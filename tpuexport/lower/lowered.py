"""What lowering produces, and what every later stage and the runtime read: `LoweredProgram` (a
portable program and its weights) and how XLA:CPU runs one. Apart from lowering.py because the
runtime and artifact reader use it without importing torch."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from tpuexport.errors import TpuExportError
from tpuexport.lower.cpu_program import cpu_program, state_positions
from tpuexport.signature import ProgramSignature

if TYPE_CHECKING:
    import torch

# How XLA:CPU compiles a program to run it (verification, Artifact.run). Its loop-invariant code
# motion hoists the f32 conversion of a scan's bfloat16 weights out of the loop, so every layer's
# weights exist in f32 at once (Llama-3.2-1B in bf16: 4.9 GB of temporaries); without it each
# iteration converts its own layer. The arithmetic is the same either way.
CPU_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
# And in this process (TensorFlow's XLA has no such option): without a loop, XLA:CPU's default
# scheduler starts every bfloat16 weight's f32 conversion before the first layer runs (the text-
# generation entry points of Llama-3.2-1B's shape, 4 layers: 1.93 GiB of temporaries per call);
# its memory-optimized scheduler converts each where it is used (0.98 GiB), same results bit for bit.
# A run compiles for one call or two (verification, Artifact.run): LLVM's -O1 instead of -O2 cuts
# the CPU seconds of compiling and running the coverage families' programs at small sizes by 5-20%
# (jax 0.12: llama 5.5 -> 4.6, bert 6.0 -> 4.8, vit 5.8 -> 5.5, resnet 6.2 -> 5.6), with outputs
# equal bit for bit, f32 and TPU-faithful (benchmarks/studies/cpu_compile_options.py); matmuls and
# convolutions are library calls, optimized either way.
RUN_COMPILER_OPTIONS = {**CPU_COMPILER_OPTIONS, "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
                        "xla_backend_optimization_level": 1}
# A run whose planned temporaries pass LARGE_RUN_TEMPORARIES is compiled again giving YNNPACK (XLA:CPU's
# library for dots) each dot on its own: by default XLA:CPU hands it whole subgraphs around a dot, and
# an attention's (the scores' dot, the scale, the mask, the softmax, the second dot) then needs every
# broadcast operand written out in f32 at the scores' size (the scale and the mask: 1 GiB at a
# 2048-token Llama-3.2-1B prefill) plus YNNPACK's own buffers for the scores, which XLA's memory
# analysis does not count (another 0.7-1.3 GiB measured). With dots only, XLA fuses the elementwise ops
# itself: that fill's run peaks 0.75 GiB lower and within its planned temporaries, which verification
# sizes its cases by (verify/generation.py verified_fills); its elementwise ops round as XLA's own
# kernels do, within a bfloat16 step of YNNPACK's. Only large runs: at small sizes the fused
# subgraphs are about 10% faster (tests/test_huggingface.py's RoBERTa conversion 10.7 -> 12.2 s with
# every run so compiled), and a 2048-token fill about 1.5x slower (benchmarks/studies/cpu_dot_fusion.py).
LARGE_RUN_OPTIONS = {**RUN_COMPILER_OPTIONS, "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
LARGE_RUN_TEMPORARIES = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class DeviceState:
    """Updated bfloat16 state a CPU run returns (LoweredProgram.run): its bit patterns, still on the
    device, for the next run to take and update in place.

    Attributes:
      bits: the uint16 bit patterns, a jax.Array (donated to the run it is passed to).
    """

    bits: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.bits.shape

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(ml_dtypes.bfloat16)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The values as numpy bfloat16 (a copy: the state stays usable)."""
        values = np.array(self.bits).view(ml_dtypes.bfloat16)
        return values if dtype is None else values.astype(dtype)


@dataclasses.dataclass(frozen=True)
class LoweredProgram:
    """The lowering stage's result: a portable program and the weights it is called with.

    The program is called as `exported.call(weights, inputs)` with two lists, in the order of
    `weight_names` and `signature.inputs`; weights are arguments of `@main`, not constants.

    Attributes:
      exported: the jax.export.Exported (platforms cpu and tpu, symbolic dims, shape assertions).
      weight_names: state_dict-style names of the weights, in call order.
      weights: the weight arrays, in call order (bfloat16 for precision "bf16"), or None for a
        plan (a model without weights, e.g. built on the meta device): the program then carries
        the weights' shapes and dtypes only (`weight_specs`).
      signature: named inputs, outputs and dims.
      precision: "auto", "f32", "bf16" or "bf16-mixed", as requested (mixed_precision.py).
      matmul_precision: the TPU matmul precision pinned on every dot and convolution
        ("default", "high" or "highest"; see matmul_precision.py).
      matmul_flops: FLOPs of its dots and convolutions as an expression over the dim names
        (see cost.py; `cost.flops_at` evaluates it).
      graph: the decomposed torch program the lowering traced, op for op (in memory only, for
        op-by-op checks; None for a program read back from an artifact).
      scanned: the runs of identical blocks lowered as one scan each (ScannedRun.to_json: module
        path, blocks, stacked weight name -> state_dict names); empty when none.
      tied: weights that are another weight (an lm_head tied to the embedding), {state_dict name:
        the name it is stored and passed under}: not arguments of the program, held once.
      quantized: weight-only weights, {weight name: {"mode", "bits", "axis" (contraction axis of
        one block's weight as stored, from the end; a convolution weight's axes, a list), "group_size",
        "scale" (the scales' weight name), "kernel_shape" (a convolution weight's shape, one block's:
        it is stored as its [out, in/groups x kernel] matrix), "reason" (why int8 in an int4 program)}}.
      weight_layouts: weights stored in another layout than their state_dict tensors', {weight
        name: the tensor's axes in stored order (of one block's, for a stack)} (weight_layouts.py);
        a quantized weight's scales are stored in its layout and listed too.
      decision_matmuls: the matmuls pinned to "highest" because they feed a discrete decision
        ({"op": graph node, "module": module path, "feeds": decision op, "precision": "highest"}
        each; matmul_precision.decision_matmuls).
      lowering_options: what `lower` was asked besides the precisions ({"scan", "weight_only",
        "keep_f32"}; in memory only), for lowering a bucket again (lower/kernels.py).
    """

    exported: jax.export.Exported
    weight_names: tuple[str, ...]
    weights: tuple[np.ndarray, ...] | None
    signature: ProgramSignature
    precision: str
    matmul_precision: str
    matmul_flops: str
    graph: torch.export.ExportedProgram | None = None
    scanned: tuple[dict, ...] = ()
    tied: dict[str, str] = dataclasses.field(default_factory=dict)
    decision_matmuls: tuple[dict, ...] = ()
    quantized: dict[str, dict] = dataclasses.field(default_factory=dict)
    weight_layouts: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    lowering_options: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property
    def resolved_precision(self) -> str:
        """What the program computes in: "f32", "bf16", "f16" or "bf16-mixed" (mixed_precision.resolve_precision);
        verification's default tolerances follow it."""
        # mixed_precision.py imports torch, which the runtime does without: only a conversion asks this.
        from tpuexport.lower.mixed_precision import resolve_precision

        specs = self.signature.inputs + self.signature.outputs
        dtypes = [spec.torch_dtype for spec in specs]
        if self.quantized and self.graph is not None:
            import torch  # loaded already: the graph was traced in this process

            # A weight-only program's bfloat16 scales are multiplied in its weights' own dtype
            # (quantize/weight_only.py): they do not make an f32 program compute in bf16, while its
            # text holds them. The torch graph it traced has every dtype it computes in, and no scale.
            dtypes += [str(node.meta["val"].dtype).removeprefix("torch.") for node in self.graph.graph.nodes
                       if isinstance(node.meta.get("val"), torch.Tensor)]
            return resolve_precision(self.precision, None, dtypes)
        return resolve_precision(self.precision, self.exported, dtypes)

    @property
    def plan_only(self) -> bool:
        """True for a program lowered from weight shapes alone: it compiles but cannot run."""
        return self.weights is None

    @functools.cached_property
    def weight_specs(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Every weight's shape and dtype, in call order: the program's first arguments, so they
        are known with or without the arrays."""
        avals = self.exported.in_avals[:len(self.weight_names)]
        return tuple(jax.ShapeDtypeStruct(aval.shape, aval.dtype) for aval in avals)

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights as the program stores them (whether or not the arrays are here)."""
        return int(sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in self.weight_specs))

    @functools.cached_property
    def weight_parts(self) -> dict[str, tuple[str, ...]]:
        """Each weight's state_dict names: its own, or for a scanned run's stacked weight its
        blocks' in stacking order (axis 0)."""
        stacked = {name: tuple(originals) for run in self.scanned for name, originals in run["weights"].items()}
        stacked.update({entry["scale"]: stacked.get(name, (name,)) for name, entry in self.quantized.items()})
        return {name: stacked.get(name, (name,)) for name in self.weight_names}

    @property
    def quantized_state_axes(self) -> dict[str, int]:
        """{state_dict name: contraction axis in the state_dict tensor's layout} of every quantized
        weight's parts (`quantized` gives the axis as stored, which a transposed layout swaps)."""
        return {part: {-1: -2, -2: -1}[entry["axis"]] if name in self.weight_layouts else entry["axis"]
                for name, entry in self.quantized.items() for part in self.weight_parts[name]}

    @property
    def stacked(self) -> tuple[bool, ...]:
        """Per weight, in call order, whether it is a scanned run's stack of its blocks' weights."""
        return tuple(len(self.weight_parts[name]) > 1 for name in self.weight_names)

    @functools.cached_property
    def _device_weights(self):
        # device_put runs an aligned host array in place on XLA:CPU (jnp.asarray would copy it):
        # weights memory-mapped from the artifact are not held twice.
        return [jax.device_put(weight) for weight in self.weights]

    def run(self, inputs: Sequence[np.ndarray], program: jax.export.Exported | None = None) -> list:
        """Runs the program on CPU.

        State the program updates (a bfloat16 KV cache: an input and an output of the same name,
        cpu_program.py) comes back as a `DeviceState`; passed back as the next run's input it is
        donated to that run, which updates it in place: a session's cache exists once, not once as
        the input and again as the output of every step.

        Args:
          inputs: one array per signature input (cast to the artifact dtype here), or for state a
            DeviceState an earlier run returned.
          program: another Exported with this one's signature and weights to run instead (e.g.
            its TPU-faithful rewrite), or None.
        Returns:
          One numpy array per output, in the model's output dtypes; a DeviceState for updated state.
        Raises:
          TpuExportError: a plan without weights, wrong number of inputs, or sizes outside the
            dims' ranges.
        """
        if self.plan_only:
            raise TpuExportError("this is a plan without weights: it compiles for TPUs but cannot run; convert the model "
                                 "with its weights to run it")
        specs = self.signature.inputs
        if len(inputs) != len(specs):
            raise TpuExportError(f"the program takes {len(specs)} inputs ({', '.join(s.name for s in specs)}), got {len(inputs)}")
        arrays = [value if isinstance(value, DeviceState) else np.asarray(value) for value in inputs]
        try:
            self.signature.sizes_of([array.shape for array in arrays])
        except ValueError as error:
            raise TpuExportError(f"input shapes do not fit the program: {error}") from None
        for array, spec in zip(arrays, specs):
            if not isinstance(array, DeviceState):
                _check_dtype_kind(array, spec)
                _check_integer_range(array, spec)
        inputs = [array if isinstance(array, DeviceState) else array.astype(spec.dtype, copy=False) for array, spec in zip(arrays, specs)]
        executable, cpu = self._compiled(program or self.exported, tuple((a.shape, np.dtype(s.dtype)) for a, s in zip(inputs, specs)))
        # The state goes in as bit patterns (cpu_program.py): numpy's copied once onto the device, a
        # DeviceState's as it is (then donated: it is used up).
        state = [inputs[position].bits if isinstance(inputs[position], DeviceState) else jax.device_put(inputs[position].view(np.uint16))
                 for position in cpu.bits_inputs]
        others = [None if position in cpu.bits_inputs else jnp.asarray(array) for position, array in enumerate(inputs)]
        outputs = executable(self._device_weights, others, state)
        return [DeviceState(output) if position in cpu.bits_outputs else np.asarray(output) for position, output in enumerate(outputs)]

    def run_temporary_bytes(self, sizes: dict[str, int], program: jax.export.Exported | None = None) -> int:
        """The temporaries XLA:CPU's executable of a `run` at these dim sizes needs (its memory
        analysis; the executable is compiled here once and kept for the run)."""
        input_types = tuple((tuple(spec.concrete_shape(sizes)), np.empty(0).astype(spec.dtype).dtype) for spec in self.signature.inputs)
        executable, _ = self._compiled(program or self.exported, input_types)
        return int(executable.memory_analysis().temp_size_in_bytes)

    @functools.cached_property
    def _executables(self) -> dict:
        return {}

    def _compiled(self, program: jax.export.Exported, input_types: tuple) -> tuple:
        """The XLA:CPU executable of `program` (as cpu_program rewrites it) for inputs of these shapes and
        dtypes, compiled once, and the CpuProgram: (executable, CpuProgram). The executable takes
        (weights, the inputs with None at the state's positions, the state's bit patterns)."""
        key = (id(program), input_types)
        if key not in self._executables:
            specs = self.signature.inputs
            cpu = cpu_program(program, len(self.weight_names),
                              state_positions([s.name for s in specs], [s.name for s in self.signature.outputs], [s.dtype for s in specs]))

            def call(weights, others, state):
                inputs = list(others)
                for position, array in zip(cpu.bits_inputs, state):
                    inputs[position] = array
                return cpu.exported.call(weights, inputs)

            arguments = [jax.ShapeDtypeStruct(shape, np.uint16 if position in cpu.bits_inputs else dtype)
                         for position, (shape, dtype) in enumerate(input_types)]
            others = [None if position in cpu.bits_inputs else argument for position, argument in enumerate(arguments)]
            state = [arguments[position] for position in cpu.bits_inputs]
            traced = jax.jit(call, donate_argnums=2).lower(self._device_weights, others, state)
            executable = traced.compile(compiler_options=RUN_COMPILER_OPTIONS)
            if executable.memory_analysis().temp_size_in_bytes > LARGE_RUN_TEMPORARIES:
                executable = traced.compile(compiler_options=LARGE_RUN_OPTIONS)
            self._executables[key] = (program, executable, cpu)
        return self._executables[key][1:]


def _dtype_kind(dtype: np.dtype) -> str:
    """"floating", "integer", "bool" or "other" (bfloat16, whose numpy kind is "V", is floating)."""
    if dtype == np.bool_:
        return "bool"
    if np.issubdtype(dtype, np.integer):
        return "integer"
    if np.issubdtype(dtype, np.floating) or dtype == ml_dtypes.bfloat16:
        return "floating"
    return "other"


def _check_dtype_kind(array: np.ndarray, spec) -> None:
    """Refuses an input of another kind than the artifact's (a float for token ids, an int for a
    float input, ...), which a cast would silently change; other widths are cast."""
    expected = _dtype_kind(np.dtype(spec.dtype))
    if _dtype_kind(array.dtype) != expected:
        raise TpuExportError(f"input {spec.name!r} is {array.dtype}, the artifact takes {spec.dtype}; "
                             f"pass a{'n' if expected == 'integer' else ''} {expected} array (other widths are cast)")


def _check_integer_range(array: np.ndarray, spec) -> None:
    """Refuses integer values the artifact's narrower dtype (int32 for int64) would wrap around."""
    if array.size == 0 or not np.issubdtype(array.dtype, np.integer) or not np.issubdtype(np.dtype(spec.dtype), np.integer):
        return
    limits = np.iinfo(np.dtype(spec.dtype))
    low, high = int(array.min()), int(array.max())
    if low < limits.min or high > limits.max:
        raise TpuExportError(
            f"input {spec.name!r} holds values {low}..{high}, outside {spec.dtype} ({limits.min}..{limits.max}) "
            "that the artifact computes in; keep integer inputs within that range"
        )
