"""Checkpoint directories: written atomically, found again on `--resume`, pruned to the newest few.

A checkpoint is `RUN/checkpoints/step-NNNNNN/` holding the trainer's Hugging Face weights and optimizer
state (written by the trainer ranks) and `controller.json` (step, version, data cursor, RNG). It is built
under a temporary name and renamed into place only when complete, so an interrupted save never leaves a
checkpoint that `--resume` would trust.

Durability: a rename is atomic but not durable by itself, and the kernel may write a file's directory entry
before its data. So every file of the staged checkpoint and every directory in it is fsynced, then the
`COMPLETE` marker is written and fsynced (last: a checkpoint that has it holds its data after a power loss),
then the rename and the directory holding it. A disk that fills up mid-save is named (`disk_full`), also where the
library that failed lost the errno (`full_after_failed_write`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

CONTROLLER_FILE = "controller.json"
COMPLETE_MARKER = "COMPLETE"
_NAME = re.compile(r"^step-(\d{6,})$")
_STAGING = re.compile(r"^\.step-\d{6,}\.tmp$")  # `staging_dir`'s names, and nothing a user would call a folder


@dataclass
class ControllerState:
    """What the controller needs to continue exactly where it stopped."""

    step: int
    version: int
    data_cursor: int
    rng: dict[str, Any] = field(default_factory=dict)
    plan_hash: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ControllerState:
        """The state written by `to_json`; ValueError saying what is wrong with anything else."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)}")
        for name in ("step", "version", "data_cursor"):
            value = data.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
        if not isinstance(data.get("rng", {}), dict) or not isinstance(data.get("plan_hash", ""), str):
            raise ValueError("rng must be an object and plan_hash a string")
        return cls(**data)


#: Errors that mean the device is full (for this user, with EDQUOT).
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# How libraries that do their own I/O (safetensors' Rust writer) word a full disk in a non-OSError.
_DISK_FULL_TEXT = re.compile(r"No space left on device|Disk quota exceeded|os error (?:28|122)\b|StorageFull")
# What fsync on a directory raises where the filesystem cannot sync directories (some network filesystems).
_NO_DIR_SYNC = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EBADF})


def fsync_file(path: Path) -> None:
    """Make a written file's data durable (its directory entry needs `fsync_dir` of the folder)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (files created, renamed or removed in it) durable; a no-op where the
    filesystem cannot sync directories."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in _NO_DIR_SYNC:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_DIR_SYNC:
            raise
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory, deepest first (each after the entries it holds)."""
    folders: list[Path] = []
    for here, dirs, files in os.walk(root):
        dirs.sort()
        folders.append(Path(here))
        for name in sorted(files):
            path = Path(here, name)
            if not path.is_symlink():
                fsync_file(path)
    for folder in reversed(folders):
        fsync_dir(folder)


def write_durably(path: Path, text: str) -> None:
    """Write `path` so that after a power loss it holds `text` or its old content: a temporary file, fsynced,
    renamed over it, and the folder fsynced."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_synced(path: Path, text: str) -> None:
    """Write `path` and fsync it before returning (a marker or state whose data must be on disk first)."""
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def staging_dir(run_dir: Path, step: int) -> Path:
    """Where a checkpoint is assembled before it is renamed into place."""
    path = checkpoints_dir(run_dir) / f".step-{step:06d}.tmp"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def staging_dirs(run_dir: Path) -> list[Path]:
    """Checkpoints being assembled, or left half-written by a failed save (never trusted by `--resume`)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _STAGING.match(p.name) and p.is_dir() and not p.is_symlink())


def remove_stale_staging(run_dir: Path) -> list[str]:
    """Remove the checkpoints an earlier driver left half-written (killed mid-save); returns their names. Only
    for the driver that holds the run directory's lock: no save of another is in progress then."""
    stale = staging_dirs(run_dir)
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    return [p.name for p in stale]


def finalize(run_dir: Path, staged: Path, state: ControllerState, keep: int) -> Path:
    """Write the controller state, make the whole checkpoint durable, mark it complete, rename it into place,
    then prune older checkpoints.

    The order is what makes a power loss safe: data (the trainer's files and controller.json) fsynced, then
    the COMPLETE marker written and fsynced, then the staged folder, the rename, and the folder holding it.
    """
    write_synced(staged / CONTROLLER_FILE, state.to_json())
    fsync_tree(staged)  # the trainer's files and every folder in the checkpoint
    write_synced(staged / COMPLETE_MARKER, f"{state.step}\n")
    fsync_dir(staged)  # the marker's entry
    root = checkpoints_dir(run_dir)
    final = root / f"step-{state.step:06d}"
    if final.exists():
        shutil.rmtree(final)
    os.rename(staged, final)
    fsync_dir(root)  # the rename
    fsync_dir(run_dir)  # checkpoints/ itself, on the first checkpoint
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def disk_full(exc: BaseException) -> OSError | None:
    """The "no space left" (ENOSPC, EDQUOT) error behind `exc`, or None.

    Looks through what wraps it: exception chains, a Ray task error's `cause` (an actor's OSError reaches the
    driver inside one, and the copy Ray raises has no errno of its own), and torch.distributed.checkpoint's
    per-rank `failures`; a library error that only words it (safetensors' writer) becomes an OSError.
    """
    chain: list[BaseException] = []
    stack: list[Any] = [exc]
    while stack:
        current = stack.pop()
        if not isinstance(current, BaseException) or any(current is seen for seen in chain):
            continue
        chain.append(current)
        if isinstance(current, OSError) and current.errno in DISK_FULL_ERRNOS:
            return current
        context = None if current.__suppress_context__ else current.__context__  # `raise ... from None` hid it
        stack += [current.__cause__, context, vars(current).get("cause")]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
    for current in chain:
        if "cause" in vars(current):  # a Ray wrapper: its text is a whole remote traceback, so only its cause counts
            continue
        found = None if isinstance(current, OSError) else _DISK_FULL_TEXT.search(str(current))
        if found is not None:
            code = errno.EDQUOT if found.group() in ("Disk quota exceeded", "os error 122") else errno.ENOSPC
            return OSError(code, os.strerror(code))
    return None


#: Free space under which a failed checkpoint write is taken for a full disk. A write that runs out of space
#: leaves the filesystem full behind it, but not every library says so: torch's zip writer (`torch.save`, and
#: torch.distributed.checkpoint through it) reports a short write as "unexpected pos N vs M".
NEARLY_FULL_BYTES = 64 * 2**20


def full_after_failed_write(exc: BaseException, folder: Path) -> OSError | None:
    """The full disk behind a failed write into ``folder``: `disk_full(exc)`, else, when the error does not say
    (torch's "unexpected pos"), an ENOSPC OSError naming ``folder`` if its filesystem has under
    `NEARLY_FULL_BYTES` free now; None when it has room (the write failed for another reason)."""
    full = disk_full(exc)
    if full is not None:
        return full
    here = Path(folder)
    while not here.exists() and here != here.parent:  # a folder the failure left unmade: its filesystem
        here = here.parent
    try:
        free = shutil.disk_usage(here).free
    except OSError:
        return None
    if free >= NEARLY_FULL_BYTES:
        return None
    return OSError(errno.ENOSPC, f"No space left on device ({free / 2**20:.1f} MiB free)", str(folder))


def close_log(handle: Any) -> None:
    """Close a log file; a full disk is not raised again here (the write that did not fit already raised, and is
    what to report), any other error is."""
    try:
        handle.close()
    except OSError as exc:
        if disk_full(exc) is None:
            raise


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (incomplete or temporary ones are ignored)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _NAME.match(path.name)
        if match and (path / COMPLETE_MARKER).is_file() and (path / CONTROLLER_FILE).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


class CheckpointError(ValueError):
    """A complete checkpoint whose controller state cannot be read (a hand edit or a damaged disk)."""


def latest_checkpoint(run_dir: Path) -> tuple[Path, ControllerState] | None:
    """The newest complete checkpoint and its controller state; CheckpointError when that state is unreadable."""
    found = complete_checkpoints(run_dir)
    if not found:
        return None
    path = found[-1]
    try:
        return path, ControllerState.from_json((path / CONTROLLER_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{path / CONTROLLER_FILE} is unreadable: {exc}") from None
