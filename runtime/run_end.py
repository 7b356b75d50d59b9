"""How a run ends early: Ctrl-C and SIGTERM (`RunStopped`), a dead actor, a full disk, each one clear message that
names the newest checkpoint to resume from; and how a SIGTERM sent to every process of the job is left to the
driver (`stop_left_to_this_process`, `leave_stop_to_driver`)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from rlc.messages import first_line
from rlc.runtime.errors import RunError, resume_command

T = TypeVar("T")


#: Signals that stop a run cleanly, as Ctrl-C does: SIGTERM is what `kill`, schedulers (Slurm, Kubernetes) and
#: `ray job stop` send first.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stop_left_to_this_process() -> Iterator[None]:
    """Processes started inside leave SIGTERM to this one: they inherit it blocked (a blocked signal stays blocked
    across fork and exec, and a handler of theirs never sees it). A scheduler that signals every process of the job
    (Slurm's `scancel`) would otherwise stop the embedded Ray's raylet, which ends every actor with it, before this
    driver has finished the step in progress and written its checkpoint. They still end when the driver ends them
    (`ray.shutdown` sends SIGKILL a second after each SIGTERM: about 4 s more at the end of a run, measured) or
    dies (Ray's processes share its fate)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def leave_stop_to_driver() -> None:
    """In a run's actor: ignore SIGTERM, and have the processes this thread starts (vLLM's engine core) inherit it
    blocked, so a signal to every process of the job stops the run through its driver, after the checkpoint. Ray's
    workers start with SIGTERM unblocked and their own handler (exit at once); the disposition is the process's,
    so it is set from whichever thread runs this (`signal.signal` works only in the main one)."""
    import ctypes
    import threading

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal(int(signal.SIGTERM), ctypes.c_void_p(int(signal.SIG_IGN)))


def actor_leaves_stop_to_driver(actor: object) -> None:
    """`leave_stop_to_driver` inside an actor, through Ray's `actor.__ray_call__.remote(...)`."""
    leave_stop_to_driver()


class RunStopped(RunError):
    """A signal stopped the run before its last step: it finished the step in progress and checkpointed it, and
    `rlc run` exits non-zero (a partial run is not a finished one)."""

    def __init__(self, step: int, total: int, signal_name: str, run_dir: Path) -> None:
        self.step, self.total = step, total
        by = f" ({signal_name})" if signal_name else ""
        super().__init__(f"stopped at step {step} of {total}{by}; {_last_checkpoint(run_dir)}")


def _last_checkpoint(run_dir: Path) -> str:
    """Where a stopped run's newest checkpoint is, and how to continue from it."""
    from rlc.runtime.checkpoint import CheckpointError, latest_checkpoint

    try:
        found = latest_checkpoint(run_dir)
    except CheckpointError:
        found = None
    if found is None:
        return _resumable(run_dir)
    return f"the last checkpoint is {found[0]} (step {found[1].step}): continue with `{resume_command()}`"


def _resumable(run_dir: Path) -> str:
    from rlc.runtime.checkpoint import CheckpointError, latest_checkpoint

    try:
        found = latest_checkpoint(run_dir)
    except CheckpointError as exc:
        return f"the newest checkpoint cannot be resumed ({exc})"
    if found is None:
        return "no checkpoint was completed, so a new run starts from the beginning (pass --overwrite)"
    return f"the newest complete checkpoint is {found[0].name}: continue with `{resume_command()}`"


def actor_death(exc: Exception) -> str:
    """One line for a dead actor: its class and the error that killed it (the last line of the remote traceback,
    e.g. ``ValueError: ...``), else the first line Ray printed."""
    text = str(exc).strip()
    named = re.search(r"class_name: (\S+)", text) or re.search(r"ray::[\w.-]+:(\w+)\.__init__", text)
    who = f"{named.group(1)}: " if named else ""
    raised = [line.strip() for line in text.splitlines() if re.match(r"\s*\w+(\.\w+)*(Error|Exception): ", line)]
    cause = raised[-1] if raised else (text.splitlines()[0] if text else type(exc).__name__)
    return who + cause


def run_controller(work: Callable[[], T], run_dir: Path, stopped_by: Sequence[str] = ()) -> T:
    """The training loop (or the resume's first sync), with a dead actor, a wait past its bound, a full disk or
    a failed write turned into a resumable message. ``stopped_by``: the stop signals this driver received so far
    (read when the work fails): a role lost after one was lost to the same signal, and the message says so."""
    from ray.exceptions import GetTimeoutError, RayActorError

    from rlc.runtime.checkpoint import checkpoints_dir, disk_full, full_after_failed_write
    from rlc.runtime.stall import StallError

    try:
        return work()
    except StallError as exc:
        raise RunError(f"{exc}. The run stopped: {_resumable(run_dir)}") from None
    except GetTimeoutError as exc:  # a TimeoutError, hence an OSError: not a failed write
        if stopped_by:
            raise RunError(_lost_to_the_stop(stopped_by[0], "a role stopped answering", run_dir)) from None
        stopped = f"the run stopped: {_resumable(run_dir)}"
        raise RunError(
            f"a role of the run stopped answering ({first_line(exc, 'no answer in time')}); {stopped}"
        ) from None
    except RayActorError as exc:
        death = actor_death(exc)
        if stopped_by:
            raise RunError(_lost_to_the_stop(stopped_by[0], f"a Ray actor died ({death})", run_dir)) from None
        raise RunError(f"a Ray actor of the run died ({death}); the run stopped: {_resumable(run_dir)}") from None
    except RunError:  # already says what happened
        raise
    except Exception as exc:  # a trainer's OSError comes inside a RayTaskError, whose own errno is None
        full = disk_full(exc)
        if full is None and _during_checkpoint(OSError(), exc, run_dir):  # a library's words for it, or none
            full = full_after_failed_write(exc, checkpoints_dir(run_dir))
        if full is not None:
            raise RunError(_disk_full_message(full, exc, run_dir)) from None
        if stopped_by:  # Ray itself going down under the signal (its raylet): whatever the call raised
            raise RunError(_lost_to_the_stop(stopped_by[0], first_line(exc, type(exc).__name__), run_dir)) from None
        cause = vars(exc).get("cause", exc)
        if not isinstance(cause, OSError):
            raise
        where = f" ({cause.filename})" if cause.filename else ""
        why = cause.strerror or first_line(cause, type(cause).__name__)
        raise RunError(
            f"writing the run's files failed: {why}{where}; the run stopped: {_resumable(run_dir)}"
        ) from None


def _lost_to_the_stop(signal_name: str, what: str, run_dir: Path) -> str:
    """A stop signal that also reached the run's Ray processes (a scheduler signalling every process of the job,
    where this driver did not start them: a cluster's raylets stop on SIGTERM and take their actors along)."""
    return (
        f"stopped by {signal_name}, which also reached the run's Ray processes: {what} before the step in progress "
        f"was checkpointed; {_last_checkpoint(run_dir)}"
    )


def _disk_full_message(full: OSError, exc: BaseException, run_dir: Path) -> str:
    """What to do about a full disk: during a checkpoint, that the previous one is intact (the half-written one
    is removed, which also gives back its space); elsewhere, which file could not be written."""
    import errno
    import shutil

    from rlc.runtime.checkpoint import CheckpointError, checkpoints_dir, latest_checkpoint, staging_dirs

    quota = full.errno == errno.EDQUOT
    what = "the disk quota is exceeded on" if quota else "no space left on"
    free = "free space (or raise the quota)" if quota else "free space"
    if not _during_checkpoint(full, exc, run_dir):
        where = f" ({full.filename})" if full.filename else ""
        return (
            f"writing the run's files failed: {full.strerror or 'No space left on device'}{where}; the run "
            f"stopped: {free} on the device holding {run_dir}, then {_resumable(run_dir)}"
        )
    partial = staging_dirs(run_dir)
    for folder in partial:  # never trusted by --resume, and the space is what the next try needs
        shutil.rmtree(folder, ignore_errors=True)
    removed = f" (the partial {', '.join(p.name for p in partial)} was removed)" if partial else ""
    head = f"{what} the device holding {checkpoints_dir(run_dir)} while writing a checkpoint{removed}"
    try:
        found = latest_checkpoint(run_dir)
    except CheckpointError as bad:
        return f"{head}; the previous checkpoint cannot be resumed ({bad}); {free} and start again with --overwrite"
    if found is None:
        return f"{head}; no checkpoint was completed before it: {free} and start again with --overwrite"
    return f"{head}; the previous checkpoint {found[0].name} is intact: {free} and `{resume_command()}`"


def _during_checkpoint(full: OSError, exc: BaseException, run_dir: Path) -> bool:
    """Whether a full disk stopped a checkpoint: the failed file is under RUN/checkpoints, or the error came
    through the checkpoint's code (`Controller._checkpoint`, the trainer's `save_checkpoint`, `finalize`)."""
    import traceback

    from rlc.runtime.checkpoint import checkpoints_dir

    if full.filename:
        try:
            Path(os.fsdecode(full.filename)).resolve().relative_to(checkpoints_dir(run_dir).resolve())
            return True
        except (ValueError, OSError, RuntimeError):
            pass
    names = {"_checkpoint", "save_checkpoint", "finalize", "staging_dir"}
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and not any(current is s for s in seen):
        seen.append(current)
        if any(frame.f_code.co_name in names for frame, _ in traceback.walk_tb(current.__traceback__)):
            return True
        current = current.__cause__ or current.__context__
    return False
