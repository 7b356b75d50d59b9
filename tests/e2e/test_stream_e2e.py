"""An asynchronous run on long-tailed responses: rollout streams beside training, weight updates interrupt samples.

The quickstart at max_staleness 2 on an untrained tiny model (its responses end at a random token: lengths are
geometric, long-tailed), the plan's default `rollout.weight_update: interrupt`, and an engine of 8 sequences at
a time: generating a batch then takes longer than training on one, so the engine is busy at every weight update
however fast this machine is (with the quickstart's engine it may finish each batch before the update lands).

What the run must show: rollout overlapping training in its trace, samples a weight update interrupted, each
recorded with its tokens' versions in order, and those samples trained as they were sampled: in the batch the
trainer received, each of their tokens carries the log-prob the engine returned for it and counts as old as the
version that sampled it (the staleness the step reports is over those per-token versions), so their
pre-update tokens' behaviour log-probs weigh the decoupled loss.
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from paths import REPO

RLC = [sys.executable, "-m", "rlc"]
STEPS = 6

pytestmark = pytest.mark.slow


def _record_batches(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every batch the driver hands the trainer, with the groups it was built from and the step's version."""
    from rlc.runtime.workflows.generate import GenerateWorkflow

    built: list[dict[str, Any]] = []
    real = GenerateWorkflow.build_batch

    def recording(self: GenerateWorkflow, groups: list[Any]) -> Any:
        batch, stats, domains = real(self, groups)
        built.append({"version": self.loop.version, "groups": groups, "batch": batch, "stats": stats})
        return batch, stats, domains

    monkeypatch.setattr(GenerateWorkflow, "build_batch", recording)
    return built


def _expand(spans: list[list[int]]) -> list[int]:
    """Per-token versions from the log's [version, start, end] spans."""
    return [version for version, start, end in spans for _ in range(start, end)]


def test_interrupted_samples_carry_both_versions_and_train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlc.compiler.manifest import load_plan
    from rlc.runtime.launch import run_plan
    from rlc.runtime.tasks.model_builder import build_tiny_model

    built = _record_batches(monkeypatch)

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
    logged = {
        (request["id"], request["cursors"][p], s): _expand(spans)
        for request in requests
        for p, s, spans in request.get("interrupted", [])
    }
    assert len(built) == STEPS  # one batch a step, in step order
    steps_with_interrupted = []
    for step, record in enumerate(built, 1):
        version, lags, index = record["version"], [], 0
        for group in record["groups"]:
            prompt = len(group.item.prompt_ids)
            for s, (out, logprobs) in enumerate(zip(group.output_ids, group.logprobs, strict=True)):
                versions = group.sample_versions(s)
                assert len(versions) == len(out)
                lags += [version - v for v in versions]
                # The trainer gets the engine's per-token behaviour log-probs, the pre-update tokens' included.
                assert record["batch"]["behaviour_logprobs"][index][prompt:] == list(logprobs)
                index += 1
                if len(set(versions)) > 1:  # interrupted: trained with the versions its log line records
                    assert logged[(group.request, group.item.cursor, s)] == versions
                    steps_with_interrupted.append(step)
        # The step's staleness is over each token's own version, an interrupted sample's older tokens included.
        stats = record["stats"]
        assert stats["staleness/max"] == max(lags) and stats["staleness/mean"] == pytest.approx(statistics.fmean(lags))
    assert steps_with_interrupted, "no interrupted sample was trained"
    # Where interrupted samples trained, tokens older than the policy weigh the loss by their behaviour log-probs.
    assert any(rows[step - 1]["behave_imp_weight/max"] != 1.0 for step in steps_with_interrupted)
