"""A tiny Llama-style decoder (q/k/v/o projections, gated MLP) with dynamic batch and sequence, named
as Hugging Face names Llama's weights, so that `--sharding tensor-parallel` finds its layers:

    tpuexport convert examples/decoder.py:build --target v5e-8 --mesh data=2,model=4 --sharding tensor-parallel

Besides the logits it returns a 3-way score of the first token (a head whose 3 rows split over no
mesh axis: tests use it for a dim that does not divide).
"""

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(width, width, bias=False)
        self.k_proj = nn.Linear(width, width, bias=False)
        self.v_proj = nn.Linear(width, width, bias=False)
        self.o_proj = nn.Linear(width, width, bias=False)

    def forward(self, hidden):
        batch, seq, width = hidden.shape

        def heads(x):
            return x.view(batch, seq, self.heads, width // self.heads).transpose(1, 2)

        attended = F.scaled_dot_product_attention(heads(self.q_proj(hidden)), heads(self.k_proj(hidden)), heads(self.v_proj(hidden)),
                                                  is_causal=True)
        return self.o_proj(attended.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(width)
        self.self_attn = Attention(width, heads)
        self.post_attention_layernorm = nn.RMSNorm(width)
        self.mlp = MLP(width, hidden)

    def forward(self, hidden):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Decoder(nn.Module):
    def __init__(self, vocab: int = 256, width: int = 64, heads: int = 8, hidden: int = 128, layers: int = 2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Layer(width, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.score = nn.Linear(width, 3)

    def forward(self, tokens):
        hidden = self.embed_tokens(tokens)
        for layer in self.layers:
            hidden = layer(hidden)
        hidden = self.norm(hidden)
        return {"logits": self.lm_head(hidden), "score": self.score(hidden[:, 0])}


def build():
    torch.manual_seed(0)
    with torch.no_grad():
        model = Decoder().eval()
        for norm in (module for module in model.modules() if isinstance(module, nn.RMSNorm)):
            norm.weight.uniform_(0.5, 1.5)  # as in a trained checkpoint, not all ones
    tokens = torch.randint(0, 256, (8, 16))
    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("seq", min=2, max=128)
    return {"model": model, "args": (tokens,), "dynamic_shapes": {"tokens": {0: batch, 1: seq}}}
