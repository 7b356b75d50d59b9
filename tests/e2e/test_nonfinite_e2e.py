"""Steps whose update a non-finite loss or gradient norm skipped are counted and named on the progress line; the plan's
number of them in a row (`schedule.max_nonfinite_steps`) stops the run with one line naming the step, the first
non-finite quantity and the checkpoint to resume from.

The driver is the real `run_plan` and `Controller` loop (steps, metrics, checkpoints, the stop); the trainer's results
are scripted, in the form `TrainerWorker.train_step` reports skips (see `test_robustness_signals`). The end-to-end
check is a real quickstart run whose reward function returns 3e38 for one completion in four (slow).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_robustness_signals import _harness, _plan, fake_workflow, ray_sigterm  # noqa: F401 (fixtures)
from test_run_e2e import RLC, compile_quickstart, read_metrics

from rlc.runtime import launch
from rlc.runtime.nonfinite import QUANTITIES, skip_metrics

LOSS, GRAD_NORM = (QUANTITIES.index(q) + 1 for q in ("loss", "grad_norm"))


def _scripted(monkeypatch: pytest.MonkeyPatch, skips: dict[int, tuple[int, int]]) -> None:
    """Each step's trainer result: {step: (optimizer steps skipped, first non-finite quantity's code)}."""
    from rlc.runtime import controller as controller_module

    _harness(monkeypatch, signal_during_step=None, signum=signal.SIGTERM)
    stepping = controller_module.Controller

    class Skipping(stepping):  # type: ignore[misc, valid-type]
        def _train_and_sync(self, groups: list[Any]) -> tuple[dict[str, Any], dict[str, tuple[float, float]]]:
            stats, spans = super()._train_and_sync(groups)
            skipped, code = skips.get(self.step + 1, (0, 0))
            stats["train/optimizer_steps"] = 2.0
            stats.update(skip_metrics({"skipped_steps": float(skipped), "nonfinite": float(code)}))
            return stats, spans

    monkeypatch.setattr(controller_module, "Controller", Skipping)


@pytest.mark.timeout(120)
def test_skipped_steps_are_counted_named_and_stop_the_run_at_the_bound(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    ray_sigterm: None,  # noqa: F811
    fake_workflow: None,  # noqa: F811
) -> None:
    # step 2 skips one of two updates; 3 is clean (the count starts again); 4, 5, 6 skip: the third in a row stops
    _scripted(monkeypatch, {2: (1, LOSS), 4: (2, GRAD_NORM), 5: (2, LOSS), 6: (2, LOSS)})
    plan = _plan(tmp_path)
    plan.schedule.checkpoint_every = 1
    assert plan.schedule.max_nonfinite_steps == 3  # the plan's default
    run_dir = tmp_path / "run"
    with pytest.raises(launch.RunError) as stopped:
        launch.run_plan(plan, run_dir)
    message = str(stopped.value)
    assert message == (
        "step 6: a non-finite gradient norm (first at step 4) skipped the update of 3 steps in a row, the plan's bound "
        "(schedule.max_nonfinite_steps = 3); no non-finite value reached the weights. The run stopped: `rlc run "
        "PLANDIR --resume` continues from the newest checkpoint, step-000005 (step 5), once what made the gradient "
        "norm non-finite (rewards, learning rate, data) is fixed"
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # the stopping step is recorded
    assert [r["train/nonfinite_skipped"] for r in rows] == [0, 1, 0, 1, 2, 3]
    assert [r["train/skipped_updates"] for r in rows] == [0, 1, 0, 2, 2, 2]
    assert [r.get("train/nonfinite") for r in rows] == [None, "loss", None, "grad_norm", "loss", "loss"]
    assert not (run_dir / "checkpoints" / "step-000006").exists()  # nothing is checkpointed past the stop
    out = capsys.readouterr().out
    assert "step 2/10" in out and ": non-finite loss, 1 of 2 updates skipped (1 in a row)" in out
    assert ": non-finite gradient norm, update skipped (1 in a row)" in out
    assert ": non-finite loss, update skipped (3 in a row)" in out
    assert "done:" not in out


@pytest.mark.timeout(120)
def test_a_plan_may_allow_more_skips(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    ray_sigterm: None,  # noqa: F811
    fake_workflow: None,  # noqa: F811
) -> None:
    _scripted(monkeypatch, {s: (2, LOSS) for s in (1, 2, 3)})
    plan = _plan(tmp_path, steps=4)
    plan.schedule.max_nonfinite_steps = 4
    assert launch.run_plan(plan, tmp_path / "run") == 4


def test_older_plans_read_the_default_bound() -> None:
    from plan_fixtures import cpu_plan

    from rlc.schemas.plan import Plan

    data = cpu_plan(model_path="m", run_dir="r", build_tiny=False).model_dump(mode="json")
    del data["schedule"]["max_nonfinite_steps"]
    assert Plan.model_validate(data).schedule.max_nonfinite_steps == 3


# --------------------------------------------------------------------------------------------- end to end

REWARD = """
calls = 0


def score(completion, answer, **_):
    \"\"\"Exact match, but every fourth completion scores 3e38: finite in float32, NaN GRPO advantages.\"\"\"
    global calls
    calls += 1
    if calls % 4 == 0:
        return 3e38
    return 1.0 if completion.strip() == str(answer).strip() else 0.0
"""


@pytest.mark.slow
def test_a_huge_reward_never_makes_the_loss_or_gradient_nonfinite(tmp_path: Path) -> None:
    """The quickstart with a reward of 3e38 for one completion in four (allowed as failed rewards): every step trains
    on finite numbers, and the failed rewards are counted (`reward/failed`: the test fails if 3e38 stops being
    recognised as a failed reward) and reported."""
    (tmp_path / "hugereward.py").write_text(REWARD)
    settings = ("reward.fn=hugereward:score", "reward.max_failed_share=0.5", "algorithm.steps=3")
    plan = compile_quickstart(tmp_path, *settings)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([*RLC, "run", str(plan)], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 3
    assert all(math.isfinite(r["loss/policy"]) and math.isfinite(r["grad_norm"]) for r in rows), rows
    assert all(r["train/skipped_updates"] == 0 for r in rows)
    assert sum(r["reward/failed"] for r in rows) > 0
    assert "returned 3e+38, beyond the largest reward magnitude accepted (1e+12)" in result.stdout
    assert "its group trains with zero advantages" in result.stdout  # no false signal from the 0 it scored
