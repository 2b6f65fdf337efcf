"""`tpuexport serve` over a paged KV cache (serve/paged_steps.py), driven by the official `openai` client
against a real server on a loopback port: a tiny chat model (benchmarks/chat_model.py) converted once
with --kv-cache paged, pages of 4 positions, 24 pages (fewer than its 4 rows of max context take)
and one step bucket of 8 tokens x 4 rows. Concurrent requests of different lengths, one prefilled in
chunks over several steps and one that waits for pages, give Hugging Face's greedy generate() token
for token; streams work; a request that can never fit is a 400 and the server serves on. Prefix
caching (serve/prefix_cache.py, on by default): prompts sharing full pages prefill only the rest, a
prompt diverging mid-page writes its own page, cached pages are evicted oldest first, and the tokens
are generate()'s and those of the same requests with --no-prefix-caching."""

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
def paged_artifact(tmp_path_factory):
    """(the paged artifact's directory, the Hugging Face model, its tokenizer)."""
    directory = tmp_path_factory.mktemp("paged_chat")
    source = directory / MODEL
    source.mkdir()
    save_chat_model(source)
    out = directory / f"{MODEL}.tpu"
    # The command line, as a user converts a Hugging Face directory (its weights streamed from its safetensors, as for the static cache).
    converted = tpuexport_in_process("convert", source, "--target", "cpu", "--max-context", MAX_CONTEXT, "--max-batch", ROWS, "--kv-cache",
                                     "paged", "--page-size", PAGE_SIZE, "--num-pages", NUM_PAGES, "--bucket", f"tokens={TOKENS}", "--bucket",
                                     f"rows={ROWS}", "--verify-new-tokens", 4, "--no-saved-model", "-o", out, cwd=directory)
    assert converted.returncode == 0 and "streamed from the checkpoint" in converted.stderr, converted.stderr
    return out, transformers.AutoModelForCausalLM.from_pretrained(source).eval(), transformers.AutoTokenizer.from_pretrained(source)


@pytest.fixture(scope="module")
def paged_chat(paged_artifact):
    """(the Hugging Face model, its tokenizer, an `openai` client of the paged artifact's server, the server's base URL);
    the server caches prefixes (the default), and its cache lives on from test to test."""
    out, model, tokenizer = paged_artifact
    with served(out, out.parent / "server.log") as base:
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
    prefilled, hits = _metric(base, "tpuexport_step_tokens_total", 'kind="prefill"'), _metric(base, "tpuexport_prefix_cache_hits_total")

    def complete(index: int):
        sampled = index == len(cases) - 1
        return client.completions.create(model=MODEL, prompt=prompts[index], temperature=1.0 if sampled else 0, seed=5 if sampled else None,
                                         max_tokens=cases[index][1], extra_body={"ignore_eos": sampled})

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        answers = [answer.choices[0].model_extra["token_ids"] for answer in pool.map(complete, range(len(cases)))]  # vLLM's extension
    for prompt, (_, max_tokens), ids in zip(prompts[:-1], cases, answers):
        assert ids == greedy_text(model, tokenizer, prompt, max_tokens)[1]
    assert len(answers[-1]) == cases[-1][1] and complete(len(cases) - 1).choices[0].model_extra["token_ids"] == answers[-1]
    # The sampled prompt's repeat finds its first two pages cached (the pages before its 11th token), unless the
    # 40-token requests that ran after it took them; it prefills the rest.
    hit = _metric(base, "tpuexport_prefix_cache_hits_total") - hits
    assert hit in (0, 2 * PAGE_SIZE)
    assert _metric(base, "tpuexport_step_tokens_total", 'kind="prefill"') - prefilled == sum(map(len, prompts)) + cases[-1][0] - hit
    assert _metric(base, "tpuexport_kv_cache_pages_used") == 0 and _metric(base, "tpuexport_kv_cache_pages_free") == NUM_PAGES


def _served_greedy(client, base: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float, float]:
    """(a greedy completion's token ids, the prompt tokens the prefix cache gave it, those it prefilled);
    the answer's usage reports the same cached tokens as the metrics."""
    hits, prefilled = _metric(base, "tpuexport_prefix_cache_hits_total"), _metric(base, "tpuexport_step_tokens_total", 'kind="prefill"')
    answer = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=max_tokens)
    hit = _metric(base, "tpuexport_prefix_cache_hits_total") - hits
    assert answer.usage.prompt_tokens == len(prompt) and answer.usage.prompt_tokens_details.cached_tokens == hit
    return answer.choices[0].model_extra["token_ids"], hit, _metric(base, "tpuexport_step_tokens_total", 'kind="prefill"') - prefilled


def _shared_prefix_prompts(tokenizer) -> list[list[int]]:
    """Two prompts (44 and 46 tokens) that begin with the same 40 tokens (10 pages) and go on differently."""
    prefix = _prompt(40, 100, tokenizer)
    return [prefix + _prompt(4, 101, tokenizer), prefix + _prompt(6, 102, tokenizer)]


def test_requests_sharing_a_prefix_prefill_it_once_and_generate_what_generate_does(paged_chat):
    """The first prompt finds nothing cached and prefills its 44 tokens; the second finds the 10 pages
    of the shared 40 tokens and prefills only its own 6; both are greedy generate()'s. Afterwards no
    row holds a page and the pages they wrote stay cached (and free for admission)."""
    model, tokenizer, client, base = paged_chat
    queries = _metric(base, "tpuexport_prefix_cache_queries_total")
    first, second = _shared_prefix_prompts(tokenizer)
    ids, hit, prefilled = _served_greedy(client, base, first, 8)
    assert ids == greedy_text(model, tokenizer, first, 8)[1] and (hit, prefilled) == (0, 44)
    ids, hit, prefilled = _served_greedy(client, base, second, 8)
    assert ids == greedy_text(model, tokenizer, second, 8)[1] and (hit, prefilled) == (40, 6)
    assert _metric(base, "tpuexport_prefix_cache_queries_total") - queries == 44 + 46
    assert _metric(base, "tpuexport_kv_cache_pages_used") == 0 and _metric(base, "tpuexport_kv_cache_pages_free") == NUM_PAGES
    assert _metric(base, "tpuexport_kv_cache_pages_cached") >= 11


def test_a_prompt_diverging_mid_page_writes_its_own_page(paged_chat):
    """A 42-token prompt; a second that leaves it at token 37, inside its 10th page: it takes the first
    9 pages and writes its own 10th (greedy generate()'s tokens); the first prompt again takes all 10
    pages it wrote, unchanged: the same tokens as the first time."""
    model, tokenizer, client, base = paged_chat
    original = _prompt(42, 110, tokenizer)
    diverging = original[:37] + _prompt(5, 111, tokenizer)
    expected = greedy_text(model, tokenizer, original, 8)[1]
    assert _served_greedy(client, base, original, 8)[:2] == (expected, 0)
    ids, hit, prefilled = _served_greedy(client, base, diverging, 8)
    assert ids == greedy_text(model, tokenizer, diverging, 8)[1] and (hit, prefilled) == (36, 6)
    assert _served_greedy(client, base, original, 8) == (expected, 40, 2)


def test_cached_pages_are_evicted_oldest_first_for_new_prompts(paged_chat):
    """A 30-token prompt's pages are cached; two prompts of 60 tokens (15 pages each, 30 of the cache's
    24 pages) take the free pages, then the cached ones least recently released first, so the first
    prompt's pages are all rewritten: asked again, it finds nothing, prefills all 30 tokens and still
    generates generate()'s tokens (with a cached page's key kept after it was rewritten, it would read
    another prompt's keys and values)."""
    model, tokenizer, client, base = paged_chat
    first = _prompt(30, 120, tokenizer)
    expected = greedy_text(model, tokenizer, first, 4)[1]
    assert _served_greedy(client, base, first, 4)[0] == expected
    for seed in (121, 122):
        long_prompt = _prompt(60, seed, tokenizer)
        ids, hit, _ = _served_greedy(client, base, long_prompt, 3)
        assert ids == greedy_text(model, tokenizer, long_prompt, 3)[1] and hit == 0
    assert _served_greedy(client, base, first, 4) == (expected, 0, 30)


def test_without_prefix_caching_the_same_tokens_and_every_prompt_token_prefilled(paged_artifact, paged_chat):
    """`tpuexport serve --no-prefix-caching` (parsed as the server parses it) over the same artifact, its
    model repository opened in this process (no second server to start): the shared-prefix prompts
    give the caching server's tokens, each prefilled whole, and nothing is looked up or cached."""
    from tpuexport.cli import serve
    from tpuexport.serve.metrics import Metrics
    from tpuexport.serve.models import ModelRepository

    out, _, tokenizer = paged_artifact
    _, _, client, base = paged_chat
    with serve.make_context("serve", [str(out), "--no-prefix-caching"]) as context:
        assert context.params["prefix_caching"] is False
    metrics = Metrics()
    repository = ModelRepository([out], 0, metrics, prefix_caching=context.params["prefix_caching"])
    try:
        (model,) = repository
        def prefilled() -> float:
            return metrics.registry.get_sample_value("tpuexport_step_tokens_total", {"model": MODEL, "version": "1", "kind": "prefill"}) or 0

        for prompt in _shared_prefix_prompts(tokenizer):
            before = prefilled()
            steps = model.generation.submit([prompt], 8, stop_ids=model.runner.artifact.eos_token_ids)
            ids = [step.tokens[0] for step in steps if step.tokens[0] is not None]
            assert ids == _served_greedy(client, base, prompt, 8)[0]
            assert prefilled() - before == len(prompt)
        labels = {"model": MODEL, "version": "1"}
        assert metrics.registry.get_sample_value("tpuexport_prefix_cache_queries_total", labels) is None  # never counted
        assert metrics.registry.get_sample_value("tpuexport_kv_cache_pages_cached", labels) == 0
    finally:
        repository.close()


def test_many_requests_over_shared_prefixes_at_once_give_the_tokens_they_get_uncached(paged_artifact):
    """30 requests queued at once (in this process, a model repository each way), prompts cut from three
    prefixes at random points and continued at random, 1-11 tokens each: rows start over pages other
    running rows hold or that ended rows left cached, cached pages are evicted, and every request's
    tokens equal those of the same requests without prefix caching (no EOS: each runs to its max)."""
    from tpuexport.serve.metrics import Metrics
    from tpuexport.serve.models import ModelRepository

    out, _, tokenizer = paged_artifact
    generator = np.random.default_rng(5)
    prefixes = [_prompt(length, 130 + length, tokenizer) for length in (13, 24, 33)]
    cases = []
    for _ in range(30):
        prefix = prefixes[generator.integers(0, 3)]
        prompt = prefix[:generator.integers(1, len(prefix) + 1)] + _prompt(int(generator.integers(0, 12)), int(generator.integers(1000)), tokenizer)
        cases.append((prompt, int(generator.integers(1, 12))))

    def served_tokens(prefix_caching: bool) -> tuple[list[list[int]], dict]:
        metrics = Metrics()
        repository = ModelRepository([out], 0, metrics, prefix_caching=prefix_caching)
        try:
            (model,) = repository
            streams = [model.generation.submit([prompt], max_tokens) for prompt, max_tokens in cases]
            tokens = [[step.tokens[0] for step in stream if step.tokens[0] is not None] for stream in streams]
            return tokens, {"hits": metrics.registry.get_sample_value("tpuexport_prefix_cache_hits_total", {"model": MODEL, "version": "1"}),
                            "evictions": model.generation.steps.prefix_cache.evictions if prefix_caching else 0}
        finally:
            repository.close()

    cached, counts = served_tokens(True)
    assert cached == served_tokens(False)[0]
    assert counts["hits"] >= 100 and counts["evictions"] > 0


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


def test_prefix_cache_pool_never_hands_out_a_held_page_and_evicts_least_recently_released_first():
    """The pool's bookkeeping (serve/prefix_cache.py) over 6 pages of 2: a row writes 3 pages and keys
    the 2 full ones; a second row finds them by its prompt (not the page of its last token) and
    holds them; the first row ends: those 2 stay held, its third page is free, so `take` hands out
    the 4 other pages and no held one. Released, the keyed pages are cached, then evicted (their keys
    dropped) last page first."""
    from tpuexport.serve.prefix_cache import PrefixCache, page_keys

    pool = PrefixCache(6, 2)
    tokens = [5, 6, 7, 8, 9]
    first = [pool.take() for _ in range(3)]
    for page, key in zip(first, page_keys(tokens, 2)):
        pool.register(page, key)
    assert pool.lookup(tokens[:4]) == (first[:1], page_keys(tokens, 2)[:1])  # its 4th token's page is prefilled
    found, _ = pool.lookup([5, 6, 7, 8, 1])
    assert found == first[:2] and pool.taking(found) == 0
    pool.hold(found)
    pool.give_back(first)
    assert pool.held == dict.fromkeys(first[:2], 1) and pool.available() == 4 and not pool.cached
    taken = [pool.take() for _ in range(4)]
    assert not set(taken) & set(found) and pool.available() == 0
    pool.give_back(taken)
    pool.give_back(found)
    assert list(pool.cached) == [first[1], first[0]] and pool.taking(found) == 2
    assert pool.take() in taken and pool.lookup(tokens)[0] == first[:2]  # a free page before a cached one
    for _ in range(3):
        pool.take()
    assert pool.take() == first[1] and pool.lookup(tokens)[0] == first[:1] and pool.evictions == 1
