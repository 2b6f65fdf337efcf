"""Multi-chip slices: names and topologies, each sharding preset and explicit rules compiled for an
8-chip v5e slice and verified sharded on 8 virtual CPU devices, bad input, and the CLI (real torch,
jax and libtpu; examples/decoder.py is a tiny Llama-style decoder with Llama's weight names)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

import tpuexport
from conftest import EXAMPLES, build_example
from tpuexport import compile as compile_stage
from test_cli import tpuexport_in_process as tpuexport_cli  # the command line, in this process

VOCAB = 256
LOGITS_BYTES = 8 * 16 * VOCAB * 4  # f32 logits at the example batch 8, seq 16


def convert_decoder(out: pathlib.Path, **options) -> tpuexport.Artifact:
    built = build_example("decoder")
    return tpuexport.convert(built["model"], built["args"], built["dynamic_shapes"], out=out, saved_model=False,
                             verify_budget_flops=0, **options)


def specs(artifact: tpuexport.Artifact, target: str = "v5e-8") -> tuple[dict, dict]:
    plan = artifact.manifest["targets"][target]["sharding"]["serving_default"]
    return plan["weights"], plan["inputs"]


def only_bucket(artifact: tpuexport.Artifact, target: str = "v5e-8") -> dict:
    [bucket] = artifact.manifest["targets"][target]["buckets"]
    return bucket


def sharded_run(artifact: tpuexport.Artifact) -> dict:
    [run] = artifact.manifest["verification"]["sharded"]
    assert run["passed"] and run["devices"] == 8 and run["cases"], run
    return run


def weight_bytes(artifact: tpuexport.Artifact) -> int:
    return artifact.manifest["program"]["weight_bytes"]


def test_slice_names_count_chips_or_tensorcores_and_their_topologies_build():
    v5e_8, v5p_8, v5p_128, v6e_8, ironwood_8 = compile_stage.resolve_targets(["v5e-8", "v5p-8", "v5p-128", "v6e-8", "7x-8"])
    assert (v5e_8.chips, v5e_8.devices, v5e_8.topology, v5e_8.hbm_bytes_per_device) == (8, 8, "v5e:2x4", 16 * 2**30)
    assert (v5p_8.chips, v5p_8.devices, v5p_8.name_counts) == (4, 4, "TensorCores")
    assert (v5p_128.chips, v5p_128.topology) == (64, "v5p:4x4x4")
    assert (v6e_8.chips, v6e_8.hbm_bytes) == (8, 32 * 2**30)
    assert (ironwood_8.chips, ironwood_8.devices, ironwood_8.hbm_bytes_per_device) == (4, 8, 96 * 2**30)
    # Cloud TPU's other spellings name the same slices; single chips keep their names.
    assert [t.name for t in compile_stage.resolve_targets(["v5litepod-8", "v5e-8", "tpu7x-8", "7x-8", "v5e"])] == ["v5e-8", "7x-8", "v5e"]
    # Every listed slice builds with libtpu's compile-only topology and has the devices it claims
    # (in a child: libtpu never loads in the test process, as in a user's).
    probe = textwrap.dedent("""
        import json, sys
        import jax
        jax.config.update("jax_platforms", "cpu")
        from jax.experimental import topologies
        print(json.dumps({name: len(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)
                          for name in json.loads(sys.argv[1])}))
    """)
    topologies = {t.topology: t.devices for t in compile_stage.SLICES.values()}
    result = subprocess.run([sys.executable, "-c", probe, json.dumps(list(topologies))], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == topologies


def test_unknown_slices_and_v4_slices_are_refused_with_the_reason():
    with pytest.raises(tpuexport.TpuExportError, match=r"v5e slices \(the number counts chips\) are: v5e-4, v5e-8"):
        compile_stage.resolve_targets(["v5e-6"])
    with pytest.raises(tpuexport.TpuExportError, match="megacore"):
        compile_stage.resolve_targets(["v4-8"])
    assert compile_stage.resolve_targets(["v4"])[0].chips == 1  # the single chip stays


def test_replicated_is_the_default_plan_and_exchanges_nothing(tmp_path):
    artifact = convert_decoder(tmp_path / "replicated.tpu", target="v5e-8")
    weights, inputs = specs(artifact)
    assert all(spec == [] for spec in weights.values()) and inputs == {"tokens": []}
    target = artifact.manifest["targets"]["v5e-8"]
    assert (target["chips"], target["devices"], target["hbm_bytes_per_device"]) == (8, 8, 16 * 2**30)
    assert sorted(target["device_ids"]) == list(range(8))
    bucket = only_bucket(artifact)
    assert bucket["collectives"] == {}
    # every chip holds every weight (f32) and the whole batch of int32 tokens, and returns all logits
    assert bucket["memory"]["argument_bytes"] >= weight_bytes(artifact) + 8 * 16 * 4
    assert bucket["memory"]["output_bytes"] >= LOGITS_BYTES
    assert sharded_run(artifact)["collectives"] == {}


def test_data_parallel_splits_the_batch_and_keeps_weights_whole(tmp_path):
    artifact = convert_decoder(tmp_path / "dp.tpu", target="v5e-8", sharding="data-parallel")
    weights, inputs = specs(artifact)
    assert inputs == {"tokens": ["data"]} and all(spec == [] for spec in weights.values())
    assert artifact.manifest["targets"]["v5e-8"]["sharding"]["serving_default"]["mesh"] == {"axes": ["data"], "shape": [8]}
    bucket = only_bucket(artifact)
    assert bucket["memory"]["argument_bytes"] >= weight_bytes(artifact)
    assert bucket["memory"]["output_bytes"] < LOGITS_BYTES / 4  # each chip returns its eighth of the batch
    assert "all-reduce" not in bucket["collectives"]  # every chip computes its own rows
    sharded_run(artifact)


def test_sharded_run_uses_the_first_bucket_when_no_verified_size_splits_evenly(tmp_path):
    # The verified batches (4, the example, and 1, the minimum) do not split over data=8; the bucket 16 does.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10)).eval()
    artifact = tpuexport.convert(model, (torch.randn(4, 32),), {"input": {0: torch.export.Dim("batch", min=1, max=100)}},
                                 target="v5e-8", sharding="data-parallel", buckets={"batch": [16]}, out=tmp_path / "mlp.tpu",
                                 saved_model=False, verify_budget_flops=0)
    assert all(case["sizes"]["batch"] % 8 for case in artifact.manifest["verification"]["cases"])
    [case] = sharded_run(artifact)["cases"]
    assert case["label"] == "bucket batch16" and case["sizes"] == {"batch": 16} and "splits evenly" in case["reason"]


@pytest.fixture(scope="module")
def tensor_parallel_cli(tmp_path_factory):
    """examples/decoder.py converted through the command line (in this process) for v5e-8, mesh data=2,model=4,
    tensor-parallel, with one --shard rule that splits nothing (score.bias whole, as the preset leaves it, but
    recorded as the rule's [None]): (the command's CompletedProcess, the artifact's path)."""
    out = tmp_path_factory.mktemp("tp-cli") / "decoder.tpu"
    result = tpuexport_cli("convert", f"{EXAMPLES / 'decoder.py'}:build", "--target", "v5e-8", "--mesh", "data=2,model=4",
                           "--sharding", "tensor-parallel", "--shard", r"score\.bias=None", "--no-saved-model", "--verify-budget", "0",
                           "-o", out, "--json")
    return result, out


def test_tensor_parallel_splits_heads_and_mlp_columns_then_rows(tensor_parallel_cli):
    result, out = tensor_parallel_cli
    assert result.returncode == 0, result.stderr
    artifact = tpuexport.load(out)
    weights, inputs = specs(artifact)
    # The two layers are scanned: each weight is a stack of both layers' (axis 0, left whole), laid
    # out as one layer's.
    assert artifact.manifest["scanned"][0]["count"] == 2
    for column in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert weights[f"layers.0-1.{column}.weight"] == [None, "model"], column
    for row in ("self_attn.o_proj", "mlp.down_proj"):
        assert weights[f"layers.0-1.{row}.weight"] == [None, None, "model"], row
    assert weights["layers.0-1.input_layernorm.weight"] == []
    assert weights["embed_tokens.weight"] == ["model"] and weights["lm_head.weight"] == ["model"]
    assert weights["score.weight"] == [] and inputs == {"tokens": ["data"]}
    bucket = only_bucket(artifact)
    # One all-reduce after each row-parallel projection (2 in the layer the scan runs, 2 more in the
    # layer that runs before it when its carry's type settles), one for the vocabulary-split
    # embedding; attention keeps each chip's heads (no all-gather of q, k or v).
    assert bucket["collectives"]["all-reduce"]["count"] in (3, 5), bucket["collectives"]
    assert "all-gather" not in bucket["collectives"]
    assert bucket["memory"]["argument_bytes"] < weight_bytes(artifact)
    assert sharded_run(artifact)["collectives"]["all-reduce"]["count"] >= 3  # ops in the HLO: the scan's body counts once
    # The artifact's own CPU run is the unsharded program, still equal to eager.
    built = build_example("decoder")
    tokens = torch.randint(0, VOCAB, (3, 11))
    with torch.no_grad():
        expected = built["model"](tokens)
    np.testing.assert_allclose(artifact.run(tokens)["logits"].numpy(), expected["logits"].numpy(), atol=1e-4, rtol=1e-4)


def test_tensor_parallel_int8_splits_the_integer_weights_with_their_scales(tmp_path):
    calibration = [(torch.randint(0, VOCAB, (8, 16)),) for _ in range(4)]
    artifact = convert_decoder(tmp_path / "int8.tpu", target="v5e-8", mesh="data=2,model=4", sharding="tensor-parallel",
                               quantize="int8", calibration=calibration)
    weights, _ = specs(artifact)
    assert weights["layers.0.self_attn.q_proj.weight_int8"] == ["model"] and weights["layers.0.self_attn.q_proj.weight_scale"] == ["model"]
    assert weights["layers.0.mlp.down_proj.weight_int8"] == [None, "model"] and weights["layers.0.mlp.down_proj.weight_scale"] == []
    bucket = only_bucket(artifact)
    assert next(iter(bucket["matmul_flops"])) == "s8xs8->s32"  # the split matmuls still run in int8 on each chip
    assert bucket["collectives"]["all-reduce"]["count"] >= 4
    sharded_run(artifact)


def test_fsdp_splits_each_weights_largest_divisible_dim(tmp_path):
    artifact = convert_decoder(tmp_path / "fsdp.tpu", target="v5e-8", sharding="fsdp")
    weights, inputs = specs(artifact)
    assert weights["embed_tokens.weight"] == ["data"]  # (256, 64)
    assert weights["layers.0-1.mlp.down_proj.weight"] == [None, None, "data"]  # 2 x (64, 128)
    assert weights["layers.0-1.self_attn.q_proj.weight"] == [None, "data"]  # 2 x (64, 64): the first of equal dims
    assert weights["score.weight"] == [None, "data"]  # (3, 64): 3 does not divide, 64 does
    assert weights["score.bias"] == []  # (3,) stays whole
    assert any("score.bias" in note for note in artifact.manifest["targets"]["v5e-8"]["sharding"]["serving_default"]["notes"])
    assert inputs == {"tokens": ["data"]}
    bucket = only_bucket(artifact)
    assert "all-gather" in bucket["collectives"]  # weights are gathered where they are used
    assert bucket["memory"]["argument_bytes"] < weight_bytes(artifact)
    sharded_run(artifact)


def test_explicit_rules_apply_after_the_preset_and_later_rules_win(tmp_path):
    rules = [r"_proj\.weight$=model", r"(o_proj|down_proj)\.weight$=None,model", ("lm_head", ("model", None))]
    artifact = convert_decoder(tmp_path / "rules.tpu", target="v5e-8", mesh={"model": 8}, rules=rules,
                               input_rules={"tokens": "None,None"})
    weights, inputs = specs(artifact)
    assert weights["layers.0-1.self_attn.k_proj.weight"] == [None, "model"]
    assert weights["layers.0-1.self_attn.o_proj.weight"] == [None, None, "model"]  # the later rule won
    assert weights["lm_head.weight"] == ["model", None] and weights["embed_tokens.weight"] == []
    assert inputs == {"tokens": [None, None]}
    plan = artifact.manifest["targets"]["v5e-8"]["sharding"]["serving_default"]
    assert plan["preset"] == "replicated" and plan["rules"][-1] == "input:tokens=None,None"
    assert only_bucket(artifact)["collectives"]["all-reduce"]["count"] >= 2  # o_proj and down_proj in the scan's body
    sharded_run(artifact)


class RowParallelProbe(nn.Module):
    """x @ W with W (64, 64): a rule splitting W's 64 rows over 8 chips makes each chip add 8 products."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 64))

    def forward(self, x):
        return x @ self.weight


def test_a_plan_that_changes_the_numbers_fails_verification(tmp_path):
    # Exact tolerances: unsharded, XLA:CPU adds this 64-term dot product in the order PyTorch does
    # (so does each chip on its batch row under data-parallel); split by rows, 8 partial sums of 8
    # terms are all-reduced, which rounds differently. Bit-level, so it depends on the pinned
    # versions' CPU kernels: the data-parallel conversion is the control that shows the order matches.
    torch.manual_seed(0)
    model, x = RowParallelProbe().eval(), torch.randn(8, 64)
    common = dict(saved_model=False, verify_budget_flops=0, matmul_precision="highest", tolerances={"atol": 0.0, "rtol": 0.0, "scale_tol": 0.0})
    tpuexport.convert(model, (x,), target="v5e-8", sharding="data-parallel", out=tmp_path / "batch.tpu", **common)
    with pytest.raises(tpuexport.VerificationError, match=r"sharded program \(v5e-8: mesh model=8.*on 8 CPU devices\)") as failure:
        tpuexport.convert(model, (x,), target="v5e-8", mesh="model=8", rules=["^weight$=model"], out=tmp_path / "rows.tpu", **common)
    assert not (tmp_path / "rows.tpu").exists()
    report = json.loads(failure.value.report_path.read_text())
    assert report["passed"] and not report["sharded"][0]["passed"]
    assert report["sharded"][0]["collectives"]["all-reduce"]["count"] >= 1


@pytest.fixture(scope="module")
def lowered_decoder():
    from tpuexport import export as export_stage
    from tpuexport import lower as lower_stage

    built = build_example("decoder")
    captured = export_stage.capture(export_stage.LoadedSource(built["model"], built["args"], built["dynamic_shapes"], None,
                                                              export_stage.SourceInfo("api")))
    lowered = lower_stage.lower(captured.program, captured.signature)
    return lowered, compile_stage.make_buckets(captured.signature, None)


@pytest.mark.parametrize("request_options, message", [
    ({"mesh": "data=2,model=2"}, "mesh data=2,model=2 has 4 devices but v5e-8 has 8 chips"),
    ({"mesh": "data=8", "sharding": "tensor-parallel"}, "splits over a mesh axis named 'model', which mesh data=8 lacks"),
    ({"mesh": "model=8", "rules": ["q_proj=tensor"]}, "--shard q_proj uses mesh axis 'tensor', which mesh model=8 lacks"),
    ({"mesh": "model=8", "rules": ["cross_attn=model"]}, "--shard pattern 'cross_attn' matches no weight"),
    ({"mesh": "model=8", "rules": [r"score\.weight=model"]},
     "weight 'score.weight' dim 0 has size 3, not divisible by mesh axis model=8 (8 parts)"),
    ({"mesh": "model=8", "input_rules": ["tokens=None,model"], "buckets": {"seq": [12]}},
     "input 'tokens' at bucket batch8_seq12 dim 1 has size 12, not divisible by mesh axis model=8"),
    ({"mesh": "model=8", "input_rules": ["ids=model"]}, "--shard-input names unknown input 'ids'; the inputs are tokens"),
])
def test_bad_plans_are_one_line_errors(lowered_decoder, request_options, message):
    lowered, buckets = lowered_decoder
    options = dict(request_options)
    if "buckets" in options:
        buckets = compile_stage.make_buckets(lowered.signature, options.pop("buckets"))
    [target] = compile_stage.resolve_targets(["v5e-8"])
    with pytest.raises(tpuexport.TpuExportError) as error:
        request = compile_stage.make_request(options.get("mesh"), options.get("sharding"), options.get("rules", ()),
                                             options.get("input_rules", ()))
        compile_stage.plan_sharding(request, target, lowered.weight_names, lowered.weights, lowered.signature, buckets,
                                    lowered.stacked)
    assert message in str(error.value) and "\n" not in str(error.value)


class WideInput(nn.Module):
    """A 4096-feature linear layer: at a batch of 2^20 its f32 input alone is 16 GiB."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4096, 8)

    def forward(self, x):
        return self.proj(x)


def test_plans_that_do_not_fit_a_chip_name_the_largest_buffers(tmp_path):
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=1, max=2**21)
    common = dict(args=(torch.randn(8, 4096),), dynamic_shapes={"x": {0: batch}}, buckets={"batch": [2**20]}, saved_model=False,
                  verify_budget_flops=0)
    # Replicated on a slice: refused from the plan's per-chip shard sizes, before compiling.
    with pytest.raises(tpuexport.TpuExportError, match=r"does not fit v5e-8: .* largest per device: input x f32\[1048576,4096\] 16384\.0 MiB"):
        tpuexport.convert(WideInput().eval(), target="v5e-8", out=tmp_path / "replicated.tpu", **common)
    # One chip: its arguments alone exceed the HBM, refused before verifying or compiling; the error names them.
    with pytest.raises(tpuexport.TpuExportError, match=r"does not fit in HBM: v5e bucket batch1048576 .* largest arguments: input x f32\[1048576,4096\]"):
        tpuexport.convert(WideInput().eval(), target="v5e", out=tmp_path / "chip.tpu", **common)
    assert list(tmp_path.iterdir()) == []



def test_cli_converts_for_a_slice_and_inspects_it(tensor_parallel_cli):
    """The tensor-parallel conversion above, as the command line summarizes, prints and inspects it."""
    result, out = tensor_parallel_cli
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    plan = summary["sharding"]["v5e-8"]["serving_default"]
    # The --shard rule applied after the preset: score.bias recorded as the rule gives it.
    assert plan["weights"]["score.bias"] == [None] and plan["weights"]["layers.0-1.mlp.up_proj.weight"] == [None, "model"]
    [bucket] = summary["targets"]["v5e-8"]
    assert bucket["collectives"]["all-reduce"]["count"] >= 3 and bucket["fits_in_hbm"]
    for line in ("plan v5e-8", "mesh data=2,model=4, tensor-parallel", "per chip of 16 GiB HBM", "all-reduce x",
                 "verify sharded data=2,model=4", "on 8 CPU devices"):
        assert line in result.stderr, line

    inspected = tpuexport_cli("inspect", out)
    assert inspected.returncode == 0
    assert "v5e-8: mesh data=2,model=4, tensor-parallel" in inspected.stdout and "all-reduce x" in inspected.stdout

    # (The gate's --recompile of this plan: test_plan.py recompiles the same v5e-8 plan, test_verify_gate.py the CLI's --recompile --strict.)
    listed = tpuexport_cli("targets")
    assert listed.returncode == 0
    assert "v5p and 7x names count TensorCores" in " ".join(listed.stdout.split())
    rows = {t["name"]: t for t in json.loads(tpuexport_cli("targets", "--json").stdout)}
    assert (rows["v5e-8"]["chips"], rows["v5e-8"]["total_hbm_bytes"]) == (8, 128 * 2**30)
    assert (rows["v5p-8"]["chips"], rows["7x-8"]["devices"], rows["7x-8"]["hbm_bytes_per_device"]) == (4, 8, 96 * 2**30)


def test_cli_bad_mesh_is_one_line_exit_2_and_writes_nothing(tmp_path):
    before = set(tmp_path.iterdir())
    result = tpuexport_cli("convert", f"{EXAMPLES / 'decoder.py'}:build", "--target", "v5e-8", "--mesh", "data=3",
                           "-o", tmp_path / "bad.tpu")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: mesh data=3 has 3 devices but v5e-8 has 8 chips; give --mesh sizes that "
                                                  "multiply to 8"]
    assert set(tmp_path.iterdir()) == before
    single = tpuexport_cli("convert", f"{EXAMPLES / 'decoder.py'}:build", "--target", "v5e", "--sharding", "fsdp", "-o", tmp_path / "x.tpu")
    assert single.returncode == 2 and "sharding options need a slice target such as v5e-8" in single.stderr


def test_tensor_parallel_splits_every_expert_like_a_dense_mlp(tmp_path):
    import transformers

    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_local_experts=4,
                                        num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2)
    torch.manual_seed(0)
    mixtral = transformers.MixtralForCausalLM(config).eval()

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = mixtral

        def forward(self, tokens):
            return self.model(input_ids=tokens, use_cache=False).logits

    tokens = torch.randint(0, VOCAB, (2, 8))
    artifact = tpuexport.convert(Logits(), (tokens,), {"tokens": {1: torch.export.Dim("seq", min=2, max=32)}}, out=tmp_path / "moe.tpu",
                                 target="v5e-8", mesh="model=4,data=2", sharding="tensor-parallel", saved_model=False,
                                 verify_budget_flops=0, kernels="none")
    weights, _ = specs(artifact)
    # Stored [experts, in, out] (lower/weight_layouts.py; mixture-of-experts layers stay unrolled, lower/scan.py):
    # gate/up split by output features, down by input features, within every expert; no weight of the experts is
    # whole on a chip.
    for layer in (0, 1):
        assert weights[f"model.model.layers.{layer}.mlp.experts.gate_up_proj"] == [None, None, "model"]
        assert weights[f"model.model.layers.{layer}.mlp.experts.down_proj"] == [None, "model"]
        assert weights[f"model.model.layers.{layer}.mlp.gate.weight"] == []  # the router: every chip routes every token
    assert not [note for note in artifact.manifest["targets"]["v5e-8"]["sharding"]["serving_default"]["notes"] if "experts" in note]
    sharded_run(artifact)
    # Each chip multiplies by its slice of every expert: no expert weight is gathered.
    assert "all-gather" not in only_bucket(artifact)["collectives"]
