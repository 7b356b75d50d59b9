"""The run's metrics file (RUN/metrics.jsonl): one JSON object a line per step, read by `rlc report`,
`rlc calibrate` and `rlc explain --measured`.

The runtime writes it (`runtime.metrics.MetricsLogger`); every reader goes through `read_metrics_rows`, which
checks the values it is asked about and names the file, the line and the key of anything that is not a metrics
row, so a damaged file is a clear error rather than a wrong figure.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["MEASURED_BOUNDS", "STEP_BOUND", "Bound", "MetricsError", "read_metrics_rows"]


class MetricsError(ValueError):
    """A metrics.jsonl that is not what `rlc run` writes; the message names the file, the line and the key."""


@dataclass(frozen=True)
class Bound:
    """The range a measured value must be in: a finite number from `low` to `high`."""

    what: str
    low: float
    high: float

    def problem(self, value: Any) -> str | None:
        """Why `value` is not such a number, or None when it is."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return "not a number"
        try:
            number = float(value)
        except OverflowError:
            return "not a finite number"
        if not math.isfinite(number):
            return "not a finite number"
        if number < self.low:
            return f"below {self.low:g}"
        if number > self.high:
            return f"above {self.high:g}"
        return None


#: The shortest and the longest step (or phase of one) a measurement may claim, in seconds (about 11 days).
MIN_STEP_SECONDS, MAX_SECONDS = 1e-6, 1e6
#: The most tokens a step may claim to have trained on (or a mean response may claim to hold).
MAX_TOKENS = 1e12
#: A row's step number, wherever a row has one (every reader checks it).
STEP_BOUND: dict[str, Bound] = {"step": Bound("a step number", 0, 1e12)}
#: What calibrate and explain read from each row. A phase can take no time in a step (no wait for a rollout
#: the streaming pool already holds, no sync that step); the step itself cannot.
MEASURED_BOUNDS: dict[str, Bound] = {
    **STEP_BOUND,
    "time/step_s": Bound("a step time in seconds", MIN_STEP_SECONDS, MAX_SECONDS),
    "time/rollout_s": Bound("a time in seconds", 0, MAX_SECONDS),
    "time/train_s": Bound("a time in seconds", 0, MAX_SECONDS),
    "time/weight_sync_s": Bound("a time in seconds", 0, MAX_SECONDS),
    "train/tokens": Bound("a token count", 0, MAX_TOKENS),
    "response_len/mean": Bound("a token count", 0, MAX_TOKENS),
    "agent/turns": Bound("a number of model calls", 0, 1e6),
}


def read_metrics_rows(path: Path, bounds: Mapping[str, Bound] = STEP_BOUND) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl, one JSON object a line, each value of a key in `bounds` checked.

    Blank lines are skipped, and so is a last line that lacks its newline and does not parse: the partial
    write of a run that was killed. Anything else that is not such an object (a line in the middle that is
    not JSON, bytes that are not text, a number or a list), or a bounded key whose value is not a finite
    number in its range, is a MetricsError naming `path:line` and the key. Keys missing from a row are not
    errors (each reader skips the rows it cannot use).
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise MetricsError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    lines = data.split(b"\n")
    rows = []
    for number, raw in enumerate(lines, start=1):
        where = f"{path}:{number}"
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise MetricsError(f"{where}: not UTF-8 text (metrics.jsonl holds one JSON object a line)") from None
        if not text:
            continue
        try:
            row = json.loads(text)
        except (ValueError, RecursionError) as exc:
            if number == len(lines) and text.startswith("{"):
                continue  # the last line of a run killed mid-write: the steps before it are whole
            reason = f"column {exc.colno}: {exc.msg}" if isinstance(exc, json.JSONDecodeError) else exc
            raise MetricsError(f"{where}: not JSON ({reason})") from None
        if not isinstance(row, dict):
            raise MetricsError(f"{where}: {_shown(row)} is not a JSON object of metrics")
        for key, bound in bounds.items():
            if key in row and (problem := bound.problem(row[key])) is not None:
                raise MetricsError(
                    f"{where}: {json.dumps(key)} is {_shown(row[key])}, {problem} "
                    f"({bound.what} is a number from {bound.low:g} to {bound.high:g})"
                )
        rows.append(row)
    return rows


def _shown(value: Any) -> str:
    """A JSON value as the file spells it, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
