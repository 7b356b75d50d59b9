"""The run directory: never clobber an earlier run, move it aside only when asked, and prove it is writable.

Re-typing `rlc run PLAN` must not cost hours of checkpoints. A directory that holds an earlier run is
refused unless the user says `--resume` (continue it) or `--overwrite` (move the earlier run's files to a
sibling `RUN.old-N/`; nothing is deleted). Only the run's own artifacts move: a model folder or data file
that lives inside the run directory stays where the plan expects it.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from rlc.runtime.errors import RunError, RunUsageError

#: Everything `rlc run` writes into a run directory (tests/test_run_e2e.py checks a finished run against it):
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
    "agent_samples.jsonl",
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
