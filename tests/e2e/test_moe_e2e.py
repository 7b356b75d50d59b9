"""`rlc run` of the cpu MoE example: expert parallelism in the trainer (with and without LoRA), MoE rollout in
vLLM, and the post-sync check that stops a run whose engine serves other weights than the trainer's.

Each test starts a Ray, one vLLM engine and two trainer ranks (about a minute on two cores); marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO

from rlc.runtime.sync_check import mean_gap, probe_of

EXAMPLE = REPO / "examples" / "cpu-moe.yaml"
PIPELINE_EXAMPLE = REPO / "examples" / "cpu-moe-pp.yaml"
RLC = [sys.executable, "-m", "rlc"]


def test_the_probe_takes_the_first_scoreable_sequences_cut_short() -> None:
    assert probe_of([[1], [1, 2, 3], list(range(100)), [4, 5]]) == [[1, 2, 3], list(range(64))]
    assert probe_of([[1]]) == []
    # The trainer's row has an unused entry 0; the engine's starts at token 1.
    assert mean_gap([[0.0, -1.0, -2.0]], [[-1.5, -2.0]]) == pytest.approx(0.25)


def _compile(tmp_path: Path, steps: int, example: Path = EXAMPLE, sets: tuple[str, ...] = ()) -> Path:
    plan = tmp_path / "plan"
    args = [*RLC, "compile", str(example), "-o", str(plan), "--set", f"output.dir={tmp_path / 'run'}"]
    args += ["--set", f"algorithm.steps={steps}", "--set", "output.checkpoint_every=100"]
    for setting in sets:
        args += ["--set", setting]
    subprocess.run(args, check=True, capture_output=True, text=True)
    return plan


@pytest.mark.slow
def test_cpu_moe_trains_with_expert_parallelism_as_planned(tmp_path: Path) -> None:
    from layout_record import assert_layout_as_planned

    from rlc.compiler.manifest import load_plan

    plan_dir = _compile(tmp_path, steps=6)
    result = subprocess.run([*RLC, "run", str(plan_dir)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = tmp_path / "run"
    plan = load_plan(plan_dir)
    record = assert_layout_as_planned(run, plan)
    assert record["plan_layout"]["ep"] == 2 and all(r["built"]["ep"] == 2 for r in record["ranks"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    # The engine serves the trainer's weights after every sync: probe and sampled tokens alike.
    assert all(r["sync_check/gap"] < 1e-4 for r in rows), [r["sync_check/gap"] for r in rows]
    # The trainer scored the probe before every step too (null when it did not), and the engine was judged against
    # the weights before the step wherever the step moved the probe past the plan's sync_check_min_step: at least
    # once here, so the run passed that judgment and not only the bound.
    moved = [r["sync_check/step_moved"] for r in rows]
    assert all(m is not None for m in moved) and max(moved) > plan.schedule.sync_check_min_step, moved
    assert all(r["logprob_gap/max"] < 1e-4 for r in rows), [r["logprob_gap/max"] for r in rows]
    # Rollout routing replay (the cpu plan's default): the engine recorded its experts for every step's tokens and
    # the trainer, in float32 like the engine, chose the same ones before replaying them.
    assert plan.role("actor").engine["routing_replay"] == "rollout"
    agreement = [r.get("moe/rollout_routing_agreement") for r in rows]
    assert all(a is not None and a > 0.99 for a in agreement), agreement


@pytest.mark.slow
def test_cpu_moe_trains_lora_adapters_beside_the_experts(tmp_path: Path) -> None:
    """LoRA on the MoE example under EP 2: the attention adapters train, the experts and routers stay frozen, and
    the engine, given the merged weights after every sync, serves what the trainer computes."""
    plan_dir = _compile(tmp_path, steps=4, sets=("lora.rank=4", "lora.alpha=8"))
    result = subprocess.run([*RLC, "run", str(plan_dir)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 5))
    assert all(r["sync_check/gap"] < 1e-4 for r in rows), [r["sync_check/gap"] for r in rows]
    assert all(r["logprob_gap/max"] < 1e-4 for r in rows), [r["logprob_gap/max"] for r in rows]


@pytest.mark.slow
def test_cpu_moe_trains_with_two_pipeline_stages_as_planned(tmp_path: Path) -> None:
    from layout_record import assert_layout_as_planned

    from rlc.compiler.manifest import load_plan

    plan_dir = _compile(tmp_path, steps=4, example=PIPELINE_EXAMPLE)
    result = subprocess.run([*RLC, "run", str(plan_dir)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = assert_layout_as_planned(tmp_path / "run", load_plan(plan_dir))
    assert [r["built"]["pp"] for r in record["ranks"]] == [2, 2]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["sync_check/gap"] < 1e-4 and r["logprob_gap/max"] < 1e-4 for r in rows)
    # The engine's experts reach both stages' routers (each stage reads its own decoder layers' columns).
    assert all(r.get("moe/rollout_routing_agreement", 0.0) > 0.99 for r in rows), rows


@pytest.mark.slow
def test_an_engine_left_on_stale_experts_stops_the_run(tmp_path: Path) -> None:
    """vLLM's own behaviour without rlc's expert repack after a reload: the first post-sync check stops the run."""
    from rlc.runtime.rollout.weight_sync import SKIP_REPACK_ENV

    plan_dir = _compile(tmp_path, steps=4)
    env = {**os.environ, SKIP_REPACK_ENV: "1"}
    result = subprocess.run([*RLC, "run", str(plan_dir)], capture_output=True, text=True, timeout=900, env=env)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert "after the weight sync to version 1, engine 0 scores the trainer's tokens" in out, out[-3000:]
    # Either judgment names it: past the bound, or nearer the weights before the step (the start-up experts it kept).
    assert "serves other weights than the trainer's" in out or "the engine did not take the step" in out, out[-3000:]
    assert "Traceback" not in out
