"""Property-based fuzzing of conversions: random small models (benchmarks/fuzz_models.py) converted
and run at fresh sizes; prints the cases run, the outcomes, the refusals by reason, each failure
shrunk to a minimal model, and last `silent mismatches: K` (K must be 0).

    python benchmarks/fuzz.py --examples 200 [--seed 0] [--max-ops 5] [--no-shrink] [--log FILE]
    python benchmarks/fuzz.py --summarize FILE [FILE ...]   # the figures of logged runs, added up

Ctrl-C stops it at once, SIGTERM when the case running ends; either way it prints the figures of
the cases run so far (without shrinking).

A failure is a silent mismatch (verification passed, a fresh size does not match eager) or a crash
(a conversion raising anything but TpuExportError / VerificationError). Each is shrunk by
hypothesis to the smallest case failing the same way, printed as a `FuzzCase(...)` to paste into
tests/test_fuzz.py as a regression.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import signal
import threading
import time
import warnings

from hypothesis import HealthCheck, Phase, find, given, seed, settings

import _common  # noqa: F401  (the checkout first on sys.path)
import fuzz_models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=100, help="random models to convert")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-ops", type=int, default=5, help="ops per model at most")
    parser.add_argument("--no-shrink", action="store_true", help="report failures as drawn, without shrinking")
    parser.add_argument("--log", type=pathlib.Path, help="append one line per case here as it finishes")
    parser.add_argument("--summarize", type=pathlib.Path, nargs="+", metavar="LOG",
                        help="print the figures of these --log files (cases, outcomes by mode, refusals) and exit")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    warnings.filterwarnings("ignore")
    signal.signal(signal.SIGTERM, _stop)

    outcomes: collections.Counter = collections.Counter()
    reasons: collections.Counter = collections.Counter()
    failures: list[tuple[fuzz_models.FuzzCase, fuzz_models.Outcome]] = []
    verify_failed: list[tuple[fuzz_models.FuzzCase, fuzz_models.Outcome]] = []
    started = time.perf_counter()

    @seed(args.seed)
    @settings(max_examples=args.examples, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(fuzz_models.fuzz_cases(args.max_ops))
    def run_one(case):
        if _stop_requested.is_set():
            raise KeyboardInterrupt
        outcome = fuzz_models.check(case)
        outcomes[outcome.kind] += 1
        if outcome.kind == "refused":
            reasons[outcome.reason] += 1
        if outcome.kind in fuzz_models.FAILURES:
            failures.append((case, outcome))
        if outcome.kind == "verify-failed":
            verify_failed.append((case, outcome))
        if args.log:
            with open(args.log, "a") as log:
                failed = f"\t{case!r}\t{' '.join(outcome.detail.split())[-600:]}" if outcome.kind in fuzz_models.FAILURES else ""
                log.write(f"{sum(outcomes.values())}\t{outcome.kind}\t{outcome.reason}\t{case.describe()}{failed}\n")

    interrupted = False
    try:
        run_one()
    except KeyboardInterrupt:
        interrupted = True
    seconds = time.perf_counter() - started
    total = sum(outcomes.values())
    print(f"cases run: {total} in {seconds:.0f} s ({seconds / max(total, 1):.1f} s each){' (interrupted)' if interrupted else ''}")
    for kind in fuzz_models.OUTCOMES:
        print(f"  {kind:16s} {outcomes[kind]}")
    print("refusals by reason:")
    for reason, count in reasons.most_common():
        print(f"  {count:5d}  {reason}")
    for case, outcome in verify_failed:
        print(f"verification refused: {case.describe()}\n    {outcome.detail[:400]}")
    for case, outcome in failures:
        print(f"FAILURE {outcome.kind} ({outcome.reason}): {case.describe()}\n    {outcome.detail[-1500:]}")
        if not (args.no_shrink or interrupted):
            same = lambda candidate: fuzz_models.check(candidate).kind == outcome.kind  # noqa: E731
            smallest = find(fuzz_models.fuzz_cases(args.max_ops), same,
                            settings=settings(max_examples=200, database=None, deadline=None, suppress_health_check=list(HealthCheck)))
            print(f"  shrunk to: {smallest!r}")
    print(f"silent mismatches: {outcomes['silent-mismatch']}")


_stop_requested = threading.Event()


def summarize(logs: list[pathlib.Path], group=None, group_label: str = "mode") -> None:
    """Prints the figures of logged runs added up: cases, outcomes overall and by group (the case's
    mode unless `group` maps a logged description to another), refusals by reason, each failure's
    line, and last `silent mismatches: K`. fuzz_generation.py's logs are read the same way."""
    group = group or _mode
    outcomes: collections.Counter = collections.Counter()
    reasons: collections.Counter = collections.Counter()
    by_group: collections.Counter = collections.Counter()
    failures = []
    for log in logs:
        for line in log.read_text().splitlines():
            _, kind, reason, description, *failed = line.split("\t")
            outcomes[kind] += 1
            by_group[group(description), kind] += 1
            if kind == "refused":
                reasons[reason] += 1
            if any(failed):
                failures.append(line)
    print(f"cases run: {sum(outcomes.values())} (logs: {', '.join(str(log) for log in logs)})")
    for kind in fuzz_models.OUTCOMES:
        print(f"  {kind:16s} {outcomes[kind]}")
    print(f"by {group_label}:".ljust(20) + "".join(f"{kind:>16s}" for kind in fuzz_models.OUTCOMES))
    for name in sorted({name for name, _ in by_group}):
        print(f"  {name:18s}" + "".join(f"{by_group[name, kind]:16d}" for kind in fuzz_models.OUTCOMES))
    print("refusals by reason:")
    for reason, count in reasons.most_common():
        print(f"  {count:5d}  {reason}")
    for line in failures:
        print(f"FAILURE {line}")
    print(f"silent mismatches: {outcomes['silent-mismatch']}")


def _mode(description: str) -> str:
    """A logged case's mode: its quantize mode, "float (full)" for a full conversion, or "float"."""
    settings_field = next(field for field in description.split("] ")[-1].split() if "/" in field)
    parts = settings_field.split("/")
    if len(parts) > 2:
        return parts[2]
    return "float (full)" if " full" in description else "float"


def _stop(signum, frame):
    """SIGTERM (a background run ignores SIGINT) stops the run before its next case. Not by raising
    here: an exception raised by a signal handler that lands in a finalizer or a weakref callback
    is printed and ignored, and the run went on."""
    _stop_requested.set()


if __name__ == "__main__":
    main()
