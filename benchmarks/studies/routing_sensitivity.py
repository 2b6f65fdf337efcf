"""How far a decoder's logits move when its hidden states move by one bfloat16 rounding step.

    python benchmarks/studies/routing_sensitivity.py DIR [DIR ...]

Each directory's causal LM is read in bfloat16 and run on one seeded 56-token prompt twice: as it is,
and with every attention layer's input scaled by (1 + 2^-8), one bf16 ulp. A dense decoder's logits
move by about a rounding step; a mixture-of-experts decoder whose router has near-ties moves by as
much as its experts differ on the tokens routed elsewhere. A conversion's bf16 arithmetic rounds
differently from eager PyTorch's by about that much, so such a model's logits cannot be held to the
verification's tolerances on those tokens (session 23: the sweep's bf16 flex_olmo; beam, which also
failed in bf16, does not move).
"""

from __future__ import annotations

import sys

import torch
import transformers

ULP = 2.0**-8
PROMPT_TOKENS = 56
CHANGED = 0.05  # a token whose largest logit change is above this is counted


def logits_moved(directory: str) -> tuple[float, float, int]:
    """(largest |logit|, largest change, tokens changed by more than CHANGED) for one directory."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    prompt = torch.randint(3, model.config.vocab_size, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(prompt).logits.float()
    hooks = [module.register_forward_pre_hook(lambda _, args, kwargs: ((), {**kwargs, "hidden_states": kwargs["hidden_states"] * (1 + ULP)}),
                                              with_kwargs=True)
             for name, module in model.named_modules() if name.endswith("self_attn")]
    with torch.no_grad():
        nudged = model(prompt).logits.float()
    for hook in hooks:
        hook.remove()
    change = (plain - nudged).abs()
    return plain.abs().max().item(), change.max().item(), int((change.amax(-1) > CHANGED).sum())


def main() -> None:
    print(f"{'directory':<40} {'largest logit':>13} {'largest change':>14} {'tokens changed':>14}")
    for directory in sys.argv[1:]:
        scale, change, tokens = logits_moved(directory)
        print(f"{directory:<40} {scale:>13.4f} {change:>14.4f} {tokens:>14}")


if __name__ == "__main__":
    main()
