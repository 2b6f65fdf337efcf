"""OpenAI's API on `tpuexport serve`, driven by the official `openai` client against a real server on a
loopback port: a tiny chat model (tests/chat_model.py: a Llama with a byte-level BPE tokenizer, a chat
template and an EOS in its generation_config.json) converted from its Hugging Face directory once
for this module. At temperature 0 the served text is Hugging Face's greedy generate() decoded;
sampling is reproducible by seed; EOS, stop strings and max_tokens end a choice; bad requests get
OpenAI's error objects and the server serves on; the LLM metrics are exposed."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import openai
import pytest
import requests
import torch
import transformers

from chat_model import GREEDY_PROMPT, save_chat_model
from conftest import served
from test_cli import tpuexport_in_process  # the command line, in this process
import tpuexport
from tpuexport.export import load_source
from tpuexport.pipeline import ConversionOptions, run_conversion

MODEL = "chatlm"


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """(the artifact, the Hugging Face model, its tokenizer, save_chat_model's facts, an `openai`
    client of the artifact's server, the server's base URL)."""
    directory = tmp_path_factory.mktemp("chat")
    source = directory / MODEL
    source.mkdir()
    facts = save_chat_model(source)
    options = ConversionOptions(("cpu",), directory / f"{MODEL}.tpu", buckets={"seq": [32]}, task="text-generation", max_context=64,
                                max_batch=4, new_tokens=6)
    artifact = run_conversion(load_source(str(source), task="text-generation"), options)
    model = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    with served(artifact.path, directory / "server.log") as base:
        yield artifact, model, tokenizer, facts, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0), base


def greedy_text(model, tokenizer, ids: list[int], max_new_tokens: int) -> tuple[str, list[int]]:
    """Hugging Face generate(do_sample=False) from `ids` (stopping at its generation_config's EOS),
    decoded as the server decodes (special tokens skipped)."""
    with torch.no_grad():
        output = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=max_new_tokens,
                                do_sample=False)[0, len(ids):].tolist()
    return tokenizer.decode(output, skip_special_tokens=True), output


def test_chat_at_temperature_0_is_greedy_generate_streamed_or_not(chat):
    artifact, model, tokenizer, facts, client, _ = chat
    prompt = tokenizer.apply_chat_template(GREEDY_PROMPT, add_generation_prompt=True, return_dict=True)["input_ids"]
    expected, ids = greedy_text(model, tokenizer, prompt, 20)
    assert ids == facts["greedy"]  # the model's EOS ends it after a few tokens

    answer = client.chat.completions.create(model=MODEL, messages=GREEDY_PROMPT, temperature=0, max_tokens=20)
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and choice.message.content == expected and choice.finish_reason == "stop"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(prompt), len(ids))  # the EOS counts, its text is none
    assert answer.usage.prompt_tokens_details.cached_tokens == 0  # a static cache has no prefix cache

    chunks = list(client.chat.completions.create(model=MODEL, messages=GREEDY_PROMPT, temperature=0, max_tokens=20, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == expected
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)


def test_completions_text_and_token_prompts_stop_strings_and_logprobs(chat):
    artifact, model, tokenizer, facts, client, _ = chat
    text = "Déjà vu: naïve 🙂"  # multi-byte characters: their bytes span tokens
    ids = tokenizer(text)["input_ids"]
    expected, generated = greedy_text(model, tokenizer, ids, 12)
    # Two prompts, one as text and one as ids: a choice each, both the greedy continuation; max_tokens ends them.
    answer = client.completions.create(model=MODEL, prompt=[text, text], temperature=0, max_tokens=12)
    assert [choice.text for choice in answer.choices] == [expected] * 2
    assert answer.usage.prompt_tokens == 2 * len(ids)
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=12, logprobs=3)
    (choice,) = by_ids.choices
    assert choice.text == expected and choice.finish_reason == ("stop" if generated[-1] == facts["eos"] else "length")
    # (Top alternatives are keyed by their text: two tokens whose bytes decode alike share a key.)
    assert len(choice.logprobs.tokens) == len(generated) and all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)
    # The drawn token is the likeliest at temperature 0: its logprob is the top one.
    assert all(abs(max(top.values()) - logprob) < 1e-5 for top, logprob in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs))
    # A stop string spanning tokens ends the text before it, streamed or not.
    stop = expected[3:7]
    stopped = client.completions.create(model=MODEL, prompt=text, temperature=0, max_tokens=12, stop=[stop])
    assert stopped.choices[0].text == expected[:expected.index(stop)] and stopped.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=text, temperature=0, max_tokens=12, stop=stop, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == stopped.choices[0].text


def test_seeded_sampling_is_reproducible(chat):
    _, _, _, _, client, _ = chat

    def sample(seed, **options):
        return client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True, **options}).choices[0].text

    assert sample(7) == sample(7) != sample(8)
    assert sample(7, top_k=1) == client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=0,
                                                           extra_body={"ignore_eos": True}).choices[0].text


@pytest.mark.parametrize("request_options, param, code", [
    ({"model": "nope"}, "model", "model_not_found"),
    ({"temperature": -0.5}, "temperature", None),
    ({"top_p": 1.5}, "top_p", None),
    ({"top_p": 0}, "top_p", None),
    ({"prompt": "hello " * 200}, "prompt", "context_length_exceeded"),
    ({"n": 2}, "n", None),
])
def test_bad_requests_get_openai_error_objects(chat, request_options, param, code):
    _, _, _, _, client, _ = chat
    arguments = {"model": MODEL, "prompt": "hello", "max_tokens": 2, **request_options}
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(**arguments)
    error = raised.value.body
    assert raised.value.status_code == 400 and error["param"] == param and error["code"] == code and error["type"] == "invalid_request_error"
    assert error["message"]
    assert client.completions.create(model=MODEL, prompt="hello", max_tokens=2).choices[0].text is not None  # serves on


def test_malformed_json_and_metrics(chat):
    _, _, _, _, _, base = chat
    answer = requests.post(f"{base}/v1/chat/completions", data=b'{"model": "chatlm", "messages": [', timeout=30,
                           headers={"content-type": "application/json"})
    assert answer.status_code == 400 and set(answer.json()["error"]) == {"message", "type", "param", "code"}
    assert "malformed JSON" in answer.json()["error"]["message"]
    models = requests.get(f"{base}/v1/models", timeout=30).json()
    assert [model["id"] for model in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 64
    metrics = requests.get(f"{base}/metrics", timeout=30).text
    for name in ("tpuexport_time_to_first_token_seconds_count", "tpuexport_inter_token_latency_seconds_count",
                 "tpuexport_e2e_request_latency_seconds_count", "tpuexport_request_queue_time_seconds_count", "tpuexport_prompt_tokens_total",
                 "tpuexport_generated_tokens_total"):
        assert float(re.search(rf'{name}{{model="{MODEL}",version="1"}} (\S+)', metrics).group(1)) > 0, name
    for name in ("tpuexport_num_requests_running", "tpuexport_num_requests_waiting", "tpuexport_kv_cache_slots_used"):
        assert float(re.search(rf'{name}{{model="{MODEL}",version="1"}} (\S+)', metrics).group(1)) == 0, name  # all done: slots freed


def test_the_server_loads_the_tokenizer_class_autotokenizer_picked_without_importing_torch(chat):
    """The model repository `tpuexport serve` builds, in a fresh process: its tokenizer is the class
    AutoTokenizer picks (recorded at conversion), encodes and decodes as AutoTokenizer's does, and
    torch is never imported (AutoTokenizer's config lookup imports it: about 2 s and 550 MB)."""
    artifact, _, tokenizer, _, _, _ = chat
    assert artifact.manifest["huggingface"]["tokenizer_class"] == type(tokenizer).__name__ == "TokenizersBackend"
    script = (
        "import json, sys\n"
        "from tpuexport.serve.metrics import Metrics\n"
        "from tpuexport.serve.models import ModelRepository\n"
        f"repository = ModelRepository([{str(artifact.path)!r}], 0, Metrics())\n"
        "(model,) = repository\n"
        f"ids = model.tokenizer.apply_chat_template({GREEDY_PROMPT!r}, add_generation_prompt=True, return_dict=True)['input_ids']\n"
        "state = {'class': type(model.tokenizer).__name__, 'ids': ids, 'text': model.tokenizer.decode(ids[2:]),\n"
        "         'frameworks': sorted(name for name in ('torch', 'tensorflow') if name in sys.modules)}\n"
        "repository.close()\n"
        "print(json.dumps(state))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    state = json.loads(result.stdout.splitlines()[-1])

    expected = tokenizer.apply_chat_template(GREEDY_PROMPT, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert state == {"class": "TokenizersBackend", "ids": expected, "text": tokenizer.decode(expected[2:]), "frameworks": []}


def test_generate_cli_samples_on_the_device_and_stops_at_eos(chat):
    artifact, _, tokenizer, facts, _, _ = chat
    prompt = ",".join(map(str, tokenizer.apply_chat_template(GREEDY_PROMPT, add_generation_prompt=True, return_dict=True)["input_ids"]))

    def generate(*options):
        done = tpuexport_in_process("generate", artifact.path, "--tokens", prompt, "--max-new-tokens", "8", *options)
        assert done.returncode == 0, done.stderr
        return [int(line) for line in done.stdout.split()]

    assert generate() == facts["greedy"]  # greedy, ended by the EOS of generation_config.json
    # --prompt encodes with the tokenizer the artifact carries and prints the new tokens, then their text.
    from_text = tpuexport_in_process("generate", artifact.path, "--prompt", "hello world", "--max-new-tokens", "3", "--ignore-eos")
    assert from_text.returncode == 0, from_text.stderr
    *steps, text = from_text.stdout.split("\n", 3)  # a line per step, then the text (which may hold newlines itself)
    hello = tokenizer("hello world")["input_ids"]
    assert [int(step) for step in steps] == artifact.generate(hello, 3, ignore_eos=True)[0]
    assert text == tokenizer.decode([int(step) for step in steps]) + "\n"
    sampling = tpuexport.Sampling(temperature=0.9, top_p=0.9, top_k=50, seed=5)
    ids = [int(token) for token in prompt.split(",")]
    assert generate("--temperature", "0.9", "--top-p", "0.9", "--top-k", "50", "--seed", "5", "--ignore-eos") == \
        artifact.generate(ids, 8, sampling=sampling, ignore_eos=True)[0]
