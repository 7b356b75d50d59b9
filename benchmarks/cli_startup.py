"""Start-up time of `rlc --help` and `rlc validate` against importing the compile path's libraries alone.

The compile path must stay light (no torch, ray, vllm or transformers), so `rlc --help` should cost little
more than `python -c "import pydantic, yaml, jinja2"`. Both are measured in the same run, alternating, and
the medians are printed with their ratio. Run: `python benchmarks/cli_startup.py [--runs N]`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "quickstart.yaml"

COMMANDS = {
    "baseline: import pydantic, yaml, jinja2": [sys.executable, "-c", "import pydantic, yaml, jinja2"],
    "rlc --help": [sys.executable, "-m", "rlc", "--help"],
    "rlc validate quickstart.yaml": [sys.executable, "-m", "rlc", "validate", str(EXAMPLE)],
}


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    samples: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for command in COMMANDS.values():  # warm the file cache once
        timed(command)
    for _ in range(args.runs):
        for name, command in COMMANDS.items():
            samples[name].append(timed(command))
    baseline = statistics.median(samples[next(iter(COMMANDS))])
    print(f"{'command':<40} {'median s':>9} {'ratio':>7}")
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"{name:<40} {median:>9.3f} {median / baseline:>7.2f}")


if __name__ == "__main__":
    main()
