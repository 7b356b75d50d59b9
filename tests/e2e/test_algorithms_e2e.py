"""The DAPO and GSPO examples run end to end on the cpu target (a few steps each; the learning curves are in
benchmarks/algorithms.py). These start engines, so they are slow."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO

RLC = [sys.executable, "-m", "rlc"]

pytestmark = pytest.mark.slow


def _run(tmp_path: Path, example: str, *overrides: str) -> list[dict]:
    plan, run_dir = tmp_path / "plan", tmp_path / "run"
    args = [*RLC, "compile", str(REPO / "examples" / example), "-o", str(plan), "--set", f"output.dir={run_dir}"]
    for item in overrides:
        args += ["--set", item]
    subprocess.run(args, check=True, capture_output=True, text=True)
    result = subprocess.run([*RLC, "run", str(plan)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_dapo_streams_with_dynamic_sampling_under_the_staleness_bound(tmp_path: Path) -> None:
    """Asynchronous (max_staleness 1): dropped groups give their slots back and replacements still respect the
    bound; every step trains a full batch and says how many groups it generated per kept one."""
    sets = ("algorithm.steps=8", "algorithm.max_staleness=1", "output.checkpoint_every=8")
    rows = _run(tmp_path, "cpu-dapo.yaml", *sets)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(r["staleness/max"] <= 1 for r in rows)
    # Groups were dropped (an untrained model's groups of eight often all fail), and each step counts them.
    dropped = [r["rollout/dropped_groups"] for r in rows]
    assert sum(dropped) > 0, "dynamic sampling dropped no group"
    assert all(r["rollout/generated_per_kept"] == (16 + d) / 16 <= 3.0 for r, d in zip(rows, dropped, strict=True))
    # What was dropped was generated and never trained, and replacements filled every batch to 16 groups.
    log = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    generated = {(x["id"], c) for x in log if x["kind"] == "request" for c in x["cursors"]}
    batches = [{tuple(g) for g in x["groups"]} for x in log if x["kind"] == "batch"]
    assert [len(b) for b in batches] == [16] * 8
    assert len(generated - set().union(*batches)) >= sum(dropped)
    assert all(r["train/tokens"] > 0 and math.isfinite(r["loss/policy"]) for r in rows)
    assert all(0.0 <= r["reward/generated_mean"] <= 1.0 for r in rows)


def test_gspo_trains_two_minibatches_with_the_sequence_ratio(tmp_path: Path) -> None:
    rows = _run(tmp_path, "cpu-gspo.yaml", "algorithm.steps=4", "output.checkpoint_every=4")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["train/optimizer_steps"] == 2 and math.isfinite(r["loss/policy"]) for r in rows)
    # The second minibatch trains after the first update: its sequence ratios move off 1 and GSPO's narrow range
    # clips some of them.
    assert any(r["clip_fraction"] > 0 for r in rows)
