"""TF Serving's REST API over the runtime (an ASGI app, served by uvicorn).

  POST /v1/models/<name>[/versions/<v>]:predict   {"signature_name"?, "instances": [...]} (row format)
                                                  or {"signature_name"?, "inputs": ...} (columnar)
  POST /v1/models/<name>[/versions/<v>]:generate  {"prompts": [[token ids], ...], "max_new_tokens"?: 32}
                                                  (text-generation artifacts; an audio encoder-decoder's
                                                  {"features": [[[mel bins] x frames], ...], ...} instead,
                                                  a [mel bins, frames] array per source): a stream of JSON lines,
                                                  {"step": i, "tokens": [one per prompt, null once a
                                                  row reached max context]}, then {"generated": [...]}
  GET  /v1/models/<name>[/versions/<v>]           version status
  GET  /v1/models/<name>[/versions/<v>]/metadata  signature_def, as TF Serving describes a SavedModel
  GET  /healthz                                   alive
  GET  /readyz                                    ready to take requests (503 once shutting down, or
                                                  once a multi-process run lost a process)
  GET  /monitoring/prometheus/metrics, /metrics   Prometheus metrics

Answers are TF Serving's: {"predictions": ...} for row-format requests, {"outputs": ...} for
columnar ones, {"error": "..."} with 400 for a bad request (naming the problem), 404 for an
unknown model or version, 503 while shutting down.
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tpuexport.errors import TpuExportError
from tpuexport.runtime.processes import ProcessLost
from tpuexport.serve.batching import ShuttingDown
from tpuexport.serve.generation import DEFAULT_NEW_TOKENS, GenerationStream, Step
from tpuexport.serve.metrics import UNKNOWN_MODEL, Metrics
from tpuexport.serve.models import ModelNotFound, ModelRepository, ServedModel

DEFAULT_MAX_BODY_BYTES = 64 << 20
_JSON_KINDS = {"b": "true/false", "U": "string"}  # numpy's dtype kind of JSON values that are not numbers


class BadRequest(TpuExportError):
    """A request the server cannot take (HTTP 400)."""


def create_app(repository: ModelRepository, metrics: Metrics, state: dict, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               routes: tuple[Route, ...] = ()) -> Starlette:
    """The REST app.

    Args:
      repository: the served models.
      metrics: the server's metrics.
      state: shared with the server: {"ready": bool}, False once shutdown has begun.
      max_body_bytes: larger request bodies are refused (400) without being read whole.
      routes: more routes on the same port (OpenAI's API, serve/openai.py).
    Returns:
      The Starlette app.
    """

    async def predict(request: Request) -> Response:
        start = time.perf_counter()
        name, version = request.path_params["name"], request.path_params.get("version")
        labels = {"model": UNKNOWN_MODEL, "version": ""}
        try:
            model = repository.resolve(name, version)
            labels = model.labels
            body = await read_json(request, max_body_bytes)
            inputs, row_format, signature_name = _parse_predict(body, model)
            prepared = model.runner.prepare(inputs, signature_name)
            outputs = await asyncio.wrap_future(model.batcher.submit(prepared))
            answer = JSONResponse(_format_outputs(outputs, row_format))
            outcome = "ok"
        except ModelNotFound as error:
            answer, outcome = _error(404, error), "not_found"
        except (ShuttingDown, ProcessLost) as error:
            answer, outcome = _error(503, error), "unavailable"
        except TpuExportError as error:
            answer, outcome = _error(400, error), "bad_request"
        except Exception as error:  # a failure inside a run: this request fails, the server serves on
            answer, outcome = _error(500, f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"), "error"
        metrics.requests.labels(**labels, api="rest", outcome=outcome).inc()
        metrics.latency.labels(**labels, api="rest").observe(time.perf_counter() - start)
        return answer

    async def generate(request: Request) -> Response:
        # Requests share the model's KV cache, continuously batched (serve/generation.py).
        labels = {"model": UNKNOWN_MODEL, "version": ""}
        try:
            model = repository.resolve(request.path_params["name"], request.path_params.get("version"))
            labels = model.labels
            rows, kind, max_new_tokens = _parse_generate(await read_json(request, max_body_bytes))
            if model.generation is None:
                raise BadRequest(f"model {model.name} has no decode entry point; generation needs a text-generation "
                                 "artifact (convert with --task text-generation)")
            steps = model.generation.submit(rows, max_new_tokens, kind)  # the rows are checked here: a bad one is a 400
            first = await run_in_threadpool(next, steps)
        except ModelNotFound as error:
            answer, outcome = _error(404, error), "not_found"
        except (ShuttingDown, ProcessLost) as error:
            answer, outcome = _error(503, error), "unavailable"
        except TpuExportError as error:
            answer, outcome = _error(400, error), "bad_request"
        except Exception as error:  # a failed step: this request fails, the server serves on
            answer, outcome = _error(500, f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"), "error"
        else:
            answer, outcome = StreamingResponse(_stream_lines(first, steps, len(rows)), media_type="application/x-ndjson"), "ok"
        metrics.requests.labels(**labels, api="rest_generate", outcome=outcome).inc()
        return answer

    async def status(request: Request) -> Response:
        try:
            model = repository.resolve(request.path_params["name"], request.path_params.get("version"))
        except ModelNotFound as error:
            return _error(404, error)
        versions = [model] if request.path_params.get("version") else list(repository.models[model.name].values())
        return JSONResponse({"model_version_status": [
            {"version": str(served.version), "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}}
            for served in versions
        ]})

    async def metadata(request: Request) -> Response:
        try:
            model = repository.resolve(request.path_params["name"], request.path_params.get("version"))
        except ModelNotFound as error:
            return _error(404, error)
        return JSONResponse(model.metadata_json())

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "alive"})

    async def readyz(request: Request) -> Response:
        # A multi-process run whose followers are lost takes no more requests (runtime/processes.py).
        ready = state.get("ready", False) and not any(model.runner.mirror and model.runner.mirror.lost for model in repository)
        return JSONResponse({"status": "ready" if ready else "not ready"}, status_code=200 if ready else 503)

    async def prometheus(request: Request) -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    return Starlette(routes=[
        Route("/v1/models/{name}:predict", predict, methods=["POST"]),
        Route("/v1/models/{name}/versions/{version}:predict", predict, methods=["POST"]),
        Route("/v1/models/{name}:generate", generate, methods=["POST"]),
        Route("/v1/models/{name}/versions/{version}:generate", generate, methods=["POST"]),
        Route("/v1/models/{name}", status, methods=["GET"]),
        Route("/v1/models/{name}/versions/{version}", status, methods=["GET"]),
        Route("/v1/models/{name}/metadata", metadata, methods=["GET"]),
        Route("/v1/models/{name}/versions/{version}/metadata", metadata, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/monitoring/prometheus/metrics", prometheus, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        *routes,
    ])


def _error(status: int, error) -> JSONResponse:
    return JSONResponse({"error": str(error)}, status_code=status)


async def read_json(request: Request, limit: int):
    """The request body parsed as JSON, refused past `limit` bytes (read no further than that).

    Raises:
      BadRequest: an oversized body, or one that is not JSON.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"request body of {int(declared):,} bytes exceeds the limit of {limit:,} bytes; send fewer rows per request")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"request body exceeds the limit of {limit:,} bytes; send fewer rows per request")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise BadRequest(f"malformed JSON in the request body: {error}") from None


def _parse_predict(body, model: ServedModel) -> tuple[dict, bool, str | None]:
    """(inputs by name, whether the request is in row format, its signature name).

    Raises:
      BadRequest: a body that is not a TF Serving predict request.
    """
    if not isinstance(body, dict):
        raise BadRequest('the request body must be a JSON object with "instances" or "inputs"')
    if ("instances" in body) == ("inputs" in body):
        raise BadRequest('the request needs exactly one of "instances" (row format) or "inputs" (columnar format)')
    signature_name = body.get("signature_name")
    if signature_name is not None and not isinstance(signature_name, str):
        raise BadRequest('"signature_name" must be a string')
    entry = model.runner.entry_point(signature_name)
    names = [spec.name for spec in entry.signature.inputs]
    if "inputs" in body:
        inputs = body["inputs"]
        if not isinstance(inputs, dict):
            if len(names) != 1:
                raise BadRequest(f'"inputs" must map input names to values; the inputs are: {", ".join(names)}')
            inputs = {names[0]: inputs}
        return {key: _array(value, key) for key, value in inputs.items()}, False, signature_name
    instances = body["instances"]
    if not isinstance(instances, list) or not instances:
        raise BadRequest('"instances" must be a non-empty list of rows')
    if entry.batch_dim is None:
        raise BadRequest(f'{model.name} has no batch dim to stack "instances" along; send columnar "inputs"')
    if all(isinstance(instance, dict) for instance in instances):
        keys = {frozenset(instance) for instance in instances}
        if len(keys) != 1:
            raise BadRequest('every instance must name the same inputs')
        return {key: _array([instance[key] for instance in instances], key) for key in next(iter(keys))}, True, signature_name
    if len(names) != 1:
        raise BadRequest(f"{model.name} takes {len(names)} inputs ({', '.join(names)}); give each instance as an object naming them")
    return {names[0]: _array(instances, names[0])}, True, signature_name


def _parse_generate(body) -> tuple[object, str, int]:
    """(rows, their kind, max new tokens) of a generate request: token ids per prompt ("prompts"),
    or an audio encoder-decoder's features ("features", a float array [batch, mel bins, frames]; JSON
    integers count as floats).

    Raises:
      BadRequest: a body that is not {"prompts": [[int, ...], ...] or "features": [[[number, ...], ...], ...],
        "max_new_tokens"?: int >= 1}.
    """
    if not isinstance(body, dict) or ("prompts" in body) == ("features" in body):
        raise BadRequest('the request body must be a JSON object {"prompts": [[token ids], ...], "max_new_tokens": N} '
                         '(an audio model: {"features": [[mel bins x frames], ...], "max_new_tokens": N})')
    max_new_tokens = body.get("max_new_tokens", DEFAULT_NEW_TOKENS)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise BadRequest('"max_new_tokens" must be a whole number of at least 1')
    if "features" in body:
        features = _array(body["features"], "features")
        if features.dtype.kind not in "iuf":
            raise BadRequest(f'"features" must hold numbers (floats), not {_JSON_KINDS.get(features.dtype.kind, features.dtype.name)} values')
        return features.astype(np.float32), "features", max_new_tokens
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not prompts or not all(
            isinstance(prompt, list) and all(isinstance(token, int) and not isinstance(token, bool) for token in prompt) for prompt in prompts):
        raise BadRequest('"prompts" must be a non-empty list of lists of token ids (integers)')
    return prompts, "prompts", max_new_tokens


async def _stream_lines(first: Step, steps: GenerationStream, rows: int):
    """The generate answer's JSON lines: each step's tokens, then every prompt's generated tokens.
    A client that goes away cancels the request (Starlette cancels this generator), freeing its slots."""
    generated: list[list[int]] = [[] for _ in range(rows)]
    step, index = first, 0
    try:
        while step is not None:
            for row, token in enumerate(step.tokens):
                if token is not None:
                    generated[row].append(token)
            yield json.dumps({"step": index, "tokens": step.tokens}) + "\n"
            step, index = await run_in_threadpool(next, steps, None), index + 1
        yield json.dumps({"generated": generated}) + "\n"
    finally:
        steps.cancel()


def _array(value, name: str) -> np.ndarray:
    """A JSON value as a numpy array (its dtype checked later against the input's).

    Raises:
      BadRequest: ragged lists or objects where numbers belong.
    """
    if isinstance(value, dict) and set(value) == {"b64"}:
        raise BadRequest(f"input {name!r}: binary (b64) values are not supported; send numbers")
    try:
        array = np.asarray(value)
    except ValueError as error:
        raise BadRequest(f"input {name!r} is not a rectangular array: {' '.join(str(error).split())[:160]}") from None
    if array.dtype == object:
        raise BadRequest(f"input {name!r} is not a rectangular array of numbers")
    return array


def _format_outputs(outputs: dict[str, np.ndarray], row_format: bool):
    """TF Serving's answer: {"predictions": rows} or {"outputs": columns}; a single output unnamed."""
    lists = {name: (array.astype(np.float32) if array.dtype.kind == "V" or array.dtype.name == "bfloat16" else array).tolist()
             for name, array in outputs.items()}
    if not row_format:
        return {"outputs": next(iter(lists.values())) if len(lists) == 1 else lists}
    if len(lists) == 1:
        return {"predictions": next(iter(lists.values()))}
    rows = len(next(iter(lists.values())))
    return {"predictions": [{name: values[row] for name, values in lists.items()} for row in range(rows)]}
