"""An int8 paged KV cache (--kv-cache paged --kv-cache-dtype int8): int8 pages with a scale per position,
kv head, keys and values; verified against the same step run eagerly (greedy, in the same session
steps), its distance from the float model's generate() measured; what a token sees does not depend on
how its prompt was chunked; planted scale bugs fail the comparison (real torch, jax and transformers;
the tiny Llama of test_paged, the cpu target)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tpuexport
from test_generation import tiny_llama
from test_paged import PAGED, PAGE_SIZE, TOKENS, replay_passes
from tpuexport.export.paged import Step
from tpuexport.lower.paged import PagedSession
from tpuexport.verify.paged_generation import greedy_logits
from tpuexport.verify.quantized_generation import torch_runner


@pytest.fixture(scope="module")
def int8_paged(tmp_path_factory):
    """(artifact, model) of the tiny Llama over int8 pages, for the cpu target."""
    model = tiny_llama()
    artifact = tpuexport.convert(model, **PAGED, kv_cache_dtype="int8", target="cpu", out=tmp_path_factory.mktemp("paged_int8") / "llama.tpu")
    return artifact, model


def test_int8_pages_generate_what_the_eager_int8_step_does(int8_paged):
    artifact, model = int8_paged
    manifest = artifact.manifest
    generation, verification = manifest["generation"], manifest["verification"]
    layers, pages, kv_heads, head_dim = 2, generation["num_pages"], 2, 16
    assert generation["kv_cache_dtype"] == "int8" and generation["cache_inputs"] == ["cache_kv", "cache_kv_scale"]
    assert generation["cache_shape"] == [layers, pages, PAGE_SIZE, kv_heads * 2 * head_dim]
    assert generation["scale_shape"] == [layers, pages, PAGE_SIZE, 2 * kv_heads]
    # int8 pages and float32 scales: a quarter of the float pages, plus 4 bytes per 16 values.
    assert generation["cache_bytes"] == layers * pages * PAGE_SIZE * (kv_heads * 2 * head_dim + 2 * kv_heads * 4)
    assert verification["passed"] and verification["against"] == "the int8-KV entry points' greedy generation, eager PyTorch"
    # Measured against the float model's generate(), not gated: far above the low-SQNR warning's 15 dB.
    divergence = json.loads((artifact.path / verification["report"]).read_text())["float_divergence"]
    assert divergence["against"] == "generate(do_sample=False) of the float model" and divergence["sqnr_db"] > 30
    # Artifact.generate (the lowered step on CPU) gives the eager int8 step's greedy tokens for new prompts.
    prompts = [[int(token) for token in np.random.default_rng(7).integers(0, 256, 13)], [5, 6]]
    eager_tokens, _ = greedy_logits(PagedSession(artifact.generation_program, torch_runner({"step": Step(model, artifact.generation_program.spec)})),
                                    prompts, [1, 0], TOKENS // 2, {"tokens": TOKENS, "rows": 2}, 6)
    assert artifact.generate(prompts, 6, ignore_eos=True) == eager_tokens


def test_a_token_sees_the_same_keys_whatever_the_chunking(int8_paged):
    """The step attends to its own tokens' keys as stored (quantized and dequantized): a prompt prefilled
    in chunks of 1, 3 or 8 gives the same logits up to float rounding."""
    artifact, _ = int8_paged
    program = artifact.generation_program
    prompt = [[int(token) for token in np.random.default_rng(2).integers(0, 256, 12)]]
    logits = [greedy_logits(PagedSession(program), prompt, [0], chunk, {"tokens": TOKENS, "rows": 2}, 4)[1] for chunk in (1, 3, 8)]
    for other in logits[1:]:
        np.testing.assert_allclose(other, logits[0], atol=2e-5, rtol=1e-5)


def test_planted_scale_bugs_fail_the_comparison(int8_paged):
    """The stored case replayed through the step passes; with each position's keys' and values' scales
    swapped, or the scales' pages shifted by one, the logits leave the eager int8 step's."""
    artifact, _ = int8_paged

    def swapped(inputs):
        scales = np.asarray(inputs[6])
        return [*inputs[:6], scales.reshape(*scales.shape[:-1], -1, 2)[..., ::-1].reshape(scales.shape).copy()]

    def shifted(inputs):
        return [*inputs[:6], np.roll(np.asarray(inputs[6]), 1, axis=1)]

    assert replay_passes(artifact)
    assert not replay_passes(artifact, swapped)
    assert not replay_passes(artifact, shifted)
