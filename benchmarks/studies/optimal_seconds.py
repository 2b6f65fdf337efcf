"""Where XLA's `optimal_seconds` goes negative: one program compiled scanned and unrolled for v5e,
with XLA's raw estimate, the number of internal ConcatBitcast calls in the compiled HLO, and the
figure the manifest records (raw + 1 s per call; None = unknown if still negative).

    python benchmarks/studies/optimal_seconds.py bert-base llama-base

Weights are not read (the program is lowered from their shapes), so full-size configs run in
about a minute each on two cores.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", default=["bert-base"], help="names from families.py (FAMILIES or BASE_FAMILIES)")
    options = parser.parse_args()

    import jax
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from families import BASE_FAMILIES, FAMILIES
    from tpuexport import export as export_stage
    from tpuexport import lower as lower_stage
    from tpuexport.compile.compile_child import NEGATIVE_SECOND_CALLS, optimal_seconds
    from tpuexport.export import LoadedSource, SourceInfo

    topology = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu", chips_per_host_bounds=(1, 1, 1))
    device = SingleDeviceSharding(topology.devices[0])
    print("| model | layers | XLA optimal_seconds (raw) | ConcatBitcast calls | raw + calls | recorded |")
    print("|---|---|---|---|---|---|")
    for name in options.families:
        built = {**FAMILIES, **BASE_FAMILIES}[name].build()
        captured = export_stage.capture(LoadedSource(built["model"], built["args"], built["dynamic_shapes"], None, SourceInfo("api")))
        for scan in (True, False):
            lowered = lower_stage.lower(captured.program, captured.signature, scan=scan, weights=False)
            weights = [jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=device) for spec in lowered.weight_specs]
            avals = lowered.exported.in_avals[len(weights):]
            inputs = [jax.ShapeDtypeStruct(tuple(t.shape), aval.dtype, sharding=device) for t, aval in zip(captured.example_inputs, avals)]
            compiled = jax.jit(lowered.exported.call).trace(weights, inputs).lower().compile()
            text = compiled.as_text()
            analysis = compiled.cost_analysis() or {}
            raw = float(analysis.get("optimal_seconds", float("nan")))
            calls = sum(text.count(call) for call in NEGATIVE_SECOND_CALLS)
            recorded = optimal_seconds(analysis, text)
            print(f"| {name} | {'scanned' if scan else 'unrolled'} | {raw:.6g} | {calls} | {raw + calls:.6g} | "
                  f"{'unknown' if recorded is None else f'{recorded:.6g}'} |", flush=True)


if __name__ == "__main__":
    main()
