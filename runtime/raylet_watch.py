"""Actors exit soon after their node's raylet is gone, instead of running on (and holding devices) for minutes.

A trainer or engine process started by a raylet that dies (the node's Ray killed, its head gone) is left
running: its calls never come, yet it holds its memory and devices, and its collective peers wait on it. Each
such actor watches its raylet (Ray passes its pid to workers as RAY_RAYLET_PID; otherwise the process's parent,
which for a Ray worker is the raylet) and exits when it is gone.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["WATCH_EVERY_S", "exit_with_raylet"]

#: Seconds between two looks at the raylet (a look is one `kill(pid, 0)`).
WATCH_EVERY_S = 2.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie nobody reaped yet is gone too
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _in_ray_worker() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE
    except Exception:
        return False


def exit_with_raylet(
    every: float = WATCH_EVERY_S, *, force: bool = False, on_gone: Callable[[str], None] | None = None
) -> threading.Thread | None:
    """Start a daemon thread that ends this process (exit status 1) once its raylet is gone; only inside a
    Ray worker unless `force`. Returns the thread, or None where nothing is watched."""
    if not force and not _in_ray_worker():
        return None
    parent = os.getppid()
    raylet = int(os.environ.get("RAY_RAYLET_PID", "0") or 0)
    if parent <= 1 and raylet <= 0:
        return None  # already orphaned, or started by init: nothing to tell a loss by

    def gone(why: str) -> None:
        print(f"rlc: {why}; this actor exits (pid {os.getpid()})", file=sys.stderr, flush=True)
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(every)
            if raylet > 0 and not _alive(raylet):
                (on_gone or gone)(f"this node's raylet (pid {raylet}) is gone")
                return
            if parent > 1 and os.getppid() != parent:
                (on_gone or gone)(f"this process's parent (pid {parent}, the raylet) is gone")
                return

    thread = threading.Thread(target=watch, name="rlc-raylet-watch", daemon=True)
    thread.start()
    return thread
