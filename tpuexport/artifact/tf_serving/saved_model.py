"""The lowered program as a TensorFlow SavedModel.

The serving graph is one `XlaCallModule` (the lowered StableHLO, for CPU and TPU) fed by
`ReadVariableOp`s: the weights are non-trainable `tf.Variable`s saved under `variables/`, not
constants folded into `saved_model.pb`. Dynamic dims are `None` in the serving signature; their
ranges are enforced by the module's shape assertions, which TensorFlow runs at call time.

The module is the lowered program itself (in the op jax2tf would build for it), in a form the
installed TensorFlow runs (see `tensorflow_module`). TensorFlow itself runs in its own process
(tensorflow_process.py); this module prepares what that process is asked to do.
"""

from __future__ import annotations

import pathlib

import jax
import ml_dtypes
import numpy as np

from tpuexport.artifact.tf_serving.tensorflow_process import TensorFlowProcess
from tpuexport.errors import TpuExportError
from tpuexport.lower import LoweredProgram
from tpuexport.lower.stablehlo_rewrite import ops_named
from tpuexport.signature import TensorSpec

SIGNATURE_NAME = "serving_default"
PLATFORMS = ("cpu", "tpu")
SKIP_HINT = "pass --no-saved-model (saved_model=False) to skip the TF SavedModel"


def tensorflow_module(lowered: LoweredProgram, tensorflow: TensorFlowProcess, path: pathlib.Path) -> pathlib.Path:
    """Writes the lowered program's StableHLO in a form the installed TensorFlow's XlaCallModule runs.

    jax lowers top_k, erf, asinh, ragged_dot and other ops to `stablehlo.composite` ops (a name
    plus a decomposition function). TensorFlow 2.21 cannot take them: jax.export serializes them in
    a newer form than TensorFlow's StableHLO (1.13.7) reads ("unregistered operation
    'vhlo.composite_v2'"), and its shape refinement leaves their decompositions with dynamic shapes
    ("Module has dynamic shapes"), both only when the SavedModel runs. Here each composite becomes
    a call of its decomposition, the module is serialized for TensorFlow's StableHLO version and
    read back by TensorFlow's own reader (in its process), so a program that cannot load fails now,
    before verification and compilation. (The artifact's own program keeps the composites, which
    the TPU compiler maps to its native kernels.)

    Args:
      lowered: the lowered program.
      tensorflow: the TensorFlow process.
      path: where to write the module (a portable artifact, StableHLO bytecode).
    Returns:
      `path`.
    Raises:
      TpuExportError: TensorFlow's XlaCallModule or StableHLO cannot take the program.
    """
    from jax.extend.mlir import serialize_portable_artifact
    from jax.extend.mlir.dialects import stablehlo

    installed = tensorflow.versions()
    exported = lowered.exported
    if exported.calling_convention_version > installed["call_module_version"]:
        raise TpuExportError(f"TensorFlow {installed['tensorflow']} runs jax.export calling convention {installed['call_module_version']} "
                             f"at most, the program needs {exported.calling_convention_version}; {SKIP_HINT}, or upgrade tensorflow-cpu")
    version = stablehlo.get_smaller_version(installed["stablehlo_version"], stablehlo.get_current_version())
    path.write_bytes(serialize_portable_artifact(composites_as_calls(exported.mlir_module()), version))
    loaded = tensorflow.request("load_module", module=str(path))
    if not loaded["ok"]:
        raise TpuExportError(f"TensorFlow {installed['tensorflow']} cannot load this program as StableHLO {version} ({loaded['error']}); "
                             f"{SKIP_HINT}")
    return path


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
        for composite in ops_named(module, ("stablehlo.composite",)):
            decomposition = ir.FlatSymbolRefAttr(composite.attributes["decomposition"]).value
            with ir.InsertionPoint(composite):
                call = func.CallOp([result.type for result in composite.results], decomposition, list(composite.operands))
            for result, replacement in zip(composite.results, call.results):
                result.replace_all_uses_with(replacement)
            composite.erase()
        return str(module)


def build_request(lowered: LoweredProgram, directory: pathlib.Path, module: pathlib.Path, weights: pathlib.Path) -> dict:
    """The TensorFlow process's "build" request: save a SavedModel with one signature, `serving_default`.

    Args:
      lowered: the lowered program (its signature and calling convention).
      directory: the SavedModel directory to create (TF Serving's <base path>/<version>).
      module: the file `tensorflow_module` wrote.
      weights: a safetensors file holding every weight by name (the artifact's weights file).
    Returns:
      The request's fields.
    """
    exported, signature = lowered.exported, lowered.signature
    return {
        "directory": str(directory),
        "module": str(module),
        "weights": str(weights),
        "weight_names": list(lowered.weight_names),
        "inputs": [{"name": spec.name, "dtype": spec.dtype, "shape": [size if isinstance(size, int) else None for size in spec.shape]}
                   for spec in signature.inputs],
        "outputs": [spec.name for spec in signature.outputs],
        "call": {
            # The program's flat arguments are the weights, then the inputs; it keeps those it reads.
            "kept_arguments": list(exported.module_kept_var_idx),
            "version": exported.calling_convention_version,
            "output_dtypes": [str(aval.dtype) for aval in exported.out_avals],
            "output_shapes": [[size if isinstance(size, int) else None for size in aval.shape] for aval in exported.out_avals],
            "platforms": [platform.upper() for platform in exported.platforms],
            "disabled_checks": [str(check) for check in exported.disabled_safety_checks],
            "use_shardy_partitioner": bool(jax.config.jax_use_shardy_partitioner),
        },
    }


def as_artifact_dtype(array: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """`array` in the input's artifact dtype (golden data keeps the model's dtypes, e.g. int64)."""
    return np.asarray(array).astype(ml_dtypes.bfloat16 if spec.dtype == "bfloat16" else np.dtype(spec.dtype))


# TensorFlow writes a random uuid into this file on every save; its size varies by a byte with it.
PER_SAVE_METADATA = "fingerprint.pb"


def saved_model_bytes(directory: pathlib.Path) -> int:
    """Size of the SavedModel's content (graph, variables, assets) under `directory`, leaving out
    TensorFlow's per-save fingerprint.pb so that the same model always measures the same."""
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file() and path.name != PER_SAVE_METADATA)
