"""Weight bytes and SQNR of every example in float and in each int8 mode.

    python benchmarks/studies/quantize_sizes.py [--out OUT_DIR]

Converts examples/{mlp,cnn,transformer}.py for v5e (no SavedModel) as f32 and with
--quantize int8 / int8-dynamic / int8-weight-only (static int8 calibrated on the example's
"calibration" samples), and prints manifest program.weight_bytes, the ratio to the f32 artifact
and the output SQNR: PT2E modes from quantization/report.json (with the worst layer's), weight-only
from the manifest's quantization section (it writes no report file).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402
import tpuexport  # noqa: E402

MODES = (None, "int8", "int8-dynamic", "int8-weight-only")


def measure(name: str, mode: str | None, out_dir: pathlib.Path) -> dict:
    """Converts one example in one mode; returns weight bytes and (quantized) SQNR figures."""
    built = _common.build_example(name)
    artifact = tpuexport.convert(
        built["model"], built["args"], built["dynamic_shapes"], out=out_dir / f"{name}-{mode or 'f32'}.tpu",
        quantize=mode, calibration=built["calibration"] if mode else None, saved_model=False, overwrite=True,
    )
    row = {"weight_bytes": artifact.manifest["program"]["weight_bytes"]}
    if mode:
        section = artifact.manifest["quantization"]
        report = json.loads((artifact.path / section["report"]).read_text()) if "report" in section else section
        row["output_sqnr_db"] = {output["name"]: output["sqnr_db"] for output in report["outputs"]}
        layers = [layer["sqnr_db"] for layer in report.get("layers", []) if layer["sqnr_db"] is not None]
        row["worst_layer_sqnr_db"] = min(layers) if layers else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, help="where the artifacts are written (default: a new temporary directory)")
    out_dir = parser.parse_args().out or pathlib.Path(tempfile.mkdtemp(prefix="quantize_sizes-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"{'example':<12} {'mode':<17} {'weight bytes':>12} {'vs f32':>7}  output SQNR (dB)  worst layer (dB)")
    for name in ("mlp", "cnn", "transformer"):
        float_bytes = None
        for mode in MODES:
            row = measure(name, mode, out_dir)
            float_bytes = float_bytes or row["weight_bytes"]
            sqnr = ", ".join(f"{k} {v}" for k, v in row.get("output_sqnr_db", {}).items()) or "-"
            print(f"{name:<12} {mode or 'f32':<17} {row['weight_bytes']:>12,} {row['weight_bytes'] / float_bytes:>6.3f}x  "
                  f"{sqnr:<16} {row.get('worst_layer_sqnr_db', '-')}", flush=True)


if __name__ == "__main__":
    main()
