"""One driver per run directory: a second `rlc run` (or a `--resume`) of a directory another driver holds stops at
once, before it touches the directory or starts Ray, naming the other process; a lock left by a dead process
never blocks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from plan_fixtures import CPU_SPEC, cpu_plan, spec_from

from rlc.compiler.emit import emit_plan_dir
from rlc.runtime.errors import RunError, RunUsageError
from rlc.runtime.launch import run_plan
from rlc.runtime.run_dir import LOCK_FILE, RUN_ARTIFACTS, lock_run_dir

RLC = [sys.executable, "-m", "rlc"]
HOLDER = """
import sys, time
from pathlib import Path
from rlc.runtime.run_dir import lock_run_dir
lock = lock_run_dir(Path(sys.argv[1]), print)
print("locked", flush=True)
time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another driver: a process holding the run directory's lock (as `rlc run` does for its whole run)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "locked", line + (proc.stderr.read() if proc.stderr else "")
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def earlier_run(run_dir: Path) -> None:
    ckpt = run_dir / "checkpoints" / "step-000005"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text("5\n")
    (ckpt / "controller.json").write_text('{"step": 5, "version": 5, "data_cursor": 80}')
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n' * 5)
    (run_dir / "plan.json").write_text("{}")


def _plan(tmp_path: Path):  # type: ignore[no-untyped-def]
    return cpu_plan(model_path=str(tmp_path / "no-model"), run_dir=str(tmp_path / "run"), build_tiny=False)


def test_a_second_driver_stops_at_once_naming_the_first(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    run_dir = tmp_path / "run"
    earlier_run(run_dir)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    # --overwrite would move the live run's files aside; the lock comes first.
    with pytest.raises(RunUsageError) as refused:
        run_plan(_plan(tmp_path), run_dir, overwrite=True)
    message = str(refused.value)
    assert f"another `rlc run` (pid {holder.pid} on host " in message
    assert str(run_dir) in message and f"kill {holder.pid}" in message
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
    assert not (tmp_path / "run.old-1").exists()
    # --resume while the first runs: refused the same way (not "resumed from step 5").
    with pytest.raises(RunUsageError, match=f"pid {holder.pid}"):
        run_plan(_plan(tmp_path), run_dir, resume=True)
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == holder.pid  # still the holder's


def test_the_cli_refuses_before_ray_with_exit_2(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    plan_dir = tmp_path / "plan"
    emit_plan_dir(_plan(tmp_path), spec_from(CPU_SPEC), plan_dir, provenance={})
    result = subprocess.run([*RLC, "run", str(plan_dir)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"rlc run: error: another `rlc run` (pid {holder.pid}" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout and "local Ray" not in result.stdout


def test_a_lock_left_by_a_dead_driver_does_not_block(
    tmp_path: Path, holder: subprocess.Popen[str], capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    os.kill(holder.pid, signal.SIGKILL)  # no clean-up: its lock file stays, the kernel drops its lock
    holder.wait(timeout=30)
    assert (run_dir / LOCK_FILE).is_file()
    with pytest.raises(RunError, match="model folder not found"):  # past the lock, into the pre-flight
        run_plan(_plan(tmp_path), run_dir)
    assert f"lock of pid {holder.pid} on host" in capsys.readouterr().out
    assert not (run_dir / LOCK_FILE).exists()  # removed again when the run ended


def test_the_lock_is_held_for_the_run_and_released_after(tmp_path: Path) -> None:
    run_dir = tmp_path / "nested" / "run"
    with lock_run_dir(run_dir, print):
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
        probe = subprocess.run(
            [sys.executable, "-c", HOLDER, str(run_dir)], capture_output=True, text=True, timeout=60
        )  # another process cannot take it
        assert probe.returncode == 1 and f"pid {os.getpid()}" in probe.stderr, probe.stderr
    assert not (run_dir / LOCK_FILE).exists()
    assert LOCK_FILE not in RUN_ARTIFACTS  # not an earlier run's file: --overwrite leaves it alone
    with lock_run_dir(run_dir, print):  # free again
        pass


def test_resume_of_a_missing_run_dir_creates_nothing_to_lock(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "none"
    with pytest.raises(RunError, match="no complete checkpoint"):
        run_plan(_plan(tmp_path), run_dir, resume=True)
    assert not (tmp_path / "runs").exists()


def test_a_planted_symlink_lock_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (tmp_path / "elsewhere").write_text("keep")
    (run_dir / LOCK_FILE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RunError, match="is a symbolic link"):
        lock_run_dir(run_dir, print)
    assert (tmp_path / "elsewhere").read_text() == "keep"


def test_the_driver_that_takes_the_lock_removes_half_written_checkpoints(tmp_path: Path) -> None:
    """A driver killed mid-save leaves `checkpoints/.step-N.tmp`: the next driver (a resume) removes it once it
    holds the lock, and says so; complete checkpoints and folders not named as rlc stages them stay."""
    from rlc.runtime.checkpoint import staging_dir

    run = tmp_path / "run"
    staged = staging_dir(run, 3)
    (staged / "optim").mkdir()
    (staged / "optim" / "__0_0.distcp").write_bytes(b"half")
    kept = [run / "checkpoints" / "step-000002", run / "checkpoints" / ".step-notes.tmp", run / "checkpoints" / "mine"]
    for folder in kept:
        folder.mkdir()
    said: list[str] = []
    lock = lock_run_dir(run, said.append, create=False)
    try:
        assert not staged.exists() and all(folder.is_dir() for folder in kept)
        assert said == ["removed the half-written checkpoint(s) .step-000003.tmp an earlier run left"]
    finally:
        lock.release()
