"""Peak memory per stage (tpuexport/memory.py) read from this process's real /proc: a window sees
memory touched while it is open and not before, a child process's memory is its own figure, and
where the status file cannot be read every figure is "unknown", never 0; verification's optional
runs stay within their memory bound. The conversion's figures in the manifest and the convert
summary line are tested in test_cli.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import torch

import tpuexport
from tpuexport.cli import describe_peak_memory
from tpuexport.memory import UNKNOWN_PEAK, MemoryMonitor, PeakMemory
from tpuexport.verify.sizes import output_bytes, plan_cases

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
    assert during.child_bytes == 0


def test_a_child_process_is_measured_on_its_own():
    with MemoryMonitor() as monitor:
        baseline = monitor.close(monitor.open())
        window = monitor.open()
        subprocess.run([sys.executable, "-c", "import time; block = bytearray(128 * 2**20); block[::4096] = b'x' * (len(block) // 4096); "
                                              "time.sleep(1.0)"], check=True)
        peak = monitor.close(window)
    assert peak.child_bytes >= 128 * MIB
    assert peak.anonymous_bytes < baseline.anonymous_bytes + 64 * MIB  # the child's block is not this process's


def test_unreadable_figures_are_unknown_never_zero(tmp_path):
    with MemoryMonitor(status=tmp_path / "no-such-status") as monitor:
        peak = monitor.close(monitor.open())
    assert peak == UNKNOWN_PEAK
    assert set(json.loads(json.dumps(peak.to_json())).values()) == {"unknown"}
    assert PeakMemory.from_json(peak.to_json()) == UNKNOWN_PEAK
    assert describe_peak_memory({"export": peak, "write": peak}) == "peak memory unknown"


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
    FLOPs budget, is not planned either."""
    torch.manual_seed(0)
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=2, max=2048)
    input_ids = torch.randint(0, 20000, (2, 16))
    artifact = tpuexport.convert(LanguageModelHead().eval(), (input_ids,), {"input_ids": {0: batch, 1: seq}}, target="v5e",
                                 out=tmp_path / "head.tpu", buckets={"batch": [8], "seq": [2048]}, saved_model=False, verify_budget_flops=1)
    padding = artifact.manifest["padding"]
    assert padding["passed"] and padding["bucket"] == {"batch": 8, "seq": 2048} and padding["sizes"] == {"batch": 8, "seq": 16}
    assert padding["note"].startswith("seq 16 at the example's size: the bucket's outputs, 1.2 GiB, are beyond the 1 GiB")
    memory = artifact.records.stage_memory
    assert memory["verify padding"].anonymous_bytes < memory["verify"].anonymous_bytes + 256 * MIB

    entry = artifact.records.entry_points["serving_default"]
    assert output_bytes(entry.signature, {"batch": 8, "seq": 2048}) == 8 * 2048 * 20000 * 4
    planned = {case.label for case in plan_cases(entry.signature, entry.matmul_flops)}
    assert "mid" in planned and "max" not in planned  # max: 5e9 FLOPs, within the budget, but 1.2 GiB of logits


def test_the_writer_streams_in_memory_weights_without_copying_them(tmp_path):
    """A model's 128 MiB of f32 weights are written one array at a time from their own memory: the
    write stage holds no copy of them (safetensors' save built the file in memory: +256 MiB)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 8192), torch.nn.Linear(8192, 2048)).eval()
    artifact = tpuexport.convert(model, (torch.randn(2, 2048),), {"input": {0: torch.export.Dim("batch", min=1, max=4)}}, target="v5e",
                                 out=tmp_path / "wide.tpu", saved_model=False)
    memory = artifact.records.stage_memory
    before = max(peak.anonymous_bytes for stage, peak in memory.items() if stage not in ("write", "compile"))
    assert memory["write"].anonymous_bytes < before + 64 * MIB, {stage: peak.anonymous_bytes // MIB for stage, peak in memory.items()}
    torch.testing.assert_close(artifact.run(torch.ones(3, 2048)), model(torch.ones(3, 2048)), atol=1e-4, rtol=1e-4)
