"""What exporting recurrences as scans saves (docs/lowering.md#recurrent-layers): conversion seconds
and StableHLO size of a 2-layer bidirectional LSTM (forward, cpu target) and of a tiny Mamba
(text generation, its one prefill bucket the context), with the recurrence as one scan and, for
comparison, unrolled as torch.export traces the layers' own loops (tpuexport's scans turned off: only
a fixed length then exports).

    python benchmarks/studies/recurrent_scans.py                       # the table
    python benchmarks/studies/recurrent_scans.py --lengths 64 256 --unrolled-up-to 64

Per model, mode and length it prints the conversion's seconds (export to artifact, compiles
included, in one process keeping its compiler processes) and the bytes of the MLIR text of the
program's largest entry point.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import tempfile
import time


def lstm_model():
    import torch

    class Lstm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(32, 64, num_layers=2, bidirectional=True, batch_first=True)
            self.head = torch.nn.Linear(128, 8)

        def forward(self, x):
            return self.head(self.lstm(x)[0])

    torch.manual_seed(0)
    return Lstm().eval()


def convert(name: str, length: int, scanned: bool, out: pathlib.Path):
    import torch
    import transformers

    import tpuexport
    from tpuexport.export import capturing

    off = {} if scanned else {"recurrent_layers_as_scans": contextlib.nullcontext, "selective_scans_as_scans": contextlib.nullcontext}
    own = {attribute: getattr(capturing, attribute) for attribute in off}
    for attribute, replacement in off.items():
        setattr(capturing, attribute, replacement)
    try:
        if name == "lstm":
            dims = {0: torch.export.Dim("batch", min=1, max=4)}
            if scanned:  # unrolled, the layers' own loop fixes the length: seq static
                dims[1] = torch.export.Dim("seq", min=1, max=length)
            return tpuexport.convert(lstm_model(), (torch.randn(2, length, 32),), (dims,), target="cpu", out=out, saved_model=False,
                                     overwrite=True)
        torch.manual_seed(0)
        model = transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8))
        return tpuexport.convert(model.eval(), task="text-generation", max_context=length, max_batch=2, target="cpu", out=out,
                                 saved_model=False, overwrite=True, verify_new_tokens=4)
    finally:
        for attribute, function in own.items():
            setattr(capturing, attribute, function)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=["lstm", "mamba"], choices=["lstm", "mamba"])
    parser.add_argument("--lengths", nargs="*", type=int, default=[128, 2048])
    parser.add_argument("--unrolled-up-to", type=int, default=128, help="the longest length converted unrolled too (minutes each)")
    args = parser.parse_args()
    import tpuexport

    print("| model | mode | length | convert s | largest entry point's MLIR text bytes | verified |")
    print("|---|---|---|---|---|---|")
    with tpuexport.kept_compilers(), tempfile.TemporaryDirectory() as scratch:
        for name in args.models:
            for length in args.lengths:
                for scanned in (True, False) if length <= args.unrolled_up_to else (True,):
                    start = time.perf_counter()
                    artifact = convert(name, length, scanned, pathlib.Path(scratch) / f"{name}.tpu")
                    seconds = time.perf_counter() - start
                    largest = max(path.stat().st_size for path in artifact.path.glob("program/*/stablehlo.mlir"))
                    print(f"| {name} | {'scan' if scanned else 'unrolled'} | {length} | {seconds:.1f} | {largest:,} | "
                          f"{artifact.manifest['verification']['passed']} |", flush=True)


if __name__ == "__main__":
    main()
