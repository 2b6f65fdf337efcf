"""Real architectures (tiny random-weight transformers configs, benchmarks/families.py): the fast
families of the coverage benchmark convert and verify in float, and an encoder's matmuls in
static int8, so CI catches a regression the three examples would not show.
(A decoder's PT2E int8 is test_quantized_generation's; the full table, every family in every mode,
is `python benchmarks/coverage.py`.)"""

from __future__ import annotations

import json

import pytest
from families import FAMILIES

import tpuexport

FAST = sorted(name for name, family in FAMILIES.items() if family.fast)
# Static int8 of a vision transformer and a decoder quantize the matmuls bert's int8 does (each took
# over a minute of the suite's time), and a CNN's convolutions those test_quantize.py's CNN example
# quantizes and verifies op by op: the coverage benchmark runs them.
INT8 = ("bert",)


def test_the_fast_subset_spans_encoders_decoders_vision_and_cnns():
    assert {FAMILIES[name].kind for name in FAST} == {"encoder", "decoder", "vision", "cnn"}
    assert {FAMILIES[name].kind for name in INT8} == {"encoder"}


@pytest.mark.parametrize("mode, name", [("f32", name) for name in FAST] + [("int8", name) for name in INT8],
                         ids=lambda value: value)
def test_fast_family_converts_and_verifies(mode, name, tmp_path):
    built = FAMILIES[name].build()
    quantize = mode if mode != "f32" else None
    artifact = tpuexport.convert(
        built["model"], built["args"], built["dynamic_shapes"], target="v5e", out=tmp_path / f"{name}.tpu",
        quantize=quantize, calibration=built["calibration"] if quantize else None, saved_model=False,
    )
    manifest = artifact.manifest
    assert manifest["verification"]["passed"]
    dims = {dim["name"] for dim in manifest["entry_points"]["serving_default"]["signature"]["dims"]}
    sizes = {dim: {case["sizes"][dim] for case in manifest["verification"]["cases"]} for dim in dims}
    assert all(len(seen) >= 2 for seen in sizes.values()), sizes  # every dynamic dim verified at two sizes or more
    if quantize:
        report = json.loads((artifact.path / manifest["quantization"]["report"]).read_text())
        # every matmul and convolution the quantizer takes runs as s8 x s8 -> s32 on the TPU
        assert report["integer_flops"]["fraction"] > 0.9, report["integer_flops"]
        assert all(output["sqnr_db"] is None or output["sqnr_db"] > 20 for output in report["outputs"])
