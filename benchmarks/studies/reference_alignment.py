"""Whether eager PyTorch's results depend on where a model's weights live: a 2-layer f32 Llama's greedy
generate() logits (sha256) with its weights in memory, read from its safetensors checkpoint (tensors at
8 bytes past a 64-byte boundary there), and read from a copy of that file laid out as the artifact's
weights file (64-byte aligned). Written for session 18, where the eager reference of a checkpoint
conversion moved from the checkpoint's tensors to the artifact's file and its logits changed in their
last bits.

    python benchmarks/studies/reference_alignment.py
"""

from __future__ import annotations

import hashlib
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402

import tpuexport  # noqa: E402
from tpuexport.artifact import ALIGNMENT, map_weights, write_weights  # noqa: E402
from tpuexport.arrays import torch_view  # noqa: E402
from tpuexport.export import Checkpoint, open_checkpoint, with_checkpoint_weights  # noqa: E402

PROMPT = torch.tensor([[5, 9, 2, 7, 11, 3]])


def logits_digest(model: torch.nn.Module) -> str:
    with torch.no_grad():
        out = model.generate(PROMPT, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return hashlib.sha256(torch.stack(out.logits).numpy().tobytes()).hexdigest()[:16]


def main() -> None:
    model = _common.random_llama(2, 64, 64).eval()
    state = model.state_dict()
    with tempfile.TemporaryDirectory() as directory:
        checkpoint, laid_out = pathlib.Path(directory) / "checkpoint.safetensors", pathlib.Path(directory) / "weights.safetensors"
        safetensors.torch.save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(checkpoint))
        names = list(state)
        write_weights(laid_out, names, [jax.ShapeDtypeStruct(tuple(state[name].shape), np.float32) for name in names], lambda name: [state[name]])
        arrays = map_weights(laid_out)
        with tpuexport.parameters_on_meta():
            on_meta = _common.random_llama(2, 64, 64)
        models = {"in memory": model, "checkpoint": with_checkpoint_weights(on_meta, open_checkpoint(checkpoint)),
                  "artifact layout": with_checkpoint_weights(on_meta, Checkpoint({name: torch_view(arrays[name]) for name in names}, "file"))}
        for label, held in models.items():
            offsets = sorted({parameter.data_ptr() % ALIGNMENT for parameter in held.parameters()})
            print(f"{label:<16} address mod {ALIGNMENT}: {offsets}  logits {logits_digest(held)}")


if __name__ == "__main__":
    main()
