"""OpenAI's API on `tpuexport serve`'s REST port, over the continuous-batching scheduler
(serve/generation.py), for every served model that generates from token ids:

  GET  /v1/models             the models, with their max context ("max_model_len")
  POST /v1/completions        "prompt": text, texts, token ids or lists of them (one choice each)
  POST /v1/chat/completions   "messages" rendered by the chat template of the artifact's tokenizer (hf/)

Both take max_tokens (chat: max_completion_tokens too), temperature (OpenAI's default 1), top_p,
top_k (an extension, as vLLM's: 0 or -1 for all), seed, stop (strings), stop_token_ids and
ignore_eos (vLLM's extensions), stream with stream_options.include_usage, and logprobs (completions:
0..20 alternatives; chat: logprobs with top_logprobs 0..20). Answers carry `usage` (with
prompt_tokens_details.cached_tokens, the prompt tokens the prefix cache gave) and each choice's
finish_reason, "stop" (an EOS of the model's generation_config.json, a stop token or string) or
"length" (max_tokens or the max context); streams are server-sent events, `data: {chunk}` lines
ending with `data: [DONE]`. A choice's text is its tokens detokenized as they come (serve/text.py).

Bad requests get OpenAI's error object {"error": {"message", "type", "param", "code"}} with HTTP
400 (an unknown model, parameters out of range, a prompt longer than the max context, chat for an
artifact without a chat template, malformed JSON, ...), 503 while shutting down; the server serves
on. Unsupported parameters (n > 1, echo, suffix, penalties) are refused the same way rather than ignored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tpuexport.errors import TpuExportError
from tpuexport.lower.sampling import Sampling
from tpuexport.sampling_constants import TOP_LOGPROBS
from tpuexport.runtime.processes import ProcessLost
from tpuexport.serve.batching import ShuttingDown
from tpuexport.serve.generation import PROMPTS, GenerationStream, Step
from tpuexport.serve.metrics import UNKNOWN_MODEL, Metrics
from tpuexport.serve.models import ModelNotFound, ModelRepository, ServedModel
from tpuexport.serve.rest import read_json
from tpuexport.serve.text import TextRow

# OpenAI's default max_tokens of a completion; a chat completion's default is what the context leaves.
DEFAULT_COMPLETION_TOKENS = 16
# Completions' legacy logprobs (OpenAI allows 5; vLLM and this server up to the sample entry point's top).
MAX_LOGPROBS = TOP_LOGPROBS


class OpenAIError(Exception):
    """A request OpenAI's API refuses: its HTTP status and error object."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}},
                            status_code=self.status)


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """What a completions or chat request asks, parsed and checked.

    Attributes:
      model: the served model.
      prompts: token ids per choice.
      max_tokens: tokens to generate per choice (fewer at a stop or the max context).
      sampling: temperature, top_p, top_k, seed.
      stops: stop strings.
      stop_ids: stop token ids (the model's EOS ids unless ignore_eos, and the request's).
      stream: whether to answer with server-sent events; include_usage: a last chunk with usage.
      logprobs: alternatives per token (completions' logprobs, chat's top_logprobs), or None for no logprobs.
    """

    model: ServedModel
    prompts: list[list[int]]
    max_tokens: int
    sampling: Sampling
    stops: tuple[str, ...]
    stop_ids: frozenset[int]
    stream: bool
    include_usage: bool
    logprobs: int | None


def openai_routes(repository: ModelRepository, metrics: Metrics, max_body_bytes: int) -> list[Route]:
    """The routes of the module docstring, for create_app (serve/rest.py)."""

    async def models(request: Request) -> Response:
        served = [model for model in repository if _generates_text(model)]
        latest = {model.name: model for model in sorted(served, key=lambda model: model.version)}
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": int(model.runner.artifact.path.stat().st_mtime), "owned_by": "tpuexport",
             "root": name, "max_model_len": model.generation.spec.max_context} for name, model in latest.items()]})

    async def completions(request: Request) -> Response:
        return await _answer(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _answer(request, chat=True)

    async def _answer(request: Request, chat: bool) -> Response:
        api = "openai_chat" if chat else "openai_completions"
        labels = {"model": UNKNOWN_MODEL, "version": ""}
        streams: list[GenerationStream] = []
        try:
            try:
                body = await read_json(request, max_body_bytes)
            except TpuExportError as error:
                raise OpenAIError(str(error)) from None
            model = _model(repository, body)
            labels = model.labels
            parsed = await run_in_threadpool(_parse, body, model, chat)
            for prompt in parsed.prompts:  # one request per prompt (a choice each); a refused one cancels those before it
                streams.append(_submit(parsed, prompt))
            answer_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            if parsed.stream:
                answer = StreamingResponse(_events(parsed, streams, answer_id, chat), media_type="text/event-stream")
            else:
                answer = JSONResponse(await _whole(parsed, streams, answer_id, chat))
            outcome = "ok"
        except OpenAIError as error:
            answer, outcome = error.response(), "bad_request"
        except (ShuttingDown, ProcessLost) as error:
            answer, outcome = OpenAIError(str(error), status=503, kind="service_unavailable").response(), "unavailable"
        except Exception as error:  # a failed step: this request fails, the server serves on
            answer, outcome = OpenAIError(f"{type(error).__name__}: {' '.join(str(error).split())[:300]}", status=500,
                                          kind="internal_error").response(), "error"
        if outcome != "ok":
            for stream in streams:
                stream.cancel()
        metrics.requests.labels(**labels, api=api, outcome=outcome).inc()
        return answer

    return [Route("/v1/models", models, methods=["GET"]), Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"])]


def _generates_text(model: ServedModel) -> bool:
    return model.generation is not None and model.generation.source_kind == PROMPTS


def _model(repository: ModelRepository, body) -> ServedModel:
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    name = body.get("model")
    if not isinstance(name, str):
        raise OpenAIError('"model" must name a served model (GET /v1/models lists them)', "model")
    try:
        model = repository.resolve(name)
    except ModelNotFound:
        served = ", ".join(model.name for model in repository if _generates_text(model)) or "none"
        raise OpenAIError(f"The model `{name}` does not exist; this server generates with: {served}", "model", "model_not_found") from None
    if not _generates_text(model):
        raise OpenAIError(f"the model `{name}` does not generate text from token ids (convert a causal LM with --task text-generation)",
                          "model", "model_not_found")
    return model


def _parse(body: dict, model: ServedModel, chat: bool) -> GenerationRequest:
    """The request's generation parameters, checked (in a worker thread: it tokenizes).

    Raises:
      OpenAIError: the first bad or unsupported parameter.
    """
    spec = model.generation.spec
    for name, neutral in (("n", 1), ("best_of", 1), ("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
        if body.get(name) not in (None, neutral):
            raise OpenAIError(f'"{name}" {body[name]!r} is not supported; leave it out (or {neutral})', name)
    if body.get("echo") or body.get("suffix") is not None:
        raise OpenAIError("echo and suffix are not supported; leave them out", "echo" if body.get("echo") else "suffix")
    tokenizer = model.tokenizer
    prompts = _chat_prompt(body, model) if chat else _completion_prompts(body, model)
    limit = model.generation.program.longest_row
    for prompt in prompts:
        if len(prompt) > limit:
            raise OpenAIError(f"This model's maximum context length is {spec.max_context} tokens and its longest prompt {limit}; your "
                              f"prompt has {len(prompt)} tokens. Shorten it.", "messages" if chat else "prompt", "context_length_exceeded")
    max_tokens = body.get("max_completion_tokens") if chat and body.get("max_completion_tokens") is not None else body.get("max_tokens")
    if max_tokens is None:
        max_tokens = max(1, spec.max_context - max(len(prompt) for prompt in prompts)) if chat else DEFAULT_COMPLETION_TOKENS
    _whole_number(max_tokens, "max_tokens", 1)
    temperature = _number(body, "temperature", 1.0)
    top_p = _number(body, "top_p", 1.0)
    top_k = body.get("top_k", 0)
    if top_k == -1:  # vLLM's "all"
        top_k = 0
    _whole_number(top_k, "top_k", 0)
    if temperature < 0:
        raise OpenAIError(f"temperature {temperature} is negative; give 0 (greedy) to 2", "temperature")
    if not 0 < top_p <= 1:
        raise OpenAIError(f"top_p {top_p} is outside (0, 1]", "top_p")
    seed = body.get("seed")
    if seed is not None:
        _whole_number(seed, "seed", -(1 << 63))
    stops = body.get("stop")
    stops = (stops,) if isinstance(stops, str) else stops or ()
    if not isinstance(stops, (list, tuple)) or not all(isinstance(stop, str) for stop in stops):
        raise OpenAIError('"stop" must be a string or a list of strings', "stop")
    if stops and tokenizer is None:
        raise OpenAIError("stop strings need the tokenizer, which this artifact does not carry; give stop_token_ids", "stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(token, int) and not isinstance(token, bool) for token in stop_ids):
        raise OpenAIError('"stop_token_ids" must be a list of token ids', "stop_token_ids")
    eos = () if body.get("ignore_eos") else model.runner.artifact.eos_token_ids
    logprobs = _logprobs(body, chat)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise OpenAIError('"stream" must be true or false', "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise OpenAIError('"stream_options" must be an object', "stream_options")
    return GenerationRequest(model, prompts, int(max_tokens), Sampling(temperature, top_p, int(top_k), seed), tuple(stops),
                             frozenset([*eos, *stop_ids]), stream, bool(options.get("include_usage")), logprobs)


def _completion_prompts(body: dict, model: ServedModel) -> list[list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(item, str) for item in prompt)):
        texts = [prompt] if isinstance(prompt, str) else prompt
        if model.tokenizer is None:
            raise OpenAIError(f"the model `{model.name}` carries no tokenizer (its source was not a Hugging Face directory with one); "
                              "send the prompt as token ids", "prompt")
        with model.tokenizer_lock:
            prompts = [model.tokenizer(text)["input_ids"] for text in texts]
    elif isinstance(prompt, list) and prompt and all(_is_token(item) for item in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(item, list) and all(_is_token(token) for token in item) for item in prompt):
        prompts = prompt
    else:
        raise OpenAIError('"prompt" must be a string, a list of strings, a list of token ids or a list of such lists', "prompt")
    if not all(prompts):
        raise OpenAIError("an empty prompt: give at least one token per prompt", "prompt")
    return prompts


def _chat_prompt(body: dict, model: ServedModel) -> list[list[int]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(message, dict) and isinstance(message.get("role"), str)
                                                                 for message in messages):
        raise OpenAIError('"messages" must be a non-empty list of {"role", "content"} objects', "messages")
    tokenizer = model.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise OpenAIError(f"the model `{model.name}` has no chat template (its artifact's hf/ tokenizer files define none); use "
                          "/v1/completions", "messages", "chat_template_missing")
    conversation = [{**message, "content": _content_text(message.get("content"))} for message in messages]
    with model.tokenizer_lock:
        try:
            ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        except Exception as error:  # the template's own checks (roles out of order, ...) raise what it says
            raise OpenAIError(f"the chat template refused the messages: {' '.join(str(error).split())[:300]}", "messages") from None
    return [list(ids)]


def _content_text(content) -> str:
    """A message's content as text: a string, or the text of its text parts."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                                         for part in content):
        return "".join(part["text"] for part in content)
    raise OpenAIError("a message's content must be a string or a list of text parts", "messages")


def _logprobs(body: dict, chat: bool) -> int | None:
    if chat:
        if not body.get("logprobs"):
            if body.get("top_logprobs"):
                raise OpenAIError('"top_logprobs" needs "logprobs": true', "top_logprobs")
            return None
        top = body.get("top_logprobs") or 0
        _whole_number(top, "top_logprobs", 0, MAX_LOGPROBS)
        return top
    top = body.get("logprobs")
    if top is None:
        return None
    _whole_number(top, "logprobs", 0, MAX_LOGPROBS)
    return top


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise OpenAIError(f'"{name}" must be a number', name)
    return float(value)


def _whole_number(value, name: str, low: int, high: int | None = None) -> None:
    if not _is_token(value) or value < low or (high is not None and value > high):
        within = f"{low}..{high}" if high is not None else f"at least {low}"
        raise OpenAIError(f'"{name}" must be a whole number {within}, not {value!r}', name)


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _submit(parsed: GenerationRequest, prompt: list[int]) -> GenerationStream:
    model = parsed.model
    texts = [TextRow(model.tokenizer, prompt, parsed.stops, model.tokenizer_lock)] if model.tokenizer is not None else None
    try:
        return model.generation.submit([prompt], parsed.max_tokens, PROMPTS, parsed.sampling, parsed.stop_ids,
                                       parsed.logprobs or 0, texts)
    except (ShuttingDown, ProcessLost):
        raise
    except TpuExportError as error:
        raise OpenAIError(str(error), "prompt") from None


async def _steps(streams: list[GenerationStream]) -> AsyncIterator[tuple[int, Step]]:
    """Every choice's steps as they come, (choice index, step), the streams read concurrently; a client
    gone (this generator closed) cancels them, freeing their slots."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: GenerationStream) -> None:
        try:
            async for step in stream:
                await queue.put((index, step))
            await queue.put((index, None))
        except Exception as error:
            await queue.put((index, error))

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.cancel()


@dataclasses.dataclass
class _Choice:
    """A choice's answer so far."""

    text: str = ""
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[tuple[int, float, list | None]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None


def _take(choice: _Choice, step: Step) -> tuple[str, list]:
    """Adds a step to a choice; returns the step's text and its logprob entries."""
    token, text = step.tokens[0], step.text[0] or ""
    entries = []
    if token is not None:
        choice.tokens.append(token)
        entries = [(token, step.logprobs[0], step.top[0])]
        choice.logprobs += entries
    choice.text += text
    choice.finish_reason = step.finished[0] or choice.finish_reason
    return text, entries


async def _whole(parsed: GenerationRequest, streams: list[GenerationStream], answer_id: str, chat: bool) -> dict:
    choices = [_Choice() for _ in streams]
    async for index, step in _steps(streams):
        _take(choices[index], step)
    model = parsed.model
    answer = {"id": answer_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()), "model": model.name,
              "usage": _usage(parsed, streams, choices)}
    if chat:
        answer["choices"] = [{"index": index, "message": {"role": "assistant", "content": choice.text},
                              "logprobs": _chat_logprobs(model, choice.logprobs) if parsed.logprobs is not None else None,
                              "finish_reason": choice.finish_reason} for index, choice in enumerate(choices)]
    else:
        answer["choices"] = [{"index": index, "text": choice.text, "token_ids": choice.tokens,
                              "logprobs": _completion_logprobs(model, choice.logprobs) if parsed.logprobs is not None else None,
                              "finish_reason": choice.finish_reason} for index, choice in enumerate(choices)]
    return answer


async def _events(parsed: GenerationRequest, streams: list[GenerationStream], answer_id: str, chat: bool):
    """The server-sent events of a streamed answer (module docstring); an error mid-stream is sent as
    an error object before [DONE]."""
    model, created = parsed.model, int(time.time())
    head = {"id": answer_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created, "model": model.name}
    choices = [_Choice() for _ in streams]
    try:
        if chat:
            for index in range(len(streams)):
                yield _event({**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                                   "finish_reason": None}]})
        async for index, step in _steps(streams):
            text, entries = _take(choices[index], step)
            if not text and step.finished[0] is None and parsed.logprobs is None:
                continue
            if chat:
                choice = {"index": index, "delta": {"content": text} if text else {},
                          "logprobs": _chat_logprobs(model, entries) if parsed.logprobs is not None else None,
                          "finish_reason": step.finished[0]}
            else:
                choice = {"index": index, "text": text, "logprobs": _completion_logprobs(model, entries) if parsed.logprobs is not None else None,
                          "finish_reason": step.finished[0]}
            yield _event({**head, "choices": [choice]})
        if parsed.include_usage:
            yield _event({**head, "choices": [], "usage": _usage(parsed, streams, choices)})
    except Exception as error:  # the step failed: the client gets an error object, then the end
        yield _event({"error": {"message": f"{type(error).__name__}: {' '.join(str(error).split())[:300]}", "type": "internal_error",
                                "param": None, "code": None}})
    yield "data: [DONE]\n\n"


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _usage(parsed: GenerationRequest, streams: list[GenerationStream], choices: list[_Choice]) -> dict:
    """OpenAI's usage; prompt_tokens_details.cached_tokens: prompt tokens the prefix cache gave (not prefilled)."""
    prompt, completion = sum(len(prompt) for prompt in parsed.prompts), sum(len(choice.tokens) for choice in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(stream.cached_tokens for stream in streams)}}


def _token_text(model: ServedModel, token: int) -> str:
    if model.tokenizer is None:
        return f"token_id:{token}"
    with model.tokenizer_lock:
        return model.tokenizer.decode([token])


def _completion_logprobs(model: ServedModel, entries: list) -> dict:
    """Completions' legacy logprobs object (text_offset within this part of the text)."""
    tokens = [_token_text(model, token) for token, _, _ in entries]
    offsets, offset = [], 0
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    def alternatives(top) -> dict:  # keyed by text: of two tokens that decode alike, the likelier one's
        keyed = {}
        for top_id, value in top or ():
            keyed.setdefault(_token_text(model, top_id), value)
        return keyed

    return {"tokens": tokens, "token_logprobs": [logprob for _, logprob, _ in entries],
            "top_logprobs": [alternatives(top) for _, _, top in entries], "text_offset": offsets}


def _chat_logprobs(model: ServedModel, entries: list) -> dict:
    """Chat's logprobs object: per token its text, logprob, UTF-8 bytes and top alternatives."""
    def entry(token: int, logprob: float) -> dict:
        text = _token_text(model, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(token, logprob), "top_logprobs": [entry(top_id, value) for top_id, value in top or ()]}
                        for token, logprob, top in entries]}
