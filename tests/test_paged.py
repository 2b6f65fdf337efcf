"""The paged KV cache (--kv-cache paged): one step entry point over pages, verified against Hugging Face
generate() with prompts prefilled in chunks beside another row's decode steps; the reference attention
against JAX's definition of ragged paged attention; planted page-table bugs fail the comparison; bad
page options are refused in one line; a slice (tensor-parallel over the pages' kv heads) verified partitioned and run
sharded on its CPU twin."""

from __future__ import annotations

import concurrent.futures
import sys

import jax.numpy as jnp
import numpy as np
import openai
import pytest
import torch
import tpuexport
import transformers
from conftest import free_port, served, twin_and_one_device_tokens
from test_cli import assert_clean_bad_input, tpuexport_in_process
from test_generation import tiny_llama
from tpuexport.arrays import load_arrays
from tpuexport.export.paged import PagedKVCache, paged_mask
from tpuexport.lower.generation import cpu_runner
from tpuexport.lower.paged import PagedSession
from tpuexport.runtime.entry_points import choose_bucket, entry_points
from tpuexport.runtime.runner import Runner
from tpuexport.verify.generation import compare_run, stored_cases
from tpuexport.verify.paged_generation import teacher_forced_logits
from tpuexport.verify.tolerances import default_tolerances

MAX_CONTEXT, MAX_BATCH, PAGE_SIZE, TOKENS = 64, 2, 4, 8


PAGED = dict(task="text-generation", max_context=MAX_CONTEXT, max_batch=MAX_BATCH, kv_cache="paged", page_size=PAGE_SIZE,
             buckets={"tokens": [TOKENS], "rows": [MAX_BATCH]})
# A 4-chip v5e slice, tensor-parallel over model=2 (the tiny Llama's 2 kv heads) with 2 replicas, and its CPU twin.
SLICE = dict(sharding="tensor-parallel", mesh="model=2,replica=2")
LLAMA_FACTORY = """import torch, transformers

def build():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)).eval()
"""


@pytest.fixture(scope="module")
def paged(tmp_path_factory):
    """A tiny Llama over pages of 4 positions, one step bucket of 8 tokens x 2 rows, for the cpu target,
    a v5e-4 slice, the slice's twin cpu-4 and its two-host twin cpu-2x2: (artifact, model)."""
    model = tiny_llama()
    artifact = tpuexport.convert(model, **PAGED, target=["cpu", "v5e-4", "cpu-4", "cpu-2x2"], **SLICE,
                                 out=tmp_path_factory.mktemp("paged") / "llama.tpu")
    return artifact, model


def test_paged_step_generates_what_generate_does(paged):
    """Verified at conversion: a prompt longer than the step's budget prefilled in chunks of 4 while a
    shorter row already decodes in the same steps, every logit within tolerance and every greedy token
    generate()'s; Artifact.generate drives the step (chunks of the 8-token budget) to the same tokens."""
    artifact, model = paged
    verification, generation = artifact.manifest["verification"], artifact.manifest["generation"]
    assert verification["passed"] and verification["tokens_compared"] == 16
    (case,) = verification["cases"]
    assert case["sizes"] == {"tokens": TOKENS, "rows": MAX_BATCH} and case["lengths"] == [11, 3] and "chunks of 4" in case["label"]
    assert generation["kind"] == "paged" and generation["cache_shape"] == [2, MAX_BATCH * MAX_CONTEXT // PAGE_SIZE, PAGE_SIZE, 2 * 2 * 16]
    assert sorted(artifact.records.entry_points) == ["sample", "step"]
    (bucket,) = [bucket for bucket in artifact.manifest["targets"]["cpu"]["buckets"] if bucket["entry_point"] == "step"]
    figures = bucket["paged_step"]
    assert figures["page_bytes"] * generation["num_pages"] == generation["cache_bytes"] == figures["cache_bytes"]
    assert figures["tokens_fit"] == figures["pages_fit"] * PAGE_SIZE and figures["sequences_fit_at_mean_length"] == figures["pages_fit"] // 128
    prompts = [[int(token) for token in np.random.default_rng(3).integers(0, 256, 13)], [5, 6]]
    expected = [model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
                for prompt in prompts]
    assert artifact.generate(prompts, 6) == expected
    # The command line drives the cpu target's executables through the runtime (the server: tests/test_paged_serve.py).
    result = tpuexport_in_process("generate", artifact.path, "--tokens", ",".join(map(str, prompts[0])), "--max-new-tokens", 6,
                                  cwd=artifact.path.parent)
    assert result.returncode == 0 and [int(line) for line in result.stdout.split()] == expected[0], result.stderr


def replay_passes(artifact, plant=None) -> bool:
    """Whether the artifact's stored paged case, replayed through its step on CPU with each step's inputs
    (a list in signature order) passed through `plant` first, still matches its stored logits."""
    program = artifact.generation_program
    golden = load_arrays(artifact.read_checked(artifact.manifest["verification"]["golden"]))
    (case, _, prompts, rows, eager_tokens, expected), = stored_cases(golden, artifact.manifest["verification"]["cases"])
    run = cpu_runner(program)

    def planted(name, inputs):
        return run(name, plant(list(inputs)) if plant and name == "step" else inputs)

    logits = teacher_forced_logits(PagedSession(program, planted), prompts, rows, TOKENS // 2, case["sizes"], eager_tokens)
    return compare_run(logits, expected, eager_tokens, default_tolerances("f32", "default", quantized=False).cpu).passed


def test_planted_page_table_bugs_fail_the_comparison(paged):
    """The stored verification case replayed through the step passes; with the page table shifted by one
    entry, or each row's length one short (its newest key unseen), the logits leave generate()'s."""
    artifact, _ = paged

    def shifted_pages(inputs):
        inputs[3] = np.roll(inputs[3], 1, axis=1)
        return inputs

    def short_rows(inputs):
        inputs[4] = inputs[4] - 1
        return inputs

    assert replay_passes(artifact)
    assert not replay_passes(artifact, shifted_pages)
    assert not replay_passes(artifact, short_rows)


def test_a_slice_steps_with_each_chip_holding_its_heads_pages(paged):
    """Verified at conversion: the step partitioned by the v5e-4 plan on 4 CPU devices replays a stored case
    (chunked prefill beside a decoding row) as one device does. The pages' lanes are split by kv heads, so
    attention reads only the chip's own heads: the partitioned step's only collectives are the row-parallel
    layers' all-reduces (with all keys before all values, the layout before session 17, the split separates
    keys from values and XLA adds 6 all-to-alls and 4 collective-permutes per step). The cpu-4 twin runs
    through the runtime sharded, as generate does on one device."""
    artifact, _ = paged
    manifest = artifact.manifest
    [run] = manifest["verification"]["sharded"]
    assert run["passed"] and run["targets"] == ["v5e-4", "cpu-4", "cpu-2x2"] and run["devices"] == 4  # one plan, verified once
    assert run["case"]["passed"] and run["case"]["sizes"] == {"tokens": TOKENS, "rows": MAX_BATCH} and run["case"]["lengths"] == [11, 3]
    assert set(run["collectives"]["step"]) == {"all-reduce"}, run["collectives"]
    assert run["aliased_outputs"] == {"step": 1} and run["resharded_calls"] == []
    for target in ("v5e-4", "cpu-4", "cpu-2x2"):
        plan = manifest["targets"][target]["sharding"]["step"]
        assert plan["inputs"]["cache_kv"] == [None, None, None, "model"] and plan["inputs"]["tokens"] == []
        [step] = [bucket for bucket in manifest["targets"][target]["buckets"] if bucket["entry_point"] == "step"]
        # A chip's heads' share of its target's pages: v5e-4's as many as a chip's HBM holds (below), the
        # CPU twins' the verified count.
        pages, verified = step["sizes"]["pages"], manifest["generation"]["num_pages"]
        assert (pages > 1000 * verified) if target == "v5e-4" else (pages == verified)
        assert step["paged_step"]["cache_bytes"] == manifest["generation"]["cache_bytes"] // verified * pages // 2
        # On two hosts the logits also compile replicated, for the leader to read them whole: one all-gather of [rows, vocab] f32.
        gathered = {"all-gather": {"count": 1, "bytes": MAX_BATCH * 256 * 4}} if target == "cpu-2x2" else {}
        assert {kind: value for kind, value in step["collectives"].items() if kind != "all-reduce"} == gathered
    prompts = [[5, 17, 42, 7, 9, 11, 3, 8, 1, 2, 60, 61, 62], [3, 1]]  # the first longer than the 8-token budget
    state = twin_and_one_device_tokens(artifact.path, prompts, 6)
    assert state["target"] == "cpu-4" and state["devices"] == 4 and state["compilations"] == 0
    sharded, single = state["tokens"]
    assert sharded == single and [list(row) for row in zip(*sharded)] == artifact.generate(prompts, 6, ignore_eos=True)


def step_record(artifact, target: str) -> dict:
    (record,) = [bucket for bucket in artifact.manifest["targets"][target]["buckets"] if bucket["entry_point"] == "step"]
    return record


def test_a_tpu_target_gets_the_pages_its_hbm_holds(paged):
    """Each v5e-4 chip's step compiled at the largest count that fitted among its probes (each larger one
    refused by XLA or past the chip's HBM), far above the verified count (tasks/page_count.py); its record
    and `inspect` say why; a v5e-4 host's runner (its executables not loaded: no TPU here) drives a session
    over those pages, whose step inputs pick the bucket compiled at that count."""
    artifact, _ = paged
    record = step_record(artifact, "v5e-4")
    pages, sized, verified = record["sizes"]["pages"], record["paged_step"]["num_pages_sized"], artifact.manifest["generation"]["num_pages"]
    hbm = 16 * 2**30
    assert record["paged_step"]["num_pages"] == sized["num_pages"] == record["paged_step"]["pages_fit"] == pages > 1000 * verified
    assert record["memory"]["total_bytes"] <= hbm == sized["hbm_bytes"]
    probes = sized["probes"]
    assert probes[0] == [verified, probes[0][1]] and max(count for count, total in probes if total is not None and total <= hbm) == pages
    assert all(total is None or total > hbm for count, total in probes if count > pages)
    assert sized["temp_bytes"] == record["memory"]["temp_bytes"]
    inspected = tpuexport_in_process("inspect", artifact.path, cwd=artifact.path.parent)
    assert inspected.returncode == 0 and f"v5e-4: {pages} pages (fit v5e-4's HBM of 16.0 GiB per device" in inspected.stdout.replace("\n", " ")
    v5e = Runner(artifact, "v5e-4", entry_points(artifact.records, "v5e-4"), {}, [], None, 0.0, (), 0)
    assert v5e.generation_program.spec.num_pages == pages and v5e.generation_program.spec.cache_shape[1] == pages
    assert choose_bucket(v5e.entry_points["step"], {"tokens": TOKENS, "rows": MAX_BATCH, "pages": pages}).sizes["pages"] == pages


def test_a_cpu_target_keeps_the_verified_count_and_generates_as_generate(paged):
    """The cpu target's step takes the verified count (the manifest's num_pages: max batch rows of max
    context), its runner's session holds that many pages, and it generates generate()'s greedy tokens."""
    artifact, model = paged
    verified = MAX_BATCH * MAX_CONTEXT // PAGE_SIZE
    assert artifact.manifest["generation"]["num_pages"] == verified == step_record(artifact, "cpu")["sizes"]["pages"]
    assert step_record(artifact, "cpu")["paged_step"]["num_pages_sized"] is None
    runner = tpuexport.runner(artifact, target="cpu")
    assert runner.generation_program.spec.num_pages == verified
    prompts = [[3, 9, 27, 81, 243, 1, 2, 3, 4, 5, 6], [7, 8]]
    expected = [model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
                for prompt in prompts]
    assert [[token for token in row if token is not None] for row in zip(*runner.stream(prompts, 6))] == expected


def test_num_pages_given_is_every_targets_count(tmp_path):
    """--num-pages N (a plan here: no weights, nothing verified) compiles v5e at N too, with no probe, and
    the convert summary says so."""
    (tmp_path / "lm.py").write_text(LLAMA_FACTORY)
    result = tpuexport_in_process("convert", f"{tmp_path / 'lm.py'}:build", "--task", "text-generation", "--max-context", MAX_CONTEXT,
                                  "--max-batch", MAX_BATCH, "--kv-cache", "paged", "--page-size", PAGE_SIZE, "--num-pages", 40,
                                  "--bucket", f"tokens={TOKENS}", "--target", "v5e", "--no-weights", "-o", tmp_path / "lm.tpu", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    record = step_record(tpuexport.load(tmp_path / "lm.tpu"), "v5e")
    assert record["sizes"]["pages"] == record["paged_step"]["num_pages"] == 40 and record["paged_step"]["num_pages_sized"] is None
    assert "KV cache pages on v5e: 40 pages" in result.stderr.replace("\n", " ")


def test_two_hosts_step_over_the_pages_as_one_device_does(paged):
    """`tpuexport generate` in two processes of 2 CPU devices under jax.distributed (the cpu-2x2 twin): the
    leader's session plans each step, both processes run it over their heads' pages, and the tokens are
    one device's (a prompt longer than the step's budget, prefilled in chunks beside the other's decodes)."""
    from test_multihost import PROCESSES, TARGET, cluster_flags, compiled, run_processes

    artifact, _ = paged
    assert TARGET in artifact.manifest["targets"]
    prompts = [[5, 17, 42, 7, 9, 11, 3, 8, 1, 2, 60, 61, 62], [3, 1]]
    port = free_port()
    command = [sys.executable, "-m", "tpuexport.cli", "generate", str(artifact.path), "--max-new-tokens", "6", "--ignore-eos",
               *[flag for prompt in prompts for flag in ("--tokens", ",".join(map(str, prompt)))]]
    leader, follower = run_processes([command + cluster_flags(port, index) for index in range(PROCESSES)], env={"JAX_LOG_COMPILES": "1"})
    assert leader.returncode == 0 and follower.returncode == 0, leader.stderr[-3000:] + follower.stderr[-3000:]
    steps = [[int(token) for token in line.split()] for line in leader.stdout.splitlines()]
    assert [list(row) for row in zip(*steps)] == artifact.generate(prompts, 6, ignore_eos=True) and follower.stdout == ""
    assert compiled(leader) == compiled(follower) == []  # nothing compiled at start or per step


def test_serve_serves_a_slice_twin_of_pages_sharded(paged, tmp_path, monkeypatch):
    """`tpuexport serve` on 4 CPU devices loads the cpu-4 twin without compiling; two concurrent OpenAI
    completions (one prompt longer than the step's budget, prefilled in chunks beside the other's
    decodes) give one device's greedy tokens."""
    artifact, _ = paged
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")  # the server's process, started below
    prompts = [[int(token) for token in np.random.default_rng(5).integers(0, 256, 19)], [3, 1, 4]]
    with served(artifact.path, tmp_path / "server.log") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda prompt: client.completions.create(model="llama", prompt=prompt, max_tokens=6, temperature=0),
                                    prompts))
    assert "target cpu-4 on 4 cpu devices, loaded without compiling" in (tmp_path / "server.log").read_text()
    assert [answer.choices[0].token_ids for answer in answers] == artifact.generate(prompts, 6)


def test_a_slice_plan_that_changes_the_logits_fails_the_conversion(tmp_path):
    """Exact tolerances pass on one device; lm_head split by its features (rules) loses a term in the
    partitioned sums (test_generation_slices.lm_head_that_cancels): the sharded step replay names it."""
    from test_generation_slices import lm_head_that_cancels

    expected = (r"the sharded entry points \(v5e-4: mesh model=2,replica=2, tensor-parallel, on 4 CPU devices\) do not match eager PyTorch "
                r"in step tokens8_rows2 \(prefill chunks of 4\) \+ 8 tokens: tpu run, output 'logits' ")
    with pytest.raises(tpuexport.VerificationError, match=expected):
        tpuexport.convert(lm_head_that_cancels(), **PAGED, target="v5e-4", **SLICE, rules=["lm_head=None,model"], out=tmp_path / "lm.tpu",
                          matmul_precision="highest", tolerances={"atol": 0.0, "rtol": 0.0, "scale_tol": 0.0})
    assert not (tmp_path / "lm.tpu").exists()


def test_reference_attention_is_ragged_paged_attention():
    """What the step's attention computes (each row's pages gathered by page table, the step's own keys
    appended, the row mask) equals JAX's reference of its Pallas kernel, ref_ragged_paged_attention, on
    the pages the step writes (put in the kernel's interleaved layout): the same kv_lens and causal
    positions. Rows: a chunk of 5 after 2 cached positions, one decode token, an idle row; then a
    padding token. The step's keys land at their page and offset."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, pages, page_size = 4, 2, 8, 9, 4
    cache = torch.randn((1, pages, page_size, 2 * kv_heads * head_dim), generator=generator)
    page_indices = torch.tensor([[6, 2, 0], [4, 0, 0], [0, 0, 0]])
    token_rows = torch.tensor([0, 0, 0, 0, 0, 1, -1])
    positions = torch.tensor([2, 3, 4, 5, 6, 1, 0])  # row 1 decodes its position 1
    kv_lens = torch.tensor([7, 2, 0])
    row_positions = page_indices.shape[1] * page_size
    slots = torch.where(token_rows < 0, -1, page_indices[token_rows.clamp(min=0), positions // page_size] * page_size + positions % page_size)
    paged = PagedKVCache(cache, page_indices, slots)
    new_keys, new_values = (torch.randn((1, kv_heads, 7, head_dim), generator=generator) for _ in range(2))
    keys, values = paged.update(new_keys, new_values, 0)
    query = torch.randn((1, heads, 7, head_dim), generator=generator)
    mask = paged_mask(token_rows, positions, kv_lens, row_positions, torch.float32)
    attended = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=0.3, enable_gqa=True)
    [written] = paged.written()  # the cache (a float cache has no scales)
    written = written[0]  # its one layer
    # The kernel's layout, keys and values interleaved per head [pages, page_size, 2 * kv_heads, head_dim], is the
    # cache's head-major lanes (per head its keys, then its values) split into heads: a reshape, no transpose.
    interleaved = written.reshape(pages, page_size, -1, head_dim)
    expected = ref_ragged_paged_attention(jnp.asarray(query[0].transpose(0, 1).numpy()), jnp.asarray(interleaved.numpy()),
                                          jnp.asarray(kv_lens.numpy(), jnp.int32), jnp.asarray(page_indices.numpy(), jnp.int32),
                                          jnp.array([0, 5, 6, 6], jnp.int32), jnp.array([2], jnp.int32), sm_scale=0.3)
    np.testing.assert_allclose(attended[0].transpose(0, 1)[:6].numpy(), np.asarray(expected), rtol=1e-5, atol=1e-5)
    assert torch.equal(written[page_indices[0, 1], 1], torch.stack([new_keys[0, :, 3], new_values[0, :, 3]], dim=1).flatten())


@pytest.mark.parametrize("options, expected", [
    (["--kv-cache", "paged", "--page-size", "0"], "--page-size 0: give a positive number"),
    (["--kv-cache", "paged", "--page-size", "128"], "--page-size 128 exceeds --max-context 64"),
    (["--kv-cache", "paged", "--page-size", "8", "--num-pages", "7"], "give --num-pages >= 8"),
    (["--page-size", "8"], "--page-size applies to the paged KV cache; add --kv-cache paged"),
    (["--kv-cache", "pages"], "unknown --kv-cache 'pages'"),
    (["--kv-cache", "paged", "--max-context", "8", "--page-size", "8", "--num-pages", "1"], "give --num-pages >= 2"),
    (["--kv-cache", "paged", "--target", "v5e-4", "--sharding", "data-parallel"], "--kv-cache paged does not split rows over a data axis"),
    (["--kv-cache", "paged", "--target", "v5e-4", "--sharding", "tensor-parallel"], "the model's 1 kv heads do not split over model=4"),
])
def test_bad_page_options_are_refused_in_one_line(tmp_path, options, expected):
    factory = tmp_path / "lm.py"
    factory.write_text("import transformers\n\ndef build():\n    return transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=64, "
                       "hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, "
                       "max_position_embeddings=64)).eval()\n")
    before = {path.name for path in tmp_path.iterdir()}
    result = tpuexport_in_process("convert", f"{factory}:build", "--task", "text-generation", "--max-context", "64", "--max-batch", "2",
                                  "--target", "cpu", *options, "-o", tmp_path / "lm.tpu", cwd=tmp_path)
    assert_clean_bad_input(result, tmp_path, expected, before)


def test_one_row_over_pages_prefills_in_chunks_and_generates_what_generate_does(tmp_path):
    """--max-batch 1: the step's rows and pages stay dims (examples of 2: torch.export makes a dim whose
    example is 1 static); a prompt longer than the step's budget is prefilled in chunks, verified at
    conversion and generated as generate() does."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=64)).eval()
    artifact = tpuexport.convert(model, task="text-generation", max_context=64, max_batch=1, kv_cache="paged", page_size=8,
                                 buckets={"tokens": [8]}, target="cpu", out=tmp_path / "one_row.tpu")
    verification = artifact.manifest["verification"]
    assert verification["passed"] and {case["sizes"]["rows"] for case in verification["cases"]} == {1}
    prompt = [5, 9, 3, 17, 40, 2, 8, 11, 30, 1, 6, 7, 19, 22, 23, 24, 25, 26, 27]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert artifact.generate(prompt, 8, ignore_eos=True) == [expected[0, len(prompt):].tolist()]


def test_sliding_window_layers_see_their_window_of_the_pages(tmp_path):
    """Qwen2's sliding layer (window 6) beside a full one, over pages: each of the layer's queries sees
    its row's keys within the window only (a mask per layer type), every key stays in the pages. The
    conversion verifies the step against generate(), and generation past the window equals
    generate()'s, which the same weights attending to every key do not give."""
    from test_generation import tiny_qwen2

    model = tiny_qwen2()
    artifact = tpuexport.convert(model, **{**PAGED, "max_context": 32}, target="cpu", out=tmp_path / "q.tpu")
    assert artifact.manifest["verification"]["passed"]
    prompts = [[5, 17, 42, 7, 11, 23, 8, 61, 9, 2, 30, 4], [99, 3]]
    generated = artifact.generate(prompts, max_new_tokens=10)

    def greedy(lm, prompt):
        tokens = lm.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=10,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        return tokens[0, len(prompt):].tolist()

    assert generated == [greedy(model, prompt) for prompt in prompts]
    assert greedy(tiny_qwen2(use_sliding_window=False), prompts[0]) != generated[0]  # the window changes these tokens
