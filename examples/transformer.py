"""A transformer encoder whose two inputs (tokens, mask) share dynamic batch and sequence dims.

`tpuexport convert examples/transformer.py:build --target v5e --target v6e`
"""

import torch
import torch.nn.functional as F
from torch import nn


class EncoderLayer(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm1 = nn.LayerNorm(width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, hidden, attend):
        batch, seq, width = hidden.shape
        q, k, v = self.qkv(self.norm1(hidden)).reshape(batch, seq, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=attend)
        hidden = hidden + self.proj(attended.transpose(1, 2).reshape(batch, seq, width))
        return hidden + self.mlp(self.norm2(hidden))


class Encoder(nn.Module):
    def __init__(self, vocab: int = 1000, width: int = 64, heads: int = 4, layers: int = 2, max_len: int = 256, classes: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(max_len, width)
        self.layers = nn.ModuleList(EncoderLayer(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.classify = nn.Linear(width, classes)

    def forward(self, tokens, mask):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        hidden = self.embed(tokens) + self.position(positions)
        attend = mask[:, None, None, :]  # (batch, 1, 1, seq): padded keys get no attention
        for layer in self.layers:
            hidden = layer(hidden, attend)
        hidden = self.norm(hidden)
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        return {"logits": self.classify(pooled), "hidden": hidden}


def build():
    torch.manual_seed(0)
    tokens = torch.randint(0, 1000, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, 12:] = False  # the second sequence is padded
    batch = torch.export.Dim("batch", min=1, max=32)
    seq = torch.export.Dim("seq", min=2, max=256)
    shapes = {"tokens": {0: batch, 1: seq}, "mask": {0: batch, 1: seq}}
    # Calibration samples for `--quantize int8`: random token sequences, unpadded (real text in practice).
    calibration = [(torch.randint(0, 1000, (4, 32)), torch.ones(4, 32, dtype=torch.bool)) for _ in range(8)]
    return {"model": Encoder(), "args": (tokens, mask), "dynamic_shapes": shapes, "calibration": calibration}
