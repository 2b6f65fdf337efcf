"""Random small models for property-based testing of conversions (hypothesis strategies), and the
property each must satisfy.

A case (`FuzzCase`) is a chain of ops over a hidden state `h` of shape [batch, seq, features],
started from the float input `x`, with an optional bool `mask` [batch, seq] and int64 `ids`
[batch, seq] sharing the dims, plus the numeric settings (precision, matmul precision, int8 mode).
The ops are those real models are made of: linear, conv1d/conv2d, pooling, norms, activations,
attention with masks, reshapes, transposes, slices, gathers, concatenation, reductions,
broadcasting arithmetic, dtype casts and `torch.cond`. Dims: `batch` always dynamic, `seq` static,
dynamic or a multiple (`2*k`), each with a range. Ops that would break a constraint (a slice of a
sequence that may have length 1, a mask that no longer lines up after pooling) are not drawn.
Quantize modes: PT2E int8 and int8-dynamic, and weight-only int8 and int4 (a small group size).

`check(case)` converts the case with the pipeline's own passes that decide its numbers (export,
then `pipeline.lower_forward` and `pipeline.verify_forward`: quantize, lower, verify against the
reference a conversion uses, with its tolerances; no TPU compile, SavedModel or write), then runs
the lowered program (what `Artifact.run` runs, TPU-faithfully and in f32) at fresh random sizes in
range, other than the sizes verification ran where the ranges allow, and compares it with that
reference under the same tolerances. A sampled subset of float cases (`full_conversion`) runs
`tpuexport.convert` instead, compiled for v5e and written, and checks the artifact loaded back
from disk. The outcome is one of:

  ok                the conversion verified and every fresh size matches
  refused           the conversion failed with a one-line TpuExportError (reason: its message)
  verify-failed     verification refused the conversion (VerificationError, one line)
  silent-mismatch   verification passed but a fresh size does not match: the property broken
  crash             anything else raised (a traceback reaching the user): the property broken
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import tempfile
import traceback

import numpy as np
import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

import tpuexport
from tpuexport import export as export_stage
from tpuexport import pipeline
from tpuexport.errors import TpuExportError, UnsupportedOperatorsError, VerificationError
from tpuexport.export import LoadedSource, SourceInfo
from tpuexport.inputs import make_inputs
from tpuexport.verify.sizes import PlannedCase
from tpuexport.verify.tolerances import VerificationTolerances
from tpuexport.verify.verification import ProgramRuns, run_case

# The verification budget of a fuzz case: the always-run sizes and little more (cases are tiny).
VERIFY_BUDGET_FLOPS = 2e6
FRESH_SIZES = 2
FRESH_SIZE_DRAWS = 20
MAX_FEATURES = 32
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "tanh", "sigmoid", "softmax", "leaky_relu", "elu", "hardswish",
               "softplus", "mish")
WEIGHT_ONLY_MODES = ("int8-weight-only", "int4-weight-only")
# int4's elements per scale: small, so that the tiny contraction dims are mostly divisible by it.
GROUP_SIZES = (2, 2, 4)
OUTCOMES = ("ok", "refused", "verify-failed", "silent-mismatch", "crash")
FAILURES = ("silent-mismatch", "crash")


@dataclasses.dataclass(frozen=True)
class Dims:
    """The dims of a case: batch always dynamic; seq "static", "dynamic" or "multiple" (2*k)."""

    batch_min: int
    batch_max: int
    batch_example: int
    seq_kind: str
    seq_min: int  # for "multiple": of k (seq = 2*k)
    seq_max: int
    seq_example: int  # for "multiple": of k

    @property
    def seq_example_length(self) -> int:
        return 2 * self.seq_example if self.seq_kind == "multiple" else self.seq_example

    @property
    def seq_min_length(self) -> int:
        """The shortest sequence the program may see."""
        if self.seq_kind == "static":
            return self.seq_example
        return 2 * self.seq_min if self.seq_kind == "multiple" else self.seq_min


@dataclasses.dataclass(frozen=True)
class FuzzCase:
    """One random model and its numeric settings (hypothesis shrinks it as a value)."""

    features: int
    dims: Dims
    use_mask: bool
    use_ids: bool
    ops: tuple[tuple, ...]  # (name, *parameters), applied in order
    two_outputs: bool
    precision: str
    matmul_precision: str
    quantize: str | None
    seed: int
    full_conversion: bool = False
    bf16_model: bool = False  # weights and x in bfloat16 (converted in its own dtypes by precision "auto")
    group_size: int = 2  # int4-weight-only's elements per scale

    def describe(self) -> str:
        ops = " -> ".join(":".join(str(p) for p in op) for op in self.ops) or "identity"
        d = self.dims
        seq = {"static": f"seq={d.seq_example}", "dynamic": f"seq {d.seq_min}..{d.seq_max}",
               "multiple": f"seq=2*k, k {d.seq_min}..{d.seq_max}"}[d.seq_kind]
        return (f"F={self.features} batch {d.batch_min}..{d.batch_max} {seq} mask={self.use_mask} ids={self.use_ids} "
                f"[{ops}] outputs={2 if self.two_outputs else 1} {self.precision}/{self.matmul_precision}"
                f"{'/' + self.quantize if self.quantize else ''}{f' group {self.group_size}' if self.quantize == 'int4-weight-only' else ''} seed={self.seed}{' full' if self.full_conversion else ''}"
                f"{' bf16-model' if self.bf16_model else ''}")


@dataclasses.dataclass
class ChainState:
    """What the next op may assume about h."""

    features: int
    seq_min: int  # the shortest sequence h may have at run time
    aligned: bool  # h's seq axis is still the inputs' (mask and ids line up with it)


def _draw_op(draw, state: ChainState, case_flags: dict) -> tuple:
    """One op that fits `state` (and updates it)."""
    choices = ["linear", "norm", "activation", "arith", "reduce", "reshape", "cast", "conv1d", "cond", "slice_features",
               "permute_features", "concat_features"]
    if state.features % 2 == 0:
        choices += ["attention", "conv2d"]
    if state.seq_min >= 2:
        choices += ["pool", "slice_seq"]
    choices += ["concat_seq"]
    if state.aligned and case_flags["mask"]:
        choices += ["masked_fill", "attention_masked"] if state.features % 2 == 0 else ["masked_fill"]
    if state.aligned and case_flags["ids"]:
        choices += ["embedding", "gather"]
    name = draw(st.sampled_from(choices))
    F_ = state.features
    if name == "linear":
        out = draw(st.sampled_from([4, 8, 12, 16]))
        state.features = out
        return ("linear", out, draw(st.booleans()))
    if name == "norm":
        kinds = ["layer", "rms", "batch"] + (["group"] if F_ % 2 == 0 else [])
        return ("norm", draw(st.sampled_from(kinds)))
    if name == "activation":
        return ("activation", draw(st.sampled_from(ACTIVATIONS)))
    if name == "arith":
        return ("arith", draw(st.sampled_from(["scale_shift", "soft_div", "square", "clamp", "gauss", "residual_mean", "rsqrt_norm"])))
    if name == "reduce":
        return ("reduce", draw(st.sampled_from(["center_seq", "gate_amax", "cumsum_mean", "logsumexp", "variance", "max_seq"])))
    if name == "reshape":
        if F_ % 2:
            return ("reshape", "transpose_seq")
        return ("reshape", draw(st.sampled_from(["split_transpose", "transpose_seq", "view_heads"])))
    if name == "cast":
        return ("cast", draw(st.sampled_from(["bfloat16", "float16", "float64"])))
    if name == "conv1d":
        out = draw(st.sampled_from([4, 8, 12]))
        kernel = draw(st.sampled_from([1, 3]))
        state.features = out
        return ("conv1d", out, kernel)
    if name == "conv2d":
        channels = 2 if 2 * F_ <= MAX_FEATURES else 1
        state.features = channels * F_
        return ("conv2d", channels, draw(st.booleans()))
    if name == "cond":
        return ("cond", draw(st.sampled_from(["input_mean", "seq_length"])))
    if name == "slice_features":
        keep = draw(st.integers(1, max(1, F_ - 1))) if F_ > 1 else 1
        state.features = keep
        return ("slice_features", keep)
    if name == "permute_features":
        return ("permute_features", draw(st.integers(0, 2**16)))
    if name == "concat_features":
        if 2 * F_ > MAX_FEATURES:
            return ("activation", "relu")
        state.features = 2 * F_
        return ("concat_features", draw(st.sampled_from(ACTIVATIONS[:6])))
    if name == "attention":
        heads = draw(st.sampled_from([h for h in (1, 2) if F_ % h == 0 and (F_ // h) % 2 == 0] or [1]))
        return ("attention", heads, draw(st.sampled_from(["none", "causal"])))
    if name == "attention_masked":
        heads = draw(st.sampled_from([h for h in (1, 2) if F_ % h == 0] or [1]))
        return ("attention", heads, draw(st.sampled_from(["bool_mask", "additive_mask"])))
    if name == "pool":
        kind = draw(st.sampled_from(["max", "avg"]))
        ceil = draw(st.booleans())
        state.seq_min = -(-state.seq_min // 2) if ceil else state.seq_min // 2
        state.aligned = False
        return ("pool", kind, ceil)
    if name == "slice_seq":
        kind = draw(st.sampled_from(["drop_first", "stride_2"]))
        state.seq_min = state.seq_min - 1 if kind == "drop_first" else -(-state.seq_min // 2)
        state.aligned = False
        return ("slice_seq", kind)
    if name == "concat_seq":
        state.seq_min += 1
        state.aligned = False
        return ("concat_seq",)
    if name == "masked_fill":
        return ("masked_fill",)
    if name == "embedding":
        return ("embedding", draw(st.sampled_from([5, 11])))
    if name == "gather":
        return ("gather",)
    raise AssertionError(name)


@st.composite
def fuzz_cases(draw, max_ops: int = 5) -> FuzzCase:
    """A hypothesis strategy of FuzzCases."""
    features = draw(st.sampled_from([2, 4, 6, 8]))
    batch_min = draw(st.sampled_from([1, 2]))
    batch_max = draw(st.sampled_from([4, 8, 16]))
    batch_example = draw(st.integers(max(batch_min, 2), batch_max))
    seq_kind = draw(st.sampled_from(["static", "dynamic", "multiple"]))
    if seq_kind == "static":
        seq_min = seq_max = seq_example = draw(st.integers(1, 8))
    else:
        seq_min = draw(st.sampled_from([1, 2, 3]))
        seq_max = draw(st.sampled_from([6, 8, 12]))
        seq_example = draw(st.integers(max(seq_min, 2), seq_max))
    dims = Dims(batch_min, batch_max, batch_example, seq_kind, seq_min, seq_max, seq_example)
    use_mask, use_ids = draw(st.booleans()), draw(st.booleans())
    state = ChainState(features, dims.seq_min_length, True)
    ops = tuple(_draw_op(draw, state, {"mask": use_mask, "ids": use_ids}) for _ in range(draw(st.integers(1, max_ops))))
    precision = draw(st.sampled_from(["auto", "f32", "f32", "bf16", "bf16-mixed"]))
    matmul_precision = draw(st.sampled_from(["default", "high", "highest"])) if precision in ("auto", "f32") else "default"
    quantize = draw(st.sampled_from([None] * 8 + ["int8", "int8-dynamic", *WEIGHT_ONLY_MODES]))
    full_conversion = quantize is None and draw(st.integers(0, 9)) == 0
    bf16_model = precision == "auto" and quantize in (None, *WEIGHT_ONLY_MODES) and draw(st.integers(0, 2)) == 0
    group_size = draw(st.sampled_from(GROUP_SIZES)) if quantize == "int4-weight-only" else 2
    return FuzzCase(features, dims, use_mask, use_ids, ops, draw(st.booleans()), precision, matmul_precision, quantize,
                    draw(st.integers(0, 2**16)), full_conversion, bf16_model, group_size)


class _Op(nn.Module):
    """One op of a fuzzed chain; `forward(h, ctx)` where ctx holds the model's inputs."""

    def __init__(self, op: tuple, features: int):
        super().__init__()
        self.op, self.kind = op, op[0]
        name = self.kind
        if name == "linear":
            self.layer = nn.Linear(features, op[1], bias=op[2])
        elif name == "norm":
            self.layer = {"layer": lambda: nn.LayerNorm(features), "rms": lambda: nn.RMSNorm(features),
                          "batch": lambda: nn.BatchNorm1d(features), "group": lambda: nn.GroupNorm(2, features)}[op[1]]()
            if op[1] == "batch":
                self.layer.running_mean.uniform_(-0.5, 0.5)
                self.layer.running_var.uniform_(0.5, 2.0)
        elif name == "arith":
            self.scale = nn.Parameter(torch.randn(features))
            self.shift = nn.Parameter(torch.randn(features))
        elif name == "conv1d":
            self.layer = nn.Conv1d(features, op[1], op[2], padding=op[2] // 2)
        elif name == "conv2d":
            self.layer = nn.Conv2d(1, op[1], 3, padding=1, bias=op[2])
        elif name == "attention":
            self.qkv = nn.Linear(features, 3 * features)
            self.out = nn.Linear(features, features)
        elif name == "permute_features":
            generator = torch.Generator().manual_seed(op[1])
            self.register_buffer("permutation", torch.randperm(features, generator=generator))
        elif name == "embedding":
            self.layer = nn.Embedding(op[1], features)
        elif name == "gather":
            self.register_buffer("table", torch.randn(11, features))

    def forward(self, h, ctx):  # noqa: C901  (one branch per op kind)
        kind, op = self.kind, self.op
        if kind == "linear":
            return self.layer(h)
        if kind == "norm":
            if op[1] in ("batch", "group"):
                return self.layer(h.transpose(1, 2)).transpose(1, 2)
            return self.layer(h)
        if kind == "activation":
            return activation(op[1], h)
        if kind == "arith":
            return {
                "scale_shift": lambda: h * self.scale + self.shift,
                "soft_div": lambda: h / (1 + h.abs()),
                "square": lambda: h * h * 0.5 - h,
                "clamp": lambda: h.clamp(-1.0, 2.0),
                "gauss": lambda: torch.exp(-h * h),
                "residual_mean": lambda: h + h.mean(dim=-1, keepdim=True) * self.scale,
                "rsqrt_norm": lambda: h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-5),
            }[op[1]]()
        if kind == "reduce":
            return {
                "center_seq": lambda: h - h.mean(dim=1, keepdim=True),
                "gate_amax": lambda: h * torch.sigmoid(h.amax(dim=-1, keepdim=True)),
                "cumsum_mean": lambda: h.cumsum(dim=1) / h.shape[1],
                "logsumexp": lambda: h - torch.logsumexp(h, dim=-1, keepdim=True),
                "variance": lambda: h * h.var(dim=-1, keepdim=True, unbiased=False),
                "max_seq": lambda: h + h.max(dim=1, keepdim=True).values,
            }[op[1]]()
        if kind == "reshape":
            if op[1] == "split_transpose":
                return h.unflatten(-1, (2, h.shape[-1] // 2)).transpose(-1, -2).flatten(-2)
            if op[1] == "transpose_seq":
                return torch.tanh(h.transpose(1, 2)).transpose(1, 2).contiguous()
            batch, seq, features = h.shape
            return h.reshape(batch, seq, 2, features // 2).permute(0, 2, 1, 3).reshape(batch, 2, seq * (features // 2)) \
                .reshape(batch, 2, seq, features // 2).permute(0, 2, 1, 3).reshape(batch, seq, features)
        if kind == "cast":
            return h.to(getattr(torch, op[1])).mul(1.5).to(h.dtype)
        if kind == "conv1d":
            return self.layer(h.transpose(1, 2)).transpose(1, 2)
        if kind == "conv2d":
            y = self.layer(h.unsqueeze(1))  # [batch, channels, seq, features]
            return y.permute(0, 2, 1, 3).flatten(2)
        if kind == "cond":
            if op[1] == "input_mean":
                predicate = ctx["x"].mean() > 0
            else:
                predicate = h.shape[1] > 4
            return torch.cond(predicate, lambda t: torch.tanh(t) * 2, lambda t: t.abs() - 1, (h,))
        if kind == "slice_features":
            return h[..., : op[1]]
        if kind == "permute_features":
            return h[..., self.permutation]
        if kind == "concat_features":
            return torch.cat([h, activation(op[1], h)], dim=-1)
        if kind == "attention":
            return self._attention(h, ctx)
        if kind == "pool":
            pooled = (F.max_pool1d if op[1] == "max" else F.avg_pool1d)(h.transpose(1, 2), 2, 2, ceil_mode=op[2])
            return pooled.transpose(1, 2)
        if kind == "slice_seq":
            return h[:, 1:] if op[1] == "drop_first" else h[:, ::2]
        if kind == "concat_seq":
            return torch.cat([h, h[:, :1] * 0.5], dim=1)
        if kind == "masked_fill":
            return torch.where(ctx["mask"].unsqueeze(-1), h, torch.zeros_like(h))
        if kind == "embedding":
            return h + self.layer(ctx["ids"] % self.op[1])
        if kind == "gather":
            return h + torch.index_select(self.table, 0, (ctx["ids"] % 11).flatten()).reshape(h.shape) * 0.5
        raise AssertionError(kind)

    def _attention(self, h, ctx):
        heads, masking = self.op[1], self.op[2]
        batch, seq, features = h.shape
        q, k, v = self.qkv(h).unflatten(-1, (3, heads, features // heads)).permute(2, 0, 3, 1, 4)
        if masking == "bool_mask":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx["mask"][:, None, None, :])
        elif masking == "additive_mask":
            bias = torch.where(ctx["mask"], 0.0, -1e9).to(q.dtype)[:, None, None, :]
            scores = (q @ k.transpose(-1, -2)) / (features // heads) ** 0.5 + bias
            out = scores.softmax(dim=-1) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=masking == "causal")
        return self.out(out.transpose(1, 2).flatten(2))


def activation(name: str, h):
    return {
        "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu,
        "tanh": torch.tanh, "sigmoid": torch.sigmoid, "softmax": lambda t: t.softmax(dim=-1), "leaky_relu": F.leaky_relu,
        "elu": F.elu, "hardswish": F.hardswish, "softplus": F.softplus, "mish": F.mish,
    }[name](h)


class FuzzModel(nn.Module):
    """The chain of ops of a FuzzCase over x alone (subclasses take the mask and ids too)."""

    def __init__(self, case: FuzzCase):
        super().__init__()
        torch.manual_seed(case.seed)
        self.case = case
        layers, features = [], case.features
        for op in case.ops:
            layers.append(_Op(op, features))
            features = _features_after(op, features)
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        return self.chain({"x": x})

    def chain(self, ctx: dict):
        h = ctx["x"]
        for layer in self.layers:
            h = layer(h, ctx)
        return (h, (h * h).mean(dim=-1)) if self.case.two_outputs else h


# torch.export needs named positional inputs, so one class per set of inputs.
class FuzzModelMask(FuzzModel):
    def forward(self, x, mask):
        return self.chain({"x": x, "mask": mask})


class FuzzModelIds(FuzzModel):
    def forward(self, x, ids):
        return self.chain({"x": x, "ids": ids})


class FuzzModelMaskIds(FuzzModel):
    def forward(self, x, mask, ids):
        return self.chain({"x": x, "mask": mask, "ids": ids})


MODEL_CLASSES = {(False, False): FuzzModel, (True, False): FuzzModelMask, (False, True): FuzzModelIds, (True, True): FuzzModelMaskIds}


def _features_after(op: tuple, features: int) -> int:
    kind = op[0]
    if kind in ("linear", "conv1d"):
        return op[1]
    if kind == "conv2d":
        return op[1] * features
    if kind == "slice_features":
        return op[1]
    if kind == "concat_features":
        return 2 * features
    return features


def build(case: FuzzCase):
    """(model, example args, dynamic_shapes) of a case."""
    model = MODEL_CLASSES[case.use_mask, case.use_ids](case).eval()
    dtype = torch.bfloat16 if case.bf16_model else torch.float32
    model.to(dtype)
    d = case.dims
    generator = torch.Generator().manual_seed(case.seed)
    batch, seq = d.batch_example, d.seq_example_length
    args = [torch.randn(batch, seq, case.features, generator=generator).to(dtype)]
    if case.use_mask:
        mask = torch.rand(batch, seq, generator=generator) < 0.8
        mask[:, 0] = True  # a row with no True is all -inf scores: NaN in eager, and so in the program
        args.append(mask)
    if case.use_ids:
        args.append(torch.randint(0, 50, (batch, seq), generator=generator))
    batch_dim = torch.export.Dim("batch", min=d.batch_min, max=d.batch_max)
    if d.seq_kind == "static":
        seq_dim = None
    elif d.seq_kind == "dynamic":
        seq_dim = torch.export.Dim("seq", min=d.seq_min, max=d.seq_max)
    else:
        seq_dim = 2 * torch.export.Dim("k", min=d.seq_min, max=d.seq_max)
    axes = {0: batch_dim} | ({1: seq_dim} if seq_dim is not None else {})
    dynamic_shapes = [axes] + [dict(axes) for _ in args[1:]]
    return model, tuple(args), tuple(dynamic_shapes)


@dataclasses.dataclass(frozen=True)
class Outcome:
    kind: str  # one of OUTCOMES
    reason: str = ""
    detail: str = ""
    quantized_weights: int = 0  # weights a weight-only program holds as integers


def check(case: FuzzCase, fresh_sizes: int = FRESH_SIZES) -> Outcome:
    """Converts a case and runs it at fresh sizes (module docstring)."""
    try:
        with tempfile.TemporaryDirectory(prefix="tpuexport-fuzz-") as scratch:
            if case.full_conversion:
                lowered, reference, examples, tolerances, verified = _convert_full(case, pathlib.Path(scratch))
            else:
                lowered, reference, examples, tolerances, verified = _convert_passes(case)
            return _check_fresh_sizes(case, lowered, reference, examples, tolerances, verified, fresh_sizes)
    except TpuExportError as error:
        return Outcome("refused", refusal_reason(error), str(error))
    except VerificationError as error:
        return Outcome("verify-failed", "verification failed", str(error))
    except Exception as error:  # a traceback the user would see
        return Outcome("crash", f"{type(error).__name__}", "".join(traceback.format_exception(error))[-3000:])


def conversion_options(case: FuzzCase) -> pipeline.ConversionOptions:
    """The options a conversion of `case` takes (no target: the passes used here compile nothing)."""
    return pipeline.ConversionOptions(targets=(), out=pathlib.Path("fuzz-case.tpu"), precision=case.precision,
                                      matmul_precision=case.matmul_precision, quantize=case.quantize, group_size=case.group_size,
                                      random_calibration=True, verify_budget_flops=VERIFY_BUDGET_FLOPS)


def _convert_passes(case: FuzzCase):
    """Export, then the pipeline's quantize, lower and verify passes (pipeline.lower_forward and
    verify_forward).

    Returns:
      (lowered program, the reference it was verified against, example inputs, tolerances, the
      sizes verification ran).
    Raises:
      TpuExportError, VerificationError: as a conversion does.
    """
    model, args, dynamic_shapes = build(case)
    options = conversion_options(case)
    captured = export_stage.capture(LoadedSource(model, args, dynamic_shapes, None, SourceInfo("api")))
    forward = pipeline.lower_forward(captured, options)
    report = pipeline.verify_forward(forward, options)
    if not report.passed:
        raise VerificationError(report)
    verified = [verified_case.sizes for verified_case in report.cases]
    return forward.lowered, forward.captured.reference, forward.captured.example_inputs, report.tolerances, verified


def _convert_full(case: FuzzCase, scratch: pathlib.Path):
    """`tpuexport.convert` for v5e without the SavedModel, then the artifact loaded back from disk."""
    model, args, dynamic_shapes = build(case)
    written = tpuexport.convert(model, args, dynamic_shapes, target="v5e", out=scratch / "case.tpu", precision=case.precision,
                                matmul_precision=case.matmul_precision, verify_budget_flops=VERIFY_BUDGET_FLOPS, saved_model=False)
    artifact = tpuexport.load(written.path)
    verification = artifact.manifest["verification"]
    tolerances = VerificationTolerances.from_json(verification["tolerances"])
    return artifact.program, model, args, tolerances, [verified_case["sizes"] for verified_case in verification["cases"]]


def fresh_sizes(signature, verified: list[dict[str, int]], rng: np.random.Generator, count: int) -> list[dict[str, int]]:
    """`count` random sizes in the dims' ranges, each other than the verified ones and the others
    drawn when the ranges leave room (a few draws each, then one of them is taken)."""
    drawn: list[dict[str, int]] = []
    for _ in range(count):
        for _ in range(FRESH_SIZE_DRAWS):
            sizes = {dim.name: int(rng.integers(dim.min, dim.max + 1)) for dim in signature.dims}
            if sizes not in verified and sizes not in drawn:
                break
        drawn.append(sizes)
    return drawn


def _check_fresh_sizes(case: FuzzCase, lowered, reference, examples, tolerances, verified: list[dict[str, int]],
                       count: int) -> Outcome:
    """Runs the lowered program at `count` fresh sizes (`fresh_sizes`) against the reference."""
    signature = lowered.signature
    rng = np.random.default_rng(case.seed)
    runs = ProgramRuns(lowered)
    for index, sizes in enumerate(fresh_sizes(signature, verified, rng, count)):
        inputs = make_inputs(signature.inputs, examples, sizes, seed=50_000 + index)
        try:
            result, _ = run_case(runs, reference, inputs, PlannedCase("fresh", sizes, "fuzz", 0.0), tolerances)
        except TpuExportError as error:  # the artifact refused sizes inside its own ranges
            return Outcome("silent-mismatch", "refused sizes in range", f"{sizes}: {error}")
        if not result.passed:
            summary = result.error or "; ".join(
                f"{run} {o.name}: max abs {o.max_abs_error:.3g}, {o.mismatched}/{o.elements} outside"
                for run, outputs in result.runs.items() for o in outputs if not o.passed)
            return Outcome("silent-mismatch", "mismatch at fresh sizes", f"{sizes}: {summary}")
    return Outcome("ok", quantized_weights=len(lowered.quantized))


def refusal_reason(error: TpuExportError) -> str:
    """A refusal's message reduced to its kind: operators named, numbers and quoted names elided."""
    if isinstance(error, UnsupportedOperatorsError):
        return "no TPU lowering: " + ", ".join(sorted({op.name for op in error.operators}))
    text = str(error)
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", text)
    text = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", text)
    return text[:110]
