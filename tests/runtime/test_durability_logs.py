"""metrics.jsonl and rollouts.jsonl (which `--replay` trusts) are on disk once a step, not once a line."""

from __future__ import annotations

import errno
import io
import json
import os
from pathlib import Path

import pytest

from rlc.runtime.metrics import MetricsLogger
from rlc.runtime.rollout_log import RolloutLog, read_lines


class FsyncLog:
    """Each fsync's path, and how many lines the file it synced held at that moment."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[Path, int]] = []
        real = os.fsync

        def fsync(fd: int) -> None:
            path = Path(os.readlink(f"/proc/self/fd/{fd}"))
            lines = path.read_text().count("\n") if path.is_file() else -1
            self.calls.append((path, lines))
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)

    def of(self, path: Path) -> list[int]:
        return [lines for where, lines in self.calls if where == path.resolve()]


def test_each_metrics_line_is_fsynced_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced = FsyncLog(monkeypatch)
    logger = MetricsLogger(tmp_path, ["jsonl"], total_steps=3, start_step=0)
    logger._progress.stream = io.StringIO()  # quiet
    for step in (1, 2, 3):
        logger.log({"step": step, "reward/mean": 0.5})
    logger.close()
    assert synced.of(tmp_path / "metrics.jsonl") == [1, 2, 3]  # every step's line, when written, and no more
    assert tmp_path.resolve() in [where for where, _ in synced.calls]  # the file's entry in the run directory


def test_metrics_truncated_on_resume_survive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)))
    synced = FsyncLog(monkeypatch)
    MetricsLogger(tmp_path, ["jsonl"], total_steps=6, start_step=2).close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    assert [n for where, n in synced.calls if where.name == ".metrics.jsonl.tmp"] == [2]  # written aside, synced
    assert not (tmp_path / ".metrics.jsonl.tmp").exists()


def test_rollout_log_is_fsynced_with_each_steps_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced = FsyncLog(monkeypatch)
    log = RolloutLog(tmp_path)
    for step in (1, 2):
        ids = [log.new_id() for _ in range(3)]
        for rid in ids:
            log.request(rid, [rid], version=step - 1, admitted_at=step - 1, engine=0)
        log.batch(step, [(rid, rid) for rid in ids])
    log.close()
    # once a step, when its batch line (the 4th and 8th line) is written, with the requests before it
    assert synced.of(tmp_path / "rollouts.jsonl") == [4, 8]
    assert [x["kind"] for x in read_lines(tmp_path / "rollouts.jsonl")].count("batch") == 2


def test_a_log_that_no_longer_fits_closes_without_hiding_the_error(tmp_path: Path) -> None:
    """The write that did not fit raised; closing the file (its unwritten line) must not raise over it."""

    class Full(io.StringIO):
        def close(self) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    log = RolloutLog(tmp_path)
    log._file.close()  # type: ignore[union-attr]
    log._file = Full()
    log.close()
    metrics = MetricsLogger(tmp_path, ["jsonl"], total_steps=1)
    metrics._progress.stream = io.StringIO()
    metrics._jsonl.close()  # type: ignore[union-attr]
    metrics._jsonl = Full()
    metrics.close()
