"""The paged cache's default page count per target (tasks/page_count.py): a TPU target's executables take
what its HBM holds beside the step's weights and temporaries, found by compiling the largest step bucket;
a CPU target and verification keep max batch rows of max context, and its runtime generates at that
count what Hugging Face generate() does; --num-pages gives every target the same count."""

from __future__ import annotations

import pytest
import torch
import tpuexport
from test_cli import tpuexport_in_process
from tpuexport.runtime.entry_points import choose_bucket, entry_points
from tpuexport.runtime.runner import Runner

MAX_CONTEXT, MAX_BATCH, PAGE_SIZE, TOKENS = 64, 2, 4, 8
SMALL = MAX_BATCH * MAX_CONTEXT // PAGE_SIZE  # the verified count: max batch rows of max context
FACTORY = """import torch, transformers

def build():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)).eval()
"""


def step_record(artifact, target: str) -> dict:
    (record,) = [bucket for bucket in artifact.manifest["targets"][target]["buckets"] if bucket["entry_point"] == "step"]
    return record


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The tiny Llama of tests/test_paged.py converted by the command line for v5e and cpu: (artifact, model, stderr)."""
    directory = tmp_path_factory.mktemp("pages")
    (directory / "lm.py").write_text(FACTORY)
    result = tpuexport_in_process("convert", f"{directory / 'lm.py'}:build", "--task", "text-generation", "--max-context", MAX_CONTEXT,
                                  "--max-batch", MAX_BATCH, "--kv-cache", "paged", "--page-size", PAGE_SIZE, "--bucket", f"tokens={TOKENS}",
                                  "--target", "v5e", "--target", "cpu", "-o", directory / "lm.tpu", cwd=directory)
    assert result.returncode == 0, result.stderr
    namespace = {}
    exec(FACTORY, namespace)
    return tpuexport.load(directory / "lm.tpu"), namespace["build"](), result.stderr


def test_a_tpu_target_gets_the_pages_its_hbm_holds(converted):
    """v5e's step compiled at the largest count that fitted among its probes (each larger one refused by XLA
    or past its HBM), far above the verified count; its record and the convert summary say why."""
    artifact, _, stderr = converted
    record = step_record(artifact, "v5e")
    pages, sized = record["sizes"]["pages"], record["paged_step"]["num_pages_sized"]
    hbm = 16 * 2**30
    assert record["paged_step"]["num_pages"] == sized["num_pages"] == record["paged_step"]["pages_fit"] == pages > 1000 * SMALL
    assert record["memory"]["total_bytes"] <= hbm == sized["hbm_bytes"]
    probes = sized["probes"]
    assert probes[0] == [SMALL, probes[0][1]] and max(count for count, total in probes if total is not None and total <= hbm) == pages
    assert all(total is None or total > hbm for count, total in probes if count > pages)
    assert sized["temp_bytes"] == record["memory"]["temp_bytes"]
    assert f"KV cache pages on v5e: {pages} pages (fit v5e's HBM of 16.0 GiB per device" in stderr.replace("\n", " ")
    inspected = tpuexport_in_process("inspect", artifact.path, cwd=artifact.path.parent)
    assert inspected.returncode == 0 and f"v5e: {pages} pages (fit v5e's HBM" in inspected.stdout.replace("\n", " ")
    # A v5e host's runner (its executables not loaded: no TPU here) drives a session over v5e's pages, whose
    # step inputs pick the bucket compiled at that count.
    v5e = Runner(artifact, "v5e", entry_points(artifact.records, "v5e"), {}, [], None, 0.0, (), 0)
    assert v5e.generation_program.spec.num_pages == pages and v5e.generation_program.spec.cache_shape[1] == pages
    assert choose_bucket(v5e.entry_points["step"], {"tokens": TOKENS, "rows": MAX_BATCH, "pages": pages}).sizes["pages"] == pages


def test_a_cpu_target_keeps_the_verified_count_and_generates_as_generate(converted):
    """The cpu target's step takes the verified count (the manifest's num_pages), its runner's session holds
    that many pages, and it generates Hugging Face generate()'s greedy tokens."""
    artifact, model, stderr = converted
    assert artifact.manifest["generation"]["num_pages"] == SMALL == step_record(artifact, "cpu")["sizes"]["pages"]
    assert step_record(artifact, "cpu")["paged_step"]["num_pages_sized"] is None
    assert "KV cache pages on cpu: 32 pages (the verified count" in stderr.replace("\n", " ")
    runner = tpuexport.runner(artifact, target="cpu")
    assert runner.generation_program.spec.num_pages == SMALL
    prompts = [[3, 9, 27, 81, 243, 1, 2, 3, 4, 5, 6], [7, 8]]
    expected = [model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
                for prompt in prompts]
    assert [[token for token in row if token is not None] for row in zip(*runner.stream(prompts, 6))] == expected


def test_num_pages_given_is_every_targets_count(tmp_path):
    """--num-pages N (a plan here: no weights, nothing verified) compiles v5e at N too, with no probe."""
    (tmp_path / "lm.py").write_text(FACTORY)
    result = tpuexport_in_process("convert", f"{tmp_path / 'lm.py'}:build", "--task", "text-generation", "--max-context", MAX_CONTEXT,
                                  "--max-batch", MAX_BATCH, "--kv-cache", "paged", "--page-size", PAGE_SIZE, "--num-pages", 40,
                                  "--bucket", f"tokens={TOKENS}", "--target", "v5e", "--no-weights", "-o", tmp_path / "lm.tpu", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    record = step_record(tpuexport.load(tmp_path / "lm.tpu"), "v5e")
    assert record["sizes"]["pages"] == record["paged_step"]["num_pages"] == 40 and record["paged_step"]["num_pages_sized"] is None
