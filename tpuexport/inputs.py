"""Random inputs at chosen dim sizes that follow the example inputs' values.

Shared by every stage that runs a model at new sizes (verification, random calibration, warmup
requests): floats with the examples' mean and spread, integers within their value range (token
ids stay valid; a multimodal model's rows hold its placeholder tokens as the signature records
them), bools with their rate of True (an all-True mask stays all True).
"""

from __future__ import annotations

from typing import Sequence

import torch

from tpuexport.signature import Placeholder, TensorSpec


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
            if spec.placeholders:
                tensor = with_placeholders(tensor, spec.placeholders, high + 1)
        made.append(tensor.to(example.dtype))
    return made


def with_placeholders(input_ids: torch.Tensor, placeholders: tuple[Placeholder, ...], high: int) -> torch.Tensor:
    """Token ids whose every row holds each placeholder's count of its token, in one block per
    media after the first token, and no placeholder token elsewhere (those become `high - 1` or
    the next lower id that is no placeholder).

    Args:
      input_ids: [rows, seq] token ids, seq at least 1 + the counts' sum.
      placeholders: what each row holds.
      high: one above the largest token id drawn.
    """
    tokens = {placeholder.token for placeholder in placeholders}
    filler = next(token for token in range(high - 1, -1, -1) if token not in tokens)
    ids = input_ids.clone()
    for token in tokens:
        ids[ids == token] = filler
    start = 1
    for placeholder in placeholders:
        ids[:, start:start + placeholder.count] = placeholder.token
        start += placeholder.count
    return ids
