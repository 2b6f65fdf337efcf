"""Peak resident memory of a conversion's stages, read from Linux's /proc while they run.

A thread samples the process's resident memory every SAMPLE_SECONDS (RssAnon: heap and arrays;
RssFile: memory-mapped files such as the weights and libraries; RssShmem) and its child processes'
(the TPU compilers, TensorFlow, the sharded verification: /proc/<pid>/status VmRSS). Each open
window (a stage) keeps the largest figures seen while it is open. The process's high-water mark
(VmHWM) catches a peak between two samples: when it rose during a window, the window's peak is at
least the new mark. Nothing is reset (a conversion leaves the user's process as it found it, so
/proc/self/clear_refs is never written), hence no mark for a window that did not raise it.

Children are sampled, not read from getrusage(RUSAGE_CHILDREN): Linux carries the parent's
high-water mark at fork into a child's ru_maxrss (measured: a `python -c pass` child of a process
that had touched 300 MB reported 321 MB), so it says how large the converting process once was,
not its children.
Where /proc cannot be read (not Linux), every figure is None, which a report prints as "unknown".

A conversion's memory budget (MemoryBudget, `--memory-budget GB`) bounds what the converting process
may hold: verification sizes its optional runs by what is left of it (verify/sizes.py), and weights
read into memory that alone exceed it are refused before they are read (export/sources.py).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import os
import pathlib
import threading

from tpuexport.errors import TpuExportError

# How often the thread samples the process and its children. Measured with two children: 4 % of a
# core at 10 ms (a conversion's own work competes with it on a 2-core runner), 1 % at 50 ms; the
# process's high-water mark (VmHWM) still catches a peak between two samples.
SAMPLE_SECONDS = 0.05
# How often it looks for new child processes (their own memory is sampled every SAMPLE_SECONDS).
CHILD_SCAN_SECONDS = 0.2
# What a report prints for a figure that cannot be read.
UNKNOWN = "unknown"

# The default memory budget: what the process holds when the conversion starts plus this share of what
# the machine has available then (/proc/meminfo MemAvailable). The quarter left is for what the
# budget does not count: the TPU compilers' and TensorFlow's child processes (0.5-1.4 GiB each,
# measured: docs/checkpoints-and-plans.md), the page cache of the artifact being written, and the
# other processes of a shared runner, whose memory moves during a conversion of minutes.
DEFAULT_BUDGET_FRACTION = 0.75

_STATUS = pathlib.Path("/proc/self/status")
_MEMINFO = pathlib.Path("/proc/meminfo")
_STATUS_FIELDS = ("RssAnon", "RssFile", "RssShmem", "VmHWM")


@dataclasses.dataclass(frozen=True)
class PeakMemory:
    """The largest resident memory seen during a stage, in bytes; None where it cannot be read.

    Attributes:
      anonymous_bytes: the process's largest anonymous resident memory (RssAnon: arrays, tensors, heap).
      mapped_bytes: its largest file-backed resident memory (RssFile: memory-mapped weights files,
        shared libraries).
      process_bytes: its largest total resident memory at one moment (anonymous + mapped + shared),
        or its high-water mark when that rose during the stage.
      child_bytes: the largest resident memory of one child process during the stage (TPU
        compilers, TensorFlow, sharded verification; within `kept_compilers()`, kept compiler
        processes, idle ones included); 0 when none ran.
    """

    anonymous_bytes: int | None
    mapped_bytes: int | None
    process_bytes: int | None
    child_bytes: int | None

    def to_json(self) -> dict:
        return {field.name: UNKNOWN if value is None else value for field, value in
                zip(dataclasses.fields(self), dataclasses.astuple(self))}

    @classmethod
    def from_json(cls, data: dict) -> "PeakMemory":
        return cls(*(None if data.get(field.name, UNKNOWN) == UNKNOWN else int(data[field.name]) for field in dataclasses.fields(cls)))


UNKNOWN_PEAK = PeakMemory(None, None, None, None)


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """What a conversion's process may hold in memory.

    Attributes:
      bytes: the budget, or None when it is unknown (no --memory-budget, and /proc/meminfo cannot
        be read): verification then keeps its fixed per-run bounds (verify/sizes.py).
      source: how it was chosen: "--memory-budget", or the default's figures.
    """

    bytes: int | None
    source: str

    def describe(self) -> str:
        """"12 GB (--memory-budget)" in the unit --memory-budget takes (10^9 bytes), "unknown (...)"."""
        return f"{UNKNOWN if self.bytes is None else f'{self.bytes / 1e9:.3g} GB'} ({self.source})"

    def to_json(self) -> dict:
        return {"bytes": UNKNOWN if self.bytes is None else self.bytes, "source": self.source}


def memory_budget(gigabytes: float | str | None = None) -> MemoryBudget:
    """The budget `--memory-budget GB` gives (GB = 10^9 bytes), or the default when None: the
    process's resident memory now plus DEFAULT_BUDGET_FRACTION of MemAvailable, unknown where
    /proc/meminfo cannot be read.

    Raises:
      TpuExportError: a value that is not a positive number.
    """
    if gigabytes is None:
        available, held = _mem_available(), resident_bytes()
        if available is None:
            return MemoryBudget(None, "default, unknown: /proc/meminfo has no MemAvailable here")
        return MemoryBudget(int((held or 0) + DEFAULT_BUDGET_FRACTION * available),
                            f"default: {DEFAULT_BUDGET_FRACTION:g} of the {gib(available)} available at the start + the "
                            f"{gib(held or 0)} the process held")
    try:
        value = float(gigabytes)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise TpuExportError(f"--memory-budget {gigabytes} is not a positive number of GB; give one such as 12 or 7.5 "
                             "(or leave it out for the default, a share of the memory available)")
    return MemoryBudget(int(value * 1e9), "--memory-budget")


def resident_bytes() -> int | None:
    """The process's resident memory now (anonymous + mapped + shared), None where /proc cannot be read."""
    reading = _read_status()
    return None if reading is None else reading["RssAnon"] + reading["RssFile"] + reading["RssShmem"]


def return_freed_memory() -> None:
    """Gives the pages of the heap's freed blocks back to the system: glibc's malloc_trim(0), nothing
    where the C library has none.

    XLA:CPU's buffers of a few MiB come from the heap, whose freed pages glibc keeps for the next
    allocation of the same size rather than returning them. A verification case sized differently from
    the one before it cannot reuse them, so they add up: measured on the 1B text-generation
    conversion, anonymous memory rose from 2.65 to 4.18 GiB between two cases that each freed all they
    held. Trimming between stages and cases gives the next one back its room. It sets nothing (unlike
    mallopt or MALLOC_MMAP_THRESHOLD_, which would change the user's process for good).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def _mem_available(path: pathlib.Path = _MEMINFO) -> int | None:
    """The machine's MemAvailable (what can be allocated without swapping), None where it cannot be read."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def gib(count: int | None) -> str:
    """Bytes as "1.23 GiB", "unknown" for None."""
    return UNKNOWN if count is None else f"{count / 2**30:.2f} GiB"


def largest(peaks: dict[str, PeakMemory], figure: str) -> tuple[str, PeakMemory] | None:
    """The stage whose `figure` ("process_bytes", "child_bytes", ...) is the largest, with its
    figures, or None when no stage's is known."""
    known = [(name, peak) for name, peak in peaks.items() if getattr(peak, figure) is not None]
    return max(known, key=lambda item: getattr(item[1], figure)) if known else None


class _Window:
    """The largest figures seen while a stage is open."""

    def __init__(self, reading: dict, child_bytes: int):
        self.anonymous = self.mapped = self.process = self.child = 0
        self.start_hwm = reading["VmHWM"]
        self.add(reading, child_bytes)

    def add(self, reading: dict, child_bytes: int) -> None:
        self.anonymous = max(self.anonymous, reading["RssAnon"])
        self.mapped = max(self.mapped, reading["RssFile"])
        self.process = max(self.process, reading["RssAnon"] + reading["RssFile"] + reading["RssShmem"])
        self.child = max(self.child, child_bytes)

    def peak(self, reading: dict) -> PeakMemory:
        process = max(self.process, reading["VmHWM"]) if reading["VmHWM"] > self.start_hwm else self.process
        return PeakMemory(self.anonymous, self.mapped, process, self.child)


class MemoryMonitor:
    """Samples the process's and its children's resident memory while entered; `open()` starts a
    window and `close(window)` returns its PeakMemory (UNKNOWN_PEAK where /proc cannot be read).

    Args:
      interval: seconds between samples.
      status: the process's status file (/proc/self/status); where it cannot be read, nothing is
        sampled and every figure is unknown.
    """

    def __init__(self, interval: float = SAMPLE_SECONDS, status: pathlib.Path = _STATUS):
        self.interval = interval
        self.status = status
        self.readable = _read_status(status) is not None
        self.lock = threading.Lock()
        self.windows: dict[int, _Window] = {}
        self.next_window = 0
        self.children: set[int] = set()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> "MemoryMonitor":
        if self.readable:
            self.thread = threading.Thread(target=self._sample, name="tpuexport-memory", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()

    def open(self) -> int:
        """Starts a window; returns its id for `close`."""
        with self.lock:
            self.next_window += 1
            if self.readable:
                self.windows[self.next_window] = _Window(_read_status(self.status), self._largest_child())
            return self.next_window

    def close(self, window: int) -> PeakMemory:
        """Ends a window; its largest figures."""
        peak = self.peek(window)
        with self.lock:
            self.windows.pop(window, None)
        return peak

    def peek(self, window: int) -> PeakMemory:
        """A window's largest figures so far (it stays open)."""
        with self.lock:
            opened = self.windows.get(window)
            if opened is None:
                return UNKNOWN_PEAK
            reading, child = _read_status(self.status), self._largest_child()
            opened.add(reading, child)
            return opened.peak(reading)

    def _sample(self) -> None:
        scans_every = max(1, round(CHILD_SCAN_SECONDS / self.interval))
        count = 0
        while not self.stopped.wait(self.interval):
            if count % scans_every == 0:
                self.children = _child_pids()
            count += 1
            with self.lock:
                if not self.windows:
                    continue
                reading, child = _read_status(self.status), self._largest_child()
                for window in self.windows.values():
                    window.add(reading, child)

    def _largest_child(self) -> int:
        return max((_child_rss(pid) for pid in tuple(self.children)), default=0)


def _read_status(path: pathlib.Path = _STATUS) -> dict | None:
    """{field: bytes} of _STATUS_FIELDS from a /proc status file, or None when it cannot be read."""
    try:
        text = path.read_text()
    except OSError:
        return None
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name in _STATUS_FIELDS:
            fields[name] = int(value.split()[0]) * 1024
    return fields if len(fields) == len(_STATUS_FIELDS) else None


def _child_rss(pid: int) -> int:
    """A child's resident memory (VmRSS), 0 once it is gone."""
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _child_pids() -> set[int]:
    """The process's live children: every thread's /proc children list (a child belongs to the
    thread that started it, e.g. a compile job's), empty where the kernel does not list them."""
    pids = set()
    try:
        threads = os.listdir("/proc/self/task")
    except OSError:
        return pids
    for thread in threads:
        try:
            pids.update(int(pid) for pid in pathlib.Path(f"/proc/self/task/{thread}/children").read_text().split())
        except OSError:
            continue
    return pids
