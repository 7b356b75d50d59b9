"""SIGTERM (what `kill`, schedulers, Kubernetes and `ray job stop` send) stops `rlc run` as Ctrl-C does: the step
in progress is finished and recorded, a final checkpoint is written, and the run reports "stopped at step N of M"
and exits non-zero, never "done".

The driver here is the real `run_plan` and the real `Controller` loop (steps, metrics, checkpoints); only Ray, the
roles and the trainer's arithmetic are replaced, so no actor starts. The end-to-end check against a real run is
`test_sigterm_stops_a_real_run_with_a_checkpoint` (slow).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from paths import REPO
from plan_fixtures import CPU_SPEC, cpu_plan, spec_from
from typer.testing import CliRunner

from rlc.runtime import launch

pytest.importorskip("ray")


class FakeWorkflow:
    """A batch is always ready; nothing runs on engines."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop

    def fill(self) -> None:
        pass

    def collect(self, timeout: float) -> None:
        time.sleep(min(timeout, 0.01))

    def has_batch(self) -> bool:
        return True

    def next_batch(self) -> list[Any]:
        return [object()]

    def batch_record(self, groups: list[Any]) -> list[tuple[int, int]]:
        return []

    def resume_cursor(self) -> int:
        return 7 * self.loop.step

    def in_flight(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


class FakeTrainer:
    def __init__(self) -> None:
        self.saved: list[str] = []

    def save_checkpoint(self, path: str) -> None:
        (Path(path) / "weights.bin").write_bytes(b"w")
        self.saved.append(path)

    def built_layouts(self) -> list[dict[str, Any]]:
        return []

    def shutdown(self) -> None:
        pass


class FakePool:
    restarts = 0
    engines = ()

    def shutdown(self) -> None:
        pass


def _harness(monkeypatch: pytest.MonkeyPatch, signal_during_step: int | None, signum: int) -> FakeTrainer:
    """Replace Ray and the roles; the controller's trainer step sends `signum` to this process while step
    `signal_during_step` trains (and is still training when the handler runs)."""
    from rlc.runtime import controller as controller_module

    trainer = FakeTrainer()

    class Stepping(controller_module.Controller):
        def prepare_weight_path(self) -> None:
            pass

        def _train_and_sync(self, groups: list[Any]) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
            t0 = time.perf_counter()
            if self.step + 1 == signal_during_step:
                os.kill(os.getpid(), signum)
                time.sleep(0.3)  # the driver's handler runs while this step is still training
            time.sleep(0.02)
            t1 = time.perf_counter()
            return {"train/tokens": 10.0}, {"build batch": (t0, t0), "train": (t0, t1), "weight sync": (t1, t1)}

    monkeypatch.setattr(controller_module, "Controller", Stepping)
    monkeypatch.setattr(launch, "_preflight", lambda *a: (Path("model"), None))
    monkeypatch.setattr(launch, "load_inputs", lambda *a: (None, lambda c, a: 0.0))
    monkeypatch.setattr(launch, "start_ray", lambda *a: False)
    monkeypatch.setattr(launch, "build_roles", lambda *a: (trainer, FakePool(), None, None))
    monkeypatch.setattr(launch, "check_built_layout", lambda *a: [])
    monkeypatch.setattr(launch, "write_layout_record", lambda *a: None)
    monkeypatch.setattr(launch, "write_run_record", lambda *a: None)
    monkeypatch.setattr(launch, "write_run_report", lambda *a: None)
    return trainer


def _plan(tmp_path: Path, steps: int = 10):  # type: ignore[no-untyped-def]
    plan = cpu_plan(model_path=str(tmp_path / "model"), run_dir=str(tmp_path / "run"), build_tiny=False)
    plan.loggers = ["jsonl"]
    plan.schedule.steps = steps
    plan.schedule.checkpoint_every = 100  # no checkpoint falls due before the stop
    return plan


def _ray_like_sigterm(signum: int, frame: Any) -> None:
    """What ray.init installs in the driver: exit at once, no checkpoint."""
    sys.exit(signum)


@pytest.fixture
def ray_sigterm():  # type: ignore[no-untyped-def]
    before = signal.signal(signal.SIGTERM, _ray_like_sigterm)
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.fixture
def fake_workflow(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlc.runtime import controller as controller_module

    monkeypatch.setattr(controller_module, "GenerateWorkflow", FakeWorkflow)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_finishes_the_step_checkpoints_it_and_reports_a_partial_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    ray_sigterm: None,
    fake_workflow: None,
    signum: int,
) -> None:
    trainer = _harness(monkeypatch, signal_during_step=3, signum=signum)
    run_dir = tmp_path / "run"
    with pytest.raises(launch.RunStopped) as stopped:
        launch.run_plan(_plan(tmp_path), run_dir)
    name = signal.Signals(signum).name
    message = str(stopped.value)
    assert message.startswith(f"stopped at step 3 of 10 ({name}); the last checkpoint is ")
    assert str(run_dir / "checkpoints" / "step-000003") in message and "--resume" in message
    assert isinstance(stopped.value, launch.RunError)  # the CLI's exit-code mapping applies
    out = capsys.readouterr().out
    assert f"interrupted ({name})" in out
    assert "done:" not in out
    # The step that was training when the signal came is finished, recorded and checkpointed.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    final = run_dir / "checkpoints" / "step-000003"
    assert (final / "COMPLETE").is_file() and (final / "weights.bin").is_file()
    state = json.loads((final / "controller.json").read_text())
    assert (state["step"], state["version"], state["data_cursor"]) == (3, 3, 21)
    assert len(trainer.saved) == 1
    # The handlers are the ones from before the run again (Ray's SIGTERM, Python's SIGINT).
    assert signal.getsignal(signal.SIGTERM) is _ray_like_sigterm
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert not (run_dir / ".rlc-run.lock").exists()


@pytest.mark.timeout(120)
def test_an_uninterrupted_run_is_done_and_checkpoints_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    ray_sigterm: None,
    fake_workflow: None,
) -> None:
    trainer = _harness(monkeypatch, signal_during_step=None, signum=signal.SIGTERM)
    assert launch.run_plan(_plan(tmp_path, steps=4), tmp_path / "run") == 4
    assert "done: 4 step(s)" in capsys.readouterr().out
    assert [Path(p).name for p in trainer.saved] == [".step-000004.tmp"]  # the last step's, no extra one


@pytest.mark.timeout(120)
def test_a_signal_after_a_due_checkpoint_writes_no_second_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ray_sigterm: None, fake_workflow: None
) -> None:
    trainer = _harness(monkeypatch, signal_during_step=3, signum=signal.SIGTERM)
    plan = _plan(tmp_path)
    plan.schedule.checkpoint_every = 3
    with pytest.raises(launch.RunStopped, match=r"stopped at step 3 of 10 \(SIGTERM\)"):
        launch.run_plan(plan, tmp_path / "run")
    assert [Path(p).name for p in trainer.saved] == [".step-000003.tmp"]


def test_the_cli_exits_non_zero_on_a_stopped_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlc.cli import app
    from rlc.compiler.emit import emit_plan_dir

    plan_dir = tmp_path / "plan"
    run_dir = tmp_path / "run"
    plan = cpu_plan(model_path=str(tmp_path / "model"), run_dir=str(run_dir), build_tiny=False)
    emit_plan_dir(plan, spec_from(CPU_SPEC), plan_dir, provenance={})
    final = run_dir / "checkpoints" / "step-000003"
    final.mkdir(parents=True)
    (final / "COMPLETE").write_text("3\n")
    (final / "controller.json").write_text('{"step": 3, "version": 3, "data_cursor": 48}')

    def stopped(*args: Any, **kwargs: Any) -> int:
        raise launch.RunStopped(3, 80, "SIGTERM", run_dir)

    monkeypatch.setattr(launch, "run_plan", stopped)
    result = CliRunner().invoke(app, ["run", str(plan_dir)])
    assert result.exit_code == 1, result.output
    assert "rlc run: stopped at step 3 of 80 (SIGTERM); the last checkpoint is" in result.output
    assert str(final) in result.output and f"rlc run {plan_dir} --resume" in result.output
    assert "done:" not in result.output and "Traceback" not in result.output


# --------------------------------------------------------------------------------------------- end to end

RLC = [sys.executable, "-m", "rlc"]


def _process_tree(pid: int) -> list[int]:
    """`pid` and every process under it (the embedded Ray's GCS and raylet, the actors, their vLLM processes)."""
    table = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    children: dict[int, list[int]] = {}
    for line in table.splitlines():
        child, parent = (int(x) for x in line.split())
        children.setdefault(parent, []).append(child)
    found, stack = [], [pid]
    while stack:
        found.append(stack.pop())
        stack += children.get(found[-1], [])
    return found


@pytest.mark.slow
def test_sigterm_stops_a_real_run_with_a_checkpoint(tmp_path: Path) -> None:
    """The quickstart under SIGTERM to every process of the run after a few steps, as Slurm's `scancel` sends it:
    the driver alone acts on it (the Ray processes and actors leave it to the driver), so the run ends with a
    non-zero exit, "stopped at step N", and a checkpoint of exactly step N (checkpoint_every is past the end, so
    only the stop writes one); `--resume` then runs to the end with every step recorded exactly once and no
    half-written checkpoint left."""
    plan = tmp_path / "plan"
    run_dir = tmp_path / "run"
    compile_args = [*RLC, "compile", str(REPO / "examples" / "quickstart.yaml"), "-o", str(plan)]
    for item in (f"output.dir={run_dir}", "algorithm.steps=200", "output.checkpoint_every=1000"):
        compile_args += ["--set", item]
    subprocess.run(compile_args, check=True, capture_output=True, text=True)
    proc = subprocess.Popen([*RLC, "run", str(plan)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "".join(lines)[-3000:]
    tree = _process_tree(proc.pid)
    assert len(tree) > 3  # the driver, Ray's GCS and raylet, the actors
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    code = proc.wait(timeout=300)
    reader.join(timeout=10)
    output = "".join(lines)
    assert code == 1, output[-3000:]
    assert "interrupted (SIGTERM)" in output and "Traceback" not in output
    assert "done:" not in output
    steps = len(metrics.read_text().splitlines())
    assert f"stopped at step {steps} of 200 (SIGTERM)" in output
    assert (run_dir / "checkpoints" / f"step-{steps:06d}" / "COMPLETE").is_file()
    assert not (run_dir / ".rlc-run.lock").exists()
    resumed = subprocess.run([*RLC, "run", str(plan), "--resume"], capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    numbers = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]
    assert numbers == list(range(1, 201))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")) == []
