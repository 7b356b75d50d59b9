"""An actor's process exits within seconds of its raylet's death instead of running on for minutes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlc.runtime.raylet_watch import _alive

#: The "actor": watches its parent (the stand-in raylet) and otherwise sleeps.
CHILD = (
    "from rlc.runtime.raylet_watch import exit_with_raylet\n"
    "import time\n"
    "exit_with_raylet(0.1, force=True)\n"
    "time.sleep(300)\n"
)
#: The stand-in raylet: starts the actor, says its pid, then waits to be killed.
PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', sys.argv[1]])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(300)\n"
)


def _wait_gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_an_actor_exits_when_its_raylet_parent_dies() -> None:
    raylet = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True)
    assert raylet.stdout is not None
    actor = int(raylet.stdout.readline())
    try:
        time.sleep(1.0)
        assert _alive(actor)  # watching a live raylet changes nothing
        raylet.kill()
        raylet.wait()
        assert _wait_gone(actor, 10.0), "the actor outlived its raylet"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(actor, signal.SIGKILL)


def test_an_actor_exits_when_the_raylet_named_by_ray_dies(tmp_path: Path) -> None:
    raylet = subprocess.Popen(["sleep", "300"])
    env = {**os.environ, "RAY_RAYLET_PID": str(raylet.pid)}
    actor = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        assert actor.poll() is None
        raylet.kill()
        raylet.wait()
        assert actor.wait(timeout=10) == 1
        assert actor.stderr is not None and f"raylet (pid {raylet.pid}) is gone" in actor.stderr.read()
    finally:
        actor.kill()
        raylet.kill()


def test_outside_a_ray_worker_nothing_is_watched() -> None:
    from rlc.runtime.raylet_watch import exit_with_raylet

    assert exit_with_raylet() is None
