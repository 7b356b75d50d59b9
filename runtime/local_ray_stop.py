"""Stopping the embedded Ray at the end of a run without its grace period.

The embedded Ray's processes start with SIGTERM blocked (`run_end.stop_left_to_this_process`), so `ray.shutdown`'s
SIGTERM-then-wait-then-SIGKILL costs about a second per process: 5.1 s measured at the end of every run, against
0.3 s killing them at once. By then the run's actors have ended and its files are written, so nothing is lost by
not asking. Killing the raylet outright would orphan the processes it started (its dashboard and runtime-env
agents, which it ends itself only on a graceful exit), so every descendant of Ray's processes, as it was just before
the stop, is killed too.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from pathlib import Path

__all__ = ["stop_local_ray"]


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (/proc/PID/stat field 22), which tells a reused pid apart; None
    for a process that is gone or has exited (a zombie waiting for its parent)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _family(roots: Iterable[int]) -> dict[int, str]:
    """Every process under `roots` (roots included), with its start time; empty where /proc cannot be read."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found: dict[int, str] = {}
    todo = list(roots)
    while todo:
        pid = todo.pop()
        started = _start_time(pid)
        if pid in found or started is None:
            continue
        found[pid] = started
        todo += children.get(pid, [])
    return found


def stop_local_ray() -> None:
    """`ray.shutdown` of the Ray this process started, its processes and theirs killed at once (see the module
    docstring). Where Ray's internals differ from what this expects, it is plain `ray.shutdown`."""
    import ray

    node = getattr(getattr(ray, "_private", None), "worker", None)
    node = getattr(node, "_global_node", None)
    processes = getattr(node, "all_processes", None)
    kill = getattr(node, "kill_all_processes", None)
    if not isinstance(processes, dict) or kill is None:
        ray.shutdown()
        return
    roots = [info.process.pid for infos in processes.values() for info in infos if getattr(info, "process", None)]
    family = _family(roots)
    node.kill_all_processes = lambda **kw: kill(**{**kw, "allow_graceful": False})  # type: ignore[union-attr]
    ray.shutdown()
    for pid, started in family.items():
        if _start_time(pid) == started:  # still the process seen before the stop, not a reused pid
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
