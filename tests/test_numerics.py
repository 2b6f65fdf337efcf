"""TPU numerics (#10): the matmul precision pinned on every dot and convolution, the TPU-faithful
CPU run, cost-planned verification sizes, and verification failing on planted lowering bugs."""

from __future__ import annotations

import dataclasses
import json

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from jax._src.interpreters import mlir as jax_mlir
from jax.extend.mlir import ir
from planted_bugs import FLOAT_BUGS

import tpuexport
from tpuexport import compile as compile_stage
from tpuexport.compile.hlo import matmul_ops
from tpuexport.export import LoadedSource, SourceInfo, capture
from tpuexport.lower import lower
from tpuexport.signature import ProgramSignature, SymbolicDim, TensorSpec
from tpuexport.verify import default_tolerances, plan_cases, verify
from tpuexport.verify.compare import CHUNK_ELEMENTS, OutputComparison, Tolerances, compare_output, sqnr_db
from tpuexport.verify.topk_ties import TiesToLowestIndex, selection_ties
from tpuexport.verify.sizes import resolve_requested_sizes


class ConvNormLinear(torch.nn.Module):
    """Every op the planted float bugs touch: a biased convolution, a batch norm, a layer norm,
    a square biased linear and a batched matmul of activations."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(8)
        self.linear = torch.nn.Linear(8, 8)
        self.layer_norm = torch.nn.LayerNorm(8)
        with torch.no_grad():
            self.norm.running_mean.uniform_(-0.5, 0.5)
            self.norm.running_var.uniform_(0.5, 2.0)
            self.linear.bias.normal_(0.0, 0.5)
            self.conv.bias.normal_(0.0, 0.5)

    def forward(self, image):
        features = torch.relu(self.norm(self.conv(image))).flatten(2).transpose(1, 2)  # [batch, pixels, 8]
        hidden = self.layer_norm(self.linear(features))
        return torch.bmm(hidden, hidden.transpose(1, 2)).mean(-1)


def captured_model():
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=1, max=8)
    return capture(LoadedSource(ConvNormLinear().eval(), (torch.randn(2, 3, 6, 6),), {"image": {0: batch}}, None, SourceInfo("api")))


@pytest.fixture(scope="module")
def model():
    return captured_model()


def matmul_precisions(exported) -> list[tuple[str, str | None]]:
    """(op name, precision_config attribute) of every dot_general and convolution in the module."""
    found = []
    with jax_mlir.make_ir_context(), ir.Location.unknown():
        module = ir.Module.parse(exported.mlir_module())

        def visit(op):
            if op.name in ("stablehlo.dot_general", "stablehlo.convolution"):
                found.append((op.name, str(op.attributes["precision_config"]) if "precision_config" in op.attributes else None))
            return ir.WalkResult.ADVANCE

        module.operation.walk(visit)
    return found


@pytest.mark.parametrize("setting,enum", [("default", "DEFAULT"), ("high", "HIGH"), ("highest", "HIGHEST")])
def test_every_dot_and_convolution_carries_the_pinned_precision(model, setting, enum):
    lowered = lower(model.program, model.signature, matmul_precision=setting)
    found = matmul_precisions(lowered.exported)
    assert {name for name, _ in found} == {"stablehlo.dot_general", "stablehlo.convolution"}
    # Serialization leaves out an all-DEFAULT precision_config (StableHLO's default value); the
    # module attribute records the choice.
    pinned = None if enum == "DEFAULT" else f"[#stablehlo<precision {enum}>, #stablehlo<precision {enum}>]"
    assert all(config == pinned for _, config in found), found
    assert f'tpuexport.matmul_precision = "{setting}"' in lowered.exported.mlir_module()
    # ... and the TPU compiler keeps it: the compiled v5e HLO's matmuls carry it as operand_precision.
    [target] = compile_stage.resolve_targets(["v5e"])
    [compiled] = compile_stage.compile_program(lowered, [target], compile_stage.make_buckets(lowered.signature, None)).results
    lines = [line for line in compiled.hlo_text.splitlines() if " convolution(" in line or " dot(" in line]
    assert len(lines) == len(matmul_ops(compiled.hlo_text)) >= 3
    if setting == "default":  # DEFAULT is the TPU's own default and is not printed
        assert not any("operand_precision" in line for line in lines)
    else:
        assert all(f"operand_precision={{{setting},{setting}}}" in line for line in lines), lines


def bf16_parts(array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    high = array.astype(ml_dtypes.bfloat16).astype(np.float64)
    return high, (array - high).astype(ml_dtypes.bfloat16).astype(np.float64)


@pytest.mark.parametrize("setting,passes", [("default", 1), ("high", 3)])
def test_tpu_faithful_run_multiplies_bf16_operands_as_the_tpu_does(setting, passes):
    from tpuexport.lower.matmul_precision import MATMUL_PRECISIONS, pin_matmul_precision
    from tpuexport.verify.tpu_numerics import tpu_faithful

    batch = jax.export.symbolic_shape("batch")[0]
    exported = jax.export.export(jax.jit(lambda x, w: x @ w), platforms=("cpu", "tpu"))(
        jax.ShapeDtypeStruct((batch, 64), np.float32), jax.ShapeDtypeStruct((64, 16), np.float32))
    program = tpu_faithful(pin_matmul_precision(exported, MATMUL_PRECISIONS[setting]), MATMUL_PRECISIONS[setting])
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 64)).astype(np.float32), rng.standard_normal((64, 16)).astype(np.float32)
    (x_hi, x_lo), (w_hi, w_lo) = bf16_parts(x), bf16_parts(w)
    expected = x_hi @ w_hi + ((x_hi @ w_lo + x_lo @ w_hi) if passes == 3 else 0)
    actual = np.asarray(program.call(x, w))
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)
    assert np.abs(actual - x.astype(np.float64) @ w).max() > 1e-6  # not f32: the rounding is really there


def test_the_tpu_faithful_run_rounds_at_large_sizes_too():
    """XLA:CPU keeps excess precision where it may: without the optimization barrier it removed the
    f32 -> bf16 -> f32 rounding from the coverage Mixtral's whole TPU-faithful run from 4,096
    tokens on (32 x 128: the same outputs as the f32 run), while it rounded at 16 x 128."""
    from families import FAMILIES
    from tpuexport.verify.verification import ProgramRuns

    built = FAMILIES["mixtral"].build()
    dims = {0: torch.export.Dim("batch", min=1, max=32), 1: torch.export.Dim("seq", min=2, max=128)}
    captured = capture(LoadedSource(built["model"], built["args"], {name: dims for name in built["dynamic_shapes"]}, None,
                                    SourceInfo("api")))
    runs = ProgramRuns(lower(captured.program, captured.signature))
    tokens = np.random.default_rng(0).integers(0, 1000, (32, 128)).astype(np.int32)
    outputs = runs.run([tokens, np.ones_like(tokens)])
    assert np.abs(np.asarray(outputs["tpu"][0]) - np.asarray(outputs["cpu"][0])).max() > 1e-4


def test_verification_runs_both_and_gates_on_the_tpu_arithmetic(model):
    lowered = lower(model.program, model.signature)
    report = verify(lowered, model.reference, model.example_inputs)
    assert report.passed
    # The model's outputs at every size; the "positions" case compares tables computed from
    # weights and sizes alone, not the model's outputs.
    for case in [case for case in report.cases if case.label != "positions"]:
        tpu, cpu = case.runs["tpu"][0], case.runs["cpu"][0]
        assert 1e-4 < tpu.relative_rms_error < 0.05 and cpu.relative_rms_error < 1e-5
    strict = default_tolerances("f32", "default", quantized=False)
    tight = type(strict)(strict.cpu, strict.cpu)  # the f32 rule for the TPU run: bf16 rounding exceeds it
    failed = verify(lowered, model.reference, model.example_inputs, tight)
    assert not failed.passed and "(tpu run)" in failed.failure_summary() and "(cpu run)" not in failed.failure_summary()
    assert verify(lower(model.program, model.signature, matmul_precision="highest"), model.reference, model.example_inputs, tight).passed


# One planted bug per kind of error: a term dropped (bias), a constant changed (norm epsilon) and values in the
# wrong place (output channels swapped; benchmarks/planted_bugs.py's transposed_weight, another permutation of the
# same matmuls and convolutions, is caught the same way; benchmarks/studies/float_errors.py measures every planted bug).
@pytest.mark.parametrize("bug", ["dropped_bias", "swapped_channels", "wrong_norm_epsilon"])
def test_planted_float_bugs_fail_verification(model, bug):
    with FLOAT_BUGS[bug]():
        lowered = lower(model.program, model.signature)
    report = verify(lowered, model.reference, model.example_inputs)
    assert not report.passed
    # Caught by the exact f32 run: the TPU-faithful run's wider tolerances cannot hide a bug,
    # because both runs must pass.
    assert "(cpu run)" in report.failure_summary()


def signature(**dims) -> ProgramSignature:
    """Tokens [batch, seq] with the given dims as (min, max, example)."""
    symbolic = tuple(SymbolicDim(name, *values) for name, values in dims.items())
    return ProgramSignature((TensorSpec("tokens", tuple(dims), "int32", "int64"),), (), symbolic, "")


def test_verification_sizes_are_chosen_by_cost():
    text = signature(batch=(1, 64, 8), seq=(2, 512, 128))
    flops = "2*batch*seq**2*768 + 170000000*batch*seq"
    cheap = plan_cases(text, flops, budget_flops=1e15)
    assert [c.label for c in cheap] == ["example", "min", "max", "mid"]
    assert cheap[2].sizes == {"batch": 64, "seq": 512} and cheap[3].sizes == {"batch": 33, "seq": 257}
    bounded = plan_cases(text, flops, budget_flops=1e12)
    assert [c.label for c in bounded] == ["example", "min", "max-batch", "max-seq"]
    assert sum(c.flops for c in bounded if c.reason == "within budget") <= 1e12
    tight = plan_cases(text, flops, budget_flops=0)
    assert [(c.label, c.reason) for c in tight] == [("example", "always"), ("min", "always")]
    # every dim still runs at two sizes when the example sits at a dim's minimum
    at_minimum = plan_cases(signature(batch=(1, 64, 1), seq=(2, 512, 128)), flops, budget_flops=0)
    assert [c.label for c in at_minimum] == ["example", "min", "second-batch"] and at_minimum[2].sizes == {"batch": 2, "seq": 2}
    requested = resolve_requested_sizes(text, ({"batch": 64},))
    assert plan_cases(text, flops, 0, requested)[-1].sizes == {"batch": 64, "seq": 128}
    with pytest.raises(tpuexport.TpuExportError, match="seq=1024 is out of range: seq accepts 2..512"):
        resolve_requested_sizes(text, ({"seq": 1024},))


def test_cli_matmul_precision_and_verify_options(tmp_path):
    from click.testing import CliRunner
    from conftest import EXAMPLES

    from tpuexport.cli import main

    out = tmp_path / "mlp.tpu"
    result = CliRunner().invoke(main, ["convert", f"{EXAMPLES / 'mlp.py'}:build", "--matmul-precision", "high", "--verify-budget", "0",
                                       "--verify-size", "batch=200", "--no-saved-model", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["matmul_precision"] == "high" and manifest["verification"]["matmul_precision"] == "high"
    assert [(c["label"], c["sizes"]["batch"]) for c in manifest["verification"]["cases"]] == [("example", 4), ("min", 1), ("requested", 200)]
    assert manifest["verification"]["tolerances"] == default_tolerances("f32", "high", quantized=False).to_json()
    bad = CliRunner().invoke(main, ["convert", f"{EXAMPLES / 'mlp.py'}:build", "--verify-size", "batch:3", "-o", str(tmp_path / "x.tpu")])
    assert bad.exit_code == 2 and "malformed --verify-size 'batch:3'" in bad.output and not (tmp_path / "x.tpu").exists()


class BestItem(torch.nn.Module):
    """Index of the best-scoring item (a discrete decision: its matmuls are pinned to highest by
    default, the projection's too, see test_matmuls_feeding_a_decision_are_pinned_to_highest), or with
    `threshold` whether each item's score is above it: a discrete output that is no decision op, so
    the TPU's bf16 operand rounding changes it unless the user asks for more precision."""

    def __init__(self, project: bool = False, threshold: float | None = None):
        super().__init__()
        self.project = torch.nn.Linear(2, 2, bias=False) if project else torch.nn.Identity()
        self.score = torch.nn.Linear(2, 1, bias=False)
        self.threshold = threshold
        with torch.no_grad():
            self.score.weight.fill_(1.0)
            if project:
                self.project.weight.copy_(torch.eye(2))

    def forward(self, items):
        scores = self.score(self.project(items)).squeeze(-1)
        return scores.argmax(-1) if self.threshold is None else scores > self.threshold


# 1e-3 and 1.0005e-3 round to the same bfloat16 (9.9945e-4): in one bf16 pass the two items tie
# (argmax picks the first; both score 1.00099945, under 1.0010002), in f32 the second wins (1.001 < 1.0010002 < 1.0010005).
TIED_IN_BF16 = torch.tensor([[[1.0, 1e-3], [1.0, 1.0005e-3]]] * 2)
BETWEEN_THE_SCORES = 1.0010002


def test_a_discrete_output_the_tpu_would_change_fails_with_the_precision_named(tmp_path):
    items = TIED_IN_BF16
    batch = torch.export.Dim("batch", min=1, max=4)
    with pytest.raises(tpuexport.VerificationError) as failure:
        tpuexport.convert(BestItem(threshold=BETWEEN_THE_SCORES), (items,), {"items": {0: batch}}, out=tmp_path / "best.tpu",
                          saved_model=False)
    assert "output 'output_0' at batch=2 (tpu run)" in str(failure.value) and "--matmul-precision high or highest" in str(failure.value)
    artifact = tpuexport.convert(BestItem(threshold=BETWEEN_THE_SCORES), (items,), {"items": {0: batch}}, out=tmp_path / "best.tpu",
                                 saved_model=False, matmul_precision="highest")
    assert artifact.run(items).tolist() == [[False, True]] * 2


class TiedTopK(torch.nn.Module):
    """Keeps 4 of 20 equal scores and gathers the items there: torch's CPU topk keeps other tied
    candidates than XLA's (which keeps the lowest indices)."""

    def forward(self, items):
        scores = torch.zeros(items.shape[0], 20) + 0 * items.sum(-1, keepdim=True)
        return torch.gather(items, 1, torch.topk(scores, 4).indices)


def test_exact_top_k_ties_are_broken_as_xla_breaks_them(tmp_path):
    """The reference keeps the lowest indices among exactly tied values, as the artifact (XLA's TopK)
    does, where torch's own CPU kernel keeps others: the conversion verifies, and the artifact
    gathers the first 4 items."""
    items = torch.randn(2, 20)
    assert torch.topk(torch.zeros(2, 20), 4).indices.tolist() != [[0, 1, 2, 3]] * 2  # torch's own choice, which failed verification
    with TiesToLowestIndex():
        assert torch.topk(torch.zeros(2, 20), 4).indices.tolist() == [[0, 1, 2, 3]] * 2
    artifact = tpuexport.convert(TiedTopK(), (items,), out=tmp_path / "tied.tpu", saved_model=False)
    assert artifact.manifest["verification"]["passed"]
    assert np.array_equal(np.asarray(artifact.run(items)), items[:, :4].numpy())


def test_near_ties_are_measured_in_the_units_of_the_dtype_the_model_computes_in():
    """What a failed verification names: a top-k whose k-th and (k+1)-th values lie within 4 ulps."""
    assert selection_ties(lambda: torch.topk(torch.arange(20.0) * 1e-3 + 1, 4)) == []  # distinct f32 values: no tie
    bf16_model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    [tie] = selection_ties(lambda: torch.topk(torch.arange(20.0) * 1e-3 + 1, 4), bf16_model)
    assert tie.dtype == "bfloat16" and tie.where.startswith("test_numerics.py:") and (tie.k, tie.candidates) == (4, 20)
    assert "ties with the next candidate" in tie.describe() and "verify with the trained weights" in tie.describe()


def test_matmuls_feeding_a_decision_are_pinned_to_highest():
    """The scoring matmul feeds the argmax directly, the projection through it: both pinned HIGHEST
    under the default setting (so the TPU ranks as f32 does), recorded per op, and the TPU-faithful
    run keeps them f32."""
    items = TIED_IN_BF16
    captured = capture(LoadedSource(BestItem(project=True), (items,), {"items": {0: torch.export.Dim("batch", min=1, max=4)}}, None,
                                    SourceInfo("api")))
    lowered = lower(captured.program, captured.signature)
    assert lowered.matmul_precision == "default"
    assert sorted((entry["module"], entry["feeds"], entry["precision"]) for entry in lowered.decision_matmuls) == [
        ("project", "aten.argmax.default", "highest"), ("score", "aten.argmax.default", "highest")]
    dots = [line for line in lowered.exported.mlir_module().splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) >= 2 and all("HIGHEST" in line for line in dots)
    report = verify(lowered, captured.reference, captured.example_inputs)
    assert report.passed and all(output.mismatched == 0 for case in report.cases for output in case.runs["tpu"])


def test_rounding_may_flip_a_few_decisions_but_never_produce_a_nan():
    """A token routed to another expert under bf16 rounding is an outlier the TPU-faithful rule
    allows on one element in 10^4; a NaN, or outliers on more elements, fail."""
    rule = default_tolerances("f32", "default", quantized=False).tpu
    expected = np.random.default_rng(0).standard_normal(40_000).astype(np.float32)
    flipped = expected.copy()
    flipped[[7, 19_000, 33_333]] += 5.0  # three tokens' values from another expert
    assert compare_output("logits", flipped, expected, rule).passed
    assert not compare_output("logits", flipped, expected, default_tolerances("f32", "highest", quantized=False).tpu).passed
    with_nan = expected.copy()
    with_nan[7] = np.nan
    assert not compare_output("logits", with_nan, expected, rule).passed
    many = expected.copy()
    many[::1000] += 5.0  # 40 elements: 1 in 1000
    assert not compare_output("logits", many, expected, rule).passed


def compared_whole(actual: np.ndarray, expected: np.ndarray, tolerances: Tolerances) -> OutputComparison:
    """compare.py's rule computed over the whole arrays at once (what compare_output did before it worked in chunks)."""
    actual, expected = actual.astype(np.float64), expected.astype(np.float64)
    finite = np.isfinite(expected)
    scale = float(np.sqrt(np.mean(np.square(expected[finite]))))
    atol = tolerances.atol + tolerances.scale_tol * scale + tolerances.quantization_steps * float(np.abs(expected[finite]).max()) / 127
    close = np.isclose(actual, expected, atol=atol, rtol=tolerances.rtol, equal_nan=True)
    difference = np.where((np.isnan(actual) & np.isnan(expected)) | (actual == expected), 0.0, np.abs(actual - expected))
    nonzero = expected != 0
    relative = np.nan_to_num(difference[nonzero] / np.abs(expected[nonzero]), nan=np.inf)
    difference = np.nan_to_num(difference, nan=np.inf)
    both_finite = finite & np.isfinite(actual)
    rms_error = float(np.sqrt(np.mean(np.square(difference))))
    return OutputComparison("logits", float(difference.max()), float(relative.max()), scale, rms_error / scale,
                            sqnr_db([expected[both_finite]], [actual[both_finite]]), int((~close).sum()), expected.size,
                            0 if np.any(finite & ~both_finite) else int((1.0 - tolerances.min_fraction) * expected.size),
                            tolerances.min_sqnr_db)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf - inf, and an infinite difference squared
@pytest.mark.parametrize("broken", [False, True], ids=["numbers", "nans-and-infinities-where-numbers-were"])
def test_comparing_in_chunks_gives_the_whole_array_figures(broken):
    """compare_output works through CHUNK_ELEMENTS at a time (its float64 temporaries no longer grow
    with the output); over 4.1 chunks of rows that straddle the chunks' boundaries, with NaNs, infinities,
    zeros and an outlier in both arrays, it gives what the whole-array computation gives: counts and
    maxima exactly, sums (added chunk by chunk) to the last few ulps, SQNR to its 0.01 dB."""
    rows, width = 9, 60_001
    assert rows * width > 4 * CHUNK_ELEMENTS and CHUNK_ELEMENTS % width  # chunk boundaries fall inside rows
    generator = np.random.default_rng(0)
    expected = (10.0 * generator.standard_normal((rows, width))).astype(np.float32)
    actual = expected + np.float32(1e-3) * generator.standard_normal((rows, width), dtype=np.float32)
    flat_expected, flat_actual = expected.reshape(-1), actual.reshape(-1)
    boundary = 2 * CHUNK_ELEMENTS
    flat_expected[[5, boundary - 1]] = flat_actual[[5, boundary - 1]] = np.nan  # NaN where NaN is expected: a match
    flat_expected[::4099] = 0.0
    flat_actual[::8191] = 0.0
    flat_actual[3 * CHUNK_ELEMENTS + 17] += 50.0  # an outlier in the fourth chunk
    if broken:
        # Matching infinities match, and differ by nothing (not inf - inf = NaN); opposite infinities differ by inf.
        flat_expected[11] = flat_actual[11] = np.inf
        flat_expected[boundary] = np.nan  # a number where NaN was expected
        flat_expected[boundary + 1], flat_actual[boundary + 1] = -np.inf, np.inf
        flat_actual[CHUNK_ELEMENTS + 3] = np.nan  # NaN where a number was expected: no outliers allowed
    tolerances = Tolerances(atol=1e-4, rtol=1e-4, scale_tol=1e-5, quantization_steps=0.5, min_fraction=0.99, min_sqnr_db=20.0)
    chunked, whole = compare_output("logits", actual, expected, tolerances), compared_whole(actual, expected, tolerances)
    assert (chunked.mismatched, chunked.allowed_mismatches, chunked.max_abs_error, chunked.max_rel_error) == (
        whole.mismatched, whole.allowed_mismatches, whole.max_abs_error, whole.max_rel_error)
    assert 50 < chunked.mismatched < 0.01 * expected.size
    assert chunked.scale == pytest.approx(whole.scale, rel=1e-13) and 9.9 < chunked.scale < 10.1
    assert abs(chunked.sqnr_db - whole.sqnr_db) <= 0.01 and chunked.sqnr_db > 20.0
    if broken:
        assert chunked.max_abs_error == chunked.relative_rms_error == np.inf and chunked.allowed_mismatches == 0 and not chunked.passed
    else:
        assert chunked.max_abs_error == pytest.approx(50.0, abs=0.01) and chunked.allowed_mismatches == int(0.01 * expected.size)
        assert chunked.relative_rms_error == pytest.approx(whole.relative_rms_error, rel=1e-13) and chunked.passed
    # A non-contiguous view is read chunk by chunk too, and an output within one chunk gives the whole figures exactly.
    assert compare_output("logits", actual[:, ::2], expected[:, ::2], tolerances).mismatched == compared_whole(
        actual[:, ::2], expected[:, ::2], tolerances).mismatched
    assert compare_output("logits", actual[:2, :1000], expected[:2, :1000], tolerances) == compared_whole(
        actual[:2, :1000], expected[:2, :1000], tolerances)


def test_a_generation_failure_only_the_tpu_arithmetic_shows_names_the_matmul_precision_fix():
    """Gemma 4's tiny random model failed generation verification in the TPU-faithful run only
    (logits relative RMS 0.091, 9.1e-06 in f32) with no hint; a forward's failure names
    --matmul-precision, and a generation failure now does too."""
    from tpuexport.verify.generation import GenerationCase, GenerationReport, GenerationRun

    tolerances = default_tolerances("f32", "default", quantized=False)
    eager = np.linspace(-1.0, 1.0, 64, dtype=np.float32).reshape(1, 64)
    runs = {"tpu": GenerationRun(compare_output("logits", eager * 1.5, eager, tolerances.tpu), 1, ()),
            "cpu": GenerationRun(compare_output("logits", eager, eager, tolerances.cpu), 1, ())}
    report = GenerationReport("f32", "default", tolerances, (GenerationCase({"batch": 1, "seq": 4}, (4,), (0,), 1, runs),), {})
    assert not report.passed
    assert "(tpu run): logits" in report.failure_summary() and "--matmul-precision high or highest" in report.failure_summary()
    highest = dataclasses.replace(report, matmul_precision="highest")
    assert "--matmul-precision" not in highest.failure_summary()
