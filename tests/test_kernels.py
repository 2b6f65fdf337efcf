"""TPU kernels per bucket (lower/kernels.py, verify/kernels.py, --kernels): a small attention model's
bucket compiles for v5e with Pallas flash attention, runs in interpret mode as eager PyTorch does,
planted wrong kernel arguments fail the kernel check, and --kernels none is the kernel-free build."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import tpuexport
from tpuexport.export import LoadedSource, capture
from tpuexport.lower import lower, lower_bucket_kernels
from tpuexport.lower.attention import flash_call
from tpuexport.verify.kernels import verify_kernel_use

KERNEL_SEQ, SHORT_SEQ = 256, 128


class CausalPaddedAttention(nn.Module):
    """Grouped-query self-attention over a right- or left-padded batch, its mask built as transformers
    builds one: a causal [q, k] compare of positions AND a per-key padding mask."""

    def __init__(self, hidden=128, heads=4, kv_heads=2, window: int | None = None, float_mask=False, padding=True,
                 masked_value=float("-inf")):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.kv = nn.Linear(hidden, 2 * kv_heads * self.head_dim)
        self.out = nn.Linear(hidden, hidden)
        self.window, self.float_mask, self.padding, self.masked_value = window, float_mask, padding, masked_value

    def forward(self, x, attention_mask):
        batch, seq, _ = x.shape
        query = self.q(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        key, value = self.kv(x).view(batch, seq, 2 * self.kv_heads, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        positions = torch.arange(seq, device=x.device)
        mask = positions[None, None, :, None] >= positions[None, None, None, :]
        if self.padding:
            mask = mask & attention_mask.bool()[:, None, None, :]
        if self.window is not None:
            mask = mask & (positions[None, None, :, None] - positions[None, None, None, :] < self.window)
        if self.float_mask:
            mask = torch.where(mask, 0.0, self.masked_value)
        attended = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
        return self.out(attended.transpose(1, 2).reshape(batch, seq, -1))


def _inputs(batch=2, seq=KERNEL_SEQ):
    x = torch.randn(batch, seq, 128, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq - seq // 4:] = 0  # right padding
    mask[1, : seq // 3] = 0  # left padding: the first rows see no key under the causal mask
    return x, mask


def _source(model: nn.Module) -> LoadedSource:
    seq = torch.export.Dim("seq", min=2, max=KERNEL_SEQ)
    return LoadedSource(model.eval(), _inputs(), {"x": {1: seq}, "attention_mask": {1: seq}}, None, None)


@pytest.fixture(scope="module")
def lowered():
    captured = capture(_source(CausalPaddedAttention()))
    return lower(captured.program, captured.signature)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """The model converted for v5e at seq 128 and 256, with --kernels auto and none."""
    model = CausalPaddedAttention().eval()
    built = {}
    for mode in ("auto", "none"):
        source = _source(model)
        built[mode] = tpuexport.convert(model, source.args, source.dynamic_shapes, target="v5e", buckets={"seq": [SHORT_SEQ, KERNEL_SEQ]},
                                        out=tmp_path_factory.mktemp(f"kernels_{mode}") / "attention.tpu", saved_model=False,
                                        verify_budget_flops=0, kernels=mode)
    return built


def _buckets(artifact) -> dict:
    return {bucket["sizes"]["seq"]: bucket for bucket in artifact.manifest["targets"]["v5e"]["buckets"]}


def test_kernel_bucket_compiles_for_v5e_with_flash_attention(artifacts):
    buckets = _buckets(artifacts["auto"])
    kernels = buckets[KERNEL_SEQ]["kernels"]
    assert kernels["program"] == "static with kernels"
    [use] = kernels["attention"]
    assert use["kernel"] == "flash_attention" and use["causal"] and use["key_mask"]
    assert use["shape"] == {"batch": 2, "heads": 4, "kv_heads": 2, "q": KERNEL_SEQ, "k": KERNEL_SEQ, "head_dim": 32}
    assert use["block_sizes"] == {"block_q": 256, "block_k_major": 256, "block_k": 256, "block_b": 1}
    short = buckets[SHORT_SEQ]["kernels"]
    assert short["program"] == "portable" and "128 keys" in short["reason"]
    [check] = artifacts["auto"].manifest["kernels"]["verification"]
    assert check["passed"] and check["relative_rms_error"] < 1e-4


def test_recompiling_the_artifact_compiles_the_kernel_program_again(artifacts):
    artifact = artifacts["auto"]
    programs, name = artifact.manifest["kernels"]["programs"], f"serving_default/{_buckets(artifact)[KERNEL_SEQ]['name']}"
    assert list(programs) == [name] and programs[name] in artifact.manifest["files"]
    report = tpuexport.verify_artifact(artifact.path, recompile=True)
    recompile = next(check for check in report.checks if check.name == "recompile")
    assert recompile.status == "passed", recompile.message
    assert report.passed, [(check.name, check.status, check.message) for check in report.checks]


def test_inspect_shows_the_kernels_per_bucket(artifacts):
    from click.testing import CliRunner

    from tpuexport.cli import main

    result = CliRunner().invoke(main, ["inspect", str(artifacts["auto"].path)])
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[2].strip(): line for line in result.output.splitlines() if line.count("│") > 5}
    assert "flash_attention 256" in rows[f"seq{KERNEL_SEQ}"] and "flash_attention" not in rows[f"seq{SHORT_SEQ}"]


def test_kernels_none_is_the_kernel_free_build(artifacts):
    auto, none = _buckets(artifacts["auto"]), _buckets(artifacts["none"])
    assert all("kernels" not in bucket for bucket in none.values())
    assert artifacts["none"].manifest["kernels"] == {"mode": "none", "programs": {}, "verification": []}
    # The bucket without kernels is the same executable either way; the kernel bucket is another program.
    assert auto[SHORT_SEQ]["fingerprint"] == none[SHORT_SEQ]["fingerprint"]
    assert auto[KERNEL_SEQ]["fingerprint"] != none[KERNEL_SEQ]["fingerprint"]


def test_kernel_program_in_interpret_mode_matches_eager(lowered):
    bucket = lower_bucket_kernels(lowered, {"seq": KERNEL_SEQ}, interpret=True)
    assert [use.kernel for use in bucket.uses] == ["flash_attention"]
    x, mask = _inputs()
    expected = CausalPaddedAttention().eval()(x, mask).detach().numpy()
    [actual] = lowered.run([x.numpy(), mask.numpy()], program=bucket.exported)
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)


PLANTED = {
    "causal flag": lambda q, k, v, keys, rows, causal, scale, blocks: flash_call(q, k, v, keys, rows, not causal, scale, blocks),
    "scale": lambda q, k, v, keys, rows, causal, scale, blocks: flash_call(q, k, v, keys, rows, causal, 1.0, blocks),
    "segment ids": lambda q, k, v, keys, rows, causal, scale, blocks: flash_call(q, k, v, None, rows, causal, scale, blocks),
    # query head h reads key/value head h % kv_heads instead of h // groups
    "GQA mapping": lambda q, k, v, keys, rows, causal, scale, blocks: flash_call(
        q, *(jnp.tile(t, (1, q.shape[1] // t.shape[1], 1, 1)) for t in (k, v)), keys, rows, causal, scale, blocks),
}


@pytest.fixture(scope="module")
def kernel_use(lowered):
    [use] = lower_bucket_kernels(lowered, {"seq": KERNEL_SEQ}).uses
    return use


def test_kernel_use_passes_its_interpret_mode_check(kernel_use):
    check = verify_kernel_use(kernel_use)
    assert check.passed and check.shape["q"] == KERNEL_SEQ


@pytest.mark.parametrize("dtype, causal, key_mask, query_mask", [
    ("bfloat16", False, True, True),  # an encoder's padding, rows masked too
    ("float32", True, False, False),  # is_causal alone
])
def test_other_mask_forms_pass_their_interpret_mode_check(dtype, causal, key_mask, query_mask):
    from tpuexport.lower.attention import plan_kernel

    use = plan_kernel((2, 4, 512, 64), (2, 4, 512, 64), (2, 4, 512, 64), jnp.dtype(dtype), causal, 0.125, key_mask, query_mask)
    check = verify_kernel_use(use)
    assert use.block_sizes["block_q"] == 512 and check.passed, check.to_json()


@pytest.mark.parametrize("bug", list(PLANTED))
def test_planted_wrong_kernel_arguments_fail(kernel_use, bug):
    check = verify_kernel_use(kernel_use, PLANTED[bug])
    assert not check.passed and check.error > 100 * check.tolerance


def test_a_planted_kernel_bug_keeps_the_portable_program(tmp_path, monkeypatch):
    """A wrong causal flag in the kernel call the TPU program is traced with: the conversion's
    interpret-mode check catches it and the bucket is compiled from the portable program."""
    from tpuexport.lower import attention

    monkeypatch.setattr(attention, "flash_call", PLANTED["causal flag"])
    model = CausalPaddedAttention()
    source = _source(model)
    artifact = tpuexport.convert(model, source.args, source.dynamic_shapes, target="v5e", out=tmp_path / "planted.tpu",
                                 saved_model=False, verify_budget_flops=0)
    [bucket] = artifact.manifest["targets"]["v5e"]["buckets"]
    assert bucket["kernels"]["program"] == "portable" and "failed verification in interpret mode" in bucket["kernels"]["reason"]
    [check] = artifact.manifest["kernels"]["verification"]
    assert not check["passed"] and artifact.manifest["kernels"]["programs"] == {}


@pytest.mark.parametrize("options, reason", [
    ({"window": 64}, "a mask other than causal and padding"),
    ({"float_mask": True}, "a float attention mask"),  # its padding part is read from the inputs
    ({"float_mask": True, "padding": False, "masked_value": -1e4}, "a float attention mask"),  # scores biased, not hidden
])
def test_masks_the_kernel_cannot_express_keep_the_portable_program(options, reason):
    captured = capture(_source(CausalPaddedAttention(**options)))
    bucket = lower_bucket_kernels(lower(captured.program, captured.signature), {"seq": KERNEL_SEQ})
    assert bucket.exported is None and reason in bucket.reason


@pytest.mark.parametrize("masked_value", [float("-inf"), torch.finfo(torch.float32).min])
def test_an_additive_causal_mask_from_sizes_alone_gets_the_kernel(masked_value):
    """0 where a key is seen and -inf or the dtype's lowest value elsewhere (text generation's prefill
    builds its causal mask so, as transformers does): the kernel's causal flag."""
    captured = capture(_source(CausalPaddedAttention(float_mask=True, padding=False, masked_value=masked_value)))
    bucket = lower_bucket_kernels(lower(captured.program, captured.signature), {"seq": KERNEL_SEQ})
    assert bucket.exported is not None and [(use.kernel, use.causal) for use in bucket.uses] == [("flash_attention", True)]


class RoutedAttention(nn.Module):
    """Causal attention whose output a router's top-k reads: the attention feeds a decision."""

    def __init__(self):
        super().__init__()
        self.attention, self.router = CausalPaddedAttention(padding=False), nn.Linear(128, 4)

    def forward(self, x, attention_mask):
        hidden = self.attention(x, attention_mask)
        weights, chosen = self.router(hidden).softmax(-1).topk(2)
        return hidden * weights.sum(-1, keepdim=True), chosen


def test_f32_attention_feeding_a_decision_keeps_its_pinned_precision_not_the_kernel():
    captured = capture(_source(RoutedAttention()))
    lowered = lower(captured.program, captured.signature)
    assert "attention" in {entry["module"] for entry in lowered.decision_matmuls}
    bucket = lower_bucket_kernels(lowered, {"seq": KERNEL_SEQ})
    assert bucket.exported is None and "feeds a discrete decision" in bucket.reason


def test_text_generation_prefill_gets_flash_attention_and_decode_says_why_not(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=2 * KERNEL_SEQ)
    model = transformers.LlamaForCausalLM(config).eval()
    artifact = tpuexport.convert(model, task="text-generation", max_context=2 * KERNEL_SEQ, max_batch=1, buckets={"seq": [KERNEL_SEQ]},
                                 target="v5e", out=tmp_path / "llama.tpu", weights=False)
    buckets = {bucket["entry_point"]: bucket for bucket in artifact.manifest["targets"]["v5e"]["buckets"]}
    prefill, decode = buckets["prefill"]["kernels"], buckets["decode"]["kernels"]
    assert prefill["program"] == "static with kernels"
    assert [(use["kernel"], use["causal"], use["shape"]["kv_heads"]) for use in prefill["attention"]] == [("flash_attention", True, 2)]
    assert decode["program"] == "portable" and "decode attention kernel is not used yet" in decode["reason"]
    kernels = artifact.manifest["kernels"]
    assert list(kernels["programs"]) == [f"prefill/seq{KERNEL_SEQ}"] and all(check["passed"] for check in kernels["verification"])
    assert kernels["programs"][f"prefill/seq{KERNEL_SEQ}"] in artifact.manifest["files"]


def test_unknown_kernels_mode_is_one_clear_error(tmp_path):
    model = CausalPaddedAttention()
    source = _source(model)
    with pytest.raises(tpuexport.TpuExportError, match=r"unknown --kernels 'fast'; use one of auto, none"):
        tpuexport.convert(model, source.args, source.dynamic_shapes, out=tmp_path / "x.tpu", kernels="fast")
    assert not (tmp_path / "x.tpu").exists()


def test_a_model_on_the_meta_device_gets_the_kernel():
    """Plans capture on the meta device; the mask's positions are evaluated on the CPU all the same."""
    with torch.device("meta"):
        model = CausalPaddedAttention()
    source = _source(model)
    source = LoadedSource(model, tuple(arg.to("meta") for arg in source.args), source.dynamic_shapes, None, None)
    captured = capture(source)
    bucket = lower_bucket_kernels(lower(captured.program, captured.signature, weights=False), {"seq": KERNEL_SEQ})
    assert bucket.exported is not None and [use.kernel for use in bucket.uses] == ["flash_attention"]


class TwoAttentions(nn.Module):
    """A causal-padded attention the kernel computes, then a sliding-window one it cannot."""

    def __init__(self):
        super().__init__()
        self.first, self.second = CausalPaddedAttention(), CausalPaddedAttention(window=64)

    def forward(self, x, attention_mask):
        return self.second(self.first(x, attention_mask), attention_mask)


def test_a_bucket_records_why_its_other_attention_keeps_xla():
    captured = capture(_source(TwoAttentions()))
    bucket = lower_bucket_kernels(lower(captured.program, captured.signature), {"seq": KERNEL_SEQ})
    assert bucket.exported is not None and [use.kernel for use in bucket.uses] == ["flash_attention"]
    assert "a mask other than causal and padding" in bucket.to_json()["other_attention"]
