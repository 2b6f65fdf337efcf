"""The pages a TPU target's HBM holds for the paged Llama-3.2-1B step (16 layers, bf16, context 4096, 8
rows, pages of 16; planned on meta weights): the count tpuexport sizes by compiling (tasks/page_count.py)
and its probes. Usage: python benchmarks/studies/paged_pages_sized.py [TARGET]  (v5e-8 by default;
a slice is tensor-parallel over model=N)."""
import json
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from paged_cache import CONTEXT, PAGE_SIZE, ROWS, meta_model  # noqa: E402
import tpuexport  # noqa: E402
target = sys.argv[1] if len(sys.argv) > 1 else "v5e-8"
start = time.perf_counter()
with tempfile.TemporaryDirectory() as scratch:
    sliced = dict(sharding="tensor-parallel", mesh=f"model={target.split('-')[1]}") if "-" in target else {}
    artifact = tpuexport.convert(meta_model(16), task="text-generation", max_context=CONTEXT, max_batch=ROWS, target=target, **sliced,
                                 buckets={"tokens": [8], "rows": [ROWS]}, precision="bf16", weights=False, kv_cache="paged",
                                 page_size=PAGE_SIZE, out=pathlib.Path(scratch) / "lm.tpu")
    m = artifact.manifest
print(f"{target}: {time.perf_counter() - start:.0f} s")
for bucket in m["targets"][target]["buckets"]:
    print(bucket["entry_point"], bucket["name"], bucket.get("sizes"), json.dumps(bucket["memory"]), json.dumps(bucket.get("paged_step"))[:1500])
