"""tpuexport.kept_compilers(): conversions in one process reuse compiler processes, one per target,
which compile what a new process does."""

import os
import signal

import numpy as np
import torch

import tpuexport


class Affine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x).relu()


X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)


def converted(out, target):
    torch.manual_seed(0)
    return tpuexport.convert(Affine(), args=(torch.from_numpy(X),), target=target, out=out, saved_model=False)


def idle(kept) -> dict[str, int]:
    """{target: pid} of the kept processes waiting for a request."""
    return {compiler.key[1]: compiler.process.pid for compiler in kept.idle}


def test_a_kept_process_compiles_the_next_conversion_for_its_target_and_ends_with_the_block(tmp_path):
    with tpuexport.kept_compilers(processes=2) as kept:
        # From one line: the compiled HLO's metadata names the caller's lines.
        artifacts = [converted(tmp_path / f"{name}.tpu", ["v5e", "cpu"]) for name in ("first", "again")]
        pids = idle(kept)
        assert set(pids) == {"v5e", "cpu"}
        converted(tmp_path / "again-v5e.tpu", "v5e")
        assert idle(kept) == pids, "a conversion started a process of its own"
        before = list(kept.idle)
        converted(tmp_path / "v6e.tpu", "v6e")
        # Two kept at most: the least recently used one ended.
        ended = [compiler.process for compiler in before if compiler not in kept.idle]
        assert "v6e" in idle(kept) and len(idle(kept)) == 2 and [process.returncode for process in ended] == [0]
        os.kill(idle(kept)["v6e"], signal.SIGKILL)  # a kept process that died is replaced
        converted(tmp_path / "v6e-again.tpu", "v6e")
        processes = [compiler.process for compiler in kept.idle]
    assert [process.returncode for process in processes] == [0, 0]
    # The reused processes compiled what the new ones did: the same HLO, and XLA:CPU executables that
    # run as the model does. (Not the same bytes: XLA numbers computations per process, docs/ci-gate.md.)
    for target in ("v5e", "cpu"):
        first, again = (artifact.records.buckets(target, "serving_default")[0] for artifact in artifacts)
        assert first.fingerprint == again.fingerprint
    torch.manual_seed(0)
    expected = Affine()(torch.from_numpy(X)).detach().numpy()
    for artifact in artifacts:
        (output,) = tpuexport.runner(artifact.path, target="cpu").run({"x": X}).values()
        np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-6)
