"""Fuzz `rlc validate` + `rlc compile` in-process with many hostile specs and print what broke.

    .venv/bin/python scripts/fuzz_specs.py --count 10000 [--seed 0] [--limit 10]

The mutants are those of the CI fuzz test (`tests/spec_mutants.py`); this drives many more of them and
tallies outcomes: ok, findings (diagnostics), emit-refused, and the failures the goal is zero of:
exceptions (by type and site), hangs past `--limit` seconds, invariant breaks, and runs over 2 s.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from hypothesis import HealthCheck, Phase, given, seed, settings
from spec_mutants import mutated_specs, run_case

SLOW_S = 2.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=float, default=10.0, help="seconds after which a case counts as a hang")
    args = parser.parse_args()
    kinds: collections.Counter[str] = collections.Counter()
    failures: collections.Counter[str] = collections.Counter()
    examples: dict[str, str] = {}
    times: list[float] = []
    cpu_times: list[float] = []
    slow = 0
    slowest: list[tuple[float, str]] = [(0.0, "")]
    started = time.perf_counter()

    @seed(args.seed)
    @settings(
        max_examples=args.count,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(mutated_specs())
    def one(case: tuple[str, str | None, list[str]]) -> None:
        nonlocal slow
        text, target, overrides = case
        outcome = run_case(text, target, overrides, limit_s=args.limit)
        kinds[outcome.kind] += 1
        times.append(outcome.seconds)
        cpu_times.append(outcome.cpu_seconds)
        if outcome.seconds > slowest[0][0]:
            slowest[0] = (outcome.seconds, repr((outcome.kind, text[:400], target, overrides)))
        if outcome.seconds > SLOW_S:
            slow += 1
            failures[f"over {SLOW_S:g} s ({outcome.kind})"] += 1
        if outcome.kind in ("exception", "hang", "invariant"):
            signature = outcome.detail.split(": ", 1)[0] if outcome.kind != "invariant" else outcome.detail[:80]
            failures[f"{outcome.kind}: {signature}"] += 1
            examples.setdefault(f"{outcome.kind}: {signature}", repr((text[:300], target, overrides)))

    one()
    total = sum(kinds.values())
    wall = time.perf_counter() - started
    print(f"{total} mutants in {wall:.0f} s (seed {args.seed}, hang limit {args.limit:g} s)")
    for kind, count in sorted(kinds.items()):
        print(f"  {kind:13s} {count}")
    times.sort()
    p99 = times[int(0.99 * (len(times) - 1))] if times else 0.0
    print(f"  wall time per mutant: median {statistics.median(times):.3f} s, p99 {p99:.3f} s, max {times[-1]:.3f} s")
    print(f"  CPU time per mutant: max {max(cpu_times, default=0.0):.3f} s")
    print(f"  over {SLOW_S:g} s: {slow}")
    print(f"  slowest: {slowest[0][1][:600]}")
    uncaught = kinds["exception"] + kinds["hang"] + kinds["invariant"]
    print(f"uncaught: {uncaught}")
    for signature, count in failures.most_common():
        print(f"  {count:5d}  {signature}")
        if signature in examples:
            print(f"         e.g. {examples[signature][:400]}")
    return 1 if uncaught or slow else 0


if __name__ == "__main__":
    raise SystemExit(main())
