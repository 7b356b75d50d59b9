"""An asynchronous run on long-tailed responses: rollout streams beside training, weight updates interrupt samples.

The quickstart at max_staleness 2 on an untrained tiny model (its responses end at a random token: lengths are
geometric, long-tailed), the plan's default `rollout.weight_update: interrupt`, and an engine of 8 sequences at
a time: generating a batch then takes longer than training on one, so the engine is busy at every weight update
however fast this machine is (with the quickstart's engine it may finish each batch before the update lands).

What the run must show: rollout overlapping training in its trace, samples a weight update interrupted, each
recorded with its tokens' versions in order, and those tokens' behaviour log-probs in the decoupled loss (the
importance weights move off 1, which the stale tokens make them).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO

RLC = [sys.executable, "-m", "rlc"]
STEPS = 6

pytestmark = pytest.mark.slow


def test_interrupted_samples_carry_both_versions_and_train(tmp_path: Path) -> None:
    from rlc.compiler.manifest import load_plan
    from rlc.runtime.launch import run_plan
    from rlc.runtime.tasks.model_builder import build_tiny_model

    model = build_tiny_model(tmp_path / "model", seed=0, warmup_steps=0)
    overrides = [
        f"model.path={model}",
        f"algorithm.steps={STEPS}",
        "algorithm.max_staleness=2",
        "rollout.max_response_len=96",
        "train.micro_batch_tokens=16384",
        "placement.rollout.max_num_seqs=8",
        f"output.dir={tmp_path / 'run'}",
        "output.checkpoint_every=1000",
    ]
    args = [*RLC, "compile", str(REPO / "examples" / "quickstart.yaml"), "-o", str(tmp_path / "plan")]
    for item in overrides:
        args += ["--set", item]
    subprocess.run(args, check=True, capture_output=True, text=True)
    plan = load_plan(tmp_path / "plan")
    assert plan.schedule.weight_update == "interrupt" and plan.schedule.rollout_chunk_prompts == 1
    run_dir = tmp_path / "run"
    assert run_plan(plan, run_dir) == STEPS
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    lines = [json.loads(x) for x in (run_dir / "rollouts.jsonl").read_text().splitlines() if x.strip()]
    requests = [x for x in lines if x["kind"] == "request"]
    interrupted = [(r, spans) for r in requests for _, _, spans in r.get("interrupted", [])]
    print(
        f"{sum(r['rollout/interrupted_samples'] for r in rows):.0f} interrupted samples in {len(requests)} requests; "
        f"overlap {[round(r['time/overlap_s'], 2) for r in rows]}; staleness max {[r['staleness/max'] for r in rows]}"
    )
    assert sum(r["time/overlap_s"] for r in rows) > 0  # rollout ran while the trainer worked
    assert interrupted and sum(r["rollout/interrupted_samples"] for r in rows) == len(interrupted)
    for request, spans in interrupted:
        # Contiguous spans from the first token on, each a newer version than the one before.
        assert spans[0][1] == 0 and all(a[2] == b[1] and a[0] < b[0] for a, b in itertools.pairwise(spans))
        assert request["version"] == spans[0][0] >= request["admitted_at"]
    # Tokens trained while older than the current policy: their behaviour log-probs weigh the loss.
    assert max(r["staleness/max"] for r in rows) >= 1
    assert any(r["behave_imp_weight/max"] != 1.0 for r in rows)
