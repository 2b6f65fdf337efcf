"""Max pooling with ceil_mode over a symbolic length (found by fuzzing: torchax's lowering compares
symbolic dims to pick the padding and fails), lowered and verified against eager PyTorch at every
verification size, including lengths where torch drops the last window (it would start in the
right padding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpuexport.export import LoadedSource, SourceInfo, capture
from tpuexport.lower import lower
from tpuexport.verify import verify

batch = torch.export.Dim("batch", min=1, max=8)
k = torch.export.Dim("k", min=2, max=9)


class CeilModeMaxPools(nn.Module):
    """A sequence halved by an average pool (so its length is any k: exporting a ceil_mode max pool
    straight over `2*k` specializes it), then max pools with ceil_mode over that length: the fuzzer's
    (kernel 2, stride 2), kernel 3 stride 2, and two whose last window torch drops at some lengths:
    kernel 2 stride 2 padding 1 (odd lengths) and kernel 4 stride 3 padding 2 (lengths 3m + 1); and
    the 2-d form over [length, features]; and a dilated one's indices."""

    def forward(self, x):
        over_seq = F.avg_pool1d(x.transpose(1, 2), 2, 2)
        pools = [F.max_pool1d(over_seq, 2, 2, ceil_mode=True), F.max_pool1d(over_seq, 3, 2, ceil_mode=True),
                 F.max_pool1d(over_seq, 2, 2, padding=1, ceil_mode=True), F.max_pool1d(over_seq, 4, 3, padding=2, ceil_mode=True),
                 F.max_pool2d(over_seq.transpose(1, 2).unsqueeze(1), 3, 2, padding=1, ceil_mode=True)]
        # indices too, of a dilated 2-d pool over rounded values (ties: torch keeps each window's first maximum)
        values, indices = F.max_pool2d(over_seq.round().unsqueeze(1), (3, 2), (2, 1), padding=1, dilation=(2, 1), ceil_mode=True,
                                       return_indices=True)
        return (*pools, values, indices)


def torch_ceil_mode_length(length, kernel, stride, padding):
    """torch's ceil_mode output length (pooling_output_shape), for the test's own check."""
    out = (length + 2 * padding - (kernel - 1) - 1 + stride - 1) // stride + 1
    return out - 1 if (out - 1) * stride >= length + padding else out


def test_ceil_mode_max_pool_over_a_symbolic_length_matches_eager_at_every_size():
    model = capture(LoadedSource(CeilModeMaxPools(), (torch.randn(2, 10, 4) * 2,), {"x": {0: batch, 1: 2 * k}}, None, SourceInfo("api")))
    lowered = lower(model.program, model.signature)
    report = verify(lowered, model.reference, model.example_inputs)
    assert report.passed, report.failure_summary()
    lengths = {case.sizes["k"] for case in report.cases}
    # the last-window rule bites at odd lengths for (2, 2, 1) and at 3m + 1 for (4, 3, 2)
    assert any(length % 2 == 1 for length in lengths) and any(length % 3 == 1 for length in lengths), lengths
    for length in lengths:
        outputs = lowered.run([torch.randn(3, 2 * length, 4).numpy()])
        assert outputs[2].shape[-1] == torch_ceil_mode_length(length, 2, 2, 1)
        assert outputs[3].shape[-1] == torch_ceil_mode_length(length, 4, 3, 2)
    assert torch_ceil_mode_length(5, 2, 2, 1) == 3 and torch_ceil_mode_length(7, 4, 3, 2) == 3  # the rule bites: 4 before it
