"""Metric sinks for a run: `metrics.jsonl` (one object per step), TensorBoard events, the trackers a plan names
(Weights & Biases, SwanLab, MLflow: `rlc.runtime.trackers`), and a progress display.

The JSONL file is the contract tools and tests read, and is written first each step: a tracker that fails only
stops itself. TensorBoard and the trackers are for people, and get the same numeric metrics per step; the progress
display is a rich bar with ETA and a line per step on a terminal, and plain lines otherwise (CI logs, pipes).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from rlc.messages import first_line
from rlc.runtime.checkpoint import close_log, fsync_dir, write_durably
from rlc.runtime.nonfinite import skip_text
from rlc.runtime.trackers import TRACKERS, Tracker, open_tracker

# The per-step keys every run writes (others, such as spec_decode/* or distill/<name>/*, are added by modes).
REQUIRED_KEYS: tuple[str, ...] = (
    "step",
    "version",
    "reward/mean",
    "reward/std",
    "behave_imp_weight/mean",
    "behave_imp_weight/max",
    "staleness/mean",
    "staleness/max",
    "loss/policy",
    "grad_norm",
    "entropy",
    "response_len/mean",
    "time/rollout_s",
    "time/gather_s",
    "time/reward_s",
    "time/batch_s",
    "time/train_s",
    "time/weight_sync_s",
    "time/overlap_s",
    "time/step_s",
    "throughput/rollout_tokens_per_s",
    "throughput/train_tokens_per_s",
)

#: Seconds between TensorBoard flushes (the writer's own thread; the default is two minutes).
TENSORBOARD_FLUSH_S = 5

# Keys shown on the one-line-per-step display, with their short labels.
_SHOWN = (
    ("reward/mean", "reward"),
    ("loss/policy", "loss"),
    ("staleness/mean", "stale"),
    ("behave_imp_weight/mean", "iw"),
    ("time/step_s", "s/step"),
)


def _clean(value: Any) -> Any:
    """JSON-safe scalars: NaN and infinities become null rather than invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """What TensorBoard and the trackers chart of a step: its numbers. Booleans, text and nulls stay in
    metrics.jsonl only; the step is the x axis, not a value."""
    return {
        key: float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
    }


class MetricsLogger:
    """Writes each step's metrics to every configured sink; appends on resume.

    Each step's JSONL line is fsynced as it is written (once a step), so the lines of the steps a checkpoint
    holds are on disk when it is; the file's truncation on resume is atomic.
    """

    def __init__(
        self,
        run_dir: Path,
        loggers: list[str],
        total_steps: int,
        start_step: int = 0,
        *,
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.last_step = start_step
        self.path = run_dir / "metrics.jsonl"
        if start_step == 0 and self.path.exists():
            self.path.unlink()
        elif start_step > 0 and self.path.exists():
            self._truncate_after(start_step)
        self._jsonl: TextIO | None = None
        if "jsonl" in loggers:
            self._jsonl = self.path.open("a")
            fsync_dir(run_dir)  # the file's entry, when this created it
        self._tb = None
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            # Its writer thread flushes every few seconds (and at close): a flush per step blocks the driver.
            self._tb = SummaryWriter(
                log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1, flush_secs=TENSORBOARD_FLUSH_S
            )
        self._progress = StepProgress(total_steps, start_step)
        self.trackers: list[Tracker] = []
        for name in loggers:
            if name in TRACKERS:
                self._start_tracker(name, run_name or run_dir.name, config or {}, start_step)

    def _start_tracker(self, name: str, run_name: str, config: dict[str, Any], start_step: int) -> None:
        """A tracker that cannot start is reported and left out: the run and its metrics.jsonl go on."""
        try:
            self.trackers.append(open_tracker(name, self.run_dir, run_name, config, start_step))
        except Exception as exc:
            self.message(
                f"rlc: warning: {name} did not start ({type(exc).__name__}: {first_line(exc)}); this run logs "
                "without it (metrics.jsonl has every step)"
            )

    def _truncate_after(self, step: int) -> None:
        """On resume, drop lines for steps after the checkpoint so step numbers stay continuous."""
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:
                continue
        write_durably(self.path, "".join(f"{line}\n" for line in kept))

    def log(self, metrics: dict[str, Any]) -> None:
        record = {k: _clean(v) for k, v in sorted(metrics.items())}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record, sort_keys=True) + "\n")
            self._jsonl.flush()
            os.fsync(self._jsonl.fileno())
        self.last_step = int(record.get("step", self.last_step))
        if self._tb is not None:
            self._write_tensorboard(record)
        if self.trackers:
            self._write_trackers(record)
        self._progress.update(record)

    def _write_trackers(self, record: dict[str, Any]) -> None:
        """Each tracker gets the step; one that fails is reported once, closed and logs no more (the others, and
        metrics.jsonl, go on)."""
        values = scalars(record)
        for tracker in list(self.trackers):
            try:
                tracker.log(self.last_step, values)
            except Exception as exc:
                self.trackers.remove(tracker)
                self.message(
                    f"rlc: warning: {tracker.name} failed at step {self.last_step} ({type(exc).__name__}: "
                    f"{first_line(exc)}); it logs no more in this run (metrics.jsonl has every step)"
                )
                self._close_tracker(tracker, finished=False)

    def _write_tensorboard(self, record: dict[str, Any]) -> None:
        """One event per step holding every scalar: ``add_scalar`` writes an event per key, each checksummed
        by TensorBoard's pure-Python CRC, which cost the driver about 2 ms of CPU per step for 27 keys (0.5 ms
        as one event). TensorBoard reads both forms the same way."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=key, simple_value=value) for key, value in scalars(record).items()]
        # The writer's own file writer (what add_scalar calls) keeps its purge-on-resume and flush thread.
        self._tb._get_file_writer().add_summary(Summary(value=values), int(record["step"]))

    def message(self, text: str) -> None:
        self._progress.message(text)

    def close(self) -> None:
        if self._jsonl is not None:
            handle, self._jsonl = self._jsonl, None
            close_log(handle)
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:  # finished: the last step was logged; otherwise stopped (resumable) or failed
            self._close_tracker(tracker, finished=self.last_step >= self.total_steps)
        self._progress.close()

    def _close_tracker(self, tracker: Tracker, *, finished: bool) -> None:
        try:
            tracker.close(finished)
        except Exception as exc:
            self.message(
                f"rlc: warning: {tracker.name} did not close cleanly ({type(exc).__name__}: {first_line(exc)})"
            )


class StepProgress:
    """A rich progress bar with ETA and a line per step on a terminal; plain lines when not a terminal."""

    def __init__(self, total: int, start: int = 0, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.total = total
        self.start = start
        self.started_at = time.monotonic()
        self._progress = None
        if self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._console = Console(file=self.stream)
            self._progress = Progress(
                TextColumn("[bold]rlc run"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self._console,
                transient=False,
            )
            self._task = self._progress.add_task("steps", total=total, completed=start)
            self._progress.start()

    def _line(self, record: dict[str, Any]) -> str:
        parts = [f"step {record['step']}/{self.total}"]
        for key, label in _SHOWN:
            value = record.get(key)
            if isinstance(value, int | float):
                parts.append(f"{label} {value:.3f}")
        done = int(record["step"]) - self.start
        if done > 0:
            per_step = (time.monotonic() - self.started_at) / done
            parts.append(f"eta {per_step * (self.total - int(record['step'])):.0f}s")
        skipped = skip_text(record)  # e.g. "non-finite loss, update skipped (2 in a row)"
        return "  ".join(parts) + (f": {skipped}" if skipped else "")

    def update(self, record: dict[str, Any]) -> None:
        line = self._line(record)
        if self._progress is not None:
            self._progress.console.print(line)
            self._progress.update(self._task, completed=int(record["step"]))
        else:
            print(line, file=self.stream, flush=True)

    def message(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
