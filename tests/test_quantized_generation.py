"""PT2E int8 and int8-dynamic text generation (quantize/generation.py, verify/quantized_generation.py,
verify/paged_generation.py): both entry points (or the paged step) quantized with one set of weights,
calibrated as a serving engine drives them,
s8 dots in the TPU executables, verified against the PT2E entry points (a planted int8 bug fails),
SQNR and first divergence against the float model in the quantization report."""

from __future__ import annotations

import json

import numpy as np
import pytest
from planted_bugs import INT8_BUGS
from test_generation import MAX_BATCH, MAX_CONTEXT, tiny_llama

import tpuexport
from tpuexport import export as export_stage
from tpuexport import lower as lower_stage
from tpuexport import verify as verify_stage
from tpuexport.compile.hlo import matmul_ops
from tpuexport.errors import TpuExportError
from tpuexport.pipeline import ConversionOptions, passes
from tpuexport.quantize.generation import DECODE_STEPS, calibration_prompts

NEW_TOKENS = 6

# The static cache's prefill and decode, or the paged cache's step (calibrated on steps that mix prefill
# chunks and decode tokens, export/step_work.py), at a given page count: v5e's would be sized to its HBM,
# compiles this test does not need.
CACHES = {"static": dict(buckets={"seq": [16], "batch": [MAX_BATCH]}),
          "paged": dict(kv_cache="paged", page_size=4, num_pages=32, buckets={"tokens": [8], "rows": [MAX_BATCH]})}


def convert_int8_generation(mode: str, cache: str, out) -> tuple[tpuexport.Artifact, dict]:
    """The tiny Llama converted for text generation in a PT2E mode over a cache, as tpuexport.convert does it:
    (artifact, {"model", "spec", "quantized": the conversion's {entry point: QuantizedModel}, "compiled": its
    {entry point: [CompiledBucket]} for v5e})."""
    model = tiny_llama()
    options = ConversionOptions(("v5e",), out, task="text-generation", max_context=MAX_CONTEXT, max_batch=MAX_BATCH, quantize=mode,
                                random_calibration=mode == "int8", saved_model=False, new_tokens=NEW_TOKENS, **CACHES[cache])
    with passes(export_stage.LoadedSource(model, None, None, None, export_stage.SourceInfo("api")), options) as conversion:
        made = {"model": model, "spec": conversion.spec.state.spec, "quantized": conversion.quantized,
                "compiled": {name: report.for_target("v5e") for name, report in conversion.compiled().items()}}
    return tpuexport.load(out), made


@pytest.fixture(scope="session")
def static_int8_conversion(tmp_path_factory):
    """The static int8 conversion (prefill and decode calibrated on random prompts, for v5e): (artifact, what it quantized)."""
    return convert_int8_generation("int8", "static", tmp_path_factory.mktemp("int8-generation") / "llama.tpu")


@pytest.fixture(scope="session")
def static_int8_entry_points(static_int8_conversion):
    """The tiny Llama's entry points as that conversion quantized them with static int8 on random prompts:
    (model, spec, {name: QuantizedModel})."""
    _, made = static_int8_conversion
    return made["model"], made["spec"], made["quantized"]


# Each mode once and each cache once (the suite's time): static int8 calibrates prefill and decode, and int8-dynamic quantizes
# the paged step, evaluated on the steps quantize/generation.step_samples drives.
@pytest.fixture(scope="session", params=[("int8", "static"), ("int8-dynamic", "paged")], ids="-".join)
def int8_generation(request, tmp_path_factory):
    """The tiny Llama converted for text generation in a PT2E mode over a cache: (mode, cache, artifact)."""
    mode, cache = request.param
    if cache == "static":
        artifact, _ = request.getfixturevalue("static_int8_conversion")
    else:
        artifact, _ = convert_int8_generation(mode, cache, tmp_path_factory.mktemp("int8-generation") / "llama.tpu")
    return mode, cache, artifact


def test_entry_points_share_weights_and_decode_runs_s8_dots_on_tpu(static_int8_conversion):
    _, made = static_int8_conversion
    quantized = made["quantized"]
    # Activation observers per entry point, each calibrated on its own inputs: prompts for
    # prefill, steps over the cache prefill filled for decode.
    assert quantized["prefill"].calibration_samples == 2 and quantized["decode"].calibration_samples == 2 * DECODE_STEPS
    assert all(result.calibration_source == "random" and result.warnings for result in quantized.values())
    lowered = {name: lower_stage.lower(result.captured.program, result.captured.signature) for name, result in quantized.items()}
    # One set of weights: the same names, dtypes and values in both entry points.
    assert lowered["prefill"].weight_names == lowered["decode"].weight_names
    assert all(np.array_equal(a, b) for a, b in zip(lowered["prefill"].weights, lowered["decode"].weights))
    assert np.dtype(np.int8) in {w.dtype for w in lowered["decode"].weights}
    # The conversion's own v5e executable of decode (its one bucket), compiled from that quantized program.
    [compiled] = made["compiled"]["decode"]
    types = [op.types for op in matmul_ops(compiled.hlo_text)]
    # Every dot is int8 x int8 -> int32 (XLA merges the q/k/v dots that share their operand; the
    # embedding is a gather): at least the two attention matmuls of each layer and one per linear kind.
    assert set(types) == {"s8xs8->s32"} and len(types) >= 2 * 2 + 5, types


@pytest.mark.parametrize("bug", ["int8_scale_off_by_one_step"])
def test_planted_int8_bug_fails_generation_verification(static_int8_entry_points, bug):
    model, spec, quantized = static_int8_entry_points
    references = {name: result.captured.reference for name, result in quantized.items()}
    tolerances = verify_stage.default_tolerances("f32", "default", quantized=True)
    # The op-by-op check runs the lowerings the program was traced with: the bug stays in place for it too.
    with INT8_BUGS[bug]():
        lowered = {name: lower_stage.lower(result.captured.program, result.captured.signature) for name, result in quantized.items()}
        program = lower_stage.GenerationProgram(spec, lowered, (MAX_BATCH,))
        report = verify_stage.verify_quantized_generation(program, model, references, tolerances, new_tokens=4)
    assert not report.passed and not report.conformance["decode"].passed
    assert "do not reproduce the reference given its own inputs" in report.failure_summary()


def test_int8_generation_artifact_verifies_and_reports_sqnr(int8_generation):
    mode, cache, artifact = int8_generation
    entry_points = ["step"] if cache == "paged" else ["prefill", "decode"]
    manifest = artifact.manifest
    verification = manifest["verification"]
    assert verification["passed"] and verification["tokens_compared"] == MAX_BATCH * NEW_TOKENS
    assert verification["against"].startswith("the PT2E-converted step" if cache == "paged" else "the PT2E-converted entry points")
    assert verification["tolerances"]["cpu"]["quantization_steps"] > 0  # forward int8's rule
    report = json.loads((artifact.path / manifest["verification"]["report"]).read_text())
    assert sorted(report["conformance"]) == sorted(entry_points)
    assert all(check["passed"] and check["ops"] > 100 for check in report["conformance"].values())
    # The quantization section carries what the forward int8 path's does (coverage.py reads it).
    section = manifest["quantization"]
    assert section["mode"] == mode and section["integer_flops_fraction"] == 1.0
    [logits] = section["outputs"]
    assert logits["name"] == "logits" and 25.0 < logits["sqnr_db"] < 80.0
    quantization = json.loads((artifact.path / section["report"]).read_text())
    assert quantization["integer_flops"]["by_entry_point"] == dict.fromkeys(entry_points, 1.0)
    assert quantization["weight_bytes"]["ratio"] < 0.3
    # Per row (static), or the earliest of any row (paged, as weight-only's), if the float model departs.
    assert len(quantization["first_divergence"]) == MAX_BATCH if cache == "static" else len(quantization["first_divergence"]) <= 1
    assert all(entry["step"] is None or 0 <= entry["step"] < NEW_TOKENS for entry in quantization["first_divergence"])
    # The artifact generates, and `tpuexport verify` replays its stored cases.
    [tokens] = list(artifact.generate([[1, 2, 3, 4]], max_new_tokens=3))
    assert len(tokens) == 3
    gate = tpuexport.verify_artifact(artifact.path)
    assert gate.passed, [check.message for check in gate.checks]


def test_static_int8_generation_needs_calibration_prompts(tmp_path):
    model = tiny_llama()
    spec = export_stage.generation_spec(model, MAX_BATCH, MAX_CONTEXT, prefill_buckets=(16,))
    with pytest.raises(TpuExportError, match="needs calibration prompts: --calibration FILE"):
        calibration_prompts(spec, "int8", None, None, False)
    path = tmp_path / "prompts.npz"
    np.savez(path, tokens=np.array([[5, 6, 7, 0], [8, 9, 10, 11]]), lengths=np.array([3, 4]))
    assert calibration_prompts(spec, "int8", None, path, False) == ([[5, 6, 7], [8, 9, 10, 11]], "file")
    np.savez(path, input_ids=np.zeros((2, 4), np.int64))
    with pytest.raises(TpuExportError, match="store an integer array 'tokens'"):
        calibration_prompts(spec, "int8", None, path, False)
    with pytest.raises(TpuExportError, match="outside the vocabulary"):
        calibration_prompts(spec, "int8", [[1, 999]], None, False)
