"""A checkpoint that looks complete holds its data after a power loss, and a full disk during one ends the run
with a message saying so (the previous checkpoint intact), not a traceback."""

from __future__ import annotations

import errno
import os
import traceback
from pathlib import Path
from typing import Any

import pytest

from rlc.runtime.checkpoint import (
    COMPLETE_MARKER,
    CONTROLLER_FILE,
    ControllerState,
    disk_full,
    finalize,
    latest_checkpoint,
    staging_dir,
    staging_dirs,
)


def _fd_path(fd: int) -> Path:
    return Path(os.readlink(f"/proc/self/fd/{fd}"))


class Recorder:
    """Every fsync (its path, and whether the staged COMPLETE marker existed then) and rename, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, marker: Path | None = None) -> None:
        self.events: list[tuple[str, Path, Any]] = []
        self.marker = marker
        real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

        def fsync(fd: int) -> None:
            marked = self.marker is not None and self.marker.exists()
            self.events.append(("fsync", _fd_path(fd), marked))
            real_fsync(fd)

        def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            self.events.append(("rename", Path(src).resolve(), Path(dst).resolve()))
            real_rename(src, dst, *args, **kwargs)

        def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            self.events.append(("rename", Path(src).resolve(), Path(dst).resolve()))
            real_replace(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "rename", rename)
        monkeypatch.setattr(os, "replace", replace)

    def fsyncs(self, path: Path) -> list[int]:
        return [i for i, (kind, where, _) in enumerate(self.events) if kind == "fsync" and where == path.resolve()]


def _staged_with_trainer_files(run: Path, step: int) -> Path:
    staged = staging_dir(run, step)
    (staged / "hf").mkdir()
    (staged / "hf" / "model.safetensors").write_bytes(b"w" * 64)
    (staged / "hf" / "config.json").write_text("{}")
    (staged / "optim").mkdir()
    (staged / "optim" / "__0_0.distcp").write_bytes(b"o" * 64)
    (staged / "optim" / ".metadata").write_bytes(b"m")
    (staged / "trainer_state.json").write_text('{"step": 3}')
    return staged


def _state(step: int) -> ControllerState:
    return ControllerState(step=step, version=step, data_cursor=step * 4)


def test_checkpoint_data_is_durable_before_the_marker_and_the_rename_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    staged = _staged_with_trainer_files(run, 3)
    record = Recorder(monkeypatch, marker=staged / COMPLETE_MARKER)
    final = finalize(run, staged, _state(3), keep=2)
    events = record.events
    staged = staged.resolve()

    data = [p for p in staged.rglob("*")] if staged.exists() else []
    assert not data  # renamed away
    files = ["hf/model.safetensors", "hf/config.json", "optim/__0_0.distcp", "optim/.metadata"]
    files += ["trainer_state.json", CONTROLLER_FILE]
    marker_syncs = record.fsyncs(staged / COMPLETE_MARKER)
    assert marker_syncs, "the COMPLETE marker is never fsynced"
    marker_synced = marker_syncs[0]
    for name in files:
        synced = record.fsyncs(staged / name)
        assert synced, f"{name} is never fsynced"
        assert all(not events[i][2] for i in synced), f"{name} is fsynced only after COMPLETE was written"
        assert synced[0] < marker_synced
    for folder in (staged / "hf", staged / "optim"):
        assert record.fsyncs(folder) and record.fsyncs(folder)[0] < marker_synced, f"{folder.name}/ entries"
    # the marker's own entry, then the rename, then the folder holding the checkpoint
    after_marker = [i for i in record.fsyncs(staged) if i > marker_synced]
    assert after_marker, "the staged folder is not fsynced after the marker is written"
    (renamed,) = [i for i, e in enumerate(events) if e[0] == "rename" and e[1] == staged]
    assert events[renamed][2] == final.resolve()
    assert after_marker[0] < renamed
    root_syncs = record.fsyncs(run / "checkpoints")
    assert any(i > renamed for i in root_syncs), "checkpoints/ is not fsynced after the rename"
    found = latest_checkpoint(run)
    assert found is not None and found[0] == final and found[1].step == 3


def test_a_disk_full_while_finalizing_leaves_the_previous_checkpoint_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    finalize(run, _staged_with_trainer_files(run, 2), _state(2), keep=2)
    staged = _staged_with_trainer_files(run, 4)
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if _fd_path(fd).name == CONTROLLER_FILE:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError) as caught:
        finalize(run, staged, _state(4), keep=2)
    assert caught.value.errno == errno.ENOSPC
    assert not (staged / COMPLETE_MARKER).exists()
    found = latest_checkpoint(run)
    assert found is not None and found[0].name == "step-000002"


# ----------------------------------------------------------------------------------- a full disk, found


def _ray_error(cause: BaseException, note: str = "") -> BaseException:
    """What `ray.get` raises on the driver when an actor method raised `cause` (`note`: more remote output)."""
    from ray.exceptions import RayTaskError

    try:
        raise cause
    except BaseException:
        text = note + traceback.format_exc()
    return RayTaskError("TrainerWorker.save_checkpoint", text, cause).as_instanceof_cause()


def test_disk_full_is_found_inside_what_wraps_it(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    target = str(tmp_path / "checkpoints" / ".step-000004.tmp" / "hf" / "model.safetensors")
    wrapped = _ray_error(OSError(errno.ENOSPC, "No space left on device", target))
    assert isinstance(wrapped, OSError) and wrapped.errno is None  # why the old errno check never saw it
    found = disk_full(wrapped)
    assert found is not None and found.errno == errno.ENOSPC and found.filename == target

    shards = CheckpointException("save failed", {1: (OSError(errno.EDQUOT, "Disk quota exceeded"), [])})
    assert (found := disk_full(shards)) is not None and found.errno == errno.EDQUOT

    rust = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    assert (found := disk_full(rust)) is not None and found.errno == errno.ENOSPC

    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("the writer failed") from inner
    except RuntimeError as chained:
        assert (found := disk_full(chained)) is not None and found.errno == errno.ENOSPC

    assert disk_full(OSError(errno.EACCES, "Permission denied")) is None
    assert disk_full(ValueError("bad value")) is None
    # a Ray error's text is a whole remote traceback: only its cause counts
    quoted = _ray_error(ValueError("bad value"), note="earlier: OSError: [Errno 28] No space left on device\n")
    assert "No space left on device" in str(quoted)
    assert disk_full(quoted) is None


def _run_with_checkpoint(run: Path, step: int) -> None:
    finalize(run, _staged_with_trainer_files(run, step), _state(step), keep=2)


def test_a_full_disk_during_a_trainer_checkpoint_is_named_not_a_traceback(tmp_path: Path) -> None:
    from rlc.runtime import launch
    from rlc.runtime.errors import RunError

    run = tmp_path / "run"
    _run_with_checkpoint(run, 2)

    def checkpoint() -> int:  # as Controller._checkpoint: stage, then the trainer ranks write, over Ray
        staged = staging_dir(run, 4)
        (staged / "hf").mkdir()
        (staged / "hf" / "model.safetensors").write_bytes(b"partial")
        raise _ray_error(OSError(errno.ENOSPC, "No space left on device", str(staged / "hf" / "model.safetensors")))

    with pytest.raises(RunError) as caught:
        launch.run_controller(checkpoint, run)
    message = str(caught.value)
    assert f"no space left on the device holding {run / 'checkpoints'}" in message
    assert "the previous checkpoint step-000002 is intact" in message
    assert "free space and `rlc run PLANDIR --resume`" in message
    assert "Traceback" not in message and "RayTaskError" not in message
    assert staging_dirs(run) == []  # the partial checkpoint gave its space back
    found = latest_checkpoint(run)
    assert found is not None and found[0].name == "step-000002"


def test_a_full_disk_in_the_controllers_checkpoint_code_without_a_file_name(tmp_path: Path) -> None:
    from rlc.runtime import launch
    from rlc.runtime.errors import RunError

    run = tmp_path / "run"

    def _checkpoint() -> int:  # the name Controller._checkpoint has; the error names no file
        staging_dir(run, 1)
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    with pytest.raises(RunError) as caught:
        launch.run_controller(_checkpoint, run)
    message = str(caught.value)
    assert "the disk quota is exceeded on the device holding" in message
    assert "no checkpoint was completed before it" in message and "--overwrite" in message


def test_a_full_disk_outside_a_checkpoint_names_the_file(tmp_path: Path) -> None:
    from rlc.runtime import launch
    from rlc.runtime.errors import RunError

    run = tmp_path / "run"
    _run_with_checkpoint(run, 2)

    def step() -> int:
        raise OSError(errno.ENOSPC, "No space left on device", str(run / "metrics.jsonl"))

    with pytest.raises(RunError) as caught:
        launch.run_controller(step, run)
    message = str(caught.value)
    assert message.startswith(f"writing the run's files failed: No space left on device ({run / 'metrics.jsonl'})")
    assert f"free space on the device holding {run}" in message and "step-000002" in message


def test_another_failed_write_from_an_actor_is_one_line(tmp_path: Path) -> None:
    from rlc.runtime import launch
    from rlc.runtime.errors import RunError

    def denied() -> int:
        raise _ray_error(PermissionError(errno.EACCES, "Permission denied", "/mnt/ro/checkpoints"))

    with pytest.raises(RunError) as caught:
        launch.run_controller(denied, tmp_path)
    assert str(caught.value).startswith("writing the run's files failed: Permission denied (/mnt/ro/checkpoints)")
    assert "Traceback" not in str(caught.value)

    def other() -> int:
        raise KeyError("not a write")

    with pytest.raises(KeyError):  # everything else goes on as before
        launch.run_controller(other, tmp_path)


def test_a_checkpoint_that_failed_without_naming_the_disk_on_a_full_one_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An actor's checkpoint write that failed in words that are not a full disk's (torch's "unexpected pos"), with
    the checkpoints' filesystem full: the run ends naming the full disk and the checkpoint to resume from; with room
    left the error is not taken for a full disk."""
    import shutil

    from rlc.runtime import launch
    from rlc.runtime.errors import RunError

    run = tmp_path / "run"
    _run_with_checkpoint(run, 2)
    free = [1 << 20]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100 << 30, 0, free[0]))

    def _checkpoint() -> int:  # as Controller._checkpoint: the trainer ranks write into the staged folder
        staging_dir(run, 4)
        raise _ray_error(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))

    with pytest.raises(RunError) as caught:
        launch.run_controller(_checkpoint, run)
    assert str(caught.value) == (
        f"no space left on the device holding {run / 'checkpoints'} while writing a checkpoint (the partial "
        ".step-000004.tmp was removed); the previous checkpoint step-000002 is intact: free space and "
        "`rlc run PLANDIR --resume`"
    )
    free[0] = 10 << 30
    with pytest.raises(RuntimeError, match="unexpected pos"):
        launch.run_controller(_checkpoint, run)
