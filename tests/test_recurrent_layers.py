"""torch's recurrent layers (nn.LSTM, nn.GRU, nn.RNN) over a dynamic sequence: torch.export unrolls
their own forward at the example's length, fixing the dim (Parakeet's RNN-T decoder: "the model's code
fixes decoder_seq at 8"); exported as scans they lower to one jax.lax.scan and verify against the
layers' own eager forward at every size."""

from __future__ import annotations

import torch
from torch import nn

import tpuexport
from tpuexport.export import LoadedSource, SourceInfo, capture
from tpuexport.lower import lower
from tpuexport.verify import verify

batch = torch.export.Dim("batch", min=1, max=4)
seq = torch.export.Dim("seq", min=1, max=48)


class RecurrentStack(nn.Module):
    """Every form the layers take: a 2-layer bidirectional LSTM with projections (batch first) from a
    given state, a GRU over [seq, batch, features], and a ReLU RNN over one unbatched sequence."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 8, num_layers=2, bidirectional=True, proj_size=5, batch_first=True)
        self.gru = nn.GRU(10, 7, num_layers=2)
        self.rnn = nn.RNN(7, 3, nonlinearity="relu")

    def forward(self, x):
        start = x.mean(1).tanh()[:, :5].unsqueeze(0).expand(4, -1, -1).contiguous()
        lstm_out, (hidden, cell) = self.lstm(x, (start, torch.zeros(4, x.shape[0], 8)))
        gru_out, gru_hidden = self.gru(lstm_out.transpose(0, 1))
        rnn_out, rnn_hidden = self.rnn(gru_out[:, 0])
        return lstm_out, hidden, cell, gru_out, gru_hidden, rnn_out, rnn_hidden


def test_recurrent_layers_keep_a_dynamic_sequence_and_match_their_eager_forward_at_every_size():
    torch.manual_seed(0)
    layers = (nn.LSTM.forward, nn.GRU.forward, nn.RNN.forward)
    model = capture(LoadedSource(RecurrentStack().eval(), (torch.randn(2, 9, 6),), {"x": {0: batch, 1: seq}}, None, SourceInfo("api")))
    assert (nn.LSTM.forward, nn.GRU.forward, nn.RNN.forward) == layers  # the layers' own forward, back after exporting
    lowered = lower(model.program, model.signature)
    report = verify(lowered, model.reference, model.example_inputs)
    assert report.passed, report.failure_summary()
    assert {case.sizes["seq"] for case in report.cases} >= {1, 48}
    x = torch.randn(3, 23, 6)
    with torch.no_grad():
        expected = model.reference(x)
    for name, out, want in zip([spec.name for spec in model.signature.outputs], lowered.run([x.numpy()]), expected):
        assert out.shape == tuple(want.shape), name
        torch.testing.assert_close(torch.from_numpy(out), want, atol=1e-5, rtol=1e-4, msg=name)


class LinearLstm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.lstm(x)[0])


def test_weight_only_int8_lstm_is_verified_against_its_rounded_weights(tmp_path):
    """The weight-only reference rounds the weights nn.LSTM hands torch as one list (torch._VF.lstm's
    flat weights), as the program does: the conversion verifies at the float tolerances."""
    torch.manual_seed(0)
    artifact = tpuexport.convert(LinearLstm().eval(), (torch.randn(2, 5, 16),), ({1: seq},), target="cpu", out=tmp_path / "lstm.tpu",
                                 quantize="int8-weight-only", saved_model=False)
    assert artifact.manifest["verification"]["passed"]
    assert "lstm.weight_ih_l0" in artifact.manifest["quantization"]["weights"]
