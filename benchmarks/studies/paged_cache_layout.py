"""Why a paged step's temporaries grow with its page count on a TPU: the cache's layout in the compiled step.

Plans a tiny Llama's paged step (meta weights, no verification) and compiles its one bucket for a TPU
target at each page count given, then prints, per count: the cache argument's layout as XLA compiled
it, the copies of the whole cache (`copy` instructions of its shape), and the executable's temporaries
and bytes accessed; `--dump DIR` keeps the compiled HLO. Two causes seen in session 19 (v5e):
- lanes narrower than 128 (the tiny default: 2 kv heads x 2 x 16): the cache argument's TPU layout puts
  pages minor ({1,3,2,0}), the write wants them major, and XLA copies the whole cache in and back out
  every step; the temporaries jump once those copies no longer fit in VMEM (16384 -> 32768 pages);
- Llama-3.2-1B's lanes (8 kv heads x 2 x 64, bf16, pages of 16): no layout copy, but one fusion slices
  every layer's cache out for the reads (`cache[layer]`) into a buffer of the cache's size, since the
  writes after the last layer may be scheduled before its reads: temporaries = the cache's bytes.

    python benchmarks/studies/paged_cache_layout.py --pages 16384,32768
    python benchmarks/studies/paged_cache_layout.py --pages 1024,8192 --kv-heads 8 --head-dim 64 --dtype bfloat16 --page-size 16
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tempfile

import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: _common
import _common  # noqa: E402

from tpuexport import compile as compile_stage  # noqa: E402
from tpuexport import export as export_stage  # noqa: E402
from tpuexport.compile.buckets import Bucket  # noqa: E402
from tpuexport.pipeline import ConversionOptions, passes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", default="16384,32768", help="page counts to compile at, comma-separated")
    parser.add_argument("--target", default="v5e")
    parser.add_argument("--page-size", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--dump", type=pathlib.Path, help="write each count's compiled HLO into this directory")
    args = parser.parse_args()
    heads = 2 * args.kv_heads
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=256, hidden_size=heads * args.head_dim, intermediate_size=2 * heads * args.head_dim, num_hidden_layers=2,
            num_attention_heads=heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim, max_position_embeddings=128,
        )).to(getattr(torch, args.dtype)).eval()
    options = ConversionOptions((args.target,), pathlib.Path(tempfile.mkdtemp()) / "step.tpu", buckets={"tokens": [8], "rows": [2]},
                                task="text-generation", max_context=64, max_batch=2, kv_cache="paged", page_size=args.page_size,
                                weights=False)
    with passes(export_stage.LoadedSource(model, None, None, None, export_stage.SourceInfo("api")), options, "lower") as conversion:
        step = conversion.program.entry_points["step"]
        [target] = compile_stage.resolve_targets([args.target])
        print(f"cache {[spec.shape for spec in step.signature.inputs if spec.name == 'cache_kv'][0]} {args.dtype}, {args.target}")
        for pages in map(int, args.pages.split(",")):
            [result] = compile_stage.compile_program(step, [target], [Bucket((("tokens", 8), ("rows", 2), ("pages", pages)))]).results
            cache = re.search(r"(\w+\[[\d,]*\]\{[^}]*\}) parameter\(\d+\), sharding=[^\n]*op_name=\"args\[1\]\[5\]\"", result.hlo_text)
            shape = re.escape(f",{pages},")
            copies = re.findall(rf"%copy[.\d]* = (\w+\[[\d,]*{shape}[\d,]*\]\{{[^}}]*\}}) copy\(", result.hlo_text)
            accessed = result.cost.get("bytes_accessed") or 0
            if args.dump:
                args.dump.mkdir(parents=True, exist_ok=True)
                (args.dump / f"step_{pages}.hlo").write_text(result.hlo_text)
            print(f"pages {pages}: cache argument {cache.group(1) if cache else 'unknown'}; whole-cache copies {len(copies)}: "
                  f"{', '.join(copies)}; temporaries {result.memory['temp_bytes'] / 2**20:.1f} MiB, cache (aliased) "
                  f"{result.memory['alias_bytes'] / 2**20:.1f} MiB, bytes accessed "
                  + (f"{accessed / 2**20:.1f} MiB" if accessed > 0 else "unknown"))


if __name__ == "__main__":
    main()
