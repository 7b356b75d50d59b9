"""The run directory: never clobber an earlier run, move it aside only when asked, and prove it is writable.

Re-typing `rlc run PLAN` must not cost hours of checkpoints. A directory that holds an earlier run is
refused unless the user says `--resume` (continue it) or `--overwrite` (move the earlier run's files to a
sibling `RUN.old-N/`; nothing is deleted). Only the run's own artifacts move: a model folder or data file
that lives inside the run directory stays where the plan expects it.

One driver at a time: `rlc run` holds an exclusive lock on the run directory (`RunDirLock`) for the whole run,
taken before anything else touches it, so a second `rlc run` (or a `--resume`) of the same directory stops at once
instead of writing the same checkpoints and metrics. The driver that takes the lock removes the half-written
checkpoint folders (`.step-N.tmp`) a killed driver left: none is ever resumed from, and each holds disk space.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from rlc.runtime.checkpoint import remove_stale_staging
from rlc.runtime.errors import RunError, RunUsageError

#: Everything `rlc run` writes into a run directory (tests/e2e/test_run_e2e.py checks a finished run against it):
#: their presence means an earlier run lives there, and `--overwrite` moves every one of them aside, since the
#: new run would truncate or append to any it left (the rollout log and trace a replay of that run needs).
RUN_ARTIFACTS: tuple[str, ...] = (
    "metrics.jsonl",
    "checkpoints",
    "tensorboard",
    "plan.json",
    "sync",
    "report",
    "rollouts.jsonl",
    "trace.json",
    "layout.json",
    "reproducibility.json",
    "nodes.json",
    "agent_samples.jsonl",
    "wandb",
    "swanlab",
    "mlflow",
)


def earlier_run(run_dir: Path) -> list[str]:
    """The artifacts of an earlier run found in `run_dir` (empty when there is none)."""
    if not run_dir.is_dir():
        return []
    return [name for name in RUN_ARTIFACTS if (run_dir / name).exists() or (run_dir / name).is_symlink()]


def check_location(run_dir: Path) -> None:
    """Refuse a run directory that is a file or lies under one (mkdir would fail with a bare OSError)."""
    for path in [run_dir, *run_dir.parents]:
        if not os.path.lexists(path):
            continue
        if path.is_dir():
            return
        if path == run_dir:
            raise RunError(f"the run directory {run_dir} exists and is a file: choose another --run-dir")
        raise RunError(f"the run directory {run_dir} lies under {path}, which is a file: choose another --run-dir")


def _aside_name(run_dir: Path) -> Path:
    n = 1
    while os.path.lexists(run_dir.with_name(f"{run_dir.name}.old-{n}")):
        n += 1
    return run_dir.with_name(f"{run_dir.name}.old-{n}")


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return True


def move_aside(run_dir: Path, found: list[str], keep: Iterable[str | None] = ()) -> Path:
    """Move the earlier run's artifacts into a new sibling `RUN.old-N/` and return it.

    An artifact that holds one of the plan's inputs (`keep`: model, teacher or data paths) is not moved.
    """
    inputs = [Path(p) for p in keep if p]
    aside = _aside_name(run_dir)
    try:
        aside.mkdir()
        for name in found:
            source = run_dir / name
            if any(_inside(path, source) for path in inputs):
                continue
            os.rename(source, aside / name)
    except OSError as exc:
        why = exc.strerror or exc
        raise RunError(f"--overwrite: cannot move the earlier run in {run_dir} to {aside}: {why}") from None
    return aside


def guard_earlier_run(run_dir: Path, *, overwrite: bool, keep: Iterable[str | None], log) -> None:  # type: ignore[no-untyped-def]
    """Refuse to start over an earlier run unless `overwrite`; then move it aside instead of deleting it."""
    found = earlier_run(run_dir)
    if not found:
        return
    shown = ", ".join(name + ("/" if (run_dir / name).is_dir() else "") for name in found)
    if not overwrite:
        raise RunUsageError(
            f"{run_dir} holds an earlier run ({shown}); refusing to start over it. Pass --resume to continue "
            f"it, or --overwrite to move it aside to {_aside_name(run_dir).name}/ (nothing is deleted), or "
            "choose another --run-dir"
        )
    aside = move_aside(run_dir, found, keep)
    log(f"--overwrite: moved the earlier run ({shown}) to {aside}")


def ensure_writable(run_dir: Path) -> None:
    """Create the run directory and prove a file can be written there, before anything expensive starts."""
    check_location(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = why_not_writable(exc)
        raise RunError(f"cannot create the run directory {run_dir}: {why}; choose another --run-dir") from None
    for folder in (run_dir, run_dir / "checkpoints"):
        if not folder.is_dir():
            continue
        try:
            probe_write(folder)
        except OSError as exc:
            raise RunError(
                f"the run directory {folder} is not writable: {why_not_writable(exc)}; fix its permissions or "
                "mount, or choose another --run-dir"
            ) from None


def probe_write(folder: Path) -> None:
    """Write, flush and sync a temporary file in `folder` (removed again); OSError when the folder refuses."""
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".rlc-write-test-") as probe:
        probe.write(b"rlc")
        probe.flush()
        os.fsync(probe.fileno())


def why_not_writable(exc: OSError) -> str:
    if exc.errno == errno.EROFS:
        return "it is on a read-only file system"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if exc.errno == errno.ENOSPC:
        return "no space left on the device"
    return exc.strerror or str(exc)


#: The driver's lock file inside the run directory: `flock`ed by the `rlc run` process for the whole run, holding
#: its pid and host; removed when the run ends. Not a run artifact: `--overwrite` leaves it in place.
LOCK_FILE = ".rlc-run.lock"

#: `flock` errors that mean "the file system keeps no locks", not "someone holds it".
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class RunDirLock:
    """An exclusive `flock` on `RUN/.rlc-run.lock`, held by this process until `release()` (or its death: the
    kernel drops a dead process's lock, so a crashed driver never blocks the next one)."""

    def __init__(self, path: Path | None = None, fd: int | None = None) -> None:
        self.path, self.fd = path, fd

    def release(self) -> None:
        """Remove the lock file (only while it is still ours), then unlock."""
        if self.fd is None or self.path is None:
            return
        try:
            if _same_file(self.fd, self.path):
                os.unlink(self.path)
        except OSError:
            pass  # a lock file left behind is taken over by the next run
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd` (another driver may have removed and recreated it)."""
    try:
        mine, named = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (named.st_dev, named.st_ino)


def _holder(fd: int) -> tuple[int | None, str]:
    """Who wrote the lock file: its pid and "pid N on host H, since T" (None and "" when it says nothing readable)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        pid, host, since = int(data["pid"]), str(data["host"]), str(data.get("since", ""))
    except (OSError, ValueError, KeyError, TypeError):
        return None, ""
    return pid, f"pid {pid} on host {host}" + (f", since {since}" if since else "")


def lock_run_dir(run_dir: Path, log: Callable[[str], None], *, create: bool = True) -> RunDirLock:
    """Take the run directory's lock before anything else touches the directory (creating it unless `create` is
    False and it does not exist: then there is nothing to lock, and the caller's checks refuse the run).

    RunUsageError naming the other driver's pid when one holds it; RunError when the lock file cannot be made.
    A file system without locks (some network mounts) runs unlocked, with a warning.
    """
    check_location(run_dir)
    if not run_dir.is_dir():
        if not create:
            return RunDirLock()
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            why = why_not_writable(exc)
            raise RunError(f"cannot create the run directory {run_dir}: {why}; choose another --run-dir") from None
    path = run_dir / LOCK_FILE
    for _ in range(20):  # a lock file removed between our open and our flock: open the new one
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise RunError(f"{path} is a symbolic link, not rlc's lock file: remove it") from None
            raise RunError(
                f"the run directory {run_dir} is not writable (its lock file {LOCK_FILE} cannot be made): "
                f"{why_not_writable(exc)}; fix its permissions or mount, or choose another --run-dir"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            pid, holder = _holder(fd)
            os.close(fd)
            if exc.errno in _NO_LOCKS:
                log(f"warning: the file system of {run_dir} keeps no locks; nothing stops a second `rlc run` there")
                return RunDirLock()
            who = holder or "its pid is not written yet: it is just starting"
            raise RunUsageError(
                f"another `rlc run` ({who}) is using the run directory {run_dir}; two drivers would write the same "
                f"checkpoints and metrics. Wait for it to end, stop it (`kill {pid or 'PID'}` stops it after a "
                "checkpoint), or choose another --run-dir"
            ) from None
        if not _same_file(fd, path):
            os.close(fd)
            continue
        _, left = _holder(fd)
        if left:  # a driver that died without removing its file: the kernel released its lock
            log(f"the run directory's lock of {left} was left by a process that no longer runs; taking it over")
        stale = remove_stale_staging(run_dir)  # a driver killed mid-save (never trusted by --resume)
        if stale:
            log(f"removed the half-written checkpoint(s) {', '.join(stale)} an earlier run left")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        return RunDirLock(path, fd)
    raise RunError(f"the lock file {path} keeps changing: is another program removing it?")
