"""Agentic rollouts in the plan: the environments role, the agent settings, and the terms that size them.

An agent trajectory is not one long decode: the model answers a turn, a tool runs while the engine has nothing
of that trajectory to decode, and the next turn re-sends the whole context. So an engine must hold more
trajectories in flight than it decodes at once (`inflight_per_engine`), their prefixes must stay in its KV
cache between turns (sticky routing: a trajectory's calls all go to one engine) or be prefilled again, and the
environments role (the agent runners and their tools) needs CPUs and host memory on the nodes. Pure functions
of the problem and the chosen candidate; `planner.assemble` calls them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlc.compiler import cost, search
from rlc.compiler.diagnostics import Diagnostic
from rlc.compiler.load import LineMap
from rlc.compiler.resolve import Problem
from rlc.compiler.search_context import agent_work
from rlc.schemas.plan import AgentSettings, Memory, Parallel, RayPlacement, Role
from rlc.schemas.spec import Agent

GIB = 1024**3
#: Placement group of the environments role: SPREAD, so runners land on every node rather than pile onto one.
ENV_GROUP = "rlc-environments"
#: Host memory share of a node the environments may take (the rest stays for Ray, engines' and trainers' hosts).
ENV_HOST_SHARE = 0.5


@dataclass(frozen=True)
class AgentTerms:
    """What an agent trajectory costs an engine, per the planner's model."""

    turn_tokens: int  # tokens one model turn generates (at most)
    model_s_per_turn: float  # decode time of one turn at the engine's concurrency
    tool_s_per_turn: float  # the spec's assumed tool latency
    inflight_per_engine: int  # trajectories in flight that keep the engine decoding while tools run
    kv_sequences: int  # trajectories whose prefix the engine's KV cache holds at once
    reprefill_tokens: int  # context tokens prefilled again per turn when the cache cannot hold them all
    turns_token_factor: float  # export turns: trained tokens relative to export trajectory
    batch_rollout_s: float  # the estimate's rollout if every trajectory used all max_turns
    expected_turns: float  # the mean calls per trajectory the step-time estimate prices
    call_s: float  # host seconds per call (endpoint and client), cost.agent_call_overhead_s

    def notes(self, agent: Agent, replicas: int) -> list[str]:
        busy = self.model_s_per_turn / (self.model_s_per_turn + self.tool_s_per_turn or 1.0)
        out = [
            f"agent: up to {agent.max_turns} turns of {self.turn_tokens} tokens; a turn decodes in about "
            f"{self.model_s_per_turn:.3g} s, a tool call takes {self.tool_s_per_turn:g} s (assumed), so one "
            f"trajectory keeps an engine busy {busy:.0%} of its time",
            f"agent: {self.inflight_per_engine} trajectories in flight per engine ({replicas} engine(s)) keep each "
            "engine decoding while tools run; a trajectory's calls all go to one engine (its prefix stays cached)",
        ]
        if self.reprefill_tokens:
            out.append(
                f"agent: the KV cache holds about {self.kv_sequences} trajectory prefixes, fewer than the "
                f"{self.inflight_per_engine} in flight: about {self.reprefill_tokens} tokens are prefilled again per "
                "turn (prefix evicted while its tool ran)"
            )
        assumed = "stated" if agent.expected_turns is not None else "assumed: half of max_turns"
        out.append(
            f"agent: the step-time estimate prices {self.expected_turns:g} turns per trajectory ({assumed}), each "
            f"waiting for the tool and paying {self.call_s * 1e3:.3g} ms of endpoint and client work per call, one "
            f"call at a time per engine; a batch takes at most about {self.batch_rollout_s:.3g} s of rollout if every "
            f"trajectory uses all {agent.max_turns} turns"
        )
        if agent.export == "turns":
            out.append(
                f"agent: export turns trains about {self.turns_token_factor:.1f}x the tokens of export trajectory "
                "(each call's row repeats its context)"
            )
        return out


def agent_terms(problem: Problem, best: search.Candidate) -> AgentTerms:
    agent = problem.spec.rollout.agent
    assert agent is not None
    spec = problem.spec
    ro = best.rollout
    turn_tokens = min(agent.max_tokens_per_turn, spec.rollout.max_response_len)
    model_s = max(turn_tokens * ro.time.step_s, 1e-6)
    tool_s = agent.environments.tool_latency_s
    decoding = max(1, ro.time.concurrency)
    wanted = math.ceil(decoding * (model_s + tool_s) / model_s)
    # More than the staleness gate admits per engine never runs at once.
    admitted = math.ceil(spec.algorithm.batch_prompts * spec.algorithm.group_size * (spec.algorithm.max_staleness + 1))
    inflight = max(1, min(wanted, math.ceil(admitted / ro.layout.replicas)))
    context = spec.rollout.max_total_len
    waiting = max(0, inflight - ro.seqs)
    reprefill = waiting * context // 2 if waiting else 0
    factor = (agent.max_turns + 1) / 2 if agent.export == "turns" else 1.0
    work = agent_work(problem)
    assert work is not None
    # The estimate's rollout scaled to every trajectory using all max_turns (its rounds in proportion, the prompts'
    # prefill once): an upper bound, as a longer tail with more turns is small next to the extra rounds.
    batch_s = ro.time.prefill_s + (ro.time.sync_s - ro.time.prefill_s) * agent.max_turns / work.turns
    call_s = cost.agent_call_overhead_s(problem.target)
    return AgentTerms(turn_tokens, model_s, tool_s, inflight, ro.seqs, reprefill, factor, batch_s, work.turns, call_s)


def agent_settings(problem: Problem, best: search.Candidate, served_model_name: str) -> AgentSettings | None:
    agent = problem.spec.rollout.agent
    if agent is None:
        return None
    terms = agent_terms(problem, best)
    workers = agent.environments.workers
    total = terms.inflight_per_engine * best.rollout.layout.replicas
    return AgentSettings(
        run=agent.run,
        served_model_name=served_model_name,
        max_turns=agent.max_turns,
        max_tokens_per_turn=agent.max_tokens_per_turn,
        max_context_tokens=problem.spec.rollout.max_total_len,
        timeout_s=agent.timeout_s,
        export=agent.export,
        turn_discount=agent.turn_discount,
        tool_call_parser=agent.tool_call_parser,
        max_failed_share=agent.max_failed_share,
        inflight_per_engine=terms.inflight_per_engine,
        concurrency_per_worker=max(1, math.ceil(total / workers)),
        expected_turns=terms.expected_turns,
        tool_latency_s=agent.environments.tool_latency_s,
        options=dict(sorted(agent.options.items())),
    )


def _bundle(cpus: float, memory_gib: float) -> dict[str, float]:
    bundle = {}
    if cpus > 0:
        bundle["CPU"] = float(cpus)
    if memory_gib > 0:
        bundle["memory"] = float(int(memory_gib * GIB))
    return bundle


def environments_role(problem: Problem, best: search.Candidate) -> Role | None:
    """The agent runners: one actor per worker on its own bundle of CPUs and host memory (spread over nodes); no
    bundles when the agent brings its own sandbox (cpus and memory 0)."""
    agent = problem.spec.rollout.agent
    if agent is None:
        return None
    env = agent.environments
    bundle = _bundle(env.cpus, env.memory_gib)
    per_node = math.ceil(env.workers / problem.spec.cluster.nodes)
    terms = agent_terms(problem, best)
    return Role(
        name="environments",
        kind="environments",
        devices=0,
        placement=[],
        parallel=Parallel(dp=env.workers),
        ray=RayPlacement(
            placement_group=ENV_GROUP if bundle else "",
            strategy="SPREAD",
            bundles=[bundle] * env.workers if bundle else [],
            bundle_indices=list(range(env.workers)) if bundle else [],
            actor_resources=bundle,
        ),
        backend="python",
        replicas=env.workers,
        memory=Memory(
            items={"environments_host": round(per_node * env.memory_gib, 3)},
            total_gib=round(per_node * env.memory_gib, 3),
            capacity_gib=round(problem.target.host_memory_gib * ENV_HOST_SHARE, 3),
            phase="rollout",
        ),
        estimates={
            "model_s_per_turn": round(terms.model_s_per_turn, 4),
            "tool_s_per_turn": round(terms.tool_s_per_turn, 4),
            "inflight_per_engine": float(terms.inflight_per_engine),
            "reprefill_tokens_per_turn": float(terms.reprefill_tokens),
            "turns_token_factor": round(terms.turns_token_factor, 3),
            "batch_rollout_s": round(terms.batch_rollout_s, 3),
        },
        notes=[
            f"{env.workers} agent runner(s) with {env.cpus:g} CPU(s) and {env.memory_gib:g} GiB each, about "
            f"{per_node} per node (host memory of the node, per worker: the role's memory row)",
            *terms.notes(agent, best.rollout.layout.replicas),
        ],
    )


def environments_fit(problem: Problem, lines: LineMap, file: str) -> list[Diagnostic]:
    """RLC305 when the environment workers of one node would take more than ENV_HOST_SHARE of its host memory."""
    agent = problem.spec.rollout.agent
    if agent is None:
        return []
    env = agent.environments
    per_node = math.ceil(env.workers / problem.spec.cluster.nodes)
    need = per_node * env.memory_gib
    room = problem.target.host_memory_gib * ENV_HOST_SHARE
    if need <= room:
        return []
    fewer = max(1, int(room // env.memory_gib)) * problem.spec.cluster.nodes if env.memory_gib else env.workers
    path = "rollout.agent.environments"
    return [
        Diagnostic(
            "RLC305",
            f"{env.workers} environment worker(s) of {env.memory_gib:g} GiB on {problem.spec.cluster.nodes} node(s) "
            f"put {need:g} GiB on a node, over the {room:g} GiB ({ENV_HOST_SHARE:.0%} of "
            f"{problem.target.host_memory_gib:g} GiB host memory) they may take",
            path,
            "error",
            f"use at most {fewer} workers, less memory_gib per worker, or more nodes",
            lines.line_for(path),
            file,
        )
    ]
