"""Hostile inputs at run time: `Artifact.run` and the TF SavedModel given shapes outside the dims'
ranges, wrong ranks and dtypes, NaN and infinity. A clear error or the documented result (NaN and
infinity flow through the arithmetic as in eager PyTorch), never a crash of the process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tpuexport

from conftest import build_example


@pytest.fixture(scope="module")
def eager():
    return build_example("mlp")["model"].eval()


def one_line_error(call) -> str:
    with pytest.raises(tpuexport.TpuExportError) as raised:
        call()
    assert "\n" not in str(raised.value)
    return str(raised.value)


@pytest.mark.parametrize("inputs, message", [
    ((torch.randn(257, 32),), "batch=257 is out of range: batch accepts 1..256"),
    ((torch.randn(0, 32),), "batch=0 is out of range"),
    ((torch.randn(2, 31),), "input 'x' axis 1 is 31"),
    ((torch.randn(2, 32, 1),), "input 'x' has rank 3, expected 2"),
    ((torch.randn(2, 32), torch.randn(2, 32)), "the program takes 1 inputs (x), got 2"),
    ((), "the program takes 1 inputs (x), got 0"),
    ((torch.ones(2, 32, dtype=torch.int64),), "input 'x' is int64, the artifact takes float32; pass a floating array"),
    ((torch.ones(2, 32, dtype=torch.bool),), "input 'x' is bool, the artifact takes float32"),
    ((np.array([["a"] * 32] * 2),), "input 'x' is <U1, the artifact takes float32"),
    (([[1.0] * 32, [1.0] * 31],), "input 'x' is not an array"),
], ids=["over-max", "zero", "fixed-axis", "rank", "too-many", "none", "int", "bool", "strings", "ragged"])
def test_bad_inputs_are_one_line_errors(plain_mlp_artifact, inputs, message):
    assert message in one_line_error(lambda: plain_mlp_artifact.run(*inputs))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_other_float_widths_are_cast(plain_mlp_artifact, eager, dtype):
    x = torch.randn(3, 32).to(dtype)
    torch.testing.assert_close(plain_mlp_artifact.run(x), eager(x.float()), rtol=1e-4, atol=1e-5)


def test_nan_and_infinity_flow_through_as_in_eager(plain_mlp_artifact, eager):
    x = torch.randn(4, 32)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3, 7] = -float("inf")
    actual, expected = plain_mlp_artifact.run(x), eager(x)
    assert torch.isnan(actual[1]).all() and not torch.isnan(actual[0]).any()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5, equal_nan=True)


def test_saved_model_refuses_bad_inputs_and_passes_nan_through(mlp_artifact, eager):
    """The same in TensorFlow: errors it raises (process alive), NaN rows as eager's."""
    import tensorflow as tf

    serve = tf.saved_model.load(str(mlp_artifact.path / mlp_artifact.manifest["tf_serving"]["saved_model"])).signatures["serving_default"]
    with pytest.raises(tf.errors.InvalidArgumentError, match="batch <= 256"):
        serve(x=tf.zeros([257, 32], tf.float32))
    refusals = (TypeError, ValueError, tf.errors.InvalidArgumentError)
    with pytest.raises(refusals, match="float"):
        serve(x=tf.zeros([2, 32], tf.int32))
    with pytest.raises(refusals):
        serve(x=tf.zeros([2, 32, 1], tf.float32))
    x = torch.randn(3, 32)
    x[1, 0] = float("nan")
    x[2, 0] = float("inf")
    (output,) = serve(x=tf.constant(x.numpy())).values()
    torch.testing.assert_close(torch.from_numpy(output.numpy()), eager(x), rtol=1e-4, atol=1e-5, equal_nan=True)
    assert serve(x=tf.ones([1, 32], tf.float32))  # still serving after the errors
