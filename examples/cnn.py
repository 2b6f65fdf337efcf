"""A small CNN with BatchNorm, dynamic batch: `tpuexport convert examples/cnn.py:build --target v5e`."""

import torch
from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(32, classes)

    def forward(self, image):
        return self.head(torch.flatten(self.features(image), 1))


def build():
    torch.manual_seed(0)
    model = SmallCNN()
    # Non-trivial running statistics, so BatchNorm's folding is really exercised.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    batch = torch.export.Dim("batch", min=1, max=64)
    # Calibration samples for `--quantize int8` (a real model would use real images here).
    calibration = [(torch.randn(4, 3, 32, 32),) for _ in range(8)]
    return {"model": model, "args": (torch.randn(2, 3, 32, 32),), "dynamic_shapes": {"image": {0: batch}}, "calibration": calibration}
