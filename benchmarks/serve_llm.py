"""LLM serving in `vllm bench serve`'s terms: `tpuexport serve`'s OpenAI endpoint against a baseline
serving the same model and requests in the same run.

    python benchmarks/serve_llm.py [--layers 4] [--hidden 256] [--vocab 4096] [--concurrency 1,4,16] [--requests 48]
                                   [--input-len 64] [--output-len 64] [--temperature 0]

Builds a Llama with random float32 weights and a byte-level BPE tokenizer trained on this Python's own
library sources (benchmarks/chat_model.py) as a Hugging Face directory (its generation config
names no EOS: every request generates its max_tokens), converts it for the cpu target with a max
batch of the largest concurrency, and serves it. For each concurrency N it sends --requests
streamed completions (text prompts of seeded random lengths, --input-len +-50% tokens, and
max_tokens --output-len +-50%), N in flight at a time, after one warm-up request. Then the same
requests against the baseline on the same machine: `transformers serve --continuous-batching` (the
transformers package's own OpenAI-compatible server, paged attention) on the same directory.

Prints per server and concurrency what vllm bench serve prints: request throughput, output
tokens/s, and TTFT (to the first chunk with text), TPOT ((latency - TTFT) / (output tokens - 1) per
request) and ITL (the gaps between chunks) as mean / p50 / p99 in milliseconds. Output tokens are
the server's `usage` (stream_options.include_usage), else the tokenizer's count of the text.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import pathlib
import subprocess
import sys
import sysconfig
import tempfile
import time

import numpy as np
import torch
import transformers

import _common
from chat_model import llama_config, tokenizer

ENV = _common.child_environment()


@dataclasses.dataclass(frozen=True)
class Result:
    """One request as the client saw it: seconds to the first chunk with text, the gaps between
    chunks, the whole latency, and output tokens."""

    ttft: float
    gaps: tuple[float, ...]
    latency: float
    tokens: int


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--max-context", type=int, default=256)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=48, help="per concurrency")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    concurrencies = [int(value) for value in options.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        source = pathlib.Path(scratch) / "llama"
        chat = build_model(source, options)
        workloads = {concurrency: make_requests(chat, options, concurrency) for concurrency in concurrencies}
        artifact = convert(source, pathlib.Path(scratch) / "llama.tpu", options, max(concurrencies))
        load = os.getloadavg()[0]
        results = {"tpuexport serve": run_server(["tpuexport.cli", "serve", str(artifact), "--grpc-port", "0"], "llama", workloads, chat,
                                                 options, "/readyz")}
        results["transformers serve --continuous-batching"] = run_server(
            ["transformers.cli.transformers", "serve", str(source), "--continuous-batching", "--device", "cpu", "--dtype", "float32",
             "--host", "127.0.0.1", "--cb-block-size", "32", "--cb-num-blocks", str(cache_blocks(options, max(concurrencies)))],
            str(source), workloads, chat, options, "/health")
    print(f"llama {options.layers} layers, hidden {options.hidden}, vocab {len(chat)}, f32, cpu; {options.requests} requests per concurrency, "
          f"input {options.input_len} +-50% tokens, output {options.output_len} +-50% tokens, temperature {options.temperature:g}; "
          f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} cores")
    print("| server | concurrency | requests/s | output tokens/s | TTFT mean / p50 / p99 ms | TPOT mean / p50 / p99 ms | "
          "ITL mean / p50 / p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for server, by_concurrency in results.items():
        for concurrency, (seconds, ran) in by_concurrency.items():
            tpot = [(result.latency - result.ttft) / (result.tokens - 1) for result in ran if result.tokens > 1]
            gaps = [gap for result in ran for gap in result.gaps]
            print(f"| {server} | {concurrency} | {len(ran) / seconds:.2f} | {sum(result.tokens for result in ran) / seconds:.1f} | "
                  f"{described([result.ttft for result in ran])} | {described(tpot)} | {described(gaps)} |")


def cache_blocks(options, concurrency: int) -> int:
    """transformers serve's paged cache: blocks of 32 positions for every request in flight at its
    longest (left to itself it sized the cache from the machine's memory: 7 GB for a 1-layer model)."""
    longest = options.input_len * 3 // 2 * 2 + options.output_len * 3 // 2
    return 2 * concurrency * -(-longest // 32)


def described(values: list[float]) -> str:
    if not values:
        return "-"
    return " / ".join(f"{1000 * value:.1f}" for value in (np.mean(values), np.percentile(values, 50), np.percentile(values, 99)))


def build_model(directory: pathlib.Path, options) -> transformers.PreTrainedTokenizerFast:
    """The Hugging Face directory (module docstring); returns its tokenizer."""
    library = pathlib.Path(sysconfig.get_paths()["stdlib"])
    corpus = [path.read_text(errors="ignore") for path in sorted(library.glob("*.py"))[:200]]
    chat = tokenizer(options.vocab, corpus)
    torch.manual_seed(options.seed)
    model = transformers.LlamaForCausalLM(llama_config(chat, options.hidden, options.layers, 8, 2 * options.hidden, options.max_context)).eval()
    model.generation_config = transformers.GenerationConfig(bos_token_id=chat.bos_token_id, pad_token_id=chat.eos_token_id)
    model.save_pretrained(directory)
    chat.save_pretrained(directory)
    return chat


def make_requests(chat, options, concurrency: int) -> list[tuple[str, int]]:
    """(prompt text, max_tokens) per request, seeded by the concurrency: prompts of random token ids
    (no special ones) decoded to text."""
    generator = np.random.default_rng(options.seed * 1000 + concurrency)
    specials = len(chat.all_special_ids)
    made = []
    for _ in range(options.requests):
        length = int(generator.integers(options.input_len // 2, options.input_len * 3 // 2 + 1))
        text = chat.decode(generator.integers(specials, len(chat), length).tolist())
        made.append((text, int(generator.integers(options.output_len // 2, options.output_len * 3 // 2 + 1))))
    return made


def convert(source: pathlib.Path, out: pathlib.Path, options, max_batch: int) -> pathlib.Path:
    longest = options.input_len * 3 // 2 * 2  # a decoded and re-encoded prompt may take more tokens than drawn
    buckets = sorted({size for size in (32, 64, 128, longest) if size <= longest} | {min(longest, options.max_context)})
    command = [sys.executable, "-m", "tpuexport.cli", "convert", str(source), "--task", "text-generation", "--target", "cpu",
               "--max-context", str(options.max_context), "--max-batch", str(max_batch), "--bucket", f"seq={','.join(map(str, buckets))}",
               "--bucket", "batch=1", "--verify-new-tokens", "4", "-o", str(out)]
    subprocess.run(command, check=True, env=ENV, stdout=subprocess.DEVNULL)
    return out


def run_server(command: list[str], model: str, workloads: dict, chat, options, ready_path: str) -> dict:
    """Starts a server (`python -m COMMAND ... --port PORT`), runs every workload against it, stops it.

    Returns:
      {concurrency: (seconds, [Result])}.
    """
    with _common.served(command, ready_path) as base:
        asyncio.run(measure(base, model, [workloads[next(iter(workloads))][0]], 1, chat, options))  # warm-up (a first load or compile)
        return {concurrency: asyncio.run(measure(base, model, workload, concurrency, chat, options))
                for concurrency, workload in workloads.items()}


async def measure(base: str, model: str, workload: list[tuple[str, int]], concurrency: int, chat, options) -> tuple[float, list[Result]]:
    """Sends the workload with `concurrency` requests in flight; (wall seconds, results)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=3600)
    pending = list(workload)
    results: list[Result] = []

    async def one(prompt: str, max_tokens: int) -> Result:
        start = time.perf_counter()
        arrivals, text, usage = [], [], None
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=options.temperature,
                                                 stream=True, stream_options={"include_usage": True}, seed=options.seed)
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(time.perf_counter())
                text.append(chunk.choices[0].text)
        end = time.perf_counter()
        tokens = usage if usage is not None else len(chat("".join(text), add_special_tokens=False)["input_ids"])
        first = arrivals[0] if arrivals else end
        return Result(first - start, tuple(np.diff(arrivals)), end - start, tokens)

    async def worker() -> None:
        while pending:
            prompt, max_tokens = pending.pop(0)
            results.append(await one(prompt, max_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    await client.close()
    return seconds, results


if __name__ == "__main__":
    main()
