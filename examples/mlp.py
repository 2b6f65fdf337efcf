"""A small MLP with a dynamic batch: `tpuexport convert examples/mlp.py:build --target v5e`."""

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, features: int = 32, hidden: int = 64, classes: int = 10):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.layers(x)


def build():
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=1, max=256)
    # Calibration samples for `--quantize int8` (a real model would use real data here).
    calibration = [(torch.randn(16, 32),) for _ in range(8)]
    return {"model": MLP(), "args": (torch.randn(4, 32),), "dynamic_shapes": {"x": {0: batch}}, "calibration": calibration}
