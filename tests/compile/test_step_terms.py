"""The fixed and host terms of a step: the colocated engine cycle, per-sequence host work on accelerators, and the
agent chain that staleness spreads over s + 1 steps but cannot hide."""

from __future__ import annotations

import dataclasses

import pytest
from test_agent_estimate import A2_AGENT, _context

from rlc.compiler import cost, search
from rlc.compiler.memory import RolloutLayout, model_sizes
from rlc.schemas.registry import load_arch, load_target


def test_a_colocated_switch_pays_the_engine_cycle_whatever_the_state() -> None:
    for name in ("a2", "a3", "h100"):
        target = load_target(name)
        assert cost.switch_s(target, 0.0) == pytest.approx(cost.ENGINE_CYCLE_S[target.kind])
        assert cost.switch_s(target, 10.0) > cost.switch_s(target, 0.0)
    assert cost.switch_s(load_target("cpu"), 10.0) == 0.0


def test_per_sequence_host_work_overlaps_the_device_on_accelerators() -> None:
    """A tiny model's decode step at a large batch is host-bound (c × per-sequence cost); at a small batch the
    device's step hides the host's work. On cpu the two add, as measured."""
    sizes = model_sizes(load_arch("qwen2.5-0.5b"))
    layout = RolloutLayout(devices=1, tp=1)
    target = load_target("a2")
    per_seq = cost.decode_sequence_overhead_s(target)
    assert per_seq > 0
    big = cost.decode_step_s(sizes, layout, target, 1024, 500.0, 8)
    assert big >= 1024 * per_seq
    small = cost.decode_step_s(sizes, layout, target, 2, 500.0, 8)
    no_host = target.model_copy(
        update={"efficiency": target.efficiency.model_copy(update={"decode_sequence_overhead_s": 0.0})}
    )
    assert small == pytest.approx(cost.decode_step_s(sizes, layout, no_host, 2, 500.0, 8))
    cpu = load_target("cpu")
    free = cpu.efficiency.model_copy(update={"decode_sequence_overhead_s": 0.0})
    cpu_free = cpu.model_copy(update={"efficiency": free})
    added = cost.decode_step_s(sizes, layout, cpu, 2, 500.0, 1)
    added -= cost.decode_step_s(sizes, layout, cpu_free, 2, 500.0, 1)
    assert added == pytest.approx(2 * cost.decode_sequence_overhead_s(cpu))


def test_staleness_spreads_an_agent_chain_over_s_plus_one_steps_but_never_hides_it() -> None:
    """A trajectory admitted at version v must be trained by the step at v + s: (s + 1) · step ≥ chain + train +
    sync. With slow tools the step grows with them at any staleness."""
    ctx = _context(A2_AGENT.replace("max_turns: 8", "max_turns: 8\n    environments: {tool_latency_s: 5}"))
    for staleness in (1, 2):
        work = dataclasses.replace(ctx.work, staleness=staleness)
        steps = []
        for tool_s in (5.0, 60.0):
            agent = dataclasses.replace(work.agent, tool_s=tool_s)
            rollout = cost.RolloutTime(100.0, 40.0, 1.0, 0.05, 64, 1.0, chain_s=100.0 + 7 * tool_s)
            step = cost.step_time("disaggregated", dataclasses.replace(work, agent=agent), rollout, 30.0, 0.0, 5.0, 0.0)
            assert step.step_s * (staleness + 1) >= rollout.chain_s + 30.0 + 5.0 - 1e-9
            steps.append(step.step_s)
        assert steps[1] > steps[0]
    # Single-turn rollout has no chain: the streamed step is unchanged.
    plain = cost.RolloutTime(100.0, 40.0, 1.0, 0.05, 64, 1.0)
    work = dataclasses.replace(ctx.work, staleness=1, agent=None)
    assert cost.step_time("disaggregated", work, plain, 30.0, 0.0, 5.0, 0.0).step_s == pytest.approx(45.0)


def test_an_agent_plans_rollout_carries_its_chain() -> None:
    ctx = _context(A2_AGENT)
    best = search.search_context(ctx).best
    assert best is not None
    t = best.rollout.time
    assert t.chain_s == pytest.approx(t.sync_s) and t.chain_s > 0
