"""Peak memory per stage (tpuexport/memory.py) read from this process's real /proc: a window sees
memory touched while it is open and not before, a child process's memory is its own figure, and
where the status file cannot be read every figure is "unknown", never 0; verification's optional
runs stay within their memory bound. The conversion's figures in the manifest and the convert
summary line are tested in test_cli.py."""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import subprocess
import sys
import time

import pytest

import jax
import jax.numpy as jnp
import numpy as np
import torch

import tpuexport
from tpuexport.cli import describe_memory_budget, describe_peak_memory
from tpuexport.errors import TpuExportError
from conftest import build_example
from tpuexport.lower.attention import scaled_dot_product_attention
from tpuexport.lower.cpu_dots import fold_transposes_into_dots
from tpuexport.lower.lowered import LARGE_RUN_OPTIONS, RUN_COMPILER_OPTIONS
from tpuexport.lower.stablehlo_rewrite import rewrite_module
from tpuexport.export import LoadedSource, SourceInfo, load_source, open_checkpoint
from tpuexport.memory import UNKNOWN_PEAK, MemoryMonitor, PeakMemory, _child_pids, _child_rss, memory_budget, resident_bytes
from tpuexport.pipeline import ConversionOptions, lower_forward, passes
from tpuexport.verify.sizes import MAX_OPTIONAL_OUTPUT_BYTES, output_bytes, plan_cases

MIB = 2**20


def test_a_window_sees_the_memory_touched_while_it_is_open():
    with MemoryMonitor() as monitor:
        quiet = monitor.open()
        before = monitor.close(quiet)
        window = monitor.open()
        block = np.ones(256 * MIB, dtype=np.uint8)  # 256 MiB of anonymous memory, touched
        time.sleep(0.5)  # held for ten samples
        del block
        during = monitor.close(window)
        after = monitor.close(monitor.open())
    assert during.anonymous_bytes - before.anonymous_bytes >= 250 * MIB
    assert during.process_bytes >= during.anonymous_bytes + during.mapped_bytes - 1 * MIB
    assert during.mapped_bytes > 0  # the interpreter's and numpy's shared libraries
    assert after.anonymous_bytes < during.anonymous_bytes - 200 * MIB  # freed: a later window does not carry it
    # Not the children's: the process started none in the window. It may have idle children from before
    # (the session's kept compiler processes, conftest.py), whose own size is all the window may see of them.
    idle_children = max((_child_rss(pid) for pid in _child_pids()), default=0)
    assert during.child_bytes < idle_children + 64 * MIB


def test_a_child_process_is_measured_on_its_own():
    # Larger than any idle child the process has (the session's kept compiler processes, conftest.py).
    block = 128 * MIB + max((_child_rss(pid) for pid in _child_pids()), default=0)
    with MemoryMonitor() as monitor:
        baseline = monitor.close(monitor.open())
        window = monitor.open()
        subprocess.run([sys.executable, "-c", f"import time; block = bytearray({block}); block[::4096] = b'x' * (len(block) // 4096); "
                                              "time.sleep(1.0)"], check=True)
        peak = monitor.close(window)
    assert peak.child_bytes >= block
    assert peak.anonymous_bytes < baseline.anonymous_bytes + 64 * MIB  # the child's block is not this process's


def test_freed_heap_pages_are_given_back_between_stages():
    """Blocks below glibc's mmap threshold come from the heap; freed behind one still in use, their
    pages stay resident (what XLA:CPU's buffers did between verification cases) until
    return_freed_memory gives them back. Run in a child: the test's own heap is left alone."""
    child = """
import ctypes
from tpuexport.memory import _read_status, return_freed_memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
blocks = [libc.malloc(64 * 1024) for _ in range(2048)]  # 128 MiB, each block below the mmap threshold
for block in blocks:
    ctypes.memset(block, 1, 64 * 1024)
for block in blocks[:-1]:  # the last one keeps the heap's top from shrinking by itself
    libc.free(block)
held = _read_status()["RssAnon"]
return_freed_memory()
print(held - _read_status()["RssAnon"])
"""
    given_back = int(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout)
    assert given_back > 100 * MIB


def test_unreadable_figures_are_unknown_never_zero(tmp_path):
    with MemoryMonitor(status=tmp_path / "no-such-status") as monitor:
        peak = monitor.close(monitor.open())
    assert peak == UNKNOWN_PEAK
    assert set(json.loads(json.dumps(peak.to_json())).values()) == {"unknown"}
    assert PeakMemory.from_json(peak.to_json()) == UNKNOWN_PEAK
    assert describe_peak_memory({"export": peak, "write": peak}) == "peak memory unknown"


def test_the_summary_line_names_the_budget_and_the_bounds_it_set():
    assert describe_memory_budget({"budget": {"bytes": 3 * 10**9, "source": "--memory-budget"}, "resident_bytes": 10**9,
                                   "output_bytes": 10**8, "fill_bytes": 10**9, "limited_by_budget": True}) == (
        "memory budget 3 GB (--memory-budget); verification runs within 0.09 GiB of outputs, 0.93 GiB of fill temporaries "
        "(set by the budget)")
    assert describe_memory_budget({"budget": {"bytes": "unknown", "source": "default, unknown"}}) == "memory budget unknown"


def test_the_summary_line_names_the_largest_stage_and_child():
    peaks = {"export": PeakMemory(1 * 2**30, 2**29, 3 * 2**29, 0), "verify": PeakMemory(3 * 2**30, 2**29, 7 * 2**29, 0),
             "compile": PeakMemory(2**30, 2**29, 2 * 2**30, 5 * 2**28)}
    assert describe_peak_memory(peaks) == ("peak memory 3.50 GiB in verify (anonymous 3.00 GiB, mapped 0.50 GiB); "
                                           "largest child process 1.25 GiB in compile")


class LanguageModelHead(torch.nn.Module):
    """Token ids -> logits over a 20000-token vocabulary: outputs far larger than its weights or FLOPs."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(20000, 8)
        self.head = torch.nn.Linear(8, 20000)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids))


def test_verification_runs_stay_within_the_memory_bound(tmp_path):
    """The padded bucket 8 x 2048's logits would be 1.2 GiB per run (three runs held at once): the
    padding check runs 8 rows at the example's seq instead, and says so; the "max" size, within the
    FLOPs budget, is not planned either. A 64 GB budget leaves the fixed per-run bound (1 GiB) in
    force on any machine."""
    torch.manual_seed(0)
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=2, max=2048)
    input_ids = torch.randint(0, 20000, (2, 16))
    artifact = tpuexport.convert(LanguageModelHead().eval(), (input_ids,), {"input_ids": {0: batch, 1: seq}}, target="v5e",
                                 out=tmp_path / "head.tpu", buckets={"batch": [8], "seq": [2048]}, saved_model=False, verify_budget_flops=1,
                                 memory_budget_gb=64)
    padding = artifact.manifest["padding"]
    assert padding["passed"] and padding["bucket"] == {"batch": 8, "seq": 2048} and padding["sizes"] == {"batch": 8, "seq": 16}
    assert padding["note"].startswith("seq 16 at the example's size: the bucket's outputs, 1.22 GiB, are beyond the 1.00 GiB")
    memory = artifact.records.stage_memory
    assert memory["verify padding"].anonymous_bytes < memory["verify"].anonymous_bytes + 256 * MIB

    entry = artifact.records.entry_points["serving_default"]
    assert output_bytes(entry.signature, {"batch": 8, "seq": 2048}) == 8 * 2048 * 20000 * 4
    planned = {case.label for case in plan_cases(entry.signature, entry.matmul_flops)}
    assert "mid" in planned and "max" not in planned  # max: 5e9 FLOPs, within the budget, but 1.2 GiB of logits


def test_the_writer_streams_in_memory_weights_without_copying_them(tmp_path):
    """A model's 128 MiB of f32 weights are written one array at a time from their own memory (by the
    weights pass; the write stage moves that file into the artifact): the write stage holds no copy
    of them (safetensors' save built the file in memory: +256 MiB)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 8192), torch.nn.Linear(8192, 2048)).eval()
    artifact = tpuexport.convert(model, (torch.randn(2, 2048),), {"input": {0: torch.export.Dim("batch", min=1, max=4)}}, target="v5e",
                                 out=tmp_path / "wide.tpu", saved_model=False)
    memory = artifact.records.stage_memory
    before = max(peak.anonymous_bytes for stage, peak in memory.items() if stage not in ("write", "compile"))
    assert memory["write"].anonymous_bytes < before + 64 * MIB, {stage: peak.anonymous_bytes // MIB for stage, peak in memory.items()}
    torch.testing.assert_close(artifact.run(torch.ones(3, 2048)), model(torch.ones(3, 2048)), atol=1e-4, rtol=1e-4)
    # No memory_budget_gb: the default, a share of what the machine had available.
    assert artifact.manifest["build"]["memory_budget"]["budget"]["source"].startswith("default: 0.75 of the ")


@pytest.mark.parametrize("precision", ["auto", "bf16"])
def test_an_in_memory_models_program_weights_are_the_file_or_the_model_never_a_copy(tmp_path, precision):
    """A model held in memory takes the checkpoint's route: lower reads no weight (it lowers from their
    shapes), and the weights pass writes the model's tensors, cast to the program's dtypes and the
    scanned layers stacked, into the artifact's weights file one at a time. The program then runs on
    memory maps of that file (file-backed pages, not a second copy beside the model), except where a
    model's tensor is already what the file stores (f32 kept f32, not stacked): it reads that tensor
    in place, as the eager reference does. Either way the arrays are, bit for bit, those a lowering
    that reads the weights holds, and the model is left as it was found."""
    built = build_example("decoder")  # f32; its layers scanned
    model = built["model"]
    state = {name: (tensor.data_ptr(), tensor.clone()) for name, tensor in model.state_dict().items()}
    loaded = LoadedSource(model, built["args"], built["dynamic_shapes"], None, SourceInfo("api"))
    options = ConversionOptions(("v5e",), tmp_path / "decoder.tpu", precision=precision, saved_model=False)
    with passes(loaded, options, "lower") as conversion:
        assert conversion.program.weights_program.weights is None  # lowered from shapes
    with passes(loaded, options, "weights") as conversion:
        program = conversion.program.weights_program
        assert any(program.stacked) and not all(program.stacked) and conversion.weights_file.parent == conversion.scratch
        for name, array, stacked in zip(program.weight_names, program.weights, program.stacked):
            if stacked or precision == "bf16":
                assert isinstance(array, np.memmap) and pathlib.Path(array.filename) == conversion.weights_file, name
            else:
                assert array.ctypes.data == state[name][0], name  # the model's own tensor
        held = lower_forward(conversion.captured["serving_default"], options).lowered  # the arrays read into memory
        assert held.weight_names == program.weight_names
        for name, array, expected in zip(program.weight_names, program.weights, held.weights):
            assert array.dtype == expected.dtype, name
            np.testing.assert_array_equal(array, expected, err_msg=name)
        tokens = built["args"][0].numpy()
        for output, expected in zip(program.run([tokens]), held.run([tokens])):
            np.testing.assert_array_equal(output, expected)
    for name, tensor in model.state_dict().items():
        assert tensor.data_ptr() == state[name][0] and torch.equal(tensor, state[name][1]), name


def mapped_files() -> set[str]:
    return {line.split(maxsplit=5)[5] for line in pathlib.Path("/proc/self/maps").read_text().splitlines() if len(line.split()) > 5}


@pytest.mark.parametrize("precision", ["auto", "bf16"])
def test_a_checkpoints_weights_exist_once_in_the_artifacts_file(tmp_path, precision):
    """From a checkpoint, the weights pass copies its tensors into the artifact's weights file; then
    the eager reference's parameters that the file stores as they are (f32 kept f32; a scanned
    layer's, as its slice of the stack) are views of that file's mapping, and the checkpoint is
    unmapped: one mapping of the weights, not two. Cast to bf16, the file holds other values: the
    reference keeps the checkpoint's f32 tensors. Either way it computes what the model computes."""
    import safetensors.torch

    built = build_example("decoder")  # f32; its layers scanned
    model = built["model"].eval()
    checkpoint = tmp_path / "decoder.safetensors"
    safetensors.torch.save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()}, str(checkpoint))
    with torch.no_grad():
        expected = model(*built["args"])
    with tpuexport.parameters_on_meta():
        on_meta = build_example("decoder")["model"]
    loaded = LoadedSource(on_meta, built["args"], built["dynamic_shapes"], None, SourceInfo("api"),
                          checkpoint=open_checkpoint(checkpoint))
    options = ConversionOptions(("v5e",), tmp_path / "decoder.tpu", precision=precision, saved_model=False)
    with passes(loaded, options, "weights") as conversion:
        reference = conversion.captured["serving_default"].reference
        program = conversion.program.weights_program
        assert any(program.stacked)
        start = min(array.ctypes.data for array in program.weights)
        end = max(array.ctypes.data + array.nbytes for array in program.weights)
        assert all(isinstance(array, np.memmap) and pathlib.Path(array.filename) == conversion.weights_file for array in program.weights)
        inside = [start <= parameter.data_ptr() < end for parameter in reference.parameters()]
        assert all(inside) if precision == "auto" else not any(inside)
        assert (str(checkpoint) in mapped_files()) == (precision == "bf16")
        with torch.no_grad():
            torch.testing.assert_close(reference(*built["args"]), expected, atol=0, rtol=0)


def test_a_checkpoints_pages_are_given_back_once_read(tmp_path):
    """Weights the artifact stores otherwise than the checkpoint (here cast to bf16) keep the eager
    reference reading the checkpoint's maps. The weights pass drops each tensor's pages once written,
    and each module drops its own after its forward, so the checkpoint's resident pages stay near
    none however often the reference runs (an 8B model's 15 GiB stayed beside its int4 artifact's
    weights). The reference still computes what the model computes; the hooks end with the conversion."""
    import safetensors.torch

    torch.manual_seed(0)

    def mlp():
        return torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)).eval()

    model, args = mlp(), (torch.randn(4, 512),)
    checkpoint = tmp_path / "mlp.safetensors"
    safetensors.torch.save_file(model.state_dict(), str(checkpoint))
    with torch.no_grad():
        expected = model(*args)
    with tpuexport.parameters_on_meta():
        on_meta = mlp()
    loaded = LoadedSource(on_meta, args, None, None, SourceInfo("api"), checkpoint=open_checkpoint(checkpoint))
    options = ConversionOptions(("v5e",), tmp_path / "mlp.tpu", precision="bf16", saved_model=False)
    with passes(loaded, options, "weights") as conversion:
        reference = conversion.captured["serving_default"].reference
        assert resident_bytes_of(checkpoint) < checkpoint.stat().st_size / 8
        for _ in range(2):
            with torch.no_grad():
                torch.testing.assert_close(reference(*args), expected, atol=0, rtol=0)
            assert str(checkpoint) in mapped_files() and resident_bytes_of(checkpoint) < checkpoint.stat().st_size / 8
    assert not any(module._forward_hooks for module in reference.modules())


def test_a_weight_only_reference_drops_only_the_checkpoints_pages(tmp_path):
    """Verification runs a weight-only program's reference under a torch function mode that answers
    for each quantized weight with a rounded copy, its data_ptr() included. The pages dropped after
    each module's forward are those the checkpoint's tensors had when the hooks were made: dropping
    the copies' would zero the process's own heap (glibc aborted: "corrupted size vs. prev_size")."""
    import safetensors.torch
    import transformers

    config = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaModel(transformers.LlamaConfig(**config)).to(torch.bfloat16).eval()
    checkpoint = tmp_path / "llama.safetensors"
    safetensors.torch.save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()}, str(checkpoint))
    with tpuexport.parameters_on_meta():
        on_meta = transformers.LlamaModel(transformers.LlamaConfig(**config)).to(torch.bfloat16).eval()
    args = (torch.randint(3, 1000, (2, 16)),)
    dims = {"input_ids": {0: torch.export.Dim("batch", min=1, max=4), 1: torch.export.Dim("seq", min=2, max=64)}}
    loaded = LoadedSource(on_meta, args, dims, None, SourceInfo("api"), checkpoint=open_checkpoint(checkpoint))
    options = ConversionOptions(("v5e",), tmp_path / "llama.tpu", saved_model=False, quantize="int4-weight-only", verify_budget_flops=0)
    with passes(loaded, options, "verify") as conversion:
        assert conversion.verified.report.passed
        assert resident_bytes_of(checkpoint) < checkpoint.stat().st_size / 8


def resident_bytes_of(path: pathlib.Path) -> int:
    """The process's resident bytes of its maps of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a map's header line
            inside = len(fields) > 5 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def test_the_generation_reference_reads_a_checkpoints_weights_from_the_artifacts_file(tmp_path):
    """Text generation from a checkpoint: the model whose generate() verification runs (a copy beside
    the entry points' references) has its parameters pointed at the artifact's weights file too, tied
    embeddings included; the checkpoint is unmapped."""
    import safetensors.torch
    import transformers

    from test_generation_checkpoint import LLAMA, MAX_BATCH, MAX_CONTEXT

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    checkpoint = tmp_path / "llama.safetensors"
    safetensors.torch.save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items() if name != "lm_head.weight"},
                                str(checkpoint))
    with tpuexport.parameters_on_meta():
        on_meta = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    loaded = LoadedSource(on_meta, None, None, None, SourceInfo("api"), checkpoint=open_checkpoint(checkpoint))
    options = ConversionOptions(("v5e",), tmp_path / "llama.tpu", saved_model=False, task="text-generation", max_context=MAX_CONTEXT,
                                max_batch=MAX_BATCH)
    with passes(loaded, options, "weights") as conversion:
        eager = conversion.spec.state.checkpoint_model
        program = conversion.program.weights_program
        start = min(array.ctypes.data for array in program.weights)
        end = max(array.ctypes.data + array.nbytes for array in program.weights)
        assert eager.lm_head.weight is eager.model.embed_tokens.weight
        assert all(start <= parameter.data_ptr() < end for parameter in eager.parameters())
        assert str(checkpoint) not in mapped_files()
        prompt = torch.tensor([[5, 9, 2, 7]])
        with torch.no_grad():
            assert torch.equal(eager.generate(prompt, max_new_tokens=8, do_sample=False), model.generate(prompt, max_new_tokens=8, do_sample=False))


def test_options_made_without_a_budget_carry_the_default(tmp_path):
    """run_conversion's options read the default when they are made (the command line makes them
    before it loads the source); the conversion uses theirs and reads none of its own."""
    budget = ConversionOptions(("v5e",), tmp_path / "model.tpu").memory_budget
    assert budget.source.startswith("default: 0.75 of the ") and budget.bytes > resident_bytes()


def test_a_tight_memory_budget_shrinks_and_skips_the_optional_cases(tmp_path):
    """A budget 1.4 GB above what the process holds leaves an optional run a fifth of what is left
    (eager's and both runs' outputs, and XLA's buffers of their size while a program runs): the
    sizes with long sequences and more rows (0.38-1.2 GiB of logits) are skipped and the padded bucket
    shrunk, both naming the budget, while one row at the longest seq (0.15 GiB) runs; the conversion
    passes and the manifest records the budget and the bounds it set."""
    torch.manual_seed(0)
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=2, max=2048)
    budget_gb = (resident_bytes() + 1.4e9) / 1e9
    artifact = tpuexport.convert(LanguageModelHead().eval(), (torch.randint(0, 20000, (2, 16)),), {"input_ids": {0: batch, 1: seq}},
                                 target="v5e", out=tmp_path / "head.tpu", buckets={"batch": [8], "seq": [2048]}, saved_model=False,
                                 memory_budget_gb=budget_gb)
    record = artifact.manifest["build"]["memory_budget"]
    assert record["budget"] == {"bytes": int(budget_gb * 1e9), "source": "--memory-budget"} and record["limited_by_budget"]
    assert record["output_bytes"] == int((record["budget"]["bytes"] - record["resident_bytes"]) / 5) < MAX_OPTIONAL_OUTPUT_BYTES
    verification = artifact.manifest["verification"]
    # batch 8 x seq 2 and batch 1 x seq 2048 fit; the sizes with both more rows and a long seq do not.
    assert verification["passed"] and [case["label"] for case in verification["cases"]] == ["example", "min", "max-batch", "max-seq"]
    skipped = {case["label"]: case["reason"] for case in verification["skipped"]}
    assert set(skipped) == {"max", "mid"}, skipped
    assert skipped["mid"].startswith("outputs of 0.38 GiB, beyond the ") and "the memory budget" in skipped["mid"], skipped
    assert skipped["max"].startswith("outputs of 1.22 GiB") and "--memory-budget" in skipped["mid"]
    padding = artifact.manifest["padding"]
    assert padding["passed"] and padding["sizes"] == {"batch": 8, "seq": 16} and "within the memory budget" in padding["note"]


def tpuexport_in_process(*args, cwd):
    """The command run by click's test runner in this process: (exit code, stderr lines)."""
    from click.testing import CliRunner

    from tpuexport.cli import main

    with contextlib.chdir(cwd):
        result = CliRunner().invoke(main, list(map(str, args)))
    return result.exit_code, result.stderr.strip().splitlines(), result.stdout


@pytest.mark.parametrize("value", ["0", "-2", "lots"])
def test_a_malformed_memory_budget_is_one_line_and_exit_2(value, tmp_path):
    code, lines, stdout = tpuexport_in_process("convert", "nowhere.pt2", "--memory-budget", value, cwd=tmp_path)
    assert code == 2 and lines == [f"error: --memory-budget {value} is not a positive number of GB; give one such as 12 or 7.5 "
                                   "(or leave it out for the default, a share of the memory available)"] and stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_weights_beyond_the_budget_are_refused_before_they_are_read(tmp_path):
    """A .pt2 source is read whole: beyond a 1 kB budget it is refused in one line naming its size, the
    budget and the streamed path; nothing is written."""
    model = torch.nn.Linear(64, 64)
    torch.export.save(torch.export.export(model, (torch.ones(2, 64),)), tmp_path / "linear.pt2")
    size = (tmp_path / "linear.pt2").stat().st_size
    code, lines, stdout = tpuexport_in_process("convert", "linear.pt2", "--memory-budget", "0.000001", cwd=tmp_path)
    assert code == 2 and len(lines) == 1 and stdout == "", lines
    assert lines[0].startswith(f"error: linear.pt2 (its weights are read whole), {size / 2**30:.2f} GiB, would be read into memory "
                               "and alone exceed the memory budget of 1e-06 GB (--memory-budget); give a larger --memory-budget, "
                               "or stream the weights"), lines
    assert "--checkpoint" in lines[0]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["linear.pt2"]


def test_a_directory_read_into_memory_is_refused_and_a_streamed_one_is_not(tmp_path):
    """A Hugging Face directory's weights are sized from its safetensors headers before loading:
    read into memory (PT2E rounds them there) beyond the budget they are refused; streamed, the same
    budget loads it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                                     num_labels=3)
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path / "bert")
    weights = sum(parameter.numel() * 4 for parameter in transformers.BertForSequenceClassification(config).parameters())
    budget = memory_budget(weights / 2 / 1e9)
    with pytest.raises(TpuExportError) as refused:
        load_source(str(tmp_path / "bert"), task="text-classification", weights_in_memory=True, memory_budget=budget)
    message = str(refused.value)
    assert "\n" not in message and "would be read into memory and alone exceed the memory budget" in message
    assert "--quantize int8/int8-dynamic rounds them there" in message and "give a larger --memory-budget" in message
    streamed = load_source(str(tmp_path / "bert"), task="text-classification", memory_budget=budget)
    assert streamed.checkpoint is not None


def test_a_hugging_face_directorys_checkpoint_is_unmapped_when_released(tmp_path):
    """A directory's checkpoint (its tensors under the wrapped model's names) unmaps its files when
    released, as the weights pass releases it once the references read the artifact's file; a
    tensor asked for afterwards maps its file again."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                                     num_labels=3)
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path / "bert")
    checkpoint = load_source(str(tmp_path / "bert"), task="text-classification").checkpoint
    weights = str(tmp_path / "bert" / "model.safetensors")
    name = next(iter(checkpoint))
    assert checkpoint[name].numel() and weights in mapped_files()
    checkpoint.release()
    assert weights not in mapped_files()
    assert checkpoint[name].numel() and weights in mapped_files()


def test_cpu_runs_read_a_weight_in_place_transposed_or_by_a_single_row(tmp_path):
    """torch's linear is x @ weight.T: XLA:CPU wrote each transposed weight out, in f32 for a bfloat16
    one (1 GiB for Llama-3.2-1B's head, per run), and converted the whole weight to f32 for a
    product with a single row once it reads the weight untransposed (a batch-1 prefill's head, a
    batch-1 decode step's every matmul). The CPU program's dots read the weight as it is
    (lower/cpu_dots.py): the run's temporaries are below the weight's own size at batch 4 and at
    batch 1, where those programs need an f32 copy, the outputs are the same products summed in f32, and a single row's are that row's of a
    larger batch, bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 8192, bias=False).to(torch.bfloat16).eval()
    batch = torch.export.Dim("batch", min=1, max=8)
    example = torch.randn(4, 256, dtype=torch.bfloat16)
    loaded = LoadedSource(model, (example,), {"input": {0: batch}}, None, SourceInfo("api"))
    options = ConversionOptions(("cpu",), tmp_path / "linear.tpu", saved_model=False)
    with passes(loaded, options, "lower") as conversion:
        lowered = lower_forward(conversion.captured["serving_default"], options).lowered
    weight_bytes = 8192 * 256 * 2
    inputs = [jax.ShapeDtypeStruct((4, 256), jnp.bfloat16)]
    as_exported = jax.jit(lowered.exported.call).lower(list(lowered.weights), inputs).compile()
    assert as_exported.memory_analysis().temp_size_in_bytes >= 2 * weight_bytes  # the f32 transposed copy this removes

    folded_only = rewrite_module(lowered.exported, fold_transposes_into_dots)
    single_row = jax.jit(folded_only.call).lower(list(lowered.weights), [jax.ShapeDtypeStruct((1, 256), jnp.bfloat16)]).compile()
    assert single_row.memory_analysis().temp_size_in_bytes >= 2 * weight_bytes  # the f32 copy of the weight the padded row removes

    assert lowered.run_temporary_bytes({"batch": 4}) < weight_bytes / 8
    assert lowered.run_temporary_bytes({"batch": 1}) < weight_bytes / 8

    (output,) = lowered.run([example.float().numpy()])
    expected = torch.nn.functional.linear(example.double(), model.weight.detach().double()).numpy()
    np.testing.assert_allclose(output.astype(np.float64), expected, rtol=2**-7, atol=1e-3)
    (first_row,) = lowered.run([example[:1].float().numpy()])
    np.testing.assert_array_equal(first_row, output[:1])


def test_a_transpose_folds_into_a_dot_only_where_the_result_keeps_its_dim_order():
    """A dot lists its operands' free dims in their own order: a transposed weight's single free dim
    folds; swapped free dims of a 3-d operand would reorder the result, so that transpose stays."""
    generator = np.random.default_rng(0)
    x = generator.standard_normal((3, 16)).astype(np.float32)
    w = generator.standard_normal((5, 7, 16)).astype(np.float32)
    folds_expected = {lambda x, w: jax.lax.dot_general(x, w[0].T, (((1,), (0,)), ((), ()))): 1,
                      lambda x, w: jax.lax.dot_general(x, jnp.transpose(w, (1, 0, 2)), (((1,), (2,)), ((), ()))): 0}
    for function, expected in folds_expected.items():
        exported = jax.export.export(jax.jit(function))(x, w)
        folds = []
        rewritten = rewrite_module(exported, lambda module: folds.append(fold_transposes_into_dots(module)))
        assert folds == [expected]
        np.testing.assert_allclose(rewritten.call(x, w), exported.call(x, w), rtol=1e-5)


def _library_fusion_ops(hlo: str) -> list[set[str]]:
    """The ops inside each YNNPACK fusion of compiled XLA:CPU HLO text (parameters, reshapes and
    converts left out)."""
    bodies = {}
    for block in hlo.split("\n\n"):
        head = block.lstrip().split(" ", 1)[0]
        if head.startswith("%"):
            bodies[head[1:]] = re.findall(r"= \S+ ([a-z][a-z-]*)\(", block)
    called = re.findall(r'calls=%([\w.-]+).*"kind":"__ynn_fusion"', hlo)
    return [set(bodies[name]) - {"parameter", "bitcast", "convert", "reshape"} for name in called]


def test_a_cpu_runs_attention_gives_the_dot_library_its_dots_alone():
    """XLA:CPU hands YNNPACK whole subgraphs around a dot by default: an attention's scale and mask
    are then written out in f32 at the scores' size, and YNNPACK holds the scores in buffers XLA's
    memory analysis does not count (a 2048-token Llama-3.2-1B prefill peaked 0.75 GiB above its
    plan). A run with large temporaries is compiled again with lowered.LARGE_RUN_OPTIONS, which give
    it each dot alone."""
    query = jax.ShapeDtypeStruct((1, 32, 256, 64), jnp.bfloat16)
    key = value = jax.ShapeDtypeStruct((1, 8, 256, 64), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((1, 1, 256, 256), jnp.bfloat16)  # a prefill's additive causal mask
    traced = jax.jit(lambda q, k, v, m: scaled_dot_product_attention(q, k, v, m)).lower(query, key, value, mask)

    run_fusions = _library_fusion_ops(traced.compile(compiler_options=LARGE_RUN_OPTIONS).as_text())
    assert run_fusions and all(ops == {"dot"} for ops in run_fusions)
    default_fusions = _library_fusion_ops(traced.compile(compiler_options=RUN_COMPILER_OPTIONS).as_text())
    assert any({"dot", "exponential"} <= ops for ops in default_fusions)  # the softmax inside: what the option keeps out
