"""The lowered program as a TensorFlow SavedModel.

The serving graph is one `XlaCallModule` (the lowered StableHLO, for CPU and TPU) fed by
`ReadVariableOp`s: the weights are non-trainable `tf.Variable`s saved under `variables/`, not
constants folded into `saved_model.pb`. Dynamic dims are `None` in the serving signature; their
ranges are enforced by the module's shape assertions, which TensorFlow runs at call time.

The module is the lowered program itself (in the op jax2tf would build for it), in a form the
installed TensorFlow runs (see `tensorflow_module`).

TensorFlow is imported here, lazily, by the functions that need it: importing it costs seconds.
"""

from __future__ import annotations

import pathlib

import jax
import numpy as np

from tpuexport._runtime import captured_native_stderr
from tpuexport.errors import TpuExportError
from tpuexport.lower import LoweredProgram
from tpuexport.signature import ProgramSignature, TensorSpec

SIGNATURE_NAME = "serving_default"
PLATFORMS = ("cpu", "tpu")
SKIP_HINT = "pass --no-saved-model (saved_model=False) to skip the TF SavedModel"


def tensorflow_module(lowered: LoweredProgram) -> bytes:
    """The lowered program's StableHLO in a form the installed TensorFlow's XlaCallModule runs.

    jax lowers top_k, erf, asinh, ragged_dot and other ops to `stablehlo.composite` ops (a name
    plus a decomposition function). TensorFlow 2.21 cannot take them: jax.export serializes them in
    a newer form than TensorFlow's StableHLO (1.13.7) reads ("unregistered operation
    'vhlo.composite_v2'"), and its shape refinement leaves their decompositions with dynamic shapes
    ("Module has dynamic shapes"), both only when the SavedModel runs. Here each composite becomes
    a call of its decomposition, the module is serialized for TensorFlow's StableHLO version and
    read back by TensorFlow's own reader, so a program that cannot load fails now, before
    verification and compilation. (The artifact's own program keeps the composites, which the TPU
    compiler maps to its native kernels.)

    Args:
      lowered: the lowered program.
    Returns:
      The portable artifact (StableHLO bytecode) for XlaCallModule's `module` attribute.
    Raises:
      TpuExportError: TensorFlow's XlaCallModule or StableHLO cannot take the program.
    """
    # TensorFlow logs its start-up on the native stderr, and says there why its reader refuses a module.
    with captured_native_stderr() as diagnostics:
        import tensorflow as tf
        from jax.extend.mlir import serialize_portable_artifact
        from jax.extend.mlir.dialects import stablehlo
        from tensorflow.compiler.mlir.stablehlo import stablehlo as tf_stablehlo
        from tensorflow.compiler.tf2xla.python import xla as tfxla

        exported = lowered.exported
        supported = tfxla.call_module_maximum_supported_version()
        if exported.calling_convention_version > supported:
            raise TpuExportError(f"TensorFlow {tf.__version__} runs jax.export calling convention {supported} at most, the "
                                 f"program needs {exported.calling_convention_version}; {SKIP_HINT}, or upgrade tensorflow-cpu")
        version = stablehlo.get_smaller_version(tf_stablehlo.get_current_version(), stablehlo.get_current_version())
        try:
            module = serialize_portable_artifact(composites_as_calls(exported.mlir_module()), version)
            tf_stablehlo.deserialize_portable_artifact_str(module)
            failure = None
        except Exception as error:  # MLIR raises ValueError or RuntimeError with few details
            failure = error
    if failure is None:
        return module
    reasons = [line for line in "".join(diagnostics).splitlines() if "error:" in line] or [str(failure)]
    reason = " ".join(reasons[0].split("error:", 1)[-1].split())[:200]
    raise TpuExportError(f"TensorFlow {tf.__version__} cannot load this program as StableHLO {version} ({reason}); {SKIP_HINT}")


def composites_as_calls(module_text: str) -> str:
    """The MLIR module with every `stablehlo.composite` op replaced by a call of its decomposition.

    Args:
      module_text: a jax.export module (`Exported.mlir_module()`).
    Returns:
      The module's text.
    """
    from jax.extend.mlir import ir
    from jax.extend.mlir.dialects import func

    # A context with every dialect jax's modules use: the one jax lowers in.
    context = jax.jit(lambda: 0).lower().compiler_ir("stablehlo").context
    with context, ir.Location.unknown():
        module = ir.Module.parse(module_text)
        composites = []

        def collect(operation):
            if operation.name == "stablehlo.composite":
                composites.append(operation)
            return ir.WalkResult.ADVANCE

        module.operation.walk(collect)
        for composite in composites:
            decomposition = ir.FlatSymbolRefAttr(composite.attributes["decomposition"]).value
            with ir.InsertionPoint(composite):
                call = func.CallOp([result.type for result in composite.results], decomposition, list(composite.operands))
            for result, replacement in zip(composite.results, call.results):
                result.replace_all_uses_with(replacement)
            composite.erase()
        return str(module)


def build_saved_model(lowered: LoweredProgram, directory: pathlib.Path, module_bytes: bytes | None = None) -> None:
    """Saves the lowered program as a SavedModel with one signature, `serving_default`.

    Args:
      lowered: the lowered program and its weights.
      directory: the SavedModel directory to create (TF Serving's <base path>/<version>).
      module_bytes: `tensorflow_module(lowered)` when the caller already has it, or None.
    Raises:
      TpuExportError: TensorFlow cannot load the program (see `tensorflow_module`).
      Whatever TensorFlow raises otherwise; the caller names the failure.
    """
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.python import xla as tfxla

    signature, exported = lowered.signature, lowered.exported
    module_bytes = module_bytes or tensorflow_module(lowered)
    module = tf.Module()
    module.weights = [
        tf.Variable(weight, trainable=False, name=variable_name(name))
        for name, weight in zip(lowered.weight_names, lowered.weights)
    ]

    @tf.function(input_signature=serving_input_specs(signature), autograph=False)
    def serve(*inputs):
        # The program's flat arguments are the weights, then the inputs; it keeps those it reads.
        arguments = [*module.weights, *inputs]
        outputs = tfxla.call_module(
            [arguments[index] for index in exported.module_kept_var_idx],
            version=exported.calling_convention_version,
            module=module_bytes,
            Tout=[tf.as_dtype(aval.dtype) for aval in exported.out_avals],
            Sout=[[size if isinstance(size, int) else None for size in aval.shape] for aval in exported.out_avals],
            platforms=[platform.upper() for platform in exported.platforms],
            function_list=[],
            has_token_input_output=False,
            disabled_checks=[str(check) for check in exported.disabled_safety_checks],
            use_shardy_partitioner=jax.config.jax_use_shardy_partitioner,
        )
        return {spec.name: output for spec, output in zip(signature.outputs, outputs)}

    module.serve = serve
    tf.saved_model.save(module, str(directory), signatures={SIGNATURE_NAME: serve})


def variable_name(weight_name: str) -> str:
    """The weight's name as a TensorFlow variable name. State-dict names ("layers.0.weight") are
    valid as they are, except for a leading underscore ("_offset", PT2E's "_frozen_param0"), which
    TensorFlow refuses at the start of a scope name; the variables are found by position anyway."""
    return weight_name.lstrip("_") or "weight"


def serving_input_specs(signature: ProgramSignature) -> list:
    """tf.TensorSpecs named after the inputs, in the artifact dtypes, with None for dynamic dims."""
    import tensorflow as tf

    return [
        tf.TensorSpec([size if isinstance(size, int) else None for size in spec.shape], tf.as_dtype(spec.dtype), name=spec.name)
        for spec in signature.inputs
    ]


def as_artifact_dtype(array: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """`array` in the input's artifact dtype (golden data keeps the model's dtypes, e.g. int64)."""
    import tensorflow as tf

    return np.asarray(array).astype(tf.as_dtype(spec.dtype).as_numpy_dtype)


# TensorFlow writes a random uuid into this file on every save; its size varies by a byte with it.
PER_SAVE_METADATA = "fingerprint.pb"


def saved_model_bytes(directory: pathlib.Path) -> int:
    """Size of the SavedModel's content (graph, variables, assets) under `directory`, leaving out
    TensorFlow's per-save fingerprint.pb so that the same model always measures the same."""
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file() and path.name != PER_SAVE_METADATA)
