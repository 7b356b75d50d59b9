"""Run-time failures on the cpu target end as one clear `rlc run: error:` line, never a traceback or a hang.

A reward function that raises or hangs stops the run with the sample that caused it; a killed trainer actor stops it
with a message that says how to resume. Each starts Ray, a vLLM engine and a trainer (about a minute).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from test_run_e2e import RLC, compile_quickstart

pytestmark = pytest.mark.slow


def test_reward_that_raises_or_hangs_stops_with_the_sample(tmp_path: Path) -> None:
    """The first call raises, every later one never returns: the run warns about the first, interrupts the others
    at the plan's bound, and stops past the plan's share with the last one."""
    (tmp_path / "badreward.py").write_text(
        "calls = 0\n"
        "def score(completion, answer, **_):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls == 1:\n"
        "        raise ValueError(f'cannot parse {completion!r}')\n"
        "    while True:\n"
        "        pass\n"
    )
    plan = compile_quickstart(tmp_path, "reward.fn=badreward:score", "reward.timeout_s=0.05", "algorithm.steps=4")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([*RLC, "run", str(plan)], capture_output=True, text=True, timeout=600, env=env)
    output = result.stdout + result.stderr
    print(result.stderr[-1500:])  # the message, for the record (pytest -s)
    assert result.returncode == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert "rlc run: error: reward 'badreward:score' did not return within 0.05 s (reward.timeout_s)" in result.stderr
    assert "(prompt '" in result.stderr and "answer '" in result.stderr
    assert "fix the reward function" in result.stderr and "reward.max_failed_share" in result.stderr
    assert "warning: reward 'badreward:score' raised ValueError: cannot parse" in output  # the first, before the stop


def _descendants_named(title: str) -> list[int]:
    """Pids of this process's descendants whose command line (Ray's process title) starts with `title`."""
    parents: dict[int, int] = {}
    titles: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            titles[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])

    def mine(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == os.getpid():
                return True
        return False

    return [pid for pid, text in titles.items() if text.startswith(title) and mine(pid)]


@pytest.mark.timeout(900)  # a run that never noticed the dead actor fails here instead of hanging the suite
def test_killed_trainer_actor_stops_with_a_resumable_message(tmp_path: Path) -> None:
    import ray

    from rlc.compiler.manifest import load_plan
    from rlc.runtime.errors import RunError
    from rlc.runtime.launch import run_plan

    plan_dir = compile_quickstart(tmp_path, "algorithm.steps=40", "output.checkpoint_every=2")
    run_dir = tmp_path / "run"
    killed: list[int] = []

    def killer() -> None:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and not list((run_dir / "checkpoints").glob("step-000002")):
            time.sleep(0.2)
        while time.monotonic() < deadline and not killed:
            for pid in _descendants_named("ray::TrainerWorker"):
                os.kill(pid, signal.SIGKILL)  # the run's own trainer process, by pid
                killed.append(pid)
            time.sleep(0.5)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        with pytest.raises(RunError) as stopped:
            run_plan(load_plan(plan_dir), run_dir)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    thread.join(timeout=10)
    assert killed, "the trainer was never killed"
    message = str(stopped.value)
    print(message)  # for the record (pytest -s)
    assert message.startswith("a Ray actor of the run died (TrainerWorker: ")
    assert "the newest complete checkpoint is step-" in message and "--resume" in message
