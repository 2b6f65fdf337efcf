"""Random inputs at chosen dim sizes that follow the example inputs' values.

Shared by every stage that runs a model at new sizes (verification, random calibration, warmup
requests): floats with the examples' mean and spread, integers within their value range (token
ids stay valid), bools with their rate of True (an all-True mask stays all True).
"""

from __future__ import annotations

from typing import Sequence

import torch

from tpuexport.signature import TensorSpec


def make_inputs(specs: Sequence[TensorSpec], examples: Sequence[torch.Tensor], sizes: dict[str, int], seed: int) -> list[torch.Tensor]:
    """Random inputs at `sizes` that follow the example inputs' values (see module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    made = []
    for spec, example in zip(specs, examples):
        shape = spec.concrete_shape(sizes)
        if example.dtype.is_floating_point:
            values = example.detach().float()
            spread = float(values.std()) if values.numel() > 1 else 1.0
            tensor = torch.randn(shape, generator=generator) * (spread or 1.0) + float(values.mean())
        elif example.dtype == torch.bool:
            tensor = torch.rand(shape, generator=generator) < float(example.float().mean())
        else:
            low, high = int(example.min()), int(example.max())
            tensor = torch.randint(low, high + 1, shape, generator=generator)
        made.append(tensor.to(example.dtype))
    return made
