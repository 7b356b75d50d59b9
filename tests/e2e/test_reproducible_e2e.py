"""Reproducible runs for real: the same plan and seed twice give the same curve, another seed another curve,
and an asynchronous run replays exactly from its own log (`rlc run --replay`).

Each run is a short version of an example (a few steps; engine start-up dominates), run in-process as
`rlc run` runs it. Compared: every step's reward/mean and loss/policy, exactly (plus the other trained
quantities `run_record.COMPARED_KEYS` lists).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO

RLC = [sys.executable, "-m", "rlc"]
STEPS = 8

pytestmark = pytest.mark.slow


def compile_example(name: str, out: Path, run_dir: Path, *overrides: str) -> Path:
    args = [*RLC, "compile", str(REPO / "examples" / f"{name}.yaml"), "-o", str(out)]
    for item in (f"algorithm.steps={STEPS}", f"output.dir={run_dir}", "output.checkpoint_every=1000", *overrides):
        args += ["--set", item]
    subprocess.run(args, check=True, capture_output=True, text=True)
    return out


def run(plan_dir: Path, run_dir: Path, replay: Path | None = None) -> list[dict]:
    from rlc.compiler.manifest import load_plan
    from rlc.runtime.launch import run_plan

    steps = run_plan(load_plan(plan_dir), run_dir, replay=replay)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert steps == STEPS == len(rows)
    return rows


def curve(rows: list[dict]) -> list[tuple[float, float]]:
    return [(r["reward/mean"], r["loss/policy"]) for r in rows]


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / "reproducibility.json").read_text())


def test_quickstart_repeats_and_another_seed_changes_it(tmp_path: Path) -> None:
    rows = {}
    for name, seed in (("a", 0), ("b", 0), ("other", 1)):
        plan = compile_example("quickstart", tmp_path / f"plan-{name}", tmp_path / name, f"algorithm.seed={seed}")
        rows[name] = run(plan, tmp_path / name)
    assert curve(rows["a"]) == curve(rows["b"])
    assert [r["grad_norm"] for r in rows["a"]] == [r["grad_norm"] for r in rows["b"]]
    assert curve(rows["other"]) != curve(rows["a"])
    facts = record(tmp_path / "a")
    assert facts["plan"]["deterministic"] and facts["seed"] == 0
    ranks = facts["processes"]["trainer"]
    assert ranks and all(r["deterministic_algorithms"] and r["torch_threads"] == 1 for r in ranks)
    workers = [w for engine in facts["processes"]["rollout"] for w in engine["workers"]]
    assert workers and len({w["torch_threads"] for w in workers}) == 1
    assert facts["rollouts"]["trained_prompts_by_lag"] == {"0": STEPS * 16}  # 16 prompts a step


def test_colocated_example_repeats(tmp_path: Path) -> None:
    rows = [run(compile_example("cpu-colocated", tmp_path / f"plan-{n}", tmp_path / n), tmp_path / n) for n in "ab"]
    assert curve(rows[0]) == curve(rows[1])
    assert all(r["staleness/max"] == 0 for r in rows[0])


def test_asynchronous_run_replays_exactly_from_its_log(tmp_path: Path) -> None:
    # Weight updates wait for running samples: where an interrupting update lands depends on timing.
    overrides = ("algorithm.max_staleness=1", "rollout.weight_update=wait")
    plan = compile_example("quickstart", tmp_path / "plan", tmp_path / "run", *overrides)
    recorded = run(plan, tmp_path / "run")
    facts = record(tmp_path / "run")
    assert not facts["plan"]["deterministic"] and "max_staleness 1" in facts["plan"]["reasons"][0]
    replayed = run(plan, tmp_path / "replay", replay=tmp_path / "run")
    assert curve(replayed) == curve(recorded)
    assert [r["staleness/mean"] for r in replayed] == [r["staleness/mean"] for r in recorded]
    verdict = record(tmp_path / "replay")["replay"]
    assert verdict["first_difference"] is None and verdict["identical_steps"] == STEPS
    # the replay's own log records the same requests and batches, so it can be replayed in turn
    lines = [json.loads(x) for x in (tmp_path / "replay" / "rollouts.jsonl").read_text().splitlines()]
    batches = [x["groups"] for x in lines if x["kind"] == "batch"]
    originals = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert batches == [x["groups"] for x in originals if x["kind"] == "batch"]
