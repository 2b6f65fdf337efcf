"""`tpuexport serve` over a paged KV cache (serve/paged_steps.py), driven by the official `openai` client
against a real server on a loopback port: a tiny chat model (benchmarks/chat_model.py) converted once
with --kv-cache paged, pages of 4 positions, 24 pages (fewer than its 4 rows of max context take)
and one step bucket of 8 tokens x 4 rows. Concurrent requests of different lengths, one prefilled in
chunks over several steps and one that waits for pages, give Hugging Face's greedy generate() token
for token; streams work; a request that can never fit is a 400 and the server serves on."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import openai
import pytest
import requests
import transformers

from chat_model import save_chat_model
from conftest import served
from test_cli import tpuexport_in_process
from test_openai import greedy_text

MODEL = "pagedlm"
MAX_CONTEXT, PAGE_SIZE, NUM_PAGES, TOKENS, ROWS = 64, 4, 24, 8, 4


@pytest.fixture(scope="module")
def paged_chat(tmp_path_factory):
    """(the Hugging Face model, its tokenizer, an `openai` client of the paged artifact's server, the server's base URL)."""
    directory = tmp_path_factory.mktemp("paged_chat")
    source = directory / MODEL
    source.mkdir()
    save_chat_model(source)
    out = directory / f"{MODEL}.tpu"
    # The command line, as a user converts a Hugging Face directory (its weights read in: the paged step does not stream them yet).
    converted = tpuexport_in_process("convert", source, "--target", "cpu", "--max-context", MAX_CONTEXT, "--max-batch", ROWS, "--kv-cache",
                                     "paged", "--page-size", PAGE_SIZE, "--num-pages", NUM_PAGES, "--bucket", f"tokens={TOKENS}", "--bucket",
                                     f"rows={ROWS}", "--verify-new-tokens", 4, "--no-saved-model", "-o", out, cwd=directory)
    assert converted.returncode == 0, converted.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    with served(out, directory / "server.log") as base:
        yield model, tokenizer, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0), base


def _prompt(length: int, seed: int, tokenizer) -> list[int]:
    """`length` random ids of ordinary (not special) tokens."""
    return [int(token) for token in np.random.default_rng(seed).integers(len(tokenizer.all_special_ids), len(tokenizer), length)]


def _metric(base: str, name: str, label: str = "") -> float:
    """The served model's sample of metric `name` whose labels include `label` (0 before its first count)."""
    lines = [line for line in requests.get(f"{base}/metrics", timeout=30).text.splitlines() if line.startswith(name + "{") and label in line]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_concurrent_requests_chunked_and_waiting_for_pages_are_greedy_generate(paged_chat):
    """Six requests at once over 4 rows and 24 pages: prompts of 3 to 21 tokens (21 > the step's 8-token
    budget: prefilled over three steps beside the others' decode tokens), whose worst cases take 51
    pages: the two asking for 40 tokens need 15 pages each, so one waits for the other to end (run
    together, they would fill the cache). Each greedy completion is generate()'s, the seeded sampled
    one draws what it draws alone, and every page is free again afterwards."""
    model, tokenizer, client, base = paged_chat
    cases = [(3, 10), (21, 10), (9, 10), (20, 40), (18, 40), (11, 8)]  # (prompt length, max tokens); the last one samples
    prompts = [_prompt(length, seed, tokenizer) for seed, (length, _) in enumerate(cases)]
    prefilled = _metric(base, "tpuexport_step_tokens_total", 'kind="prefill"')

    def complete(index: int):
        sampled = index == len(cases) - 1
        return client.completions.create(model=MODEL, prompt=prompts[index], temperature=1.0 if sampled else 0, seed=5 if sampled else None,
                                         max_tokens=cases[index][1], extra_body={"ignore_eos": sampled})

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        answers = [answer.choices[0].model_extra["token_ids"] for answer in pool.map(complete, range(len(cases)))]  # vLLM's extension
    for prompt, (_, max_tokens), ids in zip(prompts[:-1], cases, answers):
        assert ids == greedy_text(model, tokenizer, prompt, max_tokens)[1]
    assert len(answers[-1]) == cases[-1][1] and complete(len(cases) - 1).choices[0].model_extra["token_ids"] == answers[-1]
    assert _metric(base, "tpuexport_step_tokens_total", 'kind="prefill"') - prefilled == sum(map(len, prompts)) + cases[-1][0]
    assert _metric(base, "tpuexport_kv_cache_pages_used") == 0 and _metric(base, "tpuexport_kv_cache_pages_free") == NUM_PAGES


def test_streamed_completion_of_a_chunked_prompt(paged_chat):
    """A 19-token prompt (three steps of prefill) streamed: the text of the completion whose tokens are greedy generate()'s."""
    model, tokenizer, client, _ = paged_chat
    prompt = _prompt(19, 7, tokenizer)
    _, ids = greedy_text(model, tokenizer, prompt, 12)
    whole = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12).choices[0]
    assert whole.model_extra["token_ids"] == ids
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stream=True))
    assert len(chunks) > 1 and "".join(chunk.choices[0].text for chunk in chunks) == whole.text
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


def test_requests_that_can_never_fit_are_refused_and_the_server_serves_on(paged_chat):
    """A prompt past max context: OpenAI's error object; two rows whose prompts and max tokens need 32 pages
    of the cache's 24: a 400 naming the pages; the next request is served."""
    _, tokenizer, client, base = paged_chat
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt=_prompt(MAX_CONTEXT + 6, 1, tokenizer), temperature=0, max_tokens=4)
    assert raised.value.status_code == 400 and raised.value.body["code"] == "context_length_exceeded"
    answer = requests.post(f"{base}/v1/models/{MODEL}:generate", json={"prompts": [_prompt(40, 2, tokenizer)] * 2, "max_new_tokens": 30},
                           timeout=60)
    assert answer.status_code == 400
    assert answer.json()["error"] == (f"2 prompt(s) with max tokens 30 need 32 pages of {PAGE_SIZE} positions and the KV cache has "
                                      f"{NUM_PAGES}; send fewer prompts or ask for fewer tokens")
    served_on = client.completions.create(model=MODEL, prompt=_prompt(5, 3, tokenizer), temperature=0, max_tokens=3)
    assert served_on.usage.completion_tokens >= 1 and served_on.choices[0].finish_reason in ("stop", "length")
