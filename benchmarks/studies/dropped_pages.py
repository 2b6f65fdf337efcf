"""What dropping a checkpoint's pages after each module's forward costs the eager reference (issue #36).

Writes a Llama-3-8B-shaped checkpoint with --layers layers (bf16, random weights), builds the model
with its parameters on that checkpoint's maps (as a conversion's eager reference from a checkpoint),
and times forwards at batch 2 x seq 16, alternating without and with the hooks that drop each module's
pages after its forward (tpuexport/export/mapped_pages.py), so that both see the same machine load. Each
timed forward follows an untimed one the same way: without the hooks it finds every page resident, with
them none (as every forward but a conversion's first):

    python benchmarks/studies/dropped_pages.py [--layers 4] [--repeats 3]

Printed per forward: seconds, and the checkpoint's resident bytes in the process after it (RssFile of
its maps, /proc/self/smaps). A forward with the hooks maps each page again from the page cache (a minor
fault per page or few); one without keeps the whole checkpoint resident.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import streamed_conversion  # noqa: E402  (the Llama shapes and the checkpoint writer)


def resident_bytes_of(directory: pathlib.Path) -> int:
    """The process's resident bytes of its maps of files in `directory` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            inside = len(fields) > 5 and fields[5].startswith(str(directory))
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()

    import torch

    import tpuexport
    from tpuexport.export import drop_pages_after_use, open_checkpoint, with_checkpoint_weights

    config = dict(streamed_conversion.LLAMA_3_8B, num_hidden_layers=options.layers)
    with tempfile.TemporaryDirectory(prefix="dropped-pages-") as work:
        directory = pathlib.Path(work)
        _, size = streamed_conversion.write_checkpoint(config, "bfloat16", directory)
        with tpuexport.parameters_on_meta():
            on_meta, _ = streamed_conversion.llama(config, "bfloat16")
        checkpoint = open_checkpoint(directory)
        model = with_checkpoint_weights(on_meta, checkpoint)
        input_ids = torch.randint(3, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
        print(f"Llama-3-8B shape, {options.layers} layers: checkpoint {size / 2**30:.2f} GiB (bf16); forward at batch 2 x seq 16; "
              f"load {open('/proc/loadavg').read().split()[0]}")
        seconds = {False: [], True: []}
        with torch.no_grad():
            for repeat in range(options.repeats):
                for hooked in (False, True):
                    handles = drop_pages_after_use([model], checkpoint) if hooked else []
                    model(input_ids)  # untimed: each way's steady state (all pages resident, or none at the start)
                    start = time.perf_counter()
                    model(input_ids)
                    seconds[hooked].append(time.perf_counter() - start)
                    resident = resident_bytes_of(directory)
                    for handle in handles:
                        handle.remove()
                    print(f"  {'pages dropped' if hooked else 'kept         '}  {seconds[hooked][-1]:6.2f} s  checkpoint resident "
                          f"{resident / 2**30:5.2f} GiB")
        kept, dropped = (sorted(seconds[hooked])[len(seconds[hooked]) // 2] for hooked in (False, True))
        print(f"median forward: kept {kept:.2f} s, pages dropped {dropped:.2f} s ({dropped / kept - 1:+.0%})")


if __name__ == "__main__":
    main()
