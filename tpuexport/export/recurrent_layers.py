"""torch's recurrent layers (nn.LSTM, nn.GRU, nn.RNN) exported as one scan over the sequence.

Their own forward (`aten.lstm`, ...) is a loop over the time steps in C++, which torch.export
unrolls at the example's length: a dim declared dynamic is fixed ("the model's code fixes seq at
8": Parakeet's RNN-T decoder), and a long sequence makes a program of thousands of ops (EnCodec).
While exporting, each such layer instead runs the same recurrence with `torch._higher_order_ops.scan`,
which torch.export keeps as one op over a symbolic length and tpuexport lowers to `jax.lax.scan`
(lower/control_flow.py). The gate equations and weight layouts are torch's, as documented for each
layer; eagerly (the reference verification compares with) the layer runs as before.

Packed sequences and layers in training mode (dropout between layers) keep the layer's own forward.
"""

from __future__ import annotations

import contextlib

import torch
from torch._higher_order_ops.scan import scan


def _lstm_cell(gates: torch.Tensor, state: tuple[torch.Tensor, ...], weights: dict[str, torch.Tensor]):
    """One LSTM step from the summed input and hidden projections: gates i, f, g, o; h = o * tanh(c),
    projected by weight_hr when proj_size is set."""
    hidden, cell = state
    input_gate, forget_gate, cell_gate, output_gate = gates.chunk(4, -1)
    cell = torch.sigmoid(forget_gate) * cell + torch.sigmoid(input_gate) * torch.tanh(cell_gate)
    hidden = torch.sigmoid(output_gate) * torch.tanh(cell)
    if "weight_hr" in weights:
        hidden = hidden @ weights["weight_hr"].t()
    return hidden, (hidden, cell)


def _step(mode: str, weights: dict[str, torch.Tensor], projected_input: torch.Tensor, state: tuple[torch.Tensor, ...]):
    """One time step of one direction of one layer: (its output, its next state)."""
    hidden = state[0]
    recurrent = hidden @ weights["weight_hh"].t()
    if "bias_hh" in weights:
        recurrent = recurrent + weights["bias_hh"]
    if mode == "LSTM":
        return _lstm_cell(projected_input + recurrent, state, weights)
    if mode == "GRU":  # gates r, z, n; the reset gate scales the recurrent part of n (bias included)
        input_reset, input_update, input_new = projected_input.chunk(3, -1)
        recurrent_reset, recurrent_update, recurrent_new = recurrent.chunk(3, -1)
        reset = torch.sigmoid(input_reset + recurrent_reset)
        update = torch.sigmoid(input_update + recurrent_update)
        new = torch.tanh(input_new + reset * recurrent_new)
        hidden = (1 - update) * new + update * hidden
        return hidden, (hidden,)
    activation = torch.tanh if mode == "RNN_TANH" else torch.relu
    hidden = activation(projected_input + recurrent)
    return hidden, (hidden,)


def _direction(layer, index: int, reverse: bool, inputs: torch.Tensor, state: tuple[torch.Tensor, ...]):
    """One direction of one layer over inputs [seq, batch, features]: (outputs [seq, batch, out], final state)."""
    suffix = f"_l{index}" + ("_reverse" if reverse else "")
    projected = inputs @ getattr(layer, "weight_ih" + suffix).t()  # the input projection, for every step at once
    if layer.bias:
        projected = projected + getattr(layer, "bias_ih" + suffix)
    # The weights each step reads, copied: a scan takes no two inputs that share memory, which the
    # layer's weights may (views of one flat buffer; a checkpoint's, on the meta device).
    weights = {name: getattr(layer, name + suffix).clone() for name in ("weight_hh", "bias_hh", "weight_hr")
               if hasattr(layer, name + suffix)}

    def combine(carry, projected_input):
        output, next_state = _step(layer.mode, weights, projected_input, tuple(carry))
        return list(next_state), output.clone()  # scan's outputs may not alias its carry

    final, outputs = scan(combine, list(state), projected, reverse=reverse)
    return outputs, tuple(final)


def _recurrent_forward(layer, input, hx=None):
    """nn.LSTM / nn.GRU / nn.RNN's forward (same arguments, same results) as scans over the sequence."""
    batched = input.dim() == 3
    inputs = input if batched else input.unsqueeze(1)
    if batched and layer.batch_first:
        inputs = inputs.transpose(0, 1)
    directions = 2 if layer.bidirectional else 1
    batch = inputs.shape[1]
    out_size = layer.proj_size if layer.proj_size > 0 else layer.hidden_size
    if hx is None:
        states = [inputs.new_zeros(layer.num_layers * directions, batch, out_size)]
        if layer.mode == "LSTM":
            states.append(inputs.new_zeros(layer.num_layers * directions, batch, layer.hidden_size))
    else:
        states = list(hx) if layer.mode == "LSTM" else [hx]
        states = [state if batched else state.unsqueeze(1) for state in states]
    finals = []  # per (layer, direction): its final state
    for index in range(layer.num_layers):
        outputs = []
        for direction in range(directions):
            at = index * directions + direction
            output, final = _direction(layer, index, direction == 1, inputs, tuple(state[at] for state in states))
            outputs.append(output)
            finals.append(final)
        inputs = torch.cat(outputs, -1) if directions == 2 else outputs[0]
    output = inputs.transpose(0, 1) if batched and layer.batch_first else inputs
    final_states = [torch.stack([final[part] for final in finals]) for part in range(len(states))]
    if not batched:
        output, final_states = output.squeeze(1), [state.squeeze(1) for state in final_states]
    return output, (tuple(final_states) if layer.mode == "LSTM" else final_states[0])


def _as_scans(own_forward):
    """A recurrent layer class's forward that runs as scans, or as `own_forward` where it must."""

    def forward(layer, input, hx=None):
        if isinstance(input, torch.nn.utils.rnn.PackedSequence) or (layer.training and layer.dropout > 0):
            return own_forward(layer, input, hx)
        return _recurrent_forward(layer, input, hx)

    return forward


@contextlib.contextmanager
def recurrent_layers_as_scans():
    """While exporting, nn.LSTM, nn.GRU and nn.RNN (and their subclasses that keep their forward) run
    as scans over the sequence (the module's docstring says why); their own forward is restored after."""
    own = {cls: cls.forward for cls in (torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN)}
    for cls, forward in own.items():
        cls.forward = _as_scans(forward)
    try:
        yield
    finally:
        for cls, forward in own.items():
            cls.forward = forward
