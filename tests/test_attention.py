"""Attention lowered as JAX writes it (lower/attention.py): the same numbers as torch's
scaled_dot_product_attention in every mask form, without torch's f32 upcast or safe-softmax pass."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tpuexport import compile as compile_stage
from tpuexport.export import LoadedSource, SourceInfo, capture
from tpuexport.lower import lower
from tpuexport.lower.aten_lowerings import embedding
from tpuexport.lower.attention import scaled_dot_product_attention
from tpuexport.verify import verify


def _qkv(batch=2, heads=4, kv_heads=4, q_len=6, k_len=6, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, q_len, dim, generator=generator), torch.randn(batch, kv_heads, k_len, dim, generator=generator),
            torch.randn(batch, kv_heads, k_len, dim, generator=generator))


def _padding_mask(batch=2, q_len=6, k_len=6):
    """A boolean [batch, 1, q, k] mask whose second sequence has a fully masked query row."""
    mask = torch.ones(batch, 1, q_len, k_len, dtype=torch.bool)
    mask[1, :, :, k_len - 2:] = False
    mask[1, :, 2, :] = False
    return mask


CASES = {
    "plain": (dict(), {}),
    "causal": (dict(), {"is_causal": True}),
    "causal, longer keys": (dict(q_len=3, k_len=7), {"is_causal": True}),
    "bool mask with a fully masked row": (dict(), {"attn_mask": _padding_mask()}),
    "float mask with a fully masked row": (dict(), {"attn_mask": torch.where(_padding_mask(), 0.0, float("-inf"))}),
    "float mask, per head": (dict(), {"attn_mask": torch.randn(2, 4, 6, 6)}),
    "scale": (dict(), {"scale": 0.3}),
    "grouped-query": (dict(kv_heads=2), {"enable_gqa": True, "attn_mask": _padding_mask()}),
    "per-head bool mask, grouped-query": (dict(kv_heads=2), {"enable_gqa": True, "attn_mask": torch.rand(2, 4, 6, 6) > 0.3}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_in_every_mask_form(case):
    shapes, options = CASES[case]
    query, key, value = _qkv(**shapes)
    expected = F.scaled_dot_product_attention(query, key, value, **options).numpy()
    jax_options = {name: jnp.asarray(value.numpy()) if isinstance(value, torch.Tensor) else value for name, value in options.items()}
    actual = np.asarray(scaled_dot_product_attention(*(jnp.asarray(t.numpy()) for t in (query, key, value)), **jax_options))
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    if "fully masked" in case:
        assert np.all(actual[1, :, 2] == 0)  # torch's safe softmax: zeros, not NaN


def test_batch_dims_broadcast_as_torchs_do():
    """One row of queries over several rows of keys (Granite Speech's Q-Former over its audio windows),
    which torch broadcasts: it was refused as "cannot reshape array of shape (200, 4, 1, 3, 16)"."""
    query, _, _ = _qkv(batch=1, q_len=3)
    _, key, value = _qkv(batch=5, k_len=7, seed=1)
    expected = F.scaled_dot_product_attention(query, key, value).numpy()
    actual = np.asarray(scaled_dot_product_attention(*(jnp.asarray(t.numpy()) for t in (query, key, value))))
    assert actual.shape == (5, 4, 3, 8)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def test_bfloat16_operands_stay_bfloat16_and_match_torch_in_f32():
    query, key, value = _qkv(kv_heads=2)
    mask = _padding_mask()
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True).numpy()
    operands = [jnp.asarray(t.numpy()).astype(jnp.bfloat16) for t in (query, key, value)]
    actual = scaled_dot_product_attention(*operands, attn_mask=jnp.asarray(mask.numpy()), enable_gqa=True)
    assert actual.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(actual, np.float32), expected, rtol=3e-2, atol=3e-2)


class PaddedSelfAttention(nn.Module):
    """Self-attention over a padded batch, as encoders call it: a boolean [batch, 1, 1, seq] mask."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(32, 96)
        self.out = nn.Linear(32, 32)

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 4, 8).transpose(1, 2) for t in self.qkv(x).split(32, dim=2))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :].bool())
        return self.out(attended.transpose(1, 2).reshape(b, s, 32))


@pytest.fixture(scope="module")
def padded_attention():
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    batch, seq = torch.export.Dim("batch", min=1, max=16), torch.export.Dim("seq", min=2, max=32)
    return capture(LoadedSource(PaddedSelfAttention().eval(), (x, mask), {"x": {0: batch, 1: seq}, "mask": {0: batch, 1: seq}}, None,
                                SourceInfo("api")))


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_attention_stays_one_op_and_verifies(padded_attention, precision):
    lowered = lower(padded_attention.program, padded_attention.signature, precision)
    targets = [node.target for node in lowered.graph.graph.nodes]
    assert torch.ops.aten.scaled_dot_product_attention.default in targets
    assert torch.ops.aten._safe_softmax.default not in targets
    # Both attention matmuls are counted: 2 * 2 * heads * seq**2 * head_dim per sequence.
    assert lowered.matmul_flops.startswith("128*batch*seq**2")
    report = verify(lowered, padded_attention.reference, padded_attention.example_inputs)
    assert report.passed, report.failure_summary()
    dots = re.findall(r"stablehlo\.dot_general.*?:\s*\((tensor<[^>]*>), (tensor<[^>]*>)\)", lowered.exported.mlir_module())
    assert dots
    if precision == "bf16":  # no dot upcasts its operands to f32
        assert all(left.endswith("xbf16>") and right.endswith("xbf16>") for left, right in dots), dots


class AttentionLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.out = nn.Linear(32, 32)

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 4, 8).transpose(1, 2) for t in self.qkv(x).split(32, dim=2))
        return x + self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, 32))


class MaskedDecoder(nn.Module):
    """Layers reading one causal-and-padding mask built before them, as transformers builds it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([AttentionLayer() for _ in range(2)])

    def forward(self, x, padding):
        b, s, _ = x.shape
        positions = torch.arange(s)
        mask = (positions[None, None, None, :] <= positions[None, None, :, None]) & padding.bool()[:, None, None, :]
        mask = mask.expand(b, 1, s, s)
        for layer in self.layers:
            x = layer(x, mask)
        return x


def test_a_mask_built_before_the_layers_is_computed_in_each_layer():
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
    padding = torch.ones(2, 8, dtype=torch.long)
    padding[1, :2] = 0  # left padding: the second sequence's first two queries see no key
    batch, seq = torch.export.Dim("batch", min=1, max=16), torch.export.Dim("seq", min=2, max=32)
    model = capture(LoadedSource(MaskedDecoder().eval(), (x, padding), {"x": {0: batch, 1: seq}, "padding": {0: batch, 1: seq}},
                                 None, SourceInfo("api")))
    lowered = lower(model.program, model.signature)
    assert [run["count"] for run in lowered.scanned] == [2]
    for attention in [n for n in lowered.graph.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]:
        mask = attention.args[3]
        assert mask.target is torch.ops.aten.expand.default and mask.meta["nn_module_stack"] == attention.meta["nn_module_stack"]
    report = verify(lowered, model.reference, model.example_inputs)
    assert report.passed, report.failure_summary()
    [output] = lowered.run([x.numpy(), padding.numpy()])
    with torch.no_grad():
        expected = model.reference(x, padding).numpy()
    np.testing.assert_allclose(output[1, :2], expected[1, :2], atol=1e-5)  # fully masked rows: zeros from attention


def test_embedding_is_one_gather_clamping_out_of_range_ids():
    table = jnp.arange(12, dtype=jnp.float32).reshape(4, 3)
    rows = embedding(table, jnp.asarray([[0, 3, 4]]), padding_idx=0)
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(table)[[[0, 3, 3]]])


class ProjectedAttention(nn.Module):
    """BERT's self-attention at a width the TPU's (8, 128) tiles fit: q, k and v projections of
    [batch, seq, 256] into 4 heads of 64, a padding mask, the heads transposed back and projected."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v, self.out = (nn.Linear(256, 256) for _ in range(4))

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = (projection(x).view(b, s, 4, 64).transpose(1, 2) for projection in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.bool()[:, None, None, :])
        return self.out(attended.transpose(1, 2).reshape(b, s, 256))


def test_projected_attention_compiles_with_one_relayout_copy_per_operand():
    """The compiled v5e program copies each of q, k and v once into the layout attention reads, as
    a hand-written JAX model's does. Traced as torch decomposes it (the linear layers' dots over the
    merged [batch * seq, in] view, attention's result as [batch, heads, seq, dim]), XLA copied q and
    k twice and the result once more (5 copies; at BERT-base's width 8, 1.13x the bytes)."""
    x = torch.randn(8, 128, 256, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(8, 128, dtype=torch.long)
    mask[1, 100:] = 0
    model = capture(LoadedSource(ProjectedAttention().eval(), (x, mask), None, None, SourceInfo("api")))
    lowered = lower(model.program, model.signature)
    [target] = compile_stage.resolve_targets(["v5e"])
    [compiled] = compile_stage.compile_program(lowered, [target], compile_stage.make_buckets(lowered.signature, None)).results
    entry = compiled.hlo_text[compiled.hlo_text.index("\nENTRY"):]
    copies = re.findall(r"= (\S+) copy\(", entry)
    assert len(copies) <= 3, copies
    [output] = lowered.run([x.numpy(), mask.numpy()])
    with torch.no_grad():
        np.testing.assert_allclose(output, model.reference(x, mask).numpy(), atol=1e-5, rtol=1e-5)
