"""RUN/trace.json and the overlap metric: spans are recorded as trace events and their overlap is measured."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rlc.runtime.trace import TRACE_FILE, StepTrace, union_overlap


@pytest.mark.parametrize(
    ("intervals", "window", "expected"),
    [
        ([], (0.0, 1.0), 0.0),
        ([(0.2, 0.4)], (0.0, 1.0), 0.2),
        ([(0.2, 0.6), (0.4, 0.8)], (0.0, 1.0), 0.6),  # overlapping requests count once
        ([(0.5, 0.6), (0.1, 0.3)], (0.0, 1.0), 0.3),  # any order
        ([(-1.0, 0.5), (0.9, 2.0)], (0.0, 1.0), 0.6),  # clipped to the window
        ([(0.0, 0.2)], (0.5, 1.0), 0.0),  # before the window
        ([(0.1, 0.9), (0.2, 0.3)], (0.0, 1.0), 0.8),  # nested
    ],
)
def test_union_overlap(intervals: list[tuple[float, float]], window: tuple[float, float], expected: float) -> None:
    assert union_overlap(intervals, *window) == pytest.approx(expected)


def _events(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.startswith("[\n")
    return json.loads(text.rstrip().rstrip(",") + "]")  # the open array, closed as a viewer does


def test_trace_records_spans_and_overlap(tmp_path: Path) -> None:
    trace = StepTrace(tmp_path)
    trace.submitted(0, "generate #0", 0)
    time.sleep(0.02)
    begin = time.perf_counter()
    time.sleep(0.02)
    trace.finished(0, prompts=4)
    trace.submitted(1, "generate #1", 1)  # still in flight when the window ends: counted up to its end
    time.sleep(0.02)
    end = time.perf_counter()
    trace.trainer_span("train", begin, end, 1)
    covered = trace.overlap(begin, end)
    assert covered == pytest.approx(end - begin, abs=2e-3)
    assert trace.overlap(end + 1.0, end + 2.0) == pytest.approx(1.0, abs=1e-6)  # request 1 never finished
    trace.close()

    events = _events(tmp_path / TRACE_FILE)
    assert [e["name"] for e in events] == ["generate #0", "train"]
    gen, train = events
    assert gen["tid"] == "engine 0" and gen["args"] == {"prompts": 4} and gen["ph"] == "X"
    assert train["tid"] == "trainer" and train["args"] == {"step": 1}
    assert gen["dur"] >= 35_000 and gen["ts"] >= 0  # microseconds


def test_a_resumed_run_appends_under_its_own_process_row(tmp_path: Path) -> None:
    first = StepTrace(tmp_path)
    first.trainer_span("train", time.perf_counter(), time.perf_counter(), 1)
    first.close()
    resumed = StepTrace(tmp_path, start_step=5)
    resumed.trainer_span("train", time.perf_counter(), time.perf_counter(), 6)
    resumed.close()
    events = _events(tmp_path / TRACE_FILE)
    assert [(e["pid"], e["args"]["step"]) for e in events] == [(1, 1), (6, 6)]
    fresh = StepTrace(tmp_path)  # a new run from step 0 starts the file again
    fresh.close()
    assert _events(tmp_path / TRACE_FILE) == []


def test_finishing_an_unknown_key_is_ignored(tmp_path: Path) -> None:
    trace = StepTrace(tmp_path)
    trace.finished("never-submitted")
    trace.close()
    assert _events(tmp_path / TRACE_FILE) == []
