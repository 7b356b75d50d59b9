"""RUN/trace.json: when each generate request and each train step ran, to see rollout and training overlap.

The file is Chrome's trace-event format (a JSON array of complete events, ``"ph": "X"``, microseconds since
the run's controller started), which Perfetto (ui.perfetto.dev) and ``chrome://tracing`` open as a timeline:
one row per rollout engine with its generate requests, one row for the trainer with each step's batch
building, training and weight sync. The array is left open while the run writes it (both viewers accept
that), so a killed run leaves a readable file.

The same intervals give the step metric ``time/overlap_s``: how long, during the step's train-and-sync
window, at least one generate request was in flight. Synchronous runs (``max_staleness`` 0, colocated) show
about 0; asynchronous runs on separate resources show rollout running under training.
"""

from __future__ import annotations

import json
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any, TextIO

__all__ = ["TRACE_FILE", "StepTrace", "union_overlap"]

TRACE_FILE = "trace.json"
_TRAINER_ROW = "trainer"


def union_overlap(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Length of ``[start, end]`` covered by the union of ``intervals`` (each ``(begin, finish)``)."""
    covered, reach = 0.0, start
    for begin, finish in sorted(intervals):
        lo, hi = max(begin, reach), min(finish, end)
        if hi > lo:
            covered += hi - lo
            reach = hi
    return covered


class StepTrace:
    """Records request and trainer spans, writes them as trace events, and measures their overlap."""

    def __init__(self, run_dir: Path, start_step: int = 0) -> None:
        self.path = run_dir / TRACE_FILE
        self._origin = time.perf_counter()
        fresh = start_step == 0 or not self.path.exists()
        # A resumed run appends to the open array; its clock restarts at 0, so it gets its own process row.
        self._pid = 1 if fresh else 1 + start_step
        self._file: TextIO | None = self.path.open("w" if fresh else "a")
        if fresh:
            self._file.write("[\n")
        # In flight: key -> (submit time, span name, engine). A key is a request id or an agent session.
        self._submitted: dict[Hashable, tuple[float, str, int]] = {}
        self._done: list[tuple[float, float]] = []  # finished spans not yet older than a train window

    def submitted(self, key: Hashable, name: str, engine: int) -> None:
        self._submitted[key] = (time.perf_counter(), name, engine)

    def finished(self, key: Hashable, **args: Any) -> None:
        """A request or episode came back (or was lost with its engine): close its span."""
        if key not in self._submitted:
            return
        begin, name, engine = self._submitted.pop(key)
        end = time.perf_counter()
        self._done.append((begin, end))
        self._event(name, f"engine {engine}", begin, end, args)

    def trainer_span(self, name: str, begin: float, end: float, step: int) -> None:
        self._event(name, _TRAINER_ROW, begin, end, {"step": step})

    def overlap(self, begin: float, end: float) -> float:
        """Seconds of ``[begin, end]`` with a generate request in flight; forgets spans that ended before it."""
        spans = self._done + [(t, end) for t, _, _ in self._submitted.values()]
        self._done = [(b, e) for b, e in self._done if e > end]
        return union_overlap(spans, begin, end)

    def _event(self, name: str, row: str, begin: float, end: float, args: dict[str, Any]) -> None:
        if self._file is None:
            return
        event = {
            "name": name,
            "ph": "X",
            "pid": self._pid,
            "tid": row,
            "ts": round((begin - self._origin) * 1e6),
            "dur": max(round((end - begin) * 1e6), 1),
            "args": args,
        }
        self._file.write(json.dumps(event, sort_keys=True) + ",\n")
        self._file.flush()

    def close(self) -> None:
        """Close the trace; a full disk here is not reported again (the write that did not fit already raised)."""
        from rlc.runtime.checkpoint import close_log

        handle, self._file = self._file, None
        if handle is not None:
            close_log(handle)
