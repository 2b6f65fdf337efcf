"""Mamba's selective scan exported as one scan over the sequence.

Mamba (v1) mixers (Mamba, Falcon-Mamba, Jamba's and Zamba's Mamba layers) compute a prompt's states
with transformers' `mamba_selective_scan`, whose torch path is a Python loop over the positions:
torch.export unrolls it, one step per position of the prefill bucket (a tiny Mamba at a bucket of
2048 did not convert in 7 minutes). While exporting, the function is replaced in each loaded
transformers module that defines it by the same computation, mamba_ssm's `selective_scan_fn`
(`selective_scan_ref`: the state x <- exp(delta * A) x + delta * B * u, read out through C, then
+ D * u, times silu(z)), with the recurrence as a `torch._higher_order_ops.scan`, which lowers to one
`jax.lax.scan` (lower/control_flow.py). The arithmetic is transformers' own (its dtypes: the state
in float32, read out in the input's dtype); eagerly, for the reference, the model runs as before.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F
from torch._higher_order_ops.scan import scan

# The function transformers' Mamba (v1) mixers call for a whole sequence, by the name its modules give it.
_SELECTIVE_SCAN = "mamba_selective_scan"


def selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False,
                   **options):
    """mamba_ssm's selective_scan_fn over one sequence (the arguments transformers passes; `options`,
    its choices of torch-only paths, do not change the result).

    Args:
      hidden_states: u [batch, channels, seq]; dt: [batch, channels, seq]; A: [channels, state];
      B, C: [batch, state, seq]; D: [channels] or None; z: the gate [batch, channels, seq] or None;
      delta_bias: [channels] or None; delta_softplus: softplus dt (after its bias).
      return_last_state: also return the state after the last position [batch, channels, state].
    Returns:
      y [batch, channels, seq] (and the last state).
    """
    input_dtype = hidden_states.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    decays = torch.exp(A[None, :, None, :] * dt[:, :, :, None])  # [batch, channels, seq, state]
    inflows = dt[:, :, :, None] * B.transpose(1, 2)[:, None, :, :].float() * hidden_states[:, :, :, None].float()
    readouts = C.transpose(1, 2)  # [batch, seq, state]

    def step(state, position):
        decay, inflow, readout = position
        state = decay * state + inflow
        return state, torch.matmul(state.to(input_dtype), readout.unsqueeze(-1))[..., 0]

    start = decays.new_zeros(decays.shape[0], decays.shape[1], decays.shape[3])
    last_state, outputs = scan(step, start, (decays.movedim(2, 0), inflows.movedim(2, 0), readouts.movedim(1, 0)))
    output = outputs.movedim(0, -1)  # [batch, channels, seq]
    if D is not None:
        output = output + hidden_states * D[None, :, None]
    if z is not None:
        output = output * F.silu(z)
    return (output, last_state) if return_last_state else output


@contextlib.contextmanager
def selective_scans_as_scans():
    """While exporting, every loaded transformers module's `mamba_selective_scan` is `selective_scan`
    (the module's docstring says why); each module's own is restored after."""
    own = {module: vars(module)[_SELECTIVE_SCAN] for name, module in list(sys.modules.items())
           if name.startswith("transformers.models.") and callable(vars(module).get(_SELECTIVE_SCAN))}
    for module in own:
        setattr(module, _SELECTIVE_SCAN, selective_scan)
    try:
        yield
    finally:
        for module, function in own.items():
            setattr(module, _SELECTIVE_SCAN, function)
