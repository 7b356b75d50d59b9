"""The run's metric sinks: what TensorBoard shows is what metrics.jsonl says, also across a resume."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlc.runtime.metrics import MetricsLogger


def _log_steps(run_dir: Path, steps: range, offset: float, start_step: int = 0) -> None:
    logger = MetricsLogger(run_dir, ["jsonl", "tensorboard"], total_steps=4, start_step=start_step)
    for step in steps:
        logger.log({"step": step, "reward/mean": step + offset, "time/step_s": 0.5, "done": True, "note": "x"})
    logger.close()


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_holds_every_numeric_metric_per_step(tmp_path: Path) -> None:
    _log_steps(tmp_path, range(1, 4), offset=0.25)
    scalars = _scalars(tmp_path)
    # Booleans and strings stay in metrics.jsonl only; the step is the x axis, not a scalar.
    assert set(scalars) == {"reward/mean", "time/step_s"}
    assert scalars["reward/mean"] == [(1, 1.25), (2, 2.25), (3, 3.25)]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["reward/mean"] for line in lines] == [v for _, v in scalars["reward/mean"]]


def test_resume_replaces_the_steps_after_the_checkpoint(tmp_path: Path) -> None:
    _log_steps(tmp_path, range(1, 5), offset=0.0)
    # A resumed run starts in a later second. Event files are named by second, then by a per-process counter that
    # sorts as text (10 before 9), so two writers of one process within one second can be read in the wrong order.
    time.sleep(1 - time.time() % 1 + 0.01)
    _log_steps(tmp_path, range(3, 5), offset=0.5, start_step=2)  # resumed from the step-2 checkpoint
    assert _scalars(tmp_path)["reward/mean"] == [(1, 1.0), (2, 2.0), (3, 3.5), (4, 4.5)]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["reward/mean"]) for line in lines] == [(1, 1.0), (2, 2.0), (3, 3.5), (4, 4.5)]
