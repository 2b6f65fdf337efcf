"""Host memory while the runtime places a memory-mapped weight with a sharding plan (issue #37).

Writes one float32 weight of --gib GiB to a file, then in a fresh process per method (XLA_FLAGS
forcing --devices CPU devices) maps it read-only, as the runtime maps an artifact's weights file,
and places it split over a one-axis mesh, by rows and by columns:

    python benchmarks/studies/sharded_placement.py [--gib 1] [--devices 8]

  whole           jax.device_put(the mapped array, NamedSharding): what the runner did before
  shard-by-shard  the runner's placement (runtime/runner.py `_place`: make_array_from_callback,
                  each device given its slice of the mapping)

Printed per method: the anonymous memory (RssAnon, sampled every 2 ms) at its peak and once placed,
both above the process's before placing, against the file size and one device's share. On XLA:CPU
the devices' buffers are host memory, and a row shard of the mapping (contiguous, aligned) is used in
place without a copy; a column shard is copied, so "placed" is the model itself. What differs between
the methods is the peak above what is placed (on a TPU host the shards live in HBM and that peak is
the host's cost).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

CHILD = textwrap.dedent("""
    import json, sys, threading, time
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from tpuexport.runtime.runner import _place

    def anon():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon"))

    path, rows, columns, method, split = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    mapped = np.memmap(path, np.float32, "r", shape=(rows, columns))
    spec = PartitionSpec("model", None) if split == "rows" else PartitionSpec(None, "model")
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("model",)), spec)
    jax.device_put(np.zeros(8, np.float32)).block_until_ready()  # the backend started before measuring
    before, peak, running = anon(), [0], [True]

    def sample():
        while running[0]:
            peak[0] = max(peak[0], anon())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.perf_counter()
    placed = jax.device_put(mapped, sharding) if method == "whole" else _place(mapped, sharding)
    placed.block_until_ready()
    seconds = time.perf_counter() - start
    running[0] = False
    sampler.join()
    print(json.dumps({"peak": max(peak[0], anon()) - before, "placed": anon() - before, "seconds": seconds,
                      "shards": len(placed.addressable_shards)}))
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--devices", type=int, default=8)
    options = parser.parse_args()
    columns = 4096
    rows = int(options.gib * 2**30 / 4 / columns) // options.devices * options.devices
    size = rows * columns * 4
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={options.devices}"}
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "weight.bin")
        with open(path, "wb") as file:
            chunk = bytes(range(256)) * (2**20 // 256)
            for _ in range(size // len(chunk)):
                file.write(chunk)
            file.write(chunk[: size % len(chunk)])
        print(f"weight file {size / 2**30:.2f} GiB, [{rows}, {columns}] float32 over {options.devices} CPU devices "
              f"(one device's share {size / options.devices / 2**20:.0f} MiB)")
        for split in ("rows", "columns"):
            for method in ("whole", "shard-by-shard"):
                result = subprocess.run([sys.executable, "-c", CHILD, path, str(rows), str(columns), method, split], capture_output=True,
                                        text=True, env=env, check=True)
                figures = json.loads(result.stdout.splitlines()[-1])
                print(f"  by {split:7s} {method:15s} peak {figures['peak'] / 2**30:5.2f} GiB above start, placed {figures['placed'] / 2**30:5.2f} GiB, "
                      f"peak - placed {(figures['peak'] - figures['placed']) / 2**20:6.0f} MiB, {figures['seconds']:.2f} s, "
                      f"{figures['shards']} shards")


if __name__ == "__main__":
    main()
