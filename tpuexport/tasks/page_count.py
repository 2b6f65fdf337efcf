"""The default `--num-pages` of a paged cache, per target: as many pages as its HBM per device holds.

The step's page count is a dim of the exported program (export/paged.py, "pages"): verification runs
it on CPU at the spec's small count (max batch rows of max context), and each TPU target's executables
are compiled at that target's own count, found here in the target's compile thread before its
executables compile. The largest step bucket is compiled at the small count first; the rest of the
device's HBM, at the bytes a page takes there (XLA's aliased cache bytes: the TPU pads a page's lanes),
gives a first count. Its compile is the check: XLA's temporaries are not independent of the count
(the tiny Llama of tests/test_paged.py on v5e: 1.5 MiB of temporaries up to 16384 pages, then
about twice the cache, as XLA stops updating the cache in place), so a count that does not fit is
narrowed by regula falsi between the largest count that fitted and the smallest that did not, a few
compiles at most. The count kept always fitted when compiled. CPU targets (and CPU twins) keep the
small count: the cache is allocated in the host's memory.
"""

from __future__ import annotations

import dataclasses
import threading

from tpuexport.compile.aot import EntryPointCompile, at_sizes, compile_target
from tpuexport.errors import TpuExportError
from tpuexport.export.cache_specs import PAGES_DIM, PagedSpec, max_pages

# Compiles of the largest bucket per target, the first included; the count stops within 1% of the fit.
MAX_PROBES = 6
CLOSE_ENOUGH = 0.01


@dataclasses.dataclass(frozen=True)
class SizedPages:
    """A target's page count and what sized it (per device of a slice).

    Attributes:
      num_pages: the pages its executables take.
      page_bytes: bytes a page takes on the device (its share of the page, on a slice).
      other_bytes: the largest bucket's bytes beside the cache at num_pages (weights, temporaries,
        outputs, code): `total_bytes` less the cache.
      temp_bytes: the largest bucket's temporaries at num_pages.
      total_bytes, hbm_bytes: the largest bucket's bytes at num_pages, and the device's HBM.
      probes: [[pages, total bytes or None (XLA refused it)], ...] compiled, in order.
      bucket: the bucket probed (the largest tokens x rows).
    """

    num_pages: int
    page_bytes: int
    other_bytes: int
    temp_bytes: int
    total_bytes: int
    hbm_bytes: int
    probes: tuple[tuple[int, int | None], ...]
    bucket: str

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "probes": [list(probe) for probe in self.probes]}


class PageSizing:
    """CompileJob's `target_sizes` for a paged program whose page count was not given: {"pages": N} for
    a TPU target (its HBM's count), {} for a CPU one (the spec's). Results are kept per target (a
    compile environment's thread reuses its target's).

    Attributes:
      sized: {target name: SizedPages}.
    """

    def __init__(self, spec: PagedSpec, step: EntryPointCompile):
        self.spec = spec
        largest = max(step.buckets, key=lambda bucket: (bucket.as_dict().get("tokens", 0), bucket.as_dict().get("rows", 0)))
        self.probe_entry = dataclasses.replace(step, buckets=[largest], on_compiled=None, kernels=None)
        self.sized: dict[str, SizedPages] = {}
        self.locks: dict[str, threading.Lock] = {}
        self.lock = threading.Lock()

    def __call__(self, target, job=None) -> dict[str, int]:
        if target.platform != "tpu":
            return {}
        with self.lock:
            lock = self.locks.setdefault(target.name, threading.Lock())
        with lock:
            if target.name not in self.sized:
                self.sized[target.name] = self._size(target, job)
        return {PAGES_DIM: self.sized[target.name].num_pages}

    def _probe(self, target, job, pages: int):
        """The largest bucket's memory at `pages` on `target`, or None when XLA refuses it (out of HBM)."""
        entry = at_sizes(self.probe_entry, {PAGES_DIM: pages})
        try:
            (result,) = compile_target({"step": entry}, target, job)["step"]
        except TpuExportError as error:
            if "does not fit in HBM" in str(error):
                return None
            raise
        return result.memory

    def _size(self, target, job) -> SizedPages:
        hbm, small = target.hbm_bytes_per_device, self.spec.num_pages
        memory = self._probe(target, job, small)
        probes = [(small, memory and memory["total_bytes"])]
        if memory is None or memory["total_bytes"] > hbm:  # not even the small count: the compile stage says so
            return self._sized(small, memory or {}, hbm, probes)
        page_bytes = max(1, memory["alias_bytes"] // small)
        fit, fit_memory = small, memory
        over, over_total = None, None
        guess = min(small + (hbm - memory["total_bytes"]) // page_bytes, max_pages(self.spec.page_size))
        while len(probes) < MAX_PROBES and guess > fit and (over is None or over - fit > CLOSE_ENOUGH * fit):
            memory = self._probe(target, job, guess)
            probes.append((guess, memory and memory["total_bytes"]))
            if memory is not None and memory["total_bytes"] <= hbm:
                fit, fit_memory = guess, memory
                if over is None:  # the first guess fitted: nothing grew with the count
                    break
            else:
                over, over_total = guess, memory and memory["total_bytes"]
            if over_total is None:
                guess = (fit + over) // 2
            else:  # where the line through the largest fit and the smallest misfit reaches the HBM
                guess = fit + (hbm - fit_memory["total_bytes"]) * (over - fit) // (over_total - fit_memory["total_bytes"])
                guess = min(max(guess, fit + 1), over - 1)
        return self._sized(fit, fit_memory, hbm, probes, page_bytes)

    def _sized(self, pages: int, memory: dict, hbm: int, probes: list, page_bytes: int = 0) -> SizedPages:
        total = memory.get("total_bytes", 0)
        return SizedPages(pages, page_bytes, total - memory.get("alias_bytes", 0), memory.get("temp_bytes", 0), total, hbm,
                          tuple(probes), self.probe_entry.buckets[0].name.replace(f"_{PAGES_DIM}{self.spec.num_pages}", ""))


def describe_pages(target: str, figures: dict, verified_pages: int) -> str:
    """A target's pages and why, from its step bucket's `paged_step` record (tasks/generation.py)."""
    pages, sized = figures.get("num_pages", verified_pages), figures.get("num_pages_sized")
    if sized:
        return (f"{pages} pages (fit {target}'s HBM of {sized['hbm_bytes'] / 2**30:.1f} GiB per device beside the step's other "
                f"{sized['other_bytes'] / 2**30:.2f} GiB at bucket {sized['bucket']}, {sized['temp_bytes'] / 2**30:.2f} GiB of it "
                f"temporaries; {len(sized['probes'])} compile(s) to find it)")
    if pages != verified_pages:
        return f"{pages} pages"
    return f"{pages} pages (the verified count: --num-pages, or max batch rows of max context)"


def target_pages(manifest: dict) -> dict[str, str]:
    """A paged artifact's pages per target and why: {target: line} (empty for other artifacts)."""
    generation = manifest.get("generation", {})
    if generation.get("kind") != "paged":
        return {}
    lines = {}
    for name, target in manifest.get("targets", {}).items():
        figures = next((bucket["paged_step"] for bucket in target["buckets"] if "paged_step" in bucket), None)
        if figures is not None:
            lines[name] = describe_pages(name, figures, generation["num_pages"])
    return lines
