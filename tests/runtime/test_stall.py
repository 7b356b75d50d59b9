"""A run with work in flight and nothing finishing stops at the plan's bound and says what stalled."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlc.runtime.errors import RunError
from rlc.runtime.stall import StallError, StallWatch


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_bound_counts_from_the_last_progress() -> None:
    clock = Clock()
    watch = StallWatch(60.0, clock)
    clock.now += 59
    watch.check(lambda: "engine 0")
    watch.progress()
    clock.now += 59  # 118 s since the start, but 59 since something finished
    watch.check(lambda: "engine 0")
    clock.now += 2
    with pytest.raises(StallError, match=r"nothing finished for 61 s, past the plan's stall bound of 60 s.*engine 0"):
        watch.check(lambda: "engine 0: 1 generate request(s)")


def test_the_controller_names_the_requests_and_the_step_in_flight() -> None:
    import time
    from concurrent.futures import Future

    from loop_fixtures import fake_loop

    from rlc.runtime.controller import in_flight_text
    from rlc.runtime.workflows.generate import Chunk, GenerateWorkflow

    now = time.monotonic()
    wf = GenerateWorkflow(fake_loop(training=Future()))  # type: ignore[arg-type]
    wf.inflight = {"a": Chunk(0, [], submitted_s=now - 900), "b": Chunk(0, [], submitted_s=now - 5), "c": Chunk(1, [])}
    shown = in_flight_text(wf.in_flight(), step=6, training_since=now - 42)
    assert "engine 0: 2 generate request(s), the oldest 900 s" in shown
    assert "engine 1: 1 generate request(s)" in shown and "the trainer: step 7, 42 s" in shown


def test_a_stall_stops_the_run_with_a_resumable_message(tmp_path: Path) -> None:
    from rlc.runtime.launch import run_controller

    def stalled() -> int:
        raise StallError("nothing finished for 700 s, past the plan's stall bound of 600 s")

    with pytest.raises(RunError, match=r"stall bound of 600 s\. The run stopped: no checkpoint was completed"):
        run_controller(stalled, tmp_path)


def test_the_plan_states_the_bound_from_its_estimate() -> None:
    from rlc.compiler.schedule import STALL_FLOOR_S, stall_timeout_s

    assert stall_timeout_s(0.3, 1.5) == STALL_FLOOR_S  # a quickstart step: the floor
    assert stall_timeout_s(900.0, 1.5) == 13500.0  # ten of the slowest steps the estimate allows
    from rlc.schemas.plan import Schedule

    # The field's default keeps plans compiled before it readable.
    assert Schedule.model_fields["stall_timeout_s"].default == 1800.0


def test_a_checkpoint_that_never_finishes_stops_the_run_at_the_bound() -> None:
    from concurrent.futures import Future

    from rlc.runtime.controller import wait_checkpoint

    with pytest.raises(StallError, match="the checkpoint of step 12 did not finish within"):
        wait_checkpoint(Future(), limit_s=0.05, step=12)  # a write to a filesystem that never answers
