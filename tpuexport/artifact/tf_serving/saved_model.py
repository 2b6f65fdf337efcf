"""The lowered program as a TensorFlow SavedModel, through jax2tf.

The serving graph is one `XlaCallModule` (the lowered StableHLO, for CPU and TPU) fed by
`ReadVariableOp`s: the weights are non-trainable `tf.Variable`s saved under `variables/`, not
constants folded into `saved_model.pb`. Dynamic dims are `None` in the serving signature; their
ranges are enforced by the module's shape assertions, which TensorFlow runs at call time.

TensorFlow is imported here, lazily, by the functions that need it: importing it costs seconds.
"""

from __future__ import annotations

import pathlib

import numpy as np

from tpuexport.lower import LoweredProgram
from tpuexport.lower.shapes import dim_constraints
from tpuexport.signature import ProgramSignature, TensorSpec

SIGNATURE_NAME = "serving_default"
PLATFORMS = ("cpu", "tpu")


def polymorphic_shape(spec: TensorSpec) -> str:
    """jax2tf's shape string for one input, e.g. "(batch, seq)" or "(batch, 2*seq, 64)"."""
    return "(" + ", ".join(str(size) for size in spec.shape) + ")"


def build_saved_model(lowered: LoweredProgram, directory: pathlib.Path) -> None:
    """Saves the lowered program as a SavedModel with one signature, `serving_default`.

    Args:
      lowered: the lowered program and its weights.
      directory: the SavedModel directory to create (TF Serving's <base path>/<version>).
    Raises:
      Whatever jax2tf or TensorFlow raise; the caller names the failure.
    """
    import tensorflow as tf
    from jax.experimental import jax2tf

    signature = lowered.signature
    call = jax2tf.convert(
        lowered.exported.call,
        # The weights have static shapes; each input's shape names the signature's dims.
        polymorphic_shapes=[None, [polymorphic_shape(spec) for spec in signature.inputs]],
        # jax2tf re-derives the dims from the shapes alone; the bounds the Exported was built
        # with must be restated, or the call's own shape assertions cannot be proven and saving fails.
        polymorphic_constraints=dim_constraints(signature),
        native_serialization_platforms=PLATFORMS,
        with_gradient=False,
    )
    module = tf.Module()
    module.weights = [
        tf.Variable(weight, trainable=False, name=variable_name(name))
        for name, weight in zip(lowered.weight_names, lowered.weights)
    ]

    @tf.function(input_signature=serving_input_specs(signature), autograph=False)
    def serve(*inputs):
        outputs = call(list(module.weights), list(inputs))
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
