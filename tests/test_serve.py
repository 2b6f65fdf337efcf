"""`tpuexport serve` as a real subprocess on a loopback port, with real TF Serving clients: REST through
`requests`, gRPC through tensorflow_serving.apis stubs, and the same requests through the artifact's
SavedModel in TensorFlow. One server (module fixture) serves every test; bad requests must get a 400
(INVALID_ARGUMENT) naming the problem and leave it answering the next request. The last test stops it."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
from click.testing import CliRunner
from tensorflow_serving.apis import get_model_metadata_pb2, predict_pb2, prediction_service_pb2_grpc

from conftest import ROOT
from tpuexport.cli import main

BATCH_TIMEOUT_MS = 20
MAX_BODY_MB = 0.05


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    def __init__(self, process: subprocess.Popen, rest: str, grpc_address: str, log_path):
        self.process, self.rest, self.grpc_address, self.log_path = process, rest, grpc_address, log_path

    def log(self) -> str:
        return self.log_path.read_text()

    def predict(self, body, **kwargs) -> requests.Response:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return requests.post(f"{self.rest}/v1/models/mlp:predict", data=data, timeout=30, **kwargs)

    def stub(self):
        return prediction_service_pb2_grpc.PredictionServiceStub(grpc.insecure_channel(self.grpc_address))


@pytest.fixture(scope="module")
def server(mlp_cpu_artifact, tmp_path_factory) -> Server:
    """The artifact served as versions 1 and 2 of model mlp (a copy whose manifest says version 2)."""
    rest_port, grpc_port = free_port(), free_port()
    directory = tmp_path_factory.mktemp("serve")
    log_path = directory / "server.log"
    second = directory / "v2" / "mlp.tpu"
    shutil.copytree(mlp_cpu_artifact.path, second)
    manifest = json.loads((second / "manifest.json").read_text())
    manifest["tf_serving"]["model_version"] = 2
    (second / "manifest.json").write_text(json.dumps(manifest))
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tpuexport.cli", "serve", str(mlp_cpu_artifact.path), str(second), "--port", str(rest_port), "--grpc-port",
             str(grpc_port), "--batch-timeout-ms", str(BATCH_TIMEOUT_MS), "--max-body-mb", str(MAX_BODY_MB)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    running = Server(process, f"http://127.0.0.1:{rest_port}", f"127.0.0.1:{grpc_port}", log_path)
    deadline = time.monotonic() + 180
    while True:
        assert process.poll() is None, f"the server exited with {process.returncode}: {running.log()[-3000:]}"
        assert time.monotonic() < deadline, f"the server did not become ready: {running.log()[-3000:]}"
        try:
            if requests.get(f"{running.rest}/readyz", timeout=2).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        time.sleep(0.3)
    yield running
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def grpc_request(x: np.ndarray):
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "mlp"
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(x))
    return request


def saved_model_outputs(artifact, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """serving_default of the artifact's SavedModel on each input, in a TensorFlow process of its own."""
    script = (
        "import json, sys, numpy as np, tensorflow as tf\n"
        "model = tf.saved_model.load(sys.argv[1])\n"
        "inputs = json.loads(sys.stdin.read())\n"
        "print(json.dumps([model.signatures['serving_default'](x=tf.constant(np.asarray(x, np.float32)))['output_0'].numpy().tolist()"
        " for x in inputs]))\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(artifact.path / artifact.manifest["tf_serving"]["saved_model"])],
                            input=json.dumps([x.tolist() for x in inputs]), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return [np.asarray(outputs, np.float32) for outputs in json.loads(result.stdout.strip().splitlines()[-1])]


def assert_serves_next_request(server: Server) -> None:
    answer = server.predict({"instances": np.zeros((1, 32)).tolist()})
    assert answer.status_code == 200 and np.asarray(answer.json()["predictions"]).shape == (1, 10)
    assert server.process.poll() is None


def test_rest_and_grpc_answer_the_golden_outputs_as_the_saved_model_does(server, mlp_cpu_artifact):
    golden = [(inputs[0], outputs[0]) for sizes, inputs, outputs in mlp_cpu_artifact.golden_cases() if sizes["batch"] <= 8]
    # Padded: 2 rows run in the 4-row bucket; 5 rows of the largest case run in the 8-row bucket.
    largest = max(mlp_cpu_artifact.golden_cases(), key=lambda case: case[0]["batch"])
    golden += [(golden[0][0][:2], golden[0][1][:2]), (largest[1][0][:5], largest[2][0][:5])]
    assert sorted(len(x) for x, _ in golden) == [1, 2, 4, 5]
    rest_outputs = []
    for x, expected in golden:
        rows = server.predict({"instances": x.tolist()})
        columns = server.predict({"signature_name": "serving_default", "inputs": {"x": x.tolist()}})
        over_grpc = server.stub().Predict(grpc_request(x), timeout=30)

        assert rows.status_code == 200 and columns.status_code == 200, (rows.text, columns.text)
        from_rows = np.asarray(rows.json()["predictions"], np.float32)
        from_grpc = tf.make_ndarray(over_grpc.outputs["output_0"])
        np.testing.assert_allclose(from_rows, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(columns.json()["outputs"], np.float32), from_rows)
        np.testing.assert_array_equal(from_grpc, from_rows)
        assert over_grpc.model_spec.name == "mlp" and over_grpc.model_spec.version.value == 2  # the latest
        rest_outputs.append(from_rows)

    for served, in_tensorflow in zip(rest_outputs, saved_model_outputs(mlp_cpu_artifact, [x for x, _ in golden])):
        np.testing.assert_allclose(served, in_tensorflow, rtol=1e-5, atol=1e-6)


def test_status_metadata_health_and_versions(server):
    status = requests.get(f"{server.rest}/v1/models/mlp", timeout=10).json()
    metadata = requests.get(f"{server.rest}/v1/models/mlp/versions/1/metadata", timeout=10).json()
    missing = requests.get(f"{server.rest}/v1/models/mlp/versions/7", timeout=10)
    request = get_model_metadata_pb2.GetModelMetadataRequest()
    request.model_spec.name = "mlp"
    request.metadata_field.append("signature_def")
    signatures = get_model_metadata_pb2.SignatureDefMap()
    server.stub().GetModelMetadata(request, timeout=30).metadata["signature_def"].Unpack(signatures)

    assert status == {"model_version_status": [
        {"version": version, "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}} for version in ("1", "2")
    ]}
    signature = metadata["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert signature["inputs"]["x"]["dtype"] == "DT_FLOAT"
    assert [dim["size"] for dim in signature["inputs"]["x"]["tensor_shape"]["dim"]] == ["-1", "32"]
    assert [dim.size for dim in signatures.signature_def["serving_default"].outputs["output_0"].tensor_shape.dim] == [-1, 10]
    assert missing.status_code == 404 and "has no version 7" in missing.json()["error"]
    assert requests.get(f"{server.rest}/healthz", timeout=10).status_code == 200
    assert requests.get(f"{server.rest}/readyz", timeout=10).json() == {"status": "ready"}


ROW = [0.5] * 32
BAD_REST_REQUESTS = {
    "unknown input name": ({"inputs": {"y": [ROW]}}, "unknown input(s) 'y'; the inputs are: x"),
    "wrong dtype": ({"instances": [["a"] * 32]}, "input 'x' has dtype <U1, the model takes float32"),
    "wrong rank": ({"inputs": ROW}, "input 'x' has rank 1, expected 2"),
    "wrong feature size": ({"instances": [ROW[:31]]}, "input 'x' axis 1 is 31, expected 32"),
    "size outside every bucket": ({"instances": [ROW] * 9}, "batch=9 is outside every compiled bucket (batch=1; batch=4; batch=8"),
    "ragged rows": ({"instances": [ROW, ROW[:3]]}, "input 'x' is not a rectangular array"),
    "neither instances nor inputs": ({"rows": [ROW]}, 'exactly one of "instances" (row format) or "inputs"'),
    "malformed JSON": (b'{"instances": [[0.5, 0.5', "malformed JSON in the request body"),
    "oversized body": (json.dumps({"instances": [ROW] * 2000}), "exceeds the limit of 52,428 bytes"),
}


@pytest.mark.parametrize("kind", BAD_REST_REQUESTS)
def test_bad_rest_request_gets_400_naming_the_problem_and_the_server_serves_on(server, kind):
    body, message = BAD_REST_REQUESTS[kind]

    answer = server.predict(body)

    assert answer.status_code == 400, answer.text
    assert message in answer.json()["error"] and "\n" not in answer.json()["error"]
    assert_serves_next_request(server)


def test_each_version_answers_on_its_own_path(server):
    x = np.zeros((2, 32), np.float32)
    for version in (1, 2):
        answer = requests.post(f"{server.rest}/v1/models/mlp/versions/{version}:predict", json={"instances": x.tolist()}, timeout=30)
        request = grpc_request(x)
        request.model_spec.version.value = version
        over_grpc = server.stub().Predict(request, timeout=30)

        assert answer.status_code == 200 and np.asarray(answer.json()["predictions"]).shape == (2, 10)
        assert over_grpc.model_spec.version.value == version


def test_unknown_model_gets_404(server):
    answer = requests.post(f"{server.rest}/v1/models/resnet:predict", json={"instances": [ROW]}, timeout=10)

    assert answer.status_code == 404 and "no model 'resnet'; this server has mlp" in answer.json()["error"]
    assert_serves_next_request(server)


BAD_GRPC_REQUESTS = {
    "wrong dtype": (np.full((2, 32), "a"), grpc.StatusCode.INVALID_ARGUMENT, "input 'x' has dtype DT_STRING"),
    "size outside every bucket": (np.zeros((9, 32), np.float32), grpc.StatusCode.INVALID_ARGUMENT, "batch=9 is outside every compiled bucket"),
    "unknown model": (np.zeros((2, 32), np.float32), grpc.StatusCode.NOT_FOUND, "no model 'resnet'"),
    "wrong rank": (np.zeros((2, 32, 1), np.float32), grpc.StatusCode.INVALID_ARGUMENT, "input 'x' has rank 3, expected 2"),
}


@pytest.mark.parametrize("kind", BAD_GRPC_REQUESTS)
def test_bad_grpc_request_gets_an_error_status_naming_the_problem_and_the_server_serves_on(server, kind):
    x, code, message = BAD_GRPC_REQUESTS[kind]
    request = grpc_request(x)
    if kind == "unknown model":
        request.model_spec.name = "resnet"

    with pytest.raises(grpc.RpcError) as failed:
        server.stub().Predict(request, timeout=30)

    assert failed.value.code() == code and message in failed.value.details()
    answer = server.stub().Predict(grpc_request(np.zeros((3, 32), np.float32)), timeout=30)
    assert tf.make_ndarray(answer.outputs["output_0"]).shape == (3, 10)


def metric(text: str, name: str) -> float:
    """The sum of a metric's samples for model mlp in Prometheus' text format."""
    return sum(float(value) for value in re.findall(rf'^{name}\{{[^}}]*model="mlp"[^}}]*\}} (\S+)$', text, re.MULTILINE))


def test_the_server_runs_on_the_cpu_it_sees_and_compiled_nothing_at_start(server):
    metrics = requests.get(f"{server.rest}/metrics", timeout=10).text

    for version in ("1", "2"):
        assert f'tpuexport_compilations_at_start{{model="mlp",version="{version}"}} 0.0' in metrics
        assert f"model mlp version {version}: target cpu on 1 cpu device, loaded without compiling" in server.log()
    assert server.log().count("compilations_at_start: 0") == 2
    # No platform was chosen and the machine has no TPU: no libtpu probe and its warnings (tpuexport/devices.py).
    assert "TPU_ACCELERATOR_TYPE" not in server.log()


def test_concurrent_requests_are_batched_up_to_the_largest_bucket(server, mlp_cpu_artifact):
    before = requests.get(f"{server.rest}/metrics", timeout=10).text
    rows = np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)
    start = threading.Barrier(16)

    def one(index):
        start.wait()
        return server.predict({"instances": rows[index:index + 1].tolist()})

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(16)))
    after = requests.get(f"{server.rest}/metrics", timeout=10).text

    assert all(answer.status_code == 200 for answer in answers)
    served = np.concatenate([np.asarray(answer.json()["predictions"], np.float32) for answer in answers])
    # Each request gets its own row back, batched or not.
    np.testing.assert_allclose(served, mlp_cpu_artifact.run(rows).numpy(), rtol=1e-5, atol=1e-6)
    executions = metric(after, "tpuexport_batch_rows_count") - metric(before, "tpuexport_batch_rows_count")
    batched_rows = metric(after, "tpuexport_batch_rows_sum") - metric(before, "tpuexport_batch_rows_sum")
    assert batched_rows == 16 and executions < 16, after
    assert metric(after, "tpuexport_bucket_hits_total") > metric(before, "tpuexport_bucket_hits_total")
    assert metric(after, "tpuexport_requests_total") - metric(before, "tpuexport_requests_total") == 16
    assert 'tpuexport_request_latency_seconds_bucket{api="rest"' in after and "tpuexport_padded_rows_total" in after


def test_sigterm_finishes_requests_in_flight_and_exits_cleanly(server):
    """Runs last: it stops the module's server."""
    start = threading.Barrier(9)

    def one(_):
        start.wait()
        try:
            return server.predict({"instances": [ROW]}).status_code
        except requests.ConnectionError:  # sent after the server stopped listening
            return "refused"

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        pending = [pool.submit(one, index) for index in range(8)]
        start.wait()
        time.sleep(BATCH_TIMEOUT_MS / 4000)  # the requests are in flight, waiting for their batch
        server.process.send_signal(signal.SIGTERM)
        outcomes = [future.result() for future in pending]

    assert server.process.wait(timeout=60) == 0
    assert set(outcomes) <= {200, "refused"} and 200 in outcomes, outcomes
    assert server.log().rstrip().endswith("stopped")


def test_serve_bad_input_is_one_line_and_exit_2(mlp_cpu_artifact, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        cases = {
            "no artifact": ([str(tmp_path / "missing.tpu")], "is not a tpuexport artifact"),
            "negative batch timeout": ([str(mlp_cpu_artifact.path), "--batch-timeout-ms", "-1"], "--batch-timeout-ms -1 is negative"),
            "port in use": ([str(mlp_cpu_artifact.path), "--port", str(taken), "--grpc-port", "0"],
                            f"cannot listen for REST on 127.0.0.1:{taken}"),
        }
        for args, message in cases.values():
            result = CliRunner().invoke(main, ["serve", *args])

            assert result.exit_code == 2, result.output
            assert message in " ".join(result.stderr.split()) and "Traceback" not in result.output
