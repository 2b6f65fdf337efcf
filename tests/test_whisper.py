"""Whisper text generation: encode over audio features (input_features [batch, mel bins, frames],
every source the encoder's full length, no source lengths) and decode with Whisper's position
embedding per row, verified token for token against Hugging Face generate(do_sample=False); planted
bugs fail that verification; `tpuexport generate --features` and its bad input; `tpuexport serve`'s
generate over REST and gRPC, and its bad requests."""

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
from tpuexport.export.seq2seq import FeaturesDecode, _row_positions
from tpuexport.serve import protos
from tpuexport.verify import verify_seq2seq

MAX_CONTEXT, MAX_BATCH, NEW_TOKENS = 20, 2, 16
MEL, SOURCE = 8, 16  # num_mel_bins, max_source_positions: 32 frames per source


def tiny_whisper() -> transformers.WhisperForConditionalGeneration:
    """Weights wider than the initializer's (std 0.02 makes every step's argmax the same token)."""
    config = transformers.WhisperConfig(vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=MEL,
                                        max_source_positions=SOURCE, max_target_positions=32, pad_token_id=0, bos_token_id=1,
                                        eos_token_id=2, decoder_start_token_id=1)
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(0.0, 0.15)
    return model.eval()


def features(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, MEL, 2 * SOURCE)).astype(np.float32)


@pytest.fixture(scope="module")
def whisper_generation(tmp_path_factory):
    """A tiny Whisper converted for text generation, for the cpu target (v5e: the coverage rows): (artifact, model)."""
    model = tiny_whisper()
    artifact = tpuexport.convert(model, task="text-generation", max_context=MAX_CONTEXT, max_batch=MAX_BATCH, buckets={"batch": [MAX_BATCH]},
                                 target="cpu", verify_new_tokens=NEW_TOKENS, out=tmp_path_factory.mktemp("whisper") / "whisper.tpu")
    return artifact, model


def plain_greedy(model, source: np.ndarray, new_tokens: int) -> list[int]:
    """generate() with Whisper's own processors off (no suppressed tokens, no EOS stop): plain greedy."""
    output = model.generate(input_features=torch.from_numpy(source[None]), do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                            begin_suppress_tokens=None, suppress_tokens=None, return_dict_in_generate=True)
    assert output.sequences[0, 0] == model.config.decoder_start_token_id
    return output.sequences[0, 1:].tolist()


def test_whisper_artifact_generates_what_generate_does(whisper_generation):
    artifact, model = whisper_generation
    manifest = artifact.manifest
    verification = manifest["verification"]
    assert verification["passed"] and verification["tokens_compared"] == MAX_BATCH * NEW_TOKENS
    # Different random features per row, encoded into slots that are not their rows; every source fills all positions.
    (case,) = verification["cases"]
    assert case["sizes"] == {"batch": MAX_BATCH} and case["lengths"] == [SOURCE, SOURCE] and case["slots"] == [1, 0]
    generation = manifest["generation"]
    assert generation["source"] == "features" and generation["features"] == [MEL, 2 * SOURCE] and generation["max_source"] == SOURCE
    # No source lengths: the state is the two caches, donated and aliased by every executable.
    assert manifest["entry_points"]["encode"]["donated_inputs"] == ["cross_k", "cross_v"]
    assert manifest["entry_points"]["decode"]["donated_inputs"] == ["cache_k", "cache_v", "cross_k", "cross_v"]
    assert [spec["name"] for spec in manifest["entry_points"]["encode"]["signature"]["inputs"]][:2] == ["input_features", "slots"]
    # Free-running generation through the artifact, and through the runtime's cpu executables, equals generate().
    sources = features(MAX_BATCH, seed=7)
    generated = artifact.generate(features=sources, max_new_tokens=NEW_TOKENS)
    assert generated == [plain_greedy(model, source, NEW_TOKENS) for source in sources]
    assert generated[0] != generated[1] and len({token for tokens in generated for token in tokens}) > 2
    streamed = [[] for _ in sources]
    for step in tpuexport.runner(artifact.path).stream(sources, max_new_tokens=NEW_TOKENS):
        for row, token in enumerate(step):
            streamed[row].append(token)
    assert streamed == generated
    # One source: a [mel, frames] array.
    assert artifact.generate(features=sources[1], max_new_tokens=4) == [generated[1][:4]]


def test_verification_to_the_last_target_position(whisper_generation):
    """Whisper's generate() refuses more than max_target_positions - 1 new tokens (its start token
    counts), though the cache holds one more step: with a max context of every target position,
    verification compares max context - 1 tokens per row instead of failing on the reference
    (benchmarks/fuzz_generation.py's seed 31 found it)."""
    artifact, model = whisper_generation
    positions = model.config.max_target_positions
    model.config.max_target_positions = MAX_CONTEXT  # what generate() checks: as if the cache held every target position
    try:
        report = verify_seq2seq(artifact.generation_program, model, new_tokens=MAX_CONTEXT)
    finally:
        model.config.max_target_positions = positions
    assert report.passed, report.failure_summary()
    assert report.tokens_compared() == MAX_BATCH * (MAX_CONTEXT - 1)


class LatePositionDecode(FeaturesDecode):
    """The position embedding of each row's next position (the cache write and the causal mask stay right)."""

    row_positions = staticmethod(lambda model, positions: _row_positions(model, positions + 1))


# Whisper's own decode bug (its positions are computed per row from the features' decoder, FeaturesDecode). An
# unwritten cross-attention slot is in the cross write Whisper's encode shares with BART's (export/seq2seq.py's
# CrossWrite): test_seq2seq.py's planted encode-UnwrittenSlotEncode fails verify_seq2seq with it.
@pytest.mark.parametrize("name, buggy", [("decode", LatePositionDecode)],
                         ids=lambda value: value if isinstance(value, str) else value.__name__)
def test_planted_bugs_fail_verification(whisper_generation, name, buggy):
    artifact, model = whisper_generation
    good = artifact.generation_program
    spec = good.spec
    args, dynamic_shapes = export_stage.seq2seq_example_arguments(spec)[name]
    captured = export_stage.capture(export_stage.LoadedSource(buggy(model, spec), args, dynamic_shapes, None, export_stage.SourceInfo("api")))
    entry_points = {**good.entry_points, name: lower_stage.lower(captured.program, captured.signature, scan=False)}
    report = verify_seq2seq(lower_stage.Seq2SeqProgram(spec, entry_points, good.encode_batches), model, new_tokens=4)
    assert not report.passed
    assert "(cpu run)" in report.failure_summary()  # the exact f32 run departs from eager, not just the TPU-rounded one


def test_gate_replays_the_stored_features(whisper_generation):
    artifact, _ = whisper_generation
    report = tpuexport.verify_artifact(artifact.path)
    assert report.passed, [check.message for check in report.checks]
    golden = next(check for check in report.checks if check.name == "golden")
    assert "stored generation case(s)" in golden.message and golden.details["cases"][0]["runs"]["cpu"]["passed"]


def test_generate_cli_reads_features(whisper_generation, tmp_path):
    artifact, _ = whisper_generation
    sources = features(MAX_BATCH, seed=3)
    np.save(tmp_path / "features.npy", sources)
    result = CliRunner().invoke(main, ["generate", str(artifact.path), "--features", str(tmp_path / "features.npy"), "--max-new-tokens", "5"])
    assert result.exit_code == 0, result.output
    steps = [[int(token) for token in line.split()] for line in result.output.strip().splitlines()]
    assert steps == [list(pair) for pair in zip(*artifact.generate(features=sources, max_new_tokens=5))]


def test_generate_bad_features_are_one_line(whisper_generation, tmp_path):
    artifact, _ = whisper_generation
    files = {"frames": np.zeros((1, MEL, 30), np.float32), "ints": np.zeros((1, MEL, 2 * SOURCE), np.int64),
             "rows": np.zeros((3, MEL, 2 * SOURCE), np.float32), "nan": np.full((1, MEL, 2 * SOURCE), np.nan, np.float32)}
    for stem, array in files.items():
        np.save(tmp_path / f"{stem}.npy", array)
    (tmp_path / "text.npy").write_text("not an array")
    cases = [(["--features", str(tmp_path / "missing.npy")], "no such file"),
             (["--features", str(tmp_path / "text.npy")], "is not a numpy .npy array"),
             (["--features", str(tmp_path / "frames.npy")], "a source of shape [8, 30]: this artifact's sources are audio features of 8 mel "
                                                            "bins x 32 frames each"),
             (["--features", str(tmp_path / "ints.npy")], "audio features of dtype int64: give float features"),
             (["--features", str(tmp_path / "rows.npy")], "3 sources exceed the artifact's max batch 2"),
             (["--features", str(tmp_path / "nan.npy")], "NaN or infinite"),
             (["--tokens", "1,2,3"], "pass --features FILE.npy")]
    for arguments, expected in cases:
        result = CliRunner().invoke(main, ["generate", str(artifact.path), *arguments])
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.output


def test_seq_bucket_of_whisper_is_one_line(tmp_path):
    """--bucket seq= names source lengths, which an audio model does not have."""
    with pytest.raises(tpuexport.TpuExportError, match=r"^--bucket seq= does not apply to WhisperForConditionalGeneration: its sources are "
                                                       r"audio features of 32 frames, always 16 source positions; drop --bucket seq$"):
        tpuexport.convert(tiny_whisper(), task="text-generation", max_context=MAX_CONTEXT, buckets={"seq": [8]}, out=tmp_path / "a.tpu")
    assert not (tmp_path / "a.tpu").exists()


@pytest.fixture(scope="module")
def whisper_server(whisper_generation, tmp_path_factory):
    """`tpuexport serve` of the Whisper artifact, REST and gRPC: (REST base URL, PredictionService stub)."""
    artifact, _ = whisper_generation
    grpc_port = free_port()
    with served(artifact.path, tmp_path_factory.mktemp("serve") / "server.log", grpc_port=grpc_port) as base:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            yield base, protos.prediction_service_pb2_grpc.PredictionServiceStub(channel)


def rest_generate(base: str, body) -> requests.Response:
    return requests.post(f"{base}/v1/models/whisper:generate", data=json.dumps(body), timeout=120)


def rest_generated(base: str, sources: np.ndarray, max_new_tokens: int) -> list[list[int]]:
    answer = rest_generate(base, {"features": sources.tolist(), "max_new_tokens": max_new_tokens})
    assert answer.status_code == 200, answer.text
    return json.loads(answer.text.splitlines()[-1])["generated"]


def grpc_generate_request(inputs: dict[str, np.ndarray]):
    request = protos.predict_pb2.PredictRequest()
    request.model_spec.name, request.model_spec.signature_name = "whisper", "generate"
    for name, array in inputs.items():
        request.inputs[name].CopyFrom(protos.to_proto(array))
    return request


def grpc_generated(stub, sources: np.ndarray, max_new_tokens: int) -> list[list[int]]:
    answer = stub.Predict(grpc_generate_request({"features": sources, "max_new_tokens": np.array(max_new_tokens)}), timeout=120)
    return protos.to_array(answer.outputs["tokens"], "tokens").tolist()


def test_serve_generates_whisper_over_rest_and_grpc(whisper_generation, whisper_server):
    """Concurrent requests, REST (features as JSON lists) and gRPC (a float32 TensorProto), more rows
    than the cache's 2 slots hold at once: each gets the tokens Artifact.generate gives its features alone."""
    artifact, _ = whisper_generation
    base, stub = whisper_server
    requested = [(rest_generated, features(1, seed=21), 9), (rest_generated, features(2, seed=22), 6),
                 (grpc_generated, features(1, seed=23), NEW_TOKENS), (grpc_generated, features(2, seed=24), 5)]
    with ThreadPoolExecutor(len(requested)) as pool:
        answers = list(pool.map(lambda request: request[0](base if request[0] is rest_generated else stub, *request[1:]), requested))
    assert answers == [artifact.generate(features=sources, max_new_tokens=max_new_tokens) for _, sources, max_new_tokens in requested]
    # The metadata describes the generate signature a gRPC client sends.
    generate = requests.get(f"{base}/v1/models/whisper/metadata", timeout=30).json()["metadata"]["signature_def"]["signature_def"]["generate"]
    assert [int(dim["size"]) for dim in generate["inputs"]["features"]["tensor_shape"]["dim"]] == [-1, MEL, 2 * SOURCE]
    assert generate["inputs"]["features"]["dtype"] == "DT_FLOAT" and generate["outputs"]["tokens"]["dtype"] == "DT_INT64"


FRAMES = 2 * SOURCE
BAD_REST_GENERATE = {
    "frames": ({"features": np.zeros((1, MEL, 30)).tolist()}, "a source of shape [8, 30]: this artifact's sources are audio features of 8 mel bins x 32 frames"),
    "no batch dim": ({"features": np.zeros((MEL, FRAMES)).tolist()}, "audio features of shape [8, 32]: send \"features\", a float array [batch, 8, 32]"),
    "strings": ({"features": np.full((1, MEL, FRAMES), "a").tolist()}, '"features" must hold numbers (floats), not string values'),
    "booleans": ({"features": np.full((1, MEL, FRAMES), True).tolist()}, '"features" must hold numbers (floats), not true/false values'),
    "ragged": ({"features": [np.zeros((MEL, FRAMES)).tolist(), [[0.0]]]}, "input 'features' is not a rectangular array"),
    "NaN": ({"features": np.full((1, MEL, FRAMES), np.nan).tolist()}, "audio features hold NaN or infinite values"),
    "token ids": ({"prompts": [[1, 2]]}, 'this model generates from audio features, not token ids: send "features"'),
    "both": ({"prompts": [[1, 2]], "features": []}, 'the request body must be a JSON object {"prompts"'),
}


@pytest.mark.parametrize("kind", BAD_REST_GENERATE)
def test_bad_rest_generate_request_is_a_400_and_the_server_serves_on(whisper_generation, whisper_server, kind):
    artifact, _ = whisper_generation
    base, _ = whisper_server
    body, expected = BAD_REST_GENERATE[kind]
    answer = rest_generate(base, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert expected in error and "\n" not in error, error
    assert rest_generated(base, features(1, seed=5), 2) == artifact.generate(features=features(1, seed=5), max_new_tokens=2)


BAD_GRPC_GENERATE = {
    "integers": ({"features": np.zeros((1, MEL, FRAMES), np.int64)}, "audio features of dtype int64: give float features"),
    "mel bins": ({"features": np.zeros((1, 4, FRAMES), np.float32)}, "a source of shape [4, 32]: this artifact's sources are audio features"),
    "infinite": ({"features": np.full((1, MEL, FRAMES), np.inf, np.float32)}, "audio features hold NaN or infinite values"),
    "token ids": ({"prompts": np.array([[1, 2]])}, "this model generates from audio features, not token ids"),
    "too many rows": ({"features": np.zeros((3, MEL, FRAMES), np.float32)}, "3 sources exceed the artifact's max batch 2"),
    "max_new_tokens": ({"features": np.zeros((1, MEL, FRAMES), np.float32), "max_new_tokens": np.array(0)},
                       '"max_new_tokens" must be one whole number'),
    "unknown input": ({"input_features": np.zeros((1, MEL, FRAMES), np.float32)}, "generate takes the input \"prompts\""),
}


@pytest.mark.parametrize("kind", BAD_GRPC_GENERATE)
def test_bad_grpc_generate_request_is_invalid_argument_and_the_server_serves_on(whisper_generation, whisper_server, kind):
    artifact, _ = whisper_generation
    _, stub = whisper_server
    inputs, expected = BAD_GRPC_GENERATE[kind]
    with pytest.raises(grpc.RpcError) as failed:
        stub.Predict(grpc_generate_request(inputs), timeout=60)
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in failed.value.details() and "\n" not in failed.value.details(), failed.value.details()
    assert grpc_generated(stub, features(1, seed=6), 2) == artifact.generate(features=features(1, seed=6), max_new_tokens=2)


def test_a_whisper_directory_loads_for_generation(tmp_path):
    """--task text-generation on a Whisper directory reads the speech encoder-decoder (Whisper's model
    type is in the causal LM table too, as its decoder alone) and defaults max context to the
    decoder's max_target_positions."""
    from tpuexport.export import load_source
    from tpuexport.export.huggingface import generation_context

    tiny_whisper().save_pretrained(tmp_path / "whisper")
    loaded = load_source(str(tmp_path / "whisper"), task="text-generation")
    assert type(loaded.model).__name__ == "WhisperForConditionalGeneration" and generation_context(loaded.model) == 32


def test_more_source_than_target_positions_is_taken():
    """A real Whisper's encoder has more positions than its decoder (1500 vs 448): its source length
    is the encoder's own, not bounded by the decoder's (found by benchmarks/fuzz_generation.py)."""
    from tpuexport.export.seq2seq import seq2seq_spec

    config = transformers.WhisperConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=1,
                                        decoder_attention_heads=1, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=4, max_source_positions=32,
                                        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    spec = seq2seq_spec(transformers.WhisperForConditionalGeneration(config), max_batch=1, max_context=16)
    assert spec.max_source == 32 and spec.features == (4, 64) and spec.max_context == 16
    with pytest.raises(tpuexport.TpuExportError, match=r"^--max-context 17 exceeds the model's 16 positions \(max_target_positions\)"):
        seq2seq_spec(transformers.WhisperForConditionalGeneration(config), max_batch=1, max_context=17)
