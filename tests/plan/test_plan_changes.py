"""`rlc run --allow-modified` says exactly what a hand edit changed before it runs, and SUMMARY.md flags user code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from plan_fixtures import CPU_SPEC, cpu_plan, spec_from

from rlc.compiler.emit import emit_plan_dir
from rlc.compiler.plan_changes import describe_modifications

RLC = [sys.executable, "-m", "rlc"]


def _plan_dir(tmp_path: Path, reward: str = "exact_match") -> Path:
    plan = cpu_plan(model_path=str(tmp_path / "no-model"), run_dir=str(tmp_path / "run"), build_tiny=False)
    plan.data.reward = reward
    out = tmp_path / "plan"
    emit_plan_dir(plan, spec_from(CPU_SPEC), out, provenance={})
    return out


def test_allow_modified_prints_each_changed_value(tmp_path: Path) -> None:
    plan_dir = _plan_dir(tmp_path)
    data = json.loads((plan_dir / "plan.json").read_text())
    data["schedule"]["steps"] = 81
    data["algorithm"]["lr"] = 0.5
    (plan_dir / "plan.json").write_text(json.dumps(data, indent=1))
    (plan_dir / "launch.sh").write_text("#!/bin/sh\n")
    (plan_dir / "notes.txt").write_text("mine")
    assert describe_modifications(plan_dir) == [
        "launch.sh: changed; rlc run does not read it",
        "plan.json: ~ algorithm.lr: 0.001 → 0.5  (+0.499)",
        "plan.json: ~ schedule.steps: 80 → 81  (+1)",
        "notes.txt: added; rlc run does not read it",
    ]
    result = subprocess.run(
        [*RLC, "run", str(plan_dir), "--allow-modified"], capture_output=True, text=True, timeout=120
    )
    assert "running a plan that differs from the compiled one" in result.stderr
    assert "schedule.steps: 80 → 81" in result.stderr and "algorithm.lr: 0.001 → 0.5" in result.stderr
    assert "model folder not found" in result.stderr  # and then it ran on (to the pre-flight here)
    refused = subprocess.run([*RLC, "run", str(plan_dir)], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "differs from the compiled one" not in refused.stderr


def test_reformatted_or_broken_plan_json(tmp_path: Path) -> None:
    plan_dir = _plan_dir(tmp_path)
    text = (plan_dir / "plan.json").read_text()
    (plan_dir / "plan.json").write_text(json.dumps(json.loads(text)))
    assert describe_modifications(plan_dir) == ["plan.json: reformatted; every value is as compiled"]
    (plan_dir / "plan.json").write_text("{")
    (line,) = describe_modifications(plan_dir)
    assert line.startswith("plan.json: no longer a valid plan")
    assert describe_modifications(_plan_dir(tmp_path / "fresh")) == []


def test_summary_flags_a_custom_reward_as_user_code(tmp_path: Path) -> None:
    custom = (_plan_dir(tmp_path / "a", reward="mylab.rewards:score") / "SUMMARY.md").read_text()
    assert "**Runs user code.** The reward function `mylab.rewards:score` is imported and called" in custom
    builtin = (_plan_dir(tmp_path / "b") / "SUMMARY.md").read_text()
    assert "Runs user code" not in builtin
