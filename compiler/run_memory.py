"""What a run measured about memory, read back for `rlc explain`: RUN/layout.json's per-rank peaks.

The trainer writes the layout it built and each rank's peak memory per phase (see `runtime/launch.py`); the
plan's estimate is the train-phase peak of the most loaded device, so that is what is set beside it. Pure
JSON reading: no runtime import on the compile path.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["MeasuredMemoryError", "measured_memory"]


class MeasuredMemoryError(ValueError):
    """A run directory without a readable layout.json."""


def measured_memory(run_dir: Path) -> dict[str, dict[str, float]]:
    """{role: {phase: GiB}}: the highest peak over the role's ranks per phase (train, logprobs, sync, load)."""
    path = run_dir / "layout.json"
    try:
        record = json.loads(path.read_text())
        role = record["role"]
        peaks: dict[str, float] = {}
        for rank in record["ranks"]:
            for phase, gib in rank["memory"]["peak_gib"].items():
                peaks[phase] = max(peaks.get(phase, 0.0), float(gib))
    except FileNotFoundError:
        raise MeasuredMemoryError(f"{path} is missing: the run did not get as far as building its trainer") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise MeasuredMemoryError(f"{path} cannot be read: {exc}") from None
    return {role: {k: round(v, 4) for k, v in sorted(peaks.items())}}
