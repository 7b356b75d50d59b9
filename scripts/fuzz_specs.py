"""Fuzz `rlc validate` + `rlc compile` in-process with many hostile specs and print what broke.

    .venv/bin/python scripts/fuzz_specs.py --count 10000 [--seed 0] [--limit 10]
    .venv/bin/python scripts/fuzz_specs.py --cli 150      # the real `rlc` command, one process per call

The mutants are those of the CI fuzz test (`tests/spec_mutants.py`); this drives many more of them and
tallies outcomes: ok, findings (diagnostics), emit-refused, and the failures the goal is zero of:
exceptions (by type and site), hangs past `--limit` seconds, invariant breaks, and runs over 2 s of CPU
(wall-clock times are printed too; on a shared machine they also count other processes).
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
from spec_mutants import BASE_FILES, mutated_specs, run_case

SLOW_S = 2.0
BASE_TEXT = BASE_FILES[0].read_text()


def over_mutants(count: int, seed_value: int):  # type: ignore[no-untyped-def]
    """Decorate a one-case function to run on `count` generated mutants (no shrinking, no example database)."""

    def wrap(fn):  # type: ignore[no-untyped-def]
        configured = settings(
            max_examples=count,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        return seed(seed_value)(configured(given(mutated_specs())(fn)))

    return wrap


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=float, default=10.0, help="seconds after which a case counts as a hang")
    parser.add_argument("--cli", type=int, default=0, help="instead: this many mutants through the `rlc` CLI")
    args = parser.parse_args()
    if args.cli:
        return cli_sample(args.cli, args.seed)
    kinds: collections.Counter[str] = collections.Counter()
    failures: collections.Counter[str] = collections.Counter()
    examples: dict[str, str] = {}
    times: list[float] = []
    cpu_times: list[float] = []
    slow = 0
    slowest: list[tuple[float, str]] = [(0.0, "")]
    run_case(BASE_TEXT, None, [])  # one-time imports (templates, planner tables) are not a mutant's cost
    started = time.perf_counter()

    @over_mutants(args.count, args.seed)
    def one(case: tuple[str, str | None, list[str]]) -> None:
        nonlocal slow
        text, target, overrides = case
        outcome = run_case(text, target, overrides, limit_s=args.limit)
        kinds[outcome.kind] += 1
        times.append(outcome.seconds)
        cpu_times.append(outcome.cpu_seconds)
        if outcome.seconds > slowest[0][0]:
            slowest[0] = (outcome.seconds, repr((outcome.kind, text[:400], target, overrides)))
        if outcome.cpu_seconds > SLOW_S:  # CPU time: the wall clock also counts whatever else loads the machine
            slow += 1
            failures[f"over {SLOW_S:g} s of CPU ({outcome.kind})"] += 1
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
    print(f"  over {SLOW_S:g} s of CPU: {slow}")
    print(f"  slowest: {slowest[0][1][:600]}")
    uncaught = kinds["exception"] + kinds["hang"] + kinds["invariant"]
    print(f"uncaught: {uncaught}")
    for signature, count in failures.most_common():
        print(f"  {count:5d}  {signature}")
        if signature in examples:
            print(f"         e.g. {examples[signature][:400]}")
    return 1 if uncaught or slow else 0


def cli_sample(count: int, seed_value: int) -> int:
    """`rlc validate` and `rlc compile` as subprocesses: exit codes must be 0/1/2 and no traceback printed."""
    import subprocess
    import tempfile

    bad: list[str] = []
    calls = 0

    @over_mutants(count, seed_value)
    def one(case: tuple[str, str | None, list[str]]) -> None:
        nonlocal calls
        text, target, overrides = case
        extra = [f"--set={o}" for o in overrides if "\x00" not in o] + ([f"--target={target}"] if target else [])
        with tempfile.TemporaryDirectory() as work:
            spec = Path(work) / "spec.yaml"
            spec.write_text(text)
            for command in (["validate", str(spec)], ["compile", str(spec), "-o", str(Path(work) / "plan")]):
                calls += 1
                result = subprocess.run(
                    [sys.executable, "-m", "rlc", *command, *extra], capture_output=True, text=True, timeout=60
                )
                if result.returncode not in (0, 1, 2) or "Traceback" in result.stdout + result.stderr:
                    bad.append(f"{command[0]} rc={result.returncode}: {(result.stderr or result.stdout)[-300:]}")

    one()
    print(f"{calls} rlc calls on {count} mutants: {len(bad)} with an exit code outside 0/1/2 or a traceback")
    for line in bad[:10]:
        print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
