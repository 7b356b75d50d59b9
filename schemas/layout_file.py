"""The run's layout file (RUN/layout.json): the plan's trainer layout, what each rank built, and predicted vs
measured peak memory per phase.

The runtime writes it once the trainer is built and again at the end (`rlc run`); `rlc explain` reads the peaks
back to set them beside the plan's estimate (the train-phase peak of the most loaded device). Pure JSON: no runtime
import on the compile path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rlc.schemas.plan import Plan

__all__ = ["LAYOUT_FILE", "MeasuredMemoryError", "layout_record", "measured_memory", "write_layout_record"]

LAYOUT_FILE = "layout.json"


def layout_record(plan: Plan, built: list[dict[str, Any]]) -> dict[str, Any]:
    """`RUN/layout.json`: the plan's layout, what each rank built, and predicted vs measured peak memory."""
    role = plan.roles_of("train")[0]
    assert role.layout is not None
    return {
        "role": role.name,
        "plan_layout": role.layout.model_dump(),
        "layout_summary": role.layout.summary(),
        "predicted_memory_gib": {"total": role.memory.total_gib, "items": role.memory.items},
        "ranks": built,
    }


def write_layout_record(run_dir: Path, plan: Plan, built: list[dict[str, Any]]) -> Path:
    """Write `layout_record` atomically (a reader never sees half a file)."""
    path = run_dir / LAYOUT_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(layout_record(plan, built), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


class MeasuredMemoryError(ValueError):
    """A run directory without a readable layout.json."""


def measured_memory(run_dir: Path) -> dict[str, dict[str, float]]:
    """{role: {phase: GiB}}: the highest peak over the role's ranks per phase (train, logprobs, sync, load)."""
    path = run_dir / LAYOUT_FILE
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
