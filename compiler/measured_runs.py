"""What runs measured, summed up for `rlc explain`: mean phase times and the highest memory peaks over runs.

A run too short to time is shown without times unless the user asked for its times (`required`); a damaged
metrics.jsonl is always an error, never hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rlc.compiler.calibrate import CalibrationError, measured_phases
from rlc.schemas.layout_file import MeasuredMemoryError, measured_memory
from rlc.schemas.metrics_file import MetricsError

__all__ = ["MeasuredRunsError", "measured_over_runs"]


class MeasuredRunsError(ValueError):
    """A run whose measurements cannot be shown; the message names the run and why."""


def measured_over_runs(
    runs: Sequence[Path], required: bool
) -> tuple[dict[str, float] | None, dict[str, dict[str, float]] | None]:
    """Mean phase times over `runs` (None when none could be timed) and each role's highest memory peak per phase
    (None when no run recorded one)."""
    times = []
    for run in runs:
        try:
            times.append(measured_phases(run))
        except (CalibrationError, MetricsError) as exc:
            if required or isinstance(exc, MetricsError):
                raise MeasuredRunsError(str(exc)) from None
    shown = {k: sum(r[k] for r in times if k in r) / len(times) for k in times[0]} if times else None
    return shown, _highest_memory(runs) or None


def _highest_memory(runs: Sequence[Path]) -> dict[str, dict[str, float]]:
    memory: dict[str, dict[str, float]] = {}
    for run in runs:
        try:
            measured = measured_memory(run)
        except MeasuredMemoryError:
            continue  # an older run, or one that stopped before its trainer was built: no memory to show
        for role, phases in measured.items():
            held = memory.setdefault(role, {})
            for phase, gib in phases.items():
                held[phase] = max(held.get(phase, 0.0), gib)
    return memory
