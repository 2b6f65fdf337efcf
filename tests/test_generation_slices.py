"""Text generation on slices: each slice plan's prefill and decode run partitioned on virtual CPU
devices, the KV cache carried between them, against the generation verification's eager
references (verify/sharded_generation.py); a plan that changes what generation computes fails the
conversion (real torch, jax, libtpu and transformers; a tiny GQA Llama, 4 heads over 2 kv heads)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

import tpuexport
from conftest import forced_devices, twin_and_one_device_tokens
from tpuexport.verify.sharded import read_array, write_array

MAX_CONTEXT, MAX_BATCH = 64, 2
# A 4-chip v5e slice; prefill compiled at one bucket (2 rows of 16 tokens), decode at max batch.
COMMON = dict(task="text-generation", max_context=MAX_CONTEXT, max_batch=MAX_BATCH, buckets={"seq": [16], "batch": [MAX_BATCH]},
              target="v5e-4")


def tiny_llama(**options) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128), **options})
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{plan: artifact} of the tiny Llama, tensor-parallel (heads over model, batch over data; also for the slice's CPU
    twin cpu-4 and one CPU device) and data-parallel."""
    out = tmp_path_factory.mktemp("slices")
    model = tiny_llama()
    return {
        "tensor-parallel": tpuexport.convert(model, **{**COMMON, "target": ["v5e-4", "cpu-4", "cpu"]}, sharding="tensor-parallel",
                                             mesh="model=2,data=2", out=out / "tp.tpu"),
        "data-parallel": tpuexport.convert(model, **COMMON, sharding="data-parallel", mesh="data=2,replica=2", out=out / "dp.tpu"),
    }


@pytest.mark.parametrize("plan, cache_spec", [("tensor-parallel", [None, "data", "model", None, None]),
                                              ("data-parallel", [None, "data", None, None, None])])
def test_each_plan_generates_partitioned_as_generate_does(converted, plan, cache_spec):
    manifest = converted[plan].manifest
    [run] = manifest["verification"]["sharded"]
    # One plan, verified once, for the slice and its CPU twin.
    assert run["passed"] and run["targets"] == (["v5e-4", "cpu-4"] if plan == "tensor-parallel" else ["v5e-4"]) and run["devices"] == 4
    # The verified case: rows of different lengths, the shorter right-padded in its bucket, then decode steps.
    case = run["case"]
    assert case["passed"] and case["sizes"] == {"batch": MAX_BATCH, "seq": 16} and case["lengths"] == [16, 4] and case["new_tokens"] == 8
    # Partitioned for real: XLA:CPU inserted collectives in both entry points.
    assert set(run["collectives"]) == {"prefill", "decode"}
    assert all(kinds for kinds in run["collectives"].values()), run["collectives"]
    if plan == "tensor-parallel":  # the row-parallel o_proj and down_proj sum their partial products
        assert run["collectives"]["decode"]["all-reduce"]["count"] >= 2 * 2
    # The cache donated and updated in place (its two tensors aliased), and left by prefill in the layout decode takes.
    assert run["aliased_outputs"] == {"prefill": 2, "decode": 2} and run["resharded_calls"] == []
    report = json.loads((converted[plan].path / "verification" / "report.json").read_text())
    [full] = report["sharded"]
    assert full["inputs"]["decode"]["cache_k"] == cache_spec and full["inputs"]["prefill"]["cache_v"] == cache_spec
    assert all(entry["tokens_compared"] == MAX_BATCH * 8 and not entry["differences"] for entry in full["case"]["runs"].values())


def lm_head_that_cancels() -> transformers.PreTrainedModel:
    """A Llama whose logits XLA:CPU computes bit for bit as PyTorch does, unless lm_head's sum is split.

    The hidden state reaching lm_head is the token's embedding, exactly: entries +-1, attention and
    MLP outputs zeroed (o_proj, down_proj), RMSNorm without epsilon (mean square 1, rsqrt 1). Each
    logit is then a sum over 64 products of which three are nonzero: +-32 at features 0 and 32,
    k * 2**-20 at feature 33. Added in feature order (PyTorch, and XLA:CPU on one device or with the
    vocabulary split) the two 32s cancel first and the small term survives; split by features over
    two devices, the second half rounds -32 + k * 2**-20 to -32 before the all-reduce, and it is lost.
    """
    model = tiny_llama(rms_norm_eps=0.0)
    generator = torch.Generator().manual_seed(0)

    def signs(*shape):
        return torch.randint(0, 2, shape, generator=generator).float() * 2 - 1

    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(signs(256, 64))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(256, 64)
        head[:, 0], head[:, 32] = 32 * signs(256), 32 * signs(256)
        head[:, 33] = torch.randint(-3, 4, (256,), generator=generator).float() * 2**-20
        model.lm_head.weight.copy_(head)
    return model


def test_the_cpu_twin_generates_sharded_the_tokens_of_one_device(converted):
    artifact = converted["tensor-parallel"]
    assert artifact.manifest["targets"]["cpu-4"]["sharding"] == artifact.manifest["targets"]["v5e-4"]["sharding"]
    prompts = [[5, 17, 42, 7, 9], [3, 1]]
    state = twin_and_one_device_tokens(artifact.path, prompts, 8, more=(
        "empty = np.zeros(sharded.entry_point('prefill').signature.inputs[3].shape, np.float32)\n"
        "cache = sharded.execute(sharded.prepare([[[1] * 16, [2] * 16], [16, 1], [0, 1], empty, empty], 'prefill'), on_device=True)\n"
        "state['cache_spec'] = [str(part) for part in cache.outputs['cache_k'].sharding.spec]"))

    assert state["target"] == "cpu-4" and state["devices"] == 4 and state["compilations"] == 0
    sharded, single = state["tokens"]
    assert sharded == single and len(sharded) == 8
    assert [list(row) for row in zip(*sharded)] == artifact.generate(prompts, 8, ignore_eos=True)  # steps -> prompts
    # The cache stays on the devices as the plan lays it out: slots over data, kv heads over model.
    assert state["cache_spec"][:3] == ["None", "data", "model"]
    # `tpuexport generate` in the same four-device setting (the runner picks cpu-4 there) prints the same tokens.
    printed = subprocess.run([sys.executable, "-m", "tpuexport.cli", "generate", str(artifact.path), "--tokens", "5,17,42,7,9",
                              "--tokens", "3,1", "--max-new-tokens", "8", "--ignore-eos"], capture_output=True, text=True, timeout=300,
                             env=forced_devices(4))
    assert printed.returncode == 0, printed.stderr[-3000:]
    assert [[int(token) for token in line.split()] for line in printed.stdout.splitlines()[:8]] == sharded


def test_a_plan_that_changes_the_logits_fails_the_conversion(tmp_path):
    # Exact tolerances (and f32 matmuls on the TPU too): the unsharded verification passes bit for bit;
    # the plan splits lm_head's features (not its vocabulary, as tensor-parallel does) over `model`.
    exact = dict(matmul_precision="highest", tolerances={"atol": 0.0, "rtol": 0.0, "scale_tol": 0.0})
    expected = (r"the sharded entry points \(v5e-4: mesh model=2,data=2, tensor-parallel, on 4 CPU devices\) do not match eager PyTorch "
                r"in prefill batch2_seq16 \+ 8 tokens: tpu run, output 'logits' .* first outside tolerance at prefill, "
                r"largest error at (prefill|decode step \d) row \d")
    with pytest.raises(tpuexport.VerificationError, match=expected) as failure:
        tpuexport.convert(lm_head_that_cancels(), **COMMON, sharding="tensor-parallel", mesh="model=2,data=2", rules=["lm_head=None,model"],
                          out=tmp_path / "lm.tpu", **exact)
    assert not (tmp_path / "lm.tpu").exists()
    report = json.loads(failure.value.report_path.read_text())
    assert report["passed"] and report["tokens_compared"] == MAX_BATCH * 8  # one device: exact
    [run] = report["sharded"]
    assert not run["passed"] and run["inputs"]["decode"]["cache_k"] == [None, "data", "model", None, None]
    assert run["collectives"]["decode"]["all-reduce"]["count"] >= 1
    logits = run["case"]["runs"]["cpu"]["logits"]
    # Only the small terms are lost: 2**-20 at most 3 times, on the logits where they survived.
    assert 0 < logits["max_abs_error"] <= 3 * 2**-20 and 0 < logits["mismatched"] < logits["elements"]


def test_arrays_reach_the_sharded_child_with_their_shapes(tmp_path):
    """Gemma 2's scalar weights went to the child as shape (1,) and its sharded run raised "Rank
    mismatch ... expected () and called with (1,)"; strided views must arrive as their values."""
    for index, array in enumerate((np.asarray(np.float32(2.5)), np.arange(6, dtype=np.int8).reshape(2, 3), np.ones((3, 4))[:, ::2])):
        back = read_array(write_array(array, tmp_path / f"{index}.bin"))
        assert back.shape == array.shape and back.dtype == array.dtype and np.array_equal(back, array)
