"""ALiBi decoders (BLOOM's and MPT's biases) over the KV cache: each key biased by its position, as the
model's own code biases a prompt run at once, though the entry points give a prepared mask over the
cache's keys (BLOOM counts positions over a 2D padding mask) and a prompt of any length (MPT slices a
bias built at max_seq_len to the keys' count, which torch.export fixed at the example's)."""

from __future__ import annotations

import pytest
import torch
import transformers

from tpuexport import export as export_stage
from tpuexport import lower as lower_stage
from tpuexport.verify import verify_generation
from test_generation import lowered_entry_point

MAX_CONTEXT, MAX_BATCH, NEW_TOKENS = 64, 2, 8


def tiny_bloom() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)
    return transformers.BloomForCausalLM(config).eval()


def tiny_mpt() -> transformers.PreTrainedModel:
    """Six heads: not a power of two, so its slopes interleave two series (build_mpt_alibi_tensor)."""
    torch.manual_seed(0)
    config = transformers.MptConfig(vocab_size=256, d_model=96, n_layers=2, n_heads=6, max_seq_len=MAX_CONTEXT)
    return transformers.MptForCausalLM(config).eval()


@pytest.mark.parametrize("family", [tiny_bloom, tiny_mpt], ids=["bloom", "mpt"])
def test_alibi_entry_points_generate_what_generate_does(family):
    """Prompts of up to 16 tokens in one prefill batch, rows of different lengths, then 8 decode steps each
    over all 64 cached positions: the logits and greedy tokens of generate()."""
    model = family()
    spec = export_stage.generation_spec(model, MAX_BATCH, MAX_CONTEXT, prefill_buckets=(16,))
    modules = export_stage.entry_point_modules(model, spec)
    entry_points = {name: lowered_entry_point(modules[name], spec, name) for name in ("prefill", "decode")}
    report = verify_generation(lower_stage.GenerationProgram(spec, entry_points, (MAX_BATCH,)), model, new_tokens=NEW_TOKENS)
    assert report.passed, report.failure_summary()
    assert report.tokens_compared() == MAX_BATCH * NEW_TOKENS
    assert len(set(report.cases[0].lengths)) == MAX_BATCH
