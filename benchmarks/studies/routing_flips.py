"""Where a mixture of experts' routing flips under TPU matmul arithmetic, and what pinning would
remove the flips: the coverage Mixtral run eagerly in PyTorch with its matmuls computed as the TPU's
default precision computes them (one bfloat16 pass: operands rounded to bfloat16, products summed
in f32), matmul by matmul pinned back to f32, against plain f32 eager.

    python benchmarks/studies/routing_flips.py                       # batch 64 x seq 128, as benchmarks/studies/routing.py

Rows: which matmuls keep f32 (the router's alone is tpuexport's default), the tokens whose set of
top-k experts differs from f32 eager in each MoE layer, and the smallest gap between the k-th and
the (k+1)-th router probability among all tokens in f32 (how close to a tie the nearest token is).
It is a model of the TPU's arithmetic in eager PyTorch, not the artifact's program (routing.py
runs that); it shows which perturbation moves the router's input enough to flip a near-tie.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402


class OnePassBf16(TorchFunctionMode):
    """F.linear and matmuls with bfloat16-rounded operands and f32 sums (the TPU's default for f32),
    except those whose weight (second operand of a linear, or the parameter it is a slice of, as an
    expert's is) has its id in `pinned`, or every matmul that is not a linear when
    `pin_other_matmuls` (attention's scores and values)."""

    def __init__(self, pinned: set[int], pin_other_matmuls: bool):
        super().__init__()
        self.pinned = pinned
        self.pin_other_matmuls = pin_other_matmuls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and not {id(args[1]), id(args[1]._base)} & self.pinned:
            return func(_round(args[0]), _round(args[1]), *args[2:], **kwargs)
        if func in (torch.matmul, torch.Tensor.matmul, torch.bmm) and not self.pin_other_matmuls:
            return func(_round(args[0]), _round(args[1]), **kwargs)
        return func(*args, **kwargs)


def _round(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.bfloat16).to(tensor.dtype) if tensor.dtype == torch.float32 else tensor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=128)
    options = parser.parse_args()

    import transformers

    from families import _CONFIGS, VOCAB

    config = next(entry[4] for entry in _CONFIGS if entry[0] == "mixtral")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**config, attn_implementation="eager")).eval()
    routers = [layer.mlp.gate for layer in model.model.layers]
    chosen: list[torch.Tensor] = []
    for router in routers:
        router.register_forward_hook(lambda module, inputs, output: chosen.append(output[2].sort(dim=-1).values))
    tokens = torch.randint(0, VOCAB, (options.batch, options.seq), generator=torch.Generator().manual_seed(1))

    def run(mode) -> list[torch.Tensor]:
        chosen.clear()
        with torch.no_grad(), mode:
            model(input_ids=tokens, use_cache=False)
        return list(chosen)

    with torch.no_grad():
        probabilities = [F.softmax(F.linear(hidden, router.weight), dim=-1) for hidden, router in zip(_router_inputs(model, tokens), routers)]
    top = config["num_experts_per_tok"]
    ranked = [probs.sort(dim=-1, descending=True).values for probs in probabilities]
    gaps = [values[:, top - 1] - values[:, top] for values in ranked]
    reference = run(contextlib.nullcontext())
    router_weights = {id(router.weight) for router in routers}
    attention_weights = {id(module.weight) for layer in model.model.layers
                         for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj)}
    expert_weights = {id(parameter) for layer in model.model.layers for parameter in layer.mlp.experts.parameters()}
    variants = [
        ("none (every matmul one bf16 pass)", set(), False),
        ("the router's (tpuexport's default)", router_weights, False),
        ("the router's and the experts'", router_weights | expert_weights, False),
        ("the router's and attention's projections (q, k, v, o)", router_weights | attention_weights, False),
        ("the router's and attention's scores and values", router_weights, True),
        ("the router's and attention's (projections, scores, values)", router_weights | attention_weights, True),
    ]
    print(f"Mixtral (coverage config, {len(routers)} MoE layers, top-{top} of {config['num_local_experts']}), "
          f"batch {options.batch} x seq {options.seq} = {options.batch * options.seq} tokens")
    print("smallest f32 gap between the k-th and (k+1)-th router probability, per layer: "
          + ", ".join(f"{gap.min().item():.2e}" for gap in gaps)
          + "; tokens with a gap under 1e-3: " + ", ".join(str(int((gap < 1e-3).sum())) for gap in gaps) + "\n")
    print("| matmuls kept f32 | tokens routed differently from f32 eager, per layer |\n|---|---|")
    for label, pinned, pin_other in variants:
        flips = [int((got != want).any(dim=-1).sum()) for got, want in zip(run(OnePassBf16(pinned, pin_other)), reference)]
        print(f"| {label} | {', '.join(map(str, flips))} |")


def _router_inputs(model, tokens) -> list[torch.Tensor]:
    """The f32 inputs of each router (the post-attention norm's output), recorded in one eager run."""
    seen: list[torch.Tensor] = []
    handles = [layer.mlp.gate.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0].reshape(-1, inputs[0].shape[-1])))
               for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=tokens, use_cache=False)
    for handle in handles:
        handle.remove()
    return seen


if __name__ == "__main__":
    main()
