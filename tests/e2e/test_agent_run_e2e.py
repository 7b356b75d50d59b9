"""`rlc run` of agent specs end to end on the cpu default (slow: Ray, a served vLLM engine, an FSDP2 trainer).

The calculator example briefly: trajectories are token-exact (the engine's log-probs of the sampled tokens equal
the trainer's), no prefix breaks, and in the recorded multi-turn rows the tool's reply carries loss mask 0 while
the model's turns carry 1. Then an agent that fails now and then (raises, hangs past timeout_s): the run goes on,
counting them, and stops with a clear message only past the stated share.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "cpu-agent.yaml"
RLC = [sys.executable, "-m", "rlc"]


def compile_example(tmp_path: Path, *overrides: str) -> Path:
    plan = tmp_path / "plan"
    args = [*RLC, "compile", str(EXAMPLE), "-o", str(plan), "--set", f"output.dir={tmp_path / 'run'}"]
    for item in overrides:
        args += ["--set", item]
    subprocess.run(args, check=True, capture_output=True, text=True)
    return plan


def run(plan: Path, timeout: int = 1500) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([*RLC, "run", str(plan)], capture_output=True, text=True, timeout=timeout, env=env)


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_calculator_agent_trajectories_are_token_exact_and_masked(tmp_path: Path) -> None:
    plan = compile_example(tmp_path, "algorithm.steps=3", "algorithm.batch_prompts=4")
    result = run(plan)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = lines(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["logprob_gap/max"] < 1e-4  # engine vs trainer on every sampled token
        assert m["agent/prefix_breaks"] == 0 and m["agent/errors"] == 0 and m["agent/timeouts"] == 0
        assert m["agent/turns"] >= 1 and m["agent/tokens_masked"] > 0 and m["agent/tokens_sampled"] > 0
        assert m["time/agent_model_s"] > 0
    samples = lines(tmp_path / "run" / "agent_samples.jsonl")
    multi = [r for s in samples for r in s["rows"] if "(" in r["text"]]
    assert multi, "no multi-turn trajectory was sampled"
    for row in multi:
        ids, mask = row["input_ids"], row["loss_mask"]
        assert len(row["tokens"]) == len(ids)
        # One character per token, special tokens (<bos>, <eos>) as one placeholder each.
        text = "".join(t if len(t) == 1 else "\x00" for t in row["tokens"])
        start = text.index("(")
        end = text.index(")", start)
        assert set(mask[start : end + 1]) == {0}  # the tool's reply never trains
        assert mask[: text.index("=") + 1] == [0] * (text.index("=") + 1)  # nor the task
        call_end = text.index("]") if "]" in text else start - 1
        assert mask[text.index("=") + 1 : call_end + 1] == [1] * (call_end - text.index("="))  # the model's call
        assert mask[end + 1 :] == [1] * (len(mask) - end - 1)  # and its answer


def test_failing_agents_are_counted_and_the_run_goes_on(tmp_path: Path) -> None:
    plan = compile_example(
        tmp_path,
        "algorithm.steps=2",
        "algorithm.batch_prompts=4",
        "algorithm.group_size=4",
        "rollout.agent.run=tests.agent_fixtures:sometimes_fails",
        "rollout.agent.timeout_s=20",
        "rollout.agent.max_failed_share=0.7",
        f"rollout.agent.options.hang_marker={tmp_path / 'hung'}",
    )
    result = run(plan)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "flaky tool" in result.stdout and "scored 0" in result.stdout
    metrics = lines(tmp_path / "run" / "metrics.jsonl")
    assert len(metrics) == 2
    assert sum(m["agent/errors"] for m in metrics) > 0
    assert sum(m["agent/timeouts"] for m in metrics) > 0


def test_an_agent_failing_past_the_share_stops_the_run_clearly(tmp_path: Path) -> None:
    plan = compile_example(
        tmp_path, "algorithm.steps=2", "algorithm.batch_prompts=2", "rollout.agent.run=tests.agent_fixtures:raises"
    )
    result = run(plan, timeout=900)
    assert result.returncode != 0
    assert "rlc run: error: agent 'tests.agent_fixtures:raises' raised ValueError: the sandbox is on fire" in (
        result.stderr + result.stdout
    )
    assert "Traceback" not in result.stderr
