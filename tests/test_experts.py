"""Mixture-of-experts weights stored as the TPU's grouped matmul reads them (lower/weight_layouts.py):
transformers keeps them [experts, out, in] and transposes them before each grouped matmul; the
artifact stores them [experts, in, out] on every weight path (in memory, streamed from a checkpoint,
stacked for a scan, laid out on a slice), and the program no longer transposes them."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import tpuexport
from tpuexport import compile as compile_stage
from tpuexport.export import LoadedSource, SourceInfo, capture
from tpuexport.lower import lower

EXPERTS, WIDTH, HIDDEN = 4, 8, 16


class Experts(nn.Module):
    """transformers' grouped-mm experts (Mixtral, Qwen-MoE): weights [experts, out, in], each
    transposed for `grouped_mm` (transformers.integrations.moe._grouped_linear)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(WIDTH, EXPERTS)
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * HIDDEN, WIDTH) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, WIDTH, HIDDEN) * 0.3)

    def forward(self, x):
        expert = self.router(x).argmax(-1)
        order = expert.argsort(stable=True)
        offsets = (expert[:, None] == torch.arange(EXPERTS, device=x.device)).sum(0).cumsum(0).to(torch.int32)
        gate, up = torch.ops.transformers.grouped_mm_fallback(x[order], self.gate_up_proj.transpose(-2, -1), offsets).chunk(2, -1)
        hidden = torch.nn.functional.silu(gate) * up
        return x + torch.ops.transformers.grouped_mm_fallback(hidden, self.down_proj.transpose(-2, -1), offsets)[order.argsort()]


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Experts(), Experts()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


TOKENS = torch.export.Dim("tokens", min=2, max=64)
# The conversions below are verified at their always-run sizes (example, minimum, second) only, verify_budget_flops=0:
# no test here reads an optional case (max, mid); each checks that verification passed and how the weights are stored.
EXPERT_WEIGHTS = [f"layers.{layer}.{name}" for layer in (0, 1) for name in ("gate_up_proj", "down_proj")]


@pytest.fixture(scope="module")
def model():
    import transformers.integrations.moe  # noqa: F401  (defines torch.ops.transformers.grouped_mm_fallback)

    torch.manual_seed(0)
    return TwoLayers().eval()


@pytest.fixture(scope="module")
def in_memory(model, tmp_path_factory):
    """The model converted for v5e (scanning requested, the default) without quantization or in a weight-only
    mode, each once for the tests that read it: a function of `quantize` giving that artifact."""
    converted = {}

    def artifact(quantize: str | None) -> tpuexport.Artifact:
        if quantize not in converted:
            converted[quantize] = tpuexport.convert(model, (torch.randn(12, WIDTH),), {"x": {0: TOKENS}}, target="v5e",
                                                    out=tmp_path_factory.mktemp("moe") / "moe.tpu", saved_model=False, kernels="none",
                                                    verify_budget_flops=0, quantize=quantize)
        return converted[quantize]

    return artifact


def stored_by_state_name(artifact) -> dict[str, np.ndarray]:
    """The artifact's weights by state_dict name, a scanned stack split into its blocks."""
    lowered = artifact.program
    found = {}
    for name, array in zip(lowered.weight_names, lowered.weights):
        parts = lowered.weight_parts[name]
        found.update({part: array[index] if len(parts) > 1 else array for index, part in enumerate(parts)})
    return found


@pytest.mark.parametrize("scan", [True, False], ids=["scan-requested", "unrolled"])
def test_expert_weights_are_stored_transposed_and_the_program_reads_them_in_place(model, in_memory, tmp_path, scan):
    args = (torch.randn(12, WIDTH),)
    artifact = in_memory(None) if scan else tpuexport.convert(model, args, {"x": {0: TOKENS}}, target="v5e", out=tmp_path / "moe.tpu",
                                                               scan=False, saved_model=False, kernels="none", verify_budget_flops=0)

    assert artifact.manifest["verification"]["passed"]
    # Scanning is asked for where it pays: mixture-of-experts layers stay unrolled (lower/scan.py), since
    # XLA copies a scan step's slice of stacked experts before its grouped matmul reads it.
    assert artifact.manifest["scanned"] == []
    layouts = artifact.manifest["program"]["weight_layouts"]
    assert layouts == {name: [0, 2, 1] for name in EXPERT_WEIGHTS}
    stored = stored_by_state_name(artifact)
    for name in EXPERT_WEIGHTS:  # [experts, in, out]: the state_dict tensor transposed
        np.testing.assert_array_equal(stored[name], model.state_dict()[name].transpose(-2, -1).numpy())
    np.testing.assert_array_equal(stored["layers.0.router.weight"], model.state_dict()["layers.0.router.weight"].numpy())
    # No transpose of an expert weight is left: each ragged dot reads its weight argument as stored.
    text = artifact.program.exported.mlir_module()
    assert text.count('stablehlo.composite "chlo.ragged_dot"') == 4
    assert "dims = [0, 2, 1]" not in text
    with torch.no_grad():
        np.testing.assert_allclose(artifact.run(*args), model(*args).numpy(), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("quantize", [None, "int8-weight-only"])
def test_a_checkpoint_streams_the_expert_weights_in_the_stored_layout(model, in_memory, tmp_path, quantize):
    args = (torch.randn(12, WIDTH),)
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()}, tmp_path / "moe.safetensors")
    with tpuexport.parameters_on_meta():
        empty = TwoLayers().eval()
    streamed = tpuexport.convert(empty, args, {"x": {0: TOKENS}}, target="v5e", out=tmp_path / "streamed.tpu",
                                 checkpoint=tmp_path / "moe.safetensors", saved_model=False, kernels="none", verify_budget_flops=0, quantize=quantize)
    held = in_memory(quantize)

    assert streamed.manifest["verification"]["passed"]
    assert streamed.manifest["program"]["weight_layouts"] == held.manifest["program"]["weight_layouts"] != {}
    assert streamed.program.weight_names == held.program.weight_names
    for name, array, expected in zip(streamed.program.weight_names, streamed.program.weights, held.program.weights):
        np.testing.assert_array_equal(array, expected, err_msg=name)


def test_a_shard_rule_names_the_state_dict_dims_of_a_transposed_expert_weight(model):
    captured = capture(LoadedSource(model, (torch.randn(12, WIDTH),), {"x": {0: TOKENS}}, None, SourceInfo("api")))
    lowered = lower(captured.program, captured.signature, weights=False)
    [target] = compile_stage.resolve_targets(["v5e-8"])
    # Experts over "expert", and the gate/up projection's output features (the tensor's dim 1) over "model".
    request = compile_stage.make_request("expert=4,model=2", None, [r"gate_up_proj=expert,model", r"down_proj=expert"])
    plan = compile_stage.plan_sharding(request, target, lowered.weight_names, lowered.weight_specs, lowered.signature,
                                       compile_stage.make_buckets(lowered.signature, None), lowered.stacked, lowered.weight_layouts)
    specs = dict(plan.weights)
    for layer in (0, 1):
        assert specs[f"layers.{layer}.gate_up_proj"] == ("expert", None, "model")  # stored [experts, in, out]
        assert specs[f"layers.{layer}.down_proj"] == ("expert",)


def test_int8_weight_only_experts_are_s8_parameters_of_the_tpu_grouped_matmul(model, in_memory):
    args = (torch.randn(12, WIDTH),)
    artifact = in_memory("int8-weight-only")

    assert artifact.manifest["verification"]["passed"]
    quantized = artifact.manifest["quantization"]["weights"]
    for name in EXPERT_WEIGHTS:
        assert quantized[name]["bits"] == 8 and quantized[name]["axis"] == -2  # [experts, in, out] contracts its in features
        assert artifact.manifest["program"]["weight_layouts"][name] == artifact.manifest["program"]["weight_layouts"][f"{name}_scale"]
    program = artifact.program
    stored = dict(zip(program.weight_names, program.weights))
    assert stored["layers.0.gate_up_proj"].dtype == np.int8 and stored["layers.0.gate_up_proj"].shape == (EXPERTS, WIDTH, 2 * HIDDEN)
    assert stored["layers.0.gate_up_proj_scale"].shape == (EXPERTS, 1, 2 * HIDDEN)
    # The integers times their scales are the state_dict tensors (transposed) to within half a step.
    weight = model.state_dict()["layers.1.down_proj"].transpose(-2, -1).numpy()
    scale = stored["layers.1.down_proj_scale"].astype(np.float32)
    assert np.abs(stored["layers.1.down_proj"] * scale - weight).max() <= scale.max() / 2 + 1e-6
    with torch.no_grad():
        np.testing.assert_allclose(artifact.run(*args), model(*args).numpy(), atol=0.1, rtol=0.1)


def test_the_compiled_tpu_program_reads_int8_experts_as_s8_parameters_without_a_float_copy(model):
    from tpuexport.quantize.weight_only import WeightOnlyScheme

    captured = capture(LoadedSource(model, (torch.randn(12, WIDTH),), {"x": {0: TOKENS}}, None, SourceInfo("api")))
    lowered = lower(captured.program, captured.signature, weight_only=WeightOnlyScheme("int8-weight-only"))
    [target] = compile_stage.resolve_targets(["v5e"])
    [compiled] = compile_stage.compile_program(lowered, [target], compile_stage.make_buckets(lowered.signature, None)).results
    text = compiled.hlo_text
    entry = text[text.index("\nENTRY"):]
    parameters = [line for line in entry.splitlines() if " parameter(" in line]
    stored = (f"s8[{EXPERTS},{WIDTH},{2 * HIDDEN}]", f"s8[{EXPERTS},{HIDDEN},{WIDTH}]")  # [experts, in, out], one per layer
    assert all(any(f"= {shape}" in line for line in parameters) for shape in stored), parameters
    # The int8 router feeds the routing's argmax: its product is pinned to f32 like a float router's.
    router = rf"precision = \[HIGHEST, HIGHEST\] : \(tensor<\?x{WIDTH}xf32>, tensor<{WIDTH}x{EXPERTS}xf32>\) -> tensor<\?x{EXPERTS}xf32>"
    assert re.search(router, lowered.exported.mlir_module())
    # No float array of an expert weight's shape exists anywhere: the integers are converted inside the products.
    assert not re.search(rf"(bf16|f32|f16)\[(2,)?{EXPERTS},({WIDTH},{2 * HIDDEN}|{HIDDEN},{WIDTH})\]", text)


def test_int4_weight_only_stores_expert_weights_int8_and_says_why(model, tmp_path):
    args = (torch.randn(12, WIDTH),)
    artifact = tpuexport.convert(model, args, {"x": {0: TOKENS}}, target="v5e", out=tmp_path / "int4.tpu", saved_model=False,
                                 kernels="none", quantize="int4-weight-only", group_size=8, verify_budget_flops=0)

    assert artifact.manifest["verification"]["passed"]
    quantized = artifact.manifest["quantization"]["weights"]
    assert quantized["layers.0.router.weight"]["bits"] == 4
    for name in EXPERT_WEIGHTS:
        assert quantized[name]["bits"] == 8 and quantized[name]["mode"] == "int8-weight-only"
        assert "s4 ragged_dot" in quantized[name]["reason"]
    stored = dict(zip(artifact.program.weight_names, artifact.program.weights))
    assert stored["layers.0.down_proj"].dtype == np.int8 and stored["layers.0.down_proj_scale"].shape == (EXPERTS, 1, WIDTH)
