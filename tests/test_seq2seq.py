"""Encoder-decoder text generation (BART, T5): encode and decode entry points over a decoder
self-attention cache and a cross-attention cache, verified token for token against Hugging Face
generate(do_sample=False); planted cache bugs fail that verification; `tpuexport generate` and
its bad input; `tpuexport serve`'s generate over REST and gRPC."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import requests
import torch
import transformers
from click.testing import CliRunner

import tpuexport
from conftest import free_port, served
from tpuexport import export as export_stage
from tpuexport import lower as lower_stage
from tpuexport.cli import main
from tpuexport.export.seq2seq import CrossWrite, Decode, Encode
from tpuexport.serve import protos
from tpuexport.verify import verify_seq2seq

MAX_CONTEXT, MAX_BATCH, SOURCE = 12, 2, 12


def spread(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """Weights wider than the initializer's (std 0.02 makes every step's argmax the same token)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(0.0, 0.15)
    return model.eval()


def tiny_bart() -> transformers.PreTrainedModel:
    config = transformers.BartConfig(vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
    return spread(transformers.BartForConditionalGeneration(config))


def tiny_t5() -> transformers.PreTrainedModel:
    config = transformers.T5Config(vocab_size=96, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
                                   relative_attention_num_buckets=16, decoder_start_token_id=0)
    return spread(transformers.T5ForConditionalGeneration(config))


def lowered_entry_point(module: torch.nn.Module, spec: export_stage.Seq2SeqSpec, name: str) -> lower_stage.LoweredProgram:
    """One entry point captured and lowered as the pipeline does it (unscanned)."""
    args, dynamic_shapes = export_stage.seq2seq_example_arguments(spec)[name]
    captured = export_stage.capture(export_stage.LoadedSource(module, args, dynamic_shapes, None, export_stage.SourceInfo("api")))
    return lower_stage.lower(captured.program, captured.signature, scan=False)


@pytest.fixture(scope="session")
def bart_generation(tmp_path_factory):
    """A tiny BART converted for text generation, for v5e and the cpu target: (artifact, model)."""
    model = tiny_bart()
    artifact = tpuexport.convert(model, task="text-generation", max_context=MAX_CONTEXT, max_batch=MAX_BATCH,
                                 buckets={"seq": [SOURCE], "batch": [MAX_BATCH]}, target=["v5e", "cpu"],
                                 out=tmp_path_factory.mktemp("bart") / "bart.tpu")
    return artifact, model


def test_bart_artifact_generates_what_generate_does(bart_generation):
    artifact, model = bart_generation
    manifest = artifact.manifest
    verification = manifest["verification"]
    assert verification["passed"] and verification["tokens_compared"] == MAX_BATCH * 8
    # Sources of different lengths, right-padded in one encode bucket, encoded into slots that are not their rows.
    (case,) = verification["cases"]
    assert case["sizes"] == {"batch": MAX_BATCH, "seq": SOURCE} and case["lengths"] == [SOURCE, SOURCE // 4] and case["slots"] == [1, 0]
    # Both caches and the source lengths are state: donated and aliased by every executable.
    assert set(manifest["entry_points"]) == {"encode", "decode"}
    assert manifest["entry_points"]["encode"]["donated_inputs"] == ["cross_k", "cross_v", "source_lengths"]
    assert manifest["entry_points"]["decode"]["donated_inputs"] == ["cache_k", "cache_v", "cross_k", "cross_v", "source_lengths"]
    buckets = {bucket["entry_point"]: bucket for bucket in manifest["targets"]["v5e"]["buckets"]}
    assert buckets["decode"]["memory"]["alias_bytes"] >= manifest["generation"]["cache_bytes"]
    # Free-running generation through the artifact, and through the runtime's cpu executables, equals generate().
    sources = [[5, 17, 42, 7, 9, 11, 60], [33, 3]]
    generated = artifact.generate(sources, max_new_tokens=MAX_CONTEXT)
    for source, tokens in zip(sources, generated):
        expected = model.generate(torch.tensor([source]), max_new_tokens=MAX_CONTEXT, do_sample=False, num_beams=1, eos_token_id=None,
                                  forced_eos_token_id=None, forced_bos_token_id=None, no_repeat_ngram_size=0, min_length=0, pad_token_id=0)
        assert tokens == expected[0, 1:].tolist()
    assert len({token for tokens in generated for token in tokens}) > 2  # not one repeated token
    runner = tpuexport.runner(artifact.path)
    assert runner.target == "cpu"
    streamed = [[] for _ in sources]
    for step in runner.stream(sources, max_new_tokens=MAX_CONTEXT):
        for row, token in enumerate(step):
            streamed[row].append(token)
    assert streamed == generated


def test_t5_entry_points_match_generate():
    """T5: relative position bias (each row's bias from its own position) and no position embedding."""
    model = tiny_t5()
    spec = export_stage.seq2seq_spec(model, MAX_BATCH, MAX_CONTEXT, source_buckets=(SOURCE,))
    modules = export_stage.seq2seq_entry_point_modules(model, spec)
    entry_points = {name: lowered_entry_point(modules[name], spec, name) for name in ("encode", "decode")}
    report = verify_seq2seq(lower_stage.Seq2SeqProgram(spec, entry_points, (MAX_BATCH,)), model, new_tokens=8)
    assert report.passed, report.failure_summary()
    assert report.tokens_compared() == MAX_BATCH * 8 and len(set(report.cases[0].lengths)) == MAX_BATCH


class UnwrittenSlotCross(CrossWrite):
    """The first row's slot keeps what a fresh cache holds (zeros) instead of its cross keys and values."""

    def write(self, cache, new, layer):
        written = torch.arange(new.shape[0], device=new.device)[:, None, None, None] > 0
        return super().write(cache, torch.where(written, new, torch.zeros_like(new)), layer)


class UnwrittenSlotEncode(Encode):
    cross_type = UnwrittenSlotCross


class UnmaskedSourceDecode(Decode):
    """Cross attention sees every source position of the slot: the padding of a short source too."""

    def forward(self, tokens, positions, cache_k, cache_v, cross_k, cross_v, source_lengths):
        return super().forward(tokens, positions, cache_k, cache_v, cross_k, cross_v, torch.full_like(source_lengths, self.spec.max_source))


class OffByOneDecode(Decode):
    """Each step runs one position late (key written, position embedding and mask at position + 1)."""

    def forward(self, tokens, positions, cache_k, cache_v, cross_k, cross_v, source_lengths):
        return super().forward(tokens, positions + 1, cache_k, cache_v, cross_k, cross_v, source_lengths)


@pytest.mark.parametrize("name, buggy", [("encode", UnwrittenSlotEncode), ("decode", UnmaskedSourceDecode), ("decode", OffByOneDecode)],
                         ids=lambda value: value if isinstance(value, str) else value.__name__)
def test_planted_cache_bugs_fail_verification(bart_generation, name, buggy):
    artifact, model = bart_generation
    good = artifact.generation_program
    spec = good.spec
    entry_points = {**good.entry_points, name: lowered_entry_point(buggy(model, spec), spec, name)}
    report = verify_seq2seq(lower_stage.Seq2SeqProgram(spec, entry_points, good.encode_batches), model, new_tokens=4)
    assert not report.passed
    assert "(cpu run)" in report.failure_summary()  # the exact f32 run departs from eager, not just the TPU-rounded one


@pytest.mark.parametrize("arguments, expected", [
    (["--tokens", ",".join(["1"] * (SOURCE + 1))], "longer than the artifact's longest source bucket (12)"),
    (["--tokens", "1,2", "--tokens", "3", "--tokens", "4"], "exceed the artifact's max batch 2"),
    (["--tokens", "1,999"], "outside the vocabulary"),
])
def test_generate_bad_input_is_one_line(bart_generation, arguments, expected):
    artifact, _ = bart_generation
    result = CliRunner().invoke(main, ["generate", str(artifact.path), *arguments])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.output


def test_generate_cli_prints_source_generations_step_by_step(bart_generation):
    artifact, _ = bart_generation
    expected = artifact.generate([[1, 2, 3], [9, 8, 7, 6]], max_new_tokens=5)
    result = CliRunner().invoke(main, ["generate", str(artifact.path), "--tokens", "1,2,3", "--tokens", "9,8,7,6", "--max-new-tokens", "5"])
    assert result.exit_code == 0, result.output
    steps = [[int(token) for token in line.split()] for line in result.output.strip().splitlines()]
    assert steps == [list(pair) for pair in zip(*expected)]


def test_what_encoder_decoders_do_not_support_yet_is_one_line(tmp_path):
    with pytest.raises(tpuexport.TpuExportError, match=r"^--task text-generation of an encoder-decoder \(BartForConditionalGeneration\) "
                                                       r"does not support --quantize yet"):
        tpuexport.convert(tiny_bart(), task="text-generation", max_context=MAX_CONTEXT, quantize="int8-weight-only", out=tmp_path / "a.tpu")
    with pytest.raises(tpuexport.TpuExportError, match=r"does not support --kv-cache-dtype int8 yet"):
        tpuexport.convert(tiny_bart(), task="text-generation", max_context=MAX_CONTEXT, kv_cache_dtype="int8", out=tmp_path / "a.tpu")
    with pytest.raises(tpuexport.TpuExportError, match=r"^--kv-cache paged does not support an encoder-decoder yet; use --kv-cache static"):
        tpuexport.convert(tiny_bart(), task="text-generation", max_context=MAX_CONTEXT, kv_cache="paged", out=tmp_path / "a.tpu")
    assert not (tmp_path / "a.tpu").exists()


def test_gate_replays_the_stored_generation(bart_generation):
    artifact, _ = bart_generation
    report = tpuexport.verify_artifact(artifact.path)
    assert report.passed, [check.message for check in report.checks]
    golden = next(check for check in report.checks if check.name == "golden")
    assert "stored generation case(s)" in golden.message and golden.details["cases"][0]["runs"]["cpu"]["passed"]


def test_serve_generates_from_encoder_decoders(bart_generation, tmp_path):
    """`tpuexport serve` schedules an encoder-decoder's generate requests like a decoder's (sources
    encoded into free cache slots, rows decoded from the start token): concurrent requests, more
    than the slots hold, each stream the tokens they generate alone; gRPC's generate (token ids as
    an int tensor) too; audio features for this text model are a 400 / INVALID_ARGUMENT."""
    artifact, _ = bart_generation
    grpc_port = free_port()
    with served(artifact.path, tmp_path / "server.log", grpc_port=grpc_port) as base:
        requested = [([[5, 17, 42]], 5), ([[9, 8, 7, 6], [3, 4]], 4), ([[11, 12]], 6)]

        def generate(sources, max_new_tokens):
            answer = requests.post(f"{base}/v1/models/bart:generate", json={"prompts": sources, "max_new_tokens": max_new_tokens},
                                   timeout=120)
            assert answer.status_code == 200, answer.text
            return json.loads(answer.text.splitlines()[-1])["generated"]

        with ThreadPoolExecutor(len(requested)) as pool:
            answers = list(pool.map(lambda request: generate(*request), requested))
        assert answers == [artifact.generate(sources, max_new_tokens=max_new_tokens) for sources, max_new_tokens in requested]

        answer = requests.post(f"{base}/v1/models/bart:generate", json={"features": [[[0.5, 0.5]]]}, timeout=60)
        assert answer.status_code == 400 and answer.json()["error"].startswith("this model generates from token ids, not audio features")
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = protos.prediction_service_pb2_grpc.PredictionServiceStub(channel)

            def grpc_generate(**inputs):
                request = protos.predict_pb2.PredictRequest()
                request.model_spec.name, request.model_spec.signature_name = "bart", "generate"
                for name, array in inputs.items():
                    request.inputs[name].CopyFrom(protos.to_proto(array))
                return protos.to_array(stub.Predict(request, timeout=120).outputs["tokens"], "tokens").tolist()

            with pytest.raises(grpc.RpcError) as failed:
                grpc_generate(features=np.zeros((1, 8, 32), np.float32))
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not audio features" in failed.value.details()
            sources = [[9, 8, 7, 6], [3, 4, 5, 6]]
            assert grpc_generate(prompts=np.array(sources), max_new_tokens=np.array(3)) == artifact.generate(sources, max_new_tokens=3)
