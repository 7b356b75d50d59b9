"""The step-time estimate of agentic rollouts: turns, tool time and per-call host work, in the planner and in
`rlc calibrate` (cost.agent_rollout_s)."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest
import yaml
from paths import REPO
from run_dir_fixtures import write_run_dir
from test_agent_spec import BASE
from test_calibrate import _write_run

from rlc.compiler import calibrate, cost, search
from rlc.compiler.pipeline import compile_text
from rlc.compiler.validate import check_text
from rlc.schemas.registry import load_target

EXAMPLE = REPO / "examples" / "cpu-agent.yaml"

A2_AGENT = BASE + "    max_turns: 8\n    max_tokens_per_turn: 1024\n"


def _context(text: str) -> search.Context:
    checked = check_text(textwrap.dedent(text), "spec.yaml")
    assert checked.problem is not None, [d.message for d in checked.report.diagnostics]
    return search.make_context(checked.problem)


def test_agent_work_defaults_to_half_the_turns_and_the_response_budget() -> None:
    work = cost.agent_work(
        max_turns=8, expected_turns=None, max_tokens_per_turn=1024, max_response_len=8192, tool_s=2.0
    )
    assert work == cost.AgentWork(turns=4.0, turn_tokens=512.0, max_turn_tokens=1024, tool_s=2.0)
    assert (
        cost.agent_work(max_turns=1, expected_turns=None, max_tokens_per_turn=8, max_response_len=8, tool_s=0).turns
        == 1
    )
    # 40 turns of up to 1,024 tokens cannot all fit a trajectory's mean response of 4,096 tokens.
    many = cost.agent_work(max_turns=80, expected_turns=40, max_tokens_per_turn=1024, max_response_len=8192, tool_s=0)
    assert many.turns == 40 and many.turn_tokens == pytest.approx(4096 / 40)


def test_the_spec_states_the_turns_and_the_context_carries_them() -> None:
    ctx = _context(A2_AGENT.replace("max_turns: 8", "max_turns: 8\n    expected_turns: 3"))
    assert ctx.work.agent is not None and ctx.work.agent.turns == 3.0
    assert ctx.work.agent.tool_s == 1.0  # environments.tool_latency_s default
    assert _context(A2_AGENT.split("rollout:")[0] + "rollout: {max_prompt_len: 2048}\n").work.agent is None


def test_more_turns_than_max_turns_is_an_error_at_its_line() -> None:
    report = check_text(A2_AGENT + "    expected_turns: 9\n", "spec.yaml").report
    (d,) = [d for d in report.errors if d.code == "RLC220"]
    assert d.path == "rollout.agent.expected_turns" and d.line == 13 and "max_turns (8)" in d.message
    report = check_text(A2_AGENT + "    expected_turns: 0.5\n", "spec.yaml").report
    assert [(d.code, d.path) for d in report.errors] == [("RLC104", "rollout.agent.expected_turns")]


def _rollout(ctx: search.Context, target=None, **agent: float) -> cost.RolloutTime:  # type: ignore[no-untyped-def]
    """The rollout estimate of the planner's best layout for `ctx`, with `agent` fields replaced."""
    best = search.search_context(ctx).best
    assert best is not None and ctx.work.agent is not None
    work = dataclasses.replace(ctx.work, agent=dataclasses.replace(ctx.work.agent, **agent))
    layout = best.rollout.layout
    return cost.rollout_time(ctx.sizes, layout, target or ctx.target, work, ctx.devices_per_node, layout.max_num_seqs)


def test_each_turn_pays_the_tool_and_every_call_its_host_work() -> None:
    ctx = _context(A2_AGENT)
    agent = ctx.work.agent
    assert agent is not None
    base = _rollout(ctx)
    slower_tools = _rollout(ctx, tool_s=agent.tool_s + 1.0)
    assert slower_tools.sync_s - base.sync_s == pytest.approx(agent.turns - 1)  # a tool between two calls
    more_turns = _rollout(ctx, turns=agent.turns * 2, tool_s=0.0)
    no_tools = _rollout(ctx, tool_s=0.0)
    # Twice the rounds; the slowest trajectory's tail grows only with the square root of its turns.
    assert 1.5 * no_tools.sync_s < more_turns.sync_s < 2 * no_tools.sync_s
    # Every call's host work is paid one call at a time on its engine: turns × the engine's share of the batch.
    dear = cost.agent_call_overhead_s(ctx.target) + 0.01
    target = ctx.target.model_copy(
        update={"efficiency": ctx.target.efficiency.model_copy(update={"agent_call_overhead_s": dear})}
    )
    best = search.search_context(ctx).best
    assert best is not None
    share = -(-ctx.work.samples // best.rollout.layout.replicas)
    assert _rollout(ctx, target).sync_s - base.sync_s == pytest.approx(agent.turns * share * 0.01)


def test_an_asynchronous_step_overlaps_tool_waits_but_not_the_engines_work() -> None:
    ctx = _context(A2_AGENT.replace("max_turns: 8", "max_turns: 8\n    environments: {tool_latency_s: 30}"))
    zero = dataclasses.replace(ctx, work=dataclasses.replace(ctx.work, staleness=0), memo={})
    on_policy = _rollout(zero)
    assert on_policy.async_s == on_policy.sync_s  # staleness 0: the batch waits for its own chain of turns
    two = dataclasses.replace(ctx, work=dataclasses.replace(ctx.work, staleness=2), memo={})
    stale = _rollout(two)
    assert stale.async_s == pytest.approx(max(stale.sync_s / 3, stale.async_s))
    assert stale.async_s < stale.sync_s
    # Without tool time or tail the chain is the engine's own work: nothing to overlap.
    busy_only = _rollout(two, tool_s=0.0)
    assert busy_only.async_s <= busy_only.sync_s


def test_asynchronous_tool_waits_count_once_they_empty_the_decode_slots() -> None:
    """Under a staleness bound the tool waits overlap other trajectories' calls only while enough trajectories are
    admitted to keep the engine's slots busy: a trajectory waiting for its tool decodes nothing. With tools slow
    enough that the admitted trajectories decode below the engine's concurrency, the estimate rises with them."""
    ctx = _context(A2_AGENT)
    one = dataclasses.replace(ctx, work=dataclasses.replace(ctx.work, staleness=1), memo={})
    times = [_rollout(one, tool_s=t).async_s for t in (0.0, 1.0, 100.0, 1000.0)]
    assert times[0] <= times[1] < times[2] < times[3]
    agent = one.work.agent
    assert agent is not None
    assert cost.decoding_share(dataclasses.replace(agent, tool_s=0.0), 0.05, 1.0) == 1.0
    assert 0 < cost.decoding_share(dataclasses.replace(agent, tool_s=100.0), 0.05, 1.0) < 0.5


def test_the_planner_prices_turns_and_says_so(tmp_path: Path) -> None:
    few = compile_text(A2_AGENT.replace("max_turns: 8", "max_turns: 8\n    expected_turns: 2"), "a.yaml")
    many = compile_text(A2_AGENT.replace("max_turns: 8", "max_turns: 8\n    expected_turns: 8"), "a.yaml")
    assert few.plan is not None and many.plan is not None
    assert many.plan.estimates.step_time_s > few.plan.estimates.step_time_s
    assert few.plan.agent is not None and few.plan.agent.expected_turns == 2.0 and few.plan.agent.tool_latency_s == 1.0
    notes = " ".join(few.plan.role("environments").notes)
    assert "prices 2 turns per trajectory (stated)" in notes and "ms of endpoint and client work per call" in notes
    default = compile_text(A2_AGENT, "a.yaml").plan
    assert default is not None
    assert "prices 4 turns per trajectory (assumed: half of max_turns)" in " ".join(default.role("environments").notes)


# --------------------------------------------------------------------------------------------- calibrate

#: What agent runs can tell: the per-call cost (their rollout is mostly calls and tool waits).
TRUTH = {"agent_call_overhead_s": 0.02}


def _agent_plan(batch: int):  # type: ignore[no-untyped-def]
    text = EXAMPLE.read_text().replace("batch_prompts: 12", f"batch_prompts: {batch}")
    compiled = compile_text(text, "cpu-agent.yaml")
    assert compiled.plan is not None, [d.message for d in compiled.report.diagnostics]
    return compiled.plan


def _truth():  # type: ignore[no-untyped-def]
    cpu = load_target("cpu")
    return cpu.model_copy(update={"efficiency": cpu.efficiency.model_copy(update=TRUTH)})


def _measured_work(plan, turns: float, response: float) -> cost.Workload:  # type: ignore[no-untyped-def]
    work = calibrate.run_workload(plan, 12.0, response)
    assert work.agent is not None
    return dataclasses.replace(work, agent=dataclasses.replace(work.agent, turns=turns, turn_tokens=response / turns))


def _write_agent_run(tmp_path: Path, batch: int, steps: int = 20) -> Path:
    """An agent run whose times are the true profile's predictions for its measured turns and lengths, ±5%."""
    plan = _agent_plan(batch)
    turns, response = 1.9, 11.0
    truth = calibrate.predict(plan, _truth(), _measured_work(plan, turns, response))
    tokens = (12.0 + response) * plan.schedule.batch_samples
    extra = {"response_len/mean": response, "agent/turns": turns}
    return write_run_dir(tmp_path / f"agent-{batch}", plan, truth, tokens, steps, **extra)


def test_calibrate_reads_an_agent_runs_turns_and_fits_the_call_cost(tmp_path: Path) -> None:
    run = calibrate.load_run(_write_agent_run(tmp_path, 12))
    assert run.work.agent is not None and run.work.agent.turns == pytest.approx(1.9)
    assert run.work.agent.turn_tokens == pytest.approx(11.0 / 1.9)
    assert run.work.agent.tool_s == pytest.approx(0.001)  # the example's assumed tool latency, from the plan
    cpu = load_target("cpu")
    fitted = calibrate.calibrate(cpu, [run, calibrate.load_run(_write_agent_run(tmp_path, 36))])
    assert fitted.efficiency.agent_call_overhead_s == pytest.approx(0.02, rel=0.15)
    assert "train_mfu=" in fitted.calibration["fitted"]  # the other phases are fitted as for any run
    # Agent runs alone leave the decode to the base profile: a plan without an agent is predicted as before.
    assert fitted.efficiency.decode_bandwidth_efficiency == cpu.efficiency.decode_bandwidth_efficiency
    plain = compile_text(EXAMPLE.read_text().split("  agent:")[0] + "reward: {fn: exact_match}\n", "p.yaml").plan
    assert plain is not None
    plain_work = calibrate.run_workload(plain, 8.0, 16.0)
    before = calibrate.predict(plain, cpu, plain_work)["rollout"]
    assert calibrate.predict(plain, fitted, plain_work)["rollout"] == before
    other = _agent_plan(24)
    work = _measured_work(other, 1.9, 11.0)
    truth = calibrate.predict(other, _truth(), work)["rollout"]
    after = calibrate.predict(other, fitted, work)["rollout"]
    assert abs(after / truth - 1) < 0.10, (after, truth)


@pytest.mark.parametrize(("turns", "why"), [(0.0, "no model call"), (7.0, "the plan allows 3")])
def test_agent_turns_the_plan_cannot_have_are_refused(tmp_path: Path, turns: float, why: str) -> None:
    plan = _agent_plan(12)
    truth = calibrate.predict(plan, _truth(), _measured_work(plan, 2.0, 11.0))
    extra = {"response_len/mean": 11.0, "agent/turns": turns}
    run = write_run_dir(tmp_path / "odd", plan, truth, 23.0 * plan.schedule.batch_samples, 20, **extra)
    with pytest.raises(calibrate.CalibrationError, match=why):
        calibrate.load_run(run)


def test_a_profile_written_before_the_call_cost_existed_still_loads(tmp_path: Path) -> None:
    from rlc.schemas.profiles import read_profile

    data = load_target("cpu").model_dump(mode="json")
    data["efficiency"].pop("agent_call_overhead_s")
    data["sources"].pop("efficiency.agent_call_overhead_s")
    path = tmp_path / "cpu.yaml"
    path.write_text(yaml.safe_dump(data))
    assert read_profile(path).efficiency.agent_call_overhead_s is None


def test_a_plan_without_a_recorded_tool_latency_reads_its_environments_role(tmp_path: Path) -> None:
    plan = _agent_plan(12)
    assert plan.agent is not None
    old = plan.model_copy(update={"agent": plan.agent.model_copy(update={"tool_latency_s": None})})
    work = calibrate.run_workload(old, 12.0, 11.0)
    assert work.agent is not None and work.agent.tool_s == pytest.approx(0.001)


def test_runs_without_an_agent_leave_the_call_cost_alone(tmp_path: Path) -> None:
    fitted = calibrate.calibrate(load_target("cpu"), [calibrate.load_run(_write_run(tmp_path, 16))])
    assert "agent_call_overhead_s" not in fitted.calibration["fitted"]
    assert fitted.efficiency.agent_call_overhead_s is None
