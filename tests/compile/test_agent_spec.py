"""`rollout.agent` in the spec and the plan: validation, the environments role, placement, settings, SUMMARY."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from paths import REPO

from rlc.compiler.validate import check_text
from rlc.runtime.launch_request import launch_request, render_request
from rlc.schemas.plan import Plan

EXAMPLE = REPO / "examples" / "cpu-agent.yaml"

BASE = """\
name: agent-run
target: a2
cluster: {nodes: 2}
model: {name: qwen3-8b, path: /models/Qwen3-8B}
data: {train: /data/tasks.jsonl}
rollout:
  max_prompt_len: 2048
  max_response_len: 8192
  agent:
    run: my_agents.swe:run
"""


def check(text: str):
    return check_text(textwrap.dedent(text), "spec.yaml").report


def compile_plan(tmp_path: Path, text: str) -> Plan:
    from typer.testing import CliRunner

    from rlc.cli import app

    tmp_path.mkdir(parents=True, exist_ok=True)
    spec = tmp_path / "spec.yaml"
    spec.write_text(text)
    out = tmp_path / "plan"
    result = CliRunner().invoke(app, ["compile", str(spec), "-o", str(out)])
    assert result.exit_code == 0, result.output
    return Plan.model_validate_json((out / "plan.json").read_text())


def test_agent_keys_get_did_you_mean_and_ranges() -> None:
    report = check(BASE + "    max_turn: 4\n")
    (d,) = [d for d in report.errors if d.code == "RLC101"]
    assert d.path == "rollout.agent.max_turn" and "`max_turns`" in d.hint and d.line == 11
    report = check(BASE + "    environments: {workers: 0, cpu: 2}\n")
    found = {(d.code, d.path) for d in report.errors}
    assert ("RLC104", "rollout.agent.environments.workers") in found
    assert ("RLC101", "rollout.agent.environments.cpu") in found
    report = check(BASE.replace("my_agents.swe:run", "my_agents.swe"))
    assert [d.path for d in report.errors] == ["rollout.agent.run"]
    report = check(BASE + "    export: rows\n")
    assert [(d.code, d.path) for d in report.errors] == [("RLC104", "rollout.agent.export")]


def test_agent_rule_warnings() -> None:
    report = check(BASE + "    turn_discount: 0.9\n    tool_call_parser: hermez\n")
    found = {d.path: d for d in report.diagnostics if d.code == "RLC220"}
    assert found["rollout.agent.turn_discount"].severity == "warning"
    assert "did you mean `hermes`" in found["rollout.agent.tool_call_parser"].hint
    assert report.ok


def test_agent_with_a_lora_adapter_is_refused_but_auto_merges() -> None:
    report = check(BASE + "lora: {rank: 8, rollout: adapter}\n")
    assert [d.path for d in report.errors if d.code == "RLC220"] == ["lora.rollout"]
    assert check(BASE + "lora: {rank: 8}\n").ok


def test_environments_too_big_for_host_memory() -> None:
    from rlc.compiler.planner import build_plan

    checked = check_text(BASE + "    environments: {workers: 64, memory_gib: 64}\n", "spec.yaml")
    assert checked.problem is not None
    plan, diags = build_plan(checked.problem, checked.lines, "spec.yaml")
    assert plan is None
    (d,) = [d for d in diags if d.code == "RLC305"]
    assert d.path == "rollout.agent.environments" and "2048 GiB on a node" in d.message
    assert "at most" in d.hint


def test_the_plan_has_an_environments_role_and_agent_settings(tmp_path: Path) -> None:
    plan = compile_plan(tmp_path, BASE + "    environments: {workers: 4, cpus: 2, memory_gib: 4}\n")
    assert plan.schedule.mode == "disaggregated"  # auto picks disaggregated for agents
    env = plan.role("environments")
    assert env.kind == "environments" and env.replicas == 4 and env.devices == 0
    assert env.ray is not None and env.ray.strategy == "SPREAD"
    assert env.ray.bundles == [{"CPU": 2.0, "memory": float(4 << 30)}] * 4
    assert env.memory.total_gib == 8.0  # two workers per node
    assert any("in flight per engine" in note for note in env.notes)
    agent = plan.agent
    assert agent is not None and agent.run == "my_agents.swe:run" and agent.served_model_name == "qwen3-8b"
    assert agent.inflight_per_engine >= 1 and agent.max_context_tokens == 2048 + 8192
    request = launch_request(plan)
    runners = [a for a in request.actors if a.kind == "environment"]
    assert [a.name for a in runners] == [f"rlc-environments-{i}" for i in range(4)]
    assert "rlc-environments (SPREAD): 4 bundle(s)" in render_request(request)
    summary = (tmp_path / "plan" / "SUMMARY.md").read_text()
    assert "**Runs user code.** The agent `my_agents.swe:run`" in summary


def test_an_agent_with_its_own_sandbox_reserves_nothing(tmp_path: Path) -> None:
    plan = compile_plan(tmp_path, BASE + "    environments: {workers: 2, cpus: 0, memory_gib: 0}\n")
    request = launch_request(plan)
    assert "rlc-environments" not in [g.name for g in request.placement_groups]
    runners = [a for a in request.actors if a.kind == "environment"]
    assert len(runners) == 2 and all(a.placement_group == "" for a in runners)
    assert "(no placement group)" in render_request(request)


def test_the_cpu_example_compiles_deterministically(tmp_path: Path) -> None:
    first = compile_plan(tmp_path / "a", EXAMPLE.read_text())
    second = compile_plan(tmp_path / "b", EXAMPLE.read_text())
    assert first.model_dump_json() == second.model_dump_json()
    assert first.model.id == "rlc-tiny-agent" and first.model.build_tiny
    assert first.agent is not None and first.agent.run == "rlc.agents.calculator:run"


def test_format_2_plans_without_agent_fields_still_load(tmp_path: Path) -> None:
    plan = compile_plan(tmp_path, EXAMPLE.read_text().replace("  agent:", "  _agent:").split("  _agent:")[0])
    data = json.loads(plan.model_dump_json())
    data.pop("agent")
    assert Plan.model_validate(data).agent is None


@pytest.mark.parametrize("mode", ["colocated"])
def test_an_agent_cannot_be_colocated(mode: str) -> None:
    report = check(BASE + f"mode: {mode}\n")
    assert [d.path for d in report.errors if d.code == "RLC220"] == ["mode"]
