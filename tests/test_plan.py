"""Plans without weights: models built on the meta device lowered from their weights' shapes,
compiled for chips and slices with the per-chip memory report, written as plan-only artifacts that
`verify` refuses to pass; the CLI's `plan` and `convert --no-weights`; misfits; and the one-line
refusal of a meta model by a conversion that needs weights (real torch, jax and libtpu)."""

from __future__ import annotations

import json
import re
import textwrap

import pytest
import torch
from torch import nn

import tpuexport
from conftest import EXAMPLES, build_example
from tpuexport import export as export_stage
from tpuexport import lower as lower_stage
from test_cli import tpuexport_in_process as tpuexport_cli  # the command line, in this process

META_DECODER_FACTORY = textwrap.dedent(f"""
    import sys

    import torch

    sys.path.insert(0, {str(EXAMPLES)!r})
    from decoder import Decoder


    def build():
        with torch.device("meta"):
            model = Decoder()
        batch = torch.export.Dim("batch", min=1, max=64)
        seq = torch.export.Dim("seq", min=2, max=128)
        return {{"model": model, "args": (torch.randint(0, 256, (8, 16)),), "dynamic_shapes": {{"tokens": {{0: batch, 1: seq}}}}}}
""")


def meta_decoder() -> dict:
    """examples/decoder.py's build() with the model rebuilt on the meta device (same shapes, no values)."""
    built = build_example("decoder")
    with torch.device("meta"):
        built["model"] = type(built["model"])()
    return built


def without_locations(mlir: str) -> str:
    """MLIR text without source locations (they name the calling line, which differs)."""
    lines = [line for line in mlir.splitlines() if not line.startswith("#loc")]
    return re.sub(r" loc\(#loc\d*\)", "", "\n".join(lines))



@pytest.fixture(scope="module")
def decoder_plan(tmp_path_factory) -> tpuexport.Artifact:
    """The meta decoder planned for one v5e and for v5e-8 tensor-parallel (data=2,model=4)."""
    built = meta_decoder()
    return tpuexport.plan(built["model"], built["args"], built["dynamic_shapes"], target=["v5e", "v5e-8"], mesh="data=2,model=4",
                          sharding="tensor-parallel", out=tmp_path_factory.mktemp("plan") / "decoder.tpu")


def test_a_plan_is_marked_plan_only_and_has_executables_memory_and_no_weights(decoder_plan):
    manifest = decoder_plan.manifest
    assert manifest["plan_only"] is True and decoder_plan.plan_only
    assert manifest["verification"] == {"passed": None, "status": "not verified: plan only"}
    assert manifest["program"]["weights"] is None and "tf_serving" not in manifest
    assert manifest["program"]["weight_bytes"] == sum(p.numel() * 4 for p in build_example("decoder")["model"].parameters())
    files = set(manifest["files"])
    assert {"program/serving_default/exported.jaxexport", "program/serving_default/stablehlo.mlir",
            "executables/v5e/serving_default/batch8_seq16.pjrt", "executables/v5e-8/serving_default/batch8_seq16.pjrt"} <= files
    assert not any(name.startswith(("weights/", "verification/", "tf_serving/")) for name in files), files
    for name, target in manifest["targets"].items():
        [bucket] = target["buckets"]
        assert bucket["fits_in_hbm"] and 0 < bucket["memory"]["total_bytes"] < 16 * 2**20, (name, bucket["memory"])
    # On the slice: the tensor-parallel plan from the weights' shapes, per-chip figures and the all-reduces.
    slice_entry = manifest["targets"]["v5e-8"]
    plan = slice_entry["sharding"]["serving_default"]
    assert plan["weights"]["layers.0-1.self_attn.q_proj.weight"] == [None, "model"]  # scanned: 2 stacked layers
    assert plan["weights"]["layers.0-1.mlp.down_proj.weight"] == [None, None, "model"]
    assert slice_entry["buckets"][0]["collectives"]["all-reduce"]["count"] >= 3
    with pytest.raises(tpuexport.TpuExportError, match="plan without weights: it compiles for TPUs but cannot run"):
        decoder_plan.run(torch.randint(0, 256, (2, 8)))


def test_a_plan_lowers_to_the_program_the_weights_lower_to():
    """Shapes alone give the same StableHLO and weight dtypes as the arrays (bf16-mixed: bfloat16 matrices, f32 vectors)."""
    built = build_example("decoder")
    captured = export_stage.capture(export_stage.LoadedSource(built["model"], built["args"], built["dynamic_shapes"], None,
                                                              export_stage.SourceInfo("api")))
    with_weights = lower_stage.lower(captured.program, captured.signature, "bf16-mixed")
    shapes_only = lower_stage.lower(captured.program, captured.signature, "bf16-mixed", weights=False)
    assert shapes_only.weights is None and shapes_only.plan_only and not with_weights.plan_only
    assert without_locations(shapes_only.exported.mlir_module()) == without_locations(with_weights.exported.mlir_module())
    assert [(w.shape, w.dtype) for w in with_weights.weights] == [(s.shape, s.dtype) for s in shapes_only.weight_specs]
    assert {str(s.dtype) for s in shapes_only.weight_specs} == {"bfloat16", "float32"}
    assert shapes_only.weight_bytes == sum(w.nbytes for w in with_weights.weights)


def test_verify_reports_a_plan_as_nothing_to_verify_and_fails(decoder_plan):
    report = tpuexport.verify_artifact(decoder_plan.path, recompile=True)
    assert not report.passed and report.plan_only and report.exit_code == 1
    checks = {check.name: check for check in report.checks}
    assert checks["integrity"].status == "passed" and checks["recompile"].status == "passed"
    assert checks["golden"].status == "failed" and checks["golden"].message.startswith("plan only (no weights, not verified): nothing to verify")
    assert checks["saved_model"].status == "skipped"

    gate = tpuexport_cli("verify", decoder_plan.path)
    assert gate.returncode == 1, gate.stderr
    assert gate.stderr.strip().splitlines()[-1] == (f"verify failed {decoder_plan.path}: plan only (no weights, not verified): "
                                                    "nothing to verify")
    inspected = tpuexport_cli("inspect", decoder_plan.path)
    assert inspected.returncode == 0 and "plan only (no weights, not verified)" in inspected.stdout, inspected.stdout


def test_cli_plan_and_convert_no_weights_write_plans(tmp_path):
    factory = tmp_path / "meta_decoder.py"
    factory.write_text(META_DECODER_FACTORY)
    out = tmp_path / "decoder.tpu"
    result = tpuexport_cli("plan", f"{factory}:build", "--target", "v5e-8", "--sharding", "tensor-parallel", "-o", out, "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["plan_only"] is True and summary["verification"]["passed"] is None
    assert summary["sharding"]["v5e-8"]["serving_default"]["mesh"] == {"axes": ["model"], "shape": [8]}
    assert "per chip of 16 GiB HBM" in result.stderr and "verify" not in result.stderr
    planned, peak = result.stderr.strip().splitlines()[-2:]
    assert planned == f"planned {factory}:build -> {out} (plan only: no weights, not verified)" and peak.startswith("peak memory ")

    no_weights = tpuexport_cli("convert", f"{factory}:build", "--target", "v5e", "--no-weights", "-o", tmp_path / "chip.tpu")
    assert no_weights.returncode == 0, no_weights.stderr
    assert json.loads((tmp_path / "chip.tpu" / "manifest.json").read_text())["plan_only"] is True


def test_convert_refuses_a_meta_model_in_one_line(tmp_path):
    factory = tmp_path / "meta_decoder.py"
    factory.write_text(META_DECODER_FACTORY)
    result = tpuexport_cli("convert", f"{factory}:build", "-o", tmp_path / "decoder.tpu")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: the model's weights are on the meta device; use `tpuexport plan` or --no-weights (tpuexport.plan or "
        "convert(weights=False) in Python)"]
    assert {p.name for p in tmp_path.iterdir()} == {"meta_decoder.py"}
    built = meta_decoder()
    with pytest.raises(tpuexport.TpuExportError, match="weights are on the meta device"):
        tpuexport.convert(built["model"], built["args"], built["dynamic_shapes"], out=tmp_path / "api.tpu")


class Wide(nn.Module):
    """Two 65536 x 65536 f32 layers: 32 GiB of weights, more than a v5e chip's 16 GiB."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(65536, 65536, bias=False)
        self.second = nn.Linear(65536, 65536, bias=False)

    def forward(self, x):
        return self.second(self.first(x))


def test_plans_that_do_not_fit_name_the_largest_buffers(tmp_path):
    with torch.device("meta"):
        model = Wide()
    args = (torch.randn(8, 65536),)
    # On a slice, replicated: refused from the per-device shards before compiling.
    with pytest.raises(tpuexport.TpuExportError,
                       match=r"does not fit v5e-8: .* largest per device: weight first.weight f32\[65536,65536\] 16384\.0 MiB"):
        tpuexport.plan(model, args, target="v5e-8", out=tmp_path / "slice.tpu")
    # On one chip: XLA's compiled memory exceeds the HBM; the error names the weights.
    with pytest.raises(tpuexport.TpuExportError,
                       match=r"does not fit in HBM: v5e bucket .* largest arguments: weight first.weight f32\[65536,65536\]"):
        tpuexport.plan(model, args, target="v5e", out=tmp_path / "chip.tpu")
    assert list(tmp_path.iterdir()) == []
