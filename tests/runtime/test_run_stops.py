"""A stop signal sent to every process of the job (Slurm's `scancel`) is the driver's to handle: what the driver
starts (the embedded Ray, and through it every actor) leaves SIGTERM to it, and where the signal still took the
run's Ray processes (a cluster's raylets) the run ends in one line naming the signal and the checkpoint to resume
from, not "a Ray actor of the run died"."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlc.runtime.checkpoint import ControllerState, finalize, staging_dir
from rlc.runtime.errors import RunError
from rlc.runtime.run_end import run_controller, stop_left_to_this_process

# A process that starts a grandchild (as the raylet starts workers, and a worker vLLM's engine core), both then
# sleeping: each prints its pid.
TREE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"])
print(child.pid, flush=True)
child.wait()
"""


def _blocked(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
    return bool(mask & (1 << (signal.SIGTERM - 1)))


def test_processes_started_for_the_run_leave_sigterm_to_the_driver() -> None:
    """Started inside the block, a process and the one it starts ignore a SIGTERM to each of them and still end on
    SIGKILL; the driver's own mask is as before."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    with stop_left_to_this_process():
        proc = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before
    try:
        assert proc.stdout is not None
        grandchild = int(proc.stdout.readline())
        assert _blocked(proc.pid) and _blocked(grandchild)
        for pid in (proc.pid, grandchild):
            subprocess.run(["kill", "-TERM", str(pid)], check=True)
        time.sleep(0.5)
        assert proc.poll() is None and Path(f"/proc/{grandchild}").exists()
    finally:
        proc.kill()
        subprocess.run(["kill", "-KILL", str(grandchild)], check=False)
        proc.wait(timeout=10)


def _dead_actor() -> BaseException:
    from ray.exceptions import ActorDiedError

    return ActorDiedError()


@pytest.mark.parametrize("lost", ["actor", "other"])
def test_a_role_lost_after_the_stop_signal_is_named_as_the_signal_with_the_checkpoint(
    tmp_path: Path, lost: str
) -> None:
    """The driver got SIGTERM, then a call failed because the same signal stopped Ray: the line names the signal and
    the checkpoint to resume from. Without a signal a dead actor is still reported as one."""
    pytest.importorskip("ray")
    run = tmp_path / "run"
    staged = staging_dir(run, 4)
    finalize(run, staged, ControllerState(step=4, version=4, data_cursor=16), keep=2)

    def work() -> int:
        raise _dead_actor() if lost == "actor" else ConnectionError("the raylet is gone")

    with pytest.raises(RunError) as caught:
        run_controller(work, run, ["SIGTERM"])
    message = str(caught.value)
    assert message.startswith("stopped by SIGTERM, which also reached the run's Ray processes: ")
    assert message.endswith(
        f"before the step in progress was checkpointed; the last checkpoint is {run / 'checkpoints' / 'step-000004'} "
        "(step 4): continue with `rlc run PLANDIR --resume`"
    )
    assert "\n" not in message
    if lost == "actor":
        with pytest.raises(RunError, match=r"^a Ray actor of the run died"):
            run_controller(work, run)


# A child that stops on SIGTERM as vLLM's engine core does (its own handler: exit).
HANDLING_CHILD = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(1)); time.sleep(60)"


@pytest.mark.ray
def test_actors_leave_sigterm_to_the_driver_and_so_do_the_processes_they_start(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """After `actor_leaves_stop_to_driver` (what the run's role builders apply to each actor), a SIGTERM to the actor
    and to the process it then starts (with a handler of its own) stops neither; an actor without it stops."""
    import ray

    from rlc.runtime.run_end import actor_leaves_stop_to_driver

    class Engine:  # defined here so that Ray ships it by value; stands for an engine actor
        def pid(self) -> int:
            import os

            return os.getpid()

        async def start(self, leave: bool) -> int:  # a process started as vLLM starts its engine core
            if leave:  # as RolloutEngine does before it starts vLLM
                actor_leaves_stop_to_driver(self)
            self.child = subprocess.Popen([sys.executable, "-c", HANDLING_CHILD])
            return self.child.pid

        async def child_running(self) -> bool:
            return self.child.poll() is None

    actor_class = ray.remote(num_cpus=0)(Engine)
    rank, engine, plain = actor_class.remote(), actor_class.remote(), actor_class.remote()
    ray.get(rank.__ray_call__.remote(actor_leaves_stop_to_driver))  # as the role builders do for trainer ranks
    pids = ray.get([rank.pid.remote(), engine.pid.remote(), plain.pid.remote()])
    children = ray.get([engine.start.remote(True), plain.start.remote(False)])
    for pid in pids + children:
        subprocess.run(["kill", "-TERM", str(pid)], check=True)
    time.sleep(1.0)
    assert ray.get([rank.pid.remote(), engine.pid.remote()], timeout=30) == pids[:2]
    assert ray.get(engine.child_running.remote(), timeout=30)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(plain.pid.remote(), timeout=30)
    for actor in (rank, engine):
        ray.kill(actor)
    for pid in children:
        subprocess.run(["kill", "-KILL", str(pid)], check=False)
