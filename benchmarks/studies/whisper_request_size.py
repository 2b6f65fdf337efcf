"""What a Whisper generate request costs on the wire and to decode, REST (JSON lists) vs gRPC (a
float32 TensorProto), at real feature sizes: bytes per request, the client's encoding seconds and
the server's decoding seconds (the functions `tpuexport serve` runs on each body), best of --repeats.

    python benchmarks/studies/whisper_request_size.py [--mel 80] [--frames 3000] [--batch 1,4] [--repeats 3]

Features are standard normal float32 (log-mel features after Whisper's normalization lie in about
[-1, 1.5]; a JSON number's length depends little on that). No model runs: the costs are the request's.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402
from tpuexport.serve import protos  # noqa: E402
from tpuexport.serve.rest import _parse_generate


def best_seconds(function, repeats: int) -> tuple[float, object]:
    """(the fastest of `repeats` calls in seconds, the last call's result)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mel", type=int, default=80)
    parser.add_argument("--frames", type=int, default=3000)
    parser.add_argument("--batch", default="1,4")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"features [batch, {args.mel}, {args.frames}] float32, best of {args.repeats}")
    print(f"{'batch':>5} {'api':>5} {'request bytes':>14} {'client encode s':>16} {'server decode s':>16}")
    for batch in map(int, args.batch.split(",")):
        features = np.random.default_rng(0).standard_normal((batch, args.mel, args.frames)).astype(np.float32)
        encode_seconds, body = best_seconds(lambda: json.dumps({"features": features.tolist(), "max_new_tokens": 32}).encode(), args.repeats)
        decode_seconds, (rows, _, _) = best_seconds(lambda: _parse_generate(json.loads(body)), args.repeats)
        assert np.array_equal(rows, features)
        print(f"{batch:>5} {'REST':>5} {len(body):>14,} {encode_seconds:>16.3f} {decode_seconds:>16.3f}")

        def grpc_body() -> bytes:
            request = protos.predict_pb2.PredictRequest()
            request.model_spec.name, request.model_spec.signature_name = "whisper", "generate"
            request.inputs["features"].CopyFrom(protos.to_proto(features))
            return request.SerializeToString()

        def grpc_decode(serialized: bytes) -> np.ndarray:
            request = protos.predict_pb2.PredictRequest.FromString(serialized)
            return protos.to_array(request.inputs["features"], "features")

        encode_seconds, serialized = best_seconds(grpc_body, args.repeats)
        decode_seconds, array = best_seconds(lambda: grpc_decode(serialized), args.repeats)
        assert np.array_equal(array, features)
        print(f"{batch:>5} {'gRPC':>5} {len(serialized):>14,} {encode_seconds:>16.3f} {decode_seconds:>16.3f}")


if __name__ == "__main__":
    main()
