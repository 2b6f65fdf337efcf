"""Property-based fuzzing, fast profile: random small models (benchmarks/fuzz_models.py) either
convert and match eager PyTorch at fresh sizes within the artifact's tolerances, or fail with one
line; never a traceback, never a mismatch verification passed. A fixed seed and a small budget
here; `python benchmarks/fuzz.py --examples N` is the long profile."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, seed, settings

import fuzz_models
from fuzz_models import Dims, FuzzCase
from tpuexport import export as export_stage
from tpuexport import pipeline
from tpuexport.export import LoadedSource, SourceInfo
from tpuexport.verify.tolerances import EXACT_F32


def assert_holds(case: FuzzCase) -> fuzz_models.Outcome:
    outcome = fuzz_models.check(case)
    assert outcome.kind not in fuzz_models.FAILURES, f"{outcome.kind} ({outcome.reason}) for {case.describe()}:\n{outcome.detail}"
    if outcome.kind in ("refused", "verify-failed"):
        assert "\n" not in outcome.detail, outcome.detail
    return outcome


@seed(20261123)
@settings(max_examples=3, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(fuzz_models.fuzz_cases(max_ops=4))
def test_random_models_convert_and_match_at_fresh_sizes_or_fail_in_one_line(case):
    assert_holds(case)


# Cases the fuzzer drew that exercise one risky path each, kept as regressions (see docs/verification.md,
# "Fuzzing", for the long run they come from).
REGRESSIONS = {
    # torch.cond on a symbolic size and a bool-masked attention over a sequence given as 2*k.
    "cond-seq-masked-attention": FuzzCase(6, Dims(1, 16, 2, "multiple", 2, 6, 3), True, False,
                                          (("cond", "seq_length"), ("conv1d", 4, 3), ("concat_features", "gelu"),
                                           ("attention", 2, "bool_mask")), True, "bf16-mixed", "default", None, 10491),
    # A gather of an embedding table by token ids (int64 -> int32 in the artifact) under highest.
    "gather-ids": FuzzCase(6, Dims(2, 8, 2, "multiple", 3, 12, 3), True, True, (("gather",),), True, "f32", "highest", None, 262),
    # Average pooling without ceil_mode (refused in session 5's runs: torchax's lowering was looked up by
    # its overload, which torchax does not register) before attention, in bf16.
    "avg-pool-attention": FuzzCase(8, Dims(1, 8, 2, "static", 5, 5, 5), False, False,
                                   (("norm", "layer"), ("attention", 1, "none"), ("pool", "avg", False)), False, "bf16",
                                   "default", None, 479),
    # Weight-only int8 and int4 (group 2): linear weights and an embedding table quantized, checked
    # against the float model with those weights dequantized.
    "int8-weight-only": FuzzCase(4, Dims(1, 4, 2, "dynamic", 1, 6, 3), False, True,
                                 (("linear", 8, True), ("embedding", 5), ("linear", 4, False)), False, "f32", "default",
                                 "int8-weight-only", 3),
    "int4-weight-only-bf16": FuzzCase(4, Dims(1, 4, 2, "dynamic", 1, 6, 3), False, True,
                                      (("linear", 8, True), ("embedding", 5), ("linear", 4, False)), False, "auto", "default",
                                      "int4-weight-only", 3, bf16_model=True, group_size=2),
    # Weight-only attention over a batch-only dim (seq static): the out projection's bias broadcast to
    # the batch is a "position table" (weights and sizes alone); its check computed with the raw int8
    # weight instead of the dequantized one and refused a correct program (max abs error 126).
    "weight-only-position-table": FuzzCase(2, Dims(2, 4, 4, "static", 2, 2, 2), True, False,
                                           (("attention", 2, "additive_mask"), ("linear", 16, False)), False, "f32", "default",
                                           "int8-weight-only", 2865),
}


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_regression_cases(name):
    outcome = assert_holds(REGRESSIONS[name])
    assert outcome.kind == "ok"
    if name in ("int8-weight-only", "int4-weight-only-bf16"):  # both linear weights and the embedding table are integers
        assert outcome.quantized_weights == 3


def test_f32_weight_only_programs_are_verified_with_f32_tolerances():
    """Found by fuzzing weight-only: an f32 model's weight-only program holds bfloat16 scales, and
    its precision resolved to bf16 from them, so it was verified within bf16's 25% where the
    docs promise the ordinary float tolerances; at that bound even the float model, int4 or int8
    rounding left out, passed as its reference. The scales are multiplied in f32: f32 tolerances."""
    case = FuzzCase(4, Dims(1, 4, 2, "dynamic", 1, 6, 3), False, True, (("linear", 8, True), ("embedding", 5), ("linear", 4, False)),
                    False, "f32", "highest", "int8-weight-only", 3)
    model, args, dynamic_shapes = fuzz_models.build(case)
    options = fuzz_models.conversion_options(case)
    forward = pipeline.lower_forward(export_stage.capture(LoadedSource(model, args, dynamic_shapes, None, SourceInfo("api"))), options)
    assert forward.lowered.resolved_precision == "f32"
    report = pipeline.verify_forward(forward, options)
    assert report.passed and report.tolerances.cpu == report.tolerances.tpu == EXACT_F32
    # The float model (no rounding of the weights) is now told apart from the dequantized reference.
    against_float = pipeline.verify_forward(dataclasses.replace(
        forward, captured=dataclasses.replace(forward.captured, reference=forward.float_reference)), options)
    assert not against_float.passed


def test_a_size_torch_export_fixed_at_1_is_refused_naming_the_op_the_line_and_the_fix():
    """Found by fuzzing: a sequence 2*k sliced twice with step 2 has length 1 at the example k=2;
    torch.export fixes it at 1 for the linear after it, keeping only a guard on the inputs, and the
    lowering failed on the shape as "not supported yet". The refusal now names the guard, a size
    in range that it refuses and the fix. With an example where that length is not 1 (k=5) the same
    model converts and matches at fresh sizes."""
    ops = (("slice_seq", "stride_2"), ("slice_seq", "stride_2"), ("linear", 8, True))
    case = FuzzCase(8, Dims(2, 8, 2, "multiple", 2, 6, 2), False, True, ops, False, "f32", "default", None, 2816)
    outcome = assert_holds(case)
    assert outcome.kind == "refused"
    assert "at aten.expand.default from " in outcome.detail and "fuzz_models.py" in outcome.detail
    assert "fails at k=3 (declared k 2..6)" in outcome.detail and "give example inputs where no such size is 1" in outcome.detail
    assert "While executing" not in outcome.detail
    assert assert_holds(dataclasses.replace(case, dims=Dims(2, 8, 2, "multiple", 2, 6, 5))).kind == "ok"


@pytest.mark.parametrize("case, fix", [
    # bf16 rounds a LayerNorm over 2 features to +-1 within a few ulps; |t| - 1 keeps only those ulps.
    (FuzzCase(2, Dims(1, 4, 3, "dynamic", 1, 6, 4), False, True, (("activation", "softplus"), ("gather",), ("arith", "scale_shift"),
                                                                   ("norm", "layer"), ("cond", "seq_length")), True, "bf16", "default", None, 1150),
     "--precision bf16-mixed keeps norms, softmax and reductions in f32"),
    # A GroupNorm over one element (2 groups of 2 channels, seq 1): f32 noise times 1/sqrt(eps), in eager PyTorch too.
    (FuzzCase(2, Dims(2, 16, 2, "dynamic", 1, 6, 2), False, False, (("reduce", "logsumexp"), ("norm", "group"), ("concat_seq",)), False,
              "auto", "highest", None, 177), "outputs that amplify rounding"),
], ids=["bf16-layer-norm-cancellation", "group-norm-of-one-element"])
def test_verification_refuses_outputs_that_amplify_rounding_and_names_the_fix(case, fix):
    """Found by fuzzing: session 5's three verify-failed cases, correct lowerings of models whose
    outputs are rounding noise. Refused (no artifact), and the message says what to change."""
    outcome = assert_holds(case)
    assert outcome.kind == "verify-failed"
    assert fix in outcome.detail and "loosen --atol/--rtol/--scale-tol" in outcome.detail


@pytest.mark.parametrize("precision, ops, differ", [
    ("bf16", (("linear", 8, True),), False),  # bf16 matmuls: the TPU computes them as the CPU does
    ("f32", (("activation", "gelu"),), False),  # no matmul at all
    ("f32", (("linear", 8, True),), True),  # an f32 matmul in one bf16 pass: a rewritten program
])
def test_the_tpu_faithful_run_is_the_program_itself_unless_a_matmul_differs(precision, ops, differ):
    """Found profiling the fuzz harness: tpu_faithful re-serialized an unchanged program, so
    verification compiled and ran every size twice for bf16, int8 and matmul-free programs."""
    from tpuexport.verify.verification import ProgramRuns

    case = FuzzCase(4, Dims(1, 4, 2, "static", 3, 3, 3), False, False, ops, False, precision, "default", None, 1)
    model, args, dynamic_shapes = fuzz_models.build(case)
    forward = pipeline.lower_forward(export_stage.capture(LoadedSource(model, args, dynamic_shapes, None, SourceInfo("api"))),
                                     fuzz_models.conversion_options(case))
    assert ProgramRuns(forward.lowered).runs_differ is differ
