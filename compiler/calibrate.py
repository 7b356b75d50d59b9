"""`rlc calibrate`: fit a target's efficiencies and fixed overheads to measured runs, as a target profile.

A run directory holds the plan it ran (`plan.json`) and one metrics line per step (`metrics.jsonl`:
`time/rollout_s`, `time/train_s`, `time/weight_sync_s`, `time/step_s`, `train/tokens`, `response_len/mean`).
Per run, the medians over the steps after a warm-up are the measurements, and the run's own workload (its
measured mean prompt and response lengths) is what the cost model is asked about, so the fit is of the
hardware terms, not of the length assumptions. Each phase is fitted with the parameters only it reads:

  train    train_mfu, micro_batch_overhead_s       (cost.train_time)
  rollout  decode_bandwidth_efficiency, prefill_mfu, decode_step_overhead_s, decode_sequence_overhead_s,
           agent_call_overhead_s (agent runs only) (cost.rollout_time; synchronous runs only, where
           time/rollout_s is the generation itself rather than a wait for the streaming pool)
  sync     weight_sync_overhead_s and the link figure each run's method reads (cost.weight_sync):
           weight_sync_link_share (broadcast), weight_sync_host_share (inplace, shared_memory),
           weight_sync_disk_gbps (disk, served LoRA adapters); weight_reload_gbps stays the base's, since on
           engines whose workers serve the whole model (every TP 1 engine) it scales with the same bytes as the
           link figure and one fit cannot tell them apart
  step     step_overhead_s                          (the rest of time/step_s, cost.step_time)

by least squares on log(predicted / measured) with a weak pull towards the base profile's values (ridge in
log space, RIDGE), so that one run, which cannot tell a throughput from a fixed cost apart, changes both in
proportion instead of driving one to a bound. The fitted profile keeps the base's schema and sources, records
what it was fitted on in `calibration`, and states its uncertainty from the fit's residuals.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from math import exp, log
from pathlib import Path

from rlc.compiler import cost, memory
from rlc.compiler.memory import ModelSizes, RolloutLayout
from rlc.schemas.metrics_file import MEASURED_BOUNDS, read_metrics_rows
from rlc.schemas.plan import WEIGHT_SYNC_TP_SLICES, Plan
from rlc.schemas.registry import load_arch
from rlc.schemas.spec import Environments
from rlc.schemas.target import TargetProfile

#: Steps skipped at the start of a run (engine warm-up, first compilations, allocator growth).
WARMUP_STEPS = 5
#: Weight of the pull towards the base profile, per parameter, in squared log units.
RIDGE = 1e-3
#: How far a parameter may move from the base value, as a factor either way.
SPAN = 100.0
#: Smallest uncertainty factor a calibrated profile states (run-to-run noise on a shared machine).
MIN_UNCERTAINTY = 1.15
PHASE_PARAMS: dict[str, tuple[str, ...]] = {
    "train": ("train_mfu", "micro_batch_overhead_s"),
    "rollout": (
        "decode_bandwidth_efficiency",
        "prefill_mfu",
        "decode_step_overhead_s",
        "decode_sequence_overhead_s",
        "agent_call_overhead_s",
    ),
    "sync": (
        "weight_sync_overhead_s",
        "weight_sync_link_share",
        "weight_sync_host_share",
        "weight_sync_disk_gbps",
    ),
    "step": ("step_overhead_s",),
}
#: The spec's default tool latency, for a plan that records none.
TOOL_LATENCY_S = Environments.model_fields["tool_latency_s"].default
#: Parameters only agent runs read (`cost.agent_rollout_s`).
AGENT_PARAMS = {"agent_call_overhead_s"}
FRACTIONS = {
    "train_mfu",
    "prefill_mfu",
    "decode_bandwidth_efficiency",
    "collective_efficiency",
    "weight_sync_link_share",
    "weight_sync_host_share",
}
#: Coordinate-descent rounds per phase (3 unless named): a sync's fixed cost and its link figure both move every
#: run's time and trade off against each other, so they converge slowly.
ROUNDS = {"sync": 12}
#: The link figure a weight-sync method reads (`cost.weight_sync`): only runs of that method can fit it.
SYNC_METHOD_FIGURES = {
    "broadcast": "weight_sync_link_share",
    "inplace": "weight_sync_host_share",
    "shared_memory": "weight_sync_host_share",
    "disk": "weight_sync_disk_gbps",
    "adapter": "weight_sync_disk_gbps",
}


class CalibrationError(ValueError):
    """A run directory that cannot be calibrated on; the message says why."""


@dataclass(frozen=True)
class Run:
    """One measured run: its plan, its medians per phase and the workload it really had."""

    name: str
    plan: Plan
    measured: dict[str, float]
    work: cost.Workload
    steps: int
    #: Dynamic sampling: groups the run generated per group it trained (the mean over its steps), or None.
    generated_per_kept: float | None = None
    #: Speculative decoding: the share of draft tokens the engines accepted (the mean over its steps), or None.
    draft_acceptance: float | None = None


def _median(rows: list[dict], key: str) -> float | None:
    values = [float(r[key]) for r in rows if key in r]
    return statistics.median(values) if values else None


def load_run(run_dir: Path) -> Run:
    """Read a run directory; the measurements are medians over the steps after WARMUP_STEPS."""
    plan_file, metrics_file = run_dir / "plan.json", run_dir / "metrics.jsonl"
    if not plan_file.is_file() or not metrics_file.is_file():
        raise CalibrationError(f"{run_dir}: a run directory holds plan.json and metrics.jsonl (run `rlc run` first)")
    try:
        plan = Plan.model_validate_json(plan_file.read_text())
    except ValueError as exc:
        raise CalibrationError(f"{plan_file}: not a plan ({exc})") from exc
    rows = [r for r in read_metrics_rows(metrics_file, MEASURED_BOUNDS) if "time/step_s" in r]
    if len(rows) <= WARMUP_STEPS:
        raise CalibrationError(f"{metrics_file}: {len(rows)} step(s); calibration needs more than {WARMUP_STEPS}")
    rows = rows[WARMUP_STEPS:]
    measured = {
        name: value
        for name, key in (
            ("rollout", "time/rollout_s"),
            ("train", "time/train_s"),
            ("sync", "time/weight_sync_s"),
            ("step", "time/step_s"),
        )
        if (value := _median(rows, key)) is not None and value > 0
    }
    samples = plan.schedule.batch_samples
    tokens = _median(rows, "train/tokens") or 0.0
    response = _median(rows, "response_len/mean") or 0.0
    prompt = max(1.0, tokens / samples - response) if tokens else plan.sampling.max_prompt_len * cost.PROMPT_FRACTION
    work = run_workload(plan, prompt, response or plan.sampling.max_response_len * cost.RESPONSE_FRACTION)
    turns = _median(rows, "agent/turns")
    if plan.agent is not None and work.agent is not None and response and turns is not None:
        # An agent run's response_len/mean counts the tokens its calls sampled (the tools' replies, masked, are
        # in train/tokens only), over agent/turns calls.
        limit = plan.agent.max_turns
        if not 1 <= turns <= limit:
            why = "most trajectories made no model call" if turns < 1 else f"the plan allows {limit}"
            raise CalibrationError(
                f"{metrics_file}: agent/turns has median {turns:g} calls per trajectory, but {why}: this run cannot "
                "calibrate agent rollouts"
            )
        work = replace(work, agent=replace(work.agent, turns=turns, turn_tokens=response / turns))
    # Dynamic sampling: the engines generated this many samples per trained one (a mean: it is a count per step).
    draws = [float(r["rollout/generated_per_kept"]) for r in rows if "rollout/generated_per_kept" in r]
    generated = statistics.fmean(draws) if draws else None
    if generated is not None:
        work = replace(work, oversample=generated)
    # Speculative decoding: the rollout time depends on the acceptance the engines had, not the one assumed.
    accepted = [float(r["spec_decode/acceptance_rate"]) for r in rows if "spec_decode/acceptance_rate" in r]
    acceptance = statistics.fmean(accepted) if accepted and work.mtp_tokens else None
    if acceptance is not None:
        work = replace(work, mtp_acceptance=acceptance)
    return Run(run_dir.name, plan, measured, work, len(rows), generated, acceptance)


def run_workload(plan: Plan, prompt_tokens: float, response_tokens: float) -> cost.Workload:
    """The plan's workload with the run's measured mean lengths in place of the planner's assumptions (for an
    agent, its turns as the plan priced them: `load_run` puts the measured ones in)."""
    algo, sampling = plan.algorithm, plan.sampling
    spec = sampling.speculative or {}
    base = cost.workload(
        batch_prompts=plan.schedule.batch_prompts,
        group_size=plan.schedule.group_size,
        max_prompt_len=sampling.max_prompt_len,
        max_response_len=sampling.max_response_len,
        staleness=plan.schedule.max_staleness,
        decoupled=algo.decoupled_loss,
        reference=algo.needs_reference and plan.lora is None,
        lora=plan.lora is not None,
        mtp_tokens=int(spec.get("num_speculative_tokens", 0)),
        mtp_acceptance=sampling.draft_acceptance or 0.0,
        mtp_draft_layers=1 if spec and spec.get("method") != "ngram" else 0,
        minibatches=algo.minibatches,
        agent=_agent_work(plan),
        oversample=algo.dynamic_sampling.expected_generated_per_kept if algo.dynamic_sampling else 1.0,
    )
    return replace(base, prompt_tokens=prompt_tokens, response_tokens=response_tokens)


def _agent_work(plan: Plan) -> cost.AgentWork | None:
    agent = plan.agent
    if agent is None:
        return None
    tool_s = agent.tool_latency_s
    if tool_s is None:  # a plan compiled before the agent settings recorded it: its environments role's estimate
        env = next((r for r in plan.roles if r.kind == "environments"), None)
        tool_s = env.estimates.get("tool_s_per_turn", TOOL_LATENCY_S) if env is not None else TOOL_LATENCY_S
    return cost.agent_work(
        max_turns=agent.max_turns,
        expected_turns=agent.expected_turns,
        max_tokens_per_turn=agent.max_tokens_per_turn,
        max_response_len=plan.sampling.max_response_len,
        tool_s=tool_s,
    )


def _sizes(plan: Plan) -> ModelSizes:
    try:
        return memory.model_sizes(load_arch(plan.model.id))
    except LookupError as exc:
        raise CalibrationError(f"model {plan.model.id!r} is not in the catalog, so its sizes are unknown") from exc


def _rollout_layout(plan: Plan) -> RolloutLayout:
    role = plan.role("rollout")
    args = role.engine
    return RolloutLayout(
        role.devices,
        role.parallel.tp,
        role.parallel.ep,
        float(args.get("gpu_memory_utilization", 0.9)),
        int(args.get("max_num_seqs", 1)),
        int(args.get("max_num_batched_tokens", 2048)),
        bool(args.get("enforce_eager", False)),
    )


def predict(plan: Plan, target: TargetProfile, work: cost.Workload) -> dict[str, float]:
    """The cost model's seconds per phase for `plan`'s layout under `target` and `work`."""
    sizes = _sizes(plan)
    dpn = plan.cluster.devices_per_node
    actor = plan.role("actor")
    assert actor.layout is not None
    train = cost.train_time(sizes, actor.layout, target, work, dpn).total_s
    rl = _rollout_layout(plan)
    rollout_t = cost.rollout_time(sizes, rl, target, work, dpn, max(1, rl.max_num_seqs))
    mode = plan.schedule.mode
    sync = cost.sync_seconds(
        sizes,
        target,
        sync_shape(plan, sizes, rl),
        sync_method(plan),
        plan.schedule.weight_sync_senders,
        plan.schedule.weight_sync_slicing,
        WEIGHT_SYNC_TP_SLICES.get(sizes.arch.hf_architecture, frozenset()),
    )
    step = cost.step_time(
        mode, work, rollout_t, train, 0.0, sync, plan.estimates.switch_s, target.efficiency.step_overhead_s
    )
    return {"train": train, "rollout": step.rollout_s, "sync": sync, "step": step.step_s}


def sync_method(plan: Plan) -> str:
    """The path a run's weights took: a served LoRA adapter, or the plan's `schedule.weight_sync`."""
    return "adapter" if plan.lora is not None and plan.lora.rollout == "adapter" else plan.schedule.weight_sync


def sync_shape(plan: Plan, sizes: ModelSizes, engine: RolloutLayout) -> cost.SyncShape:
    """Where a run's weights went, from its plan's placement (`cost.SyncShape`)."""
    actor = plan.role("actor")
    trainer_nodes = sorted({nd.node for nd in actor.placement})
    engine_nodes = {nd.node for r in plan.roles_of("rollout") for nd in r.placement}
    colocated = plan.schedule.mode == "colocated"
    cross = len(trainer_nodes) > 1 if colocated else bool(engine_nodes - set(trainer_nodes[:1]))
    adapter = 0
    if sync_method(plan) == "adapter":
        assert plan.lora is not None
        adapter = memory.lora_params(sizes.arch, plan.lora.rank, plan.lora.target_modules)
    merged = plan.lora is not None and plan.lora.rollout != "adapter"
    return cost.SyncShape(
        mode=plan.schedule.mode,
        trainer_ranks=actor.devices,
        trainer_nodes=len(trainer_nodes),
        cross_node=cross,
        devices_per_node=plan.cluster.devices_per_node,
        engine=engine,
        adapter_params=adapter,
        streamed=actor.parallel.pp == 1 and not merged,
        trainer_pp=actor.parallel.pp,
    )


def _with(target: TargetProfile, values: dict[str, float]) -> TargetProfile:
    eff = target.efficiency.model_copy(update=values)
    return target.model_copy(update={"efficiency": eff})


def _usable(run: Run, phase: str) -> bool:
    if phase not in run.measured:
        return False
    if phase == "rollout":  # streaming runs measure a wait, not the generation
        return run.plan.schedule.mode == "colocated" or run.plan.schedule.max_staleness == 0
    return True


def _loss(target: TargetProfile, base: TargetProfile, runs: list[Run], phase: str) -> float:
    total = 0.0
    for run in runs:
        if _usable(run, phase):
            predicted = predict(run.plan, target, run.work)[phase]
            total += log(max(predicted, 1e-9) / run.measured[phase]) ** 2
    for name in PHASE_PARAMS[phase]:
        now, was = cost.efficiency(target, name), cost.efficiency(base, name)
        total += RIDGE * log(max(now, 1e-9) / max(was, 1e-9)) ** 2
    return total


def _bounds(name: str, value: float) -> tuple[float, float]:
    value = max(value, 1e-4)
    high = min(value * SPAN, 1.0) if name in FRACTIONS else value * SPAN
    return log(value / SPAN), log(high)


def golden_section(f, lo: float, hi: float, rounds: int = 40) -> float:  # type: ignore[no-untyped-def]
    """Minimise a one-dimensional function on [lo, hi] (golden-section search)."""
    ratio = (5**0.5 - 1) / 2
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(rounds):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return (a + b) / 2


def fit(base: TargetProfile, runs: list[Run]) -> tuple[TargetProfile, dict[str, float]]:
    """Fit each phase's parameters (coordinate descent, golden-section steps in log space); the phases in order
    train, rollout, sync, step (the step's overhead is what the other phases leave unexplained)."""
    target = base
    fitted: dict[str, float] = {}
    for phase, all_names in PHASE_PARAMS.items():
        usable = [r for r in runs if _usable(r, phase)]
        if not usable:
            continue
        names = _phase_names(all_names, usable)
        for _ in range(ROUNDS.get(phase, 3)):
            for name in names:
                lo, hi = _bounds(name, cost.efficiency(base, name))

                def f(x: float, name: str = name, now: TargetProfile = target, phase: str = phase) -> float:
                    return _loss(_with(now, {name: exp(x)}), base, runs, phase)

                target = _with(target, {name: exp(golden_section(f, lo, hi))})
        fitted.update({n: cost.efficiency(target, n) for n in names})
    return target, fitted


def _phase_names(names: tuple[str, ...], usable: list[Run]) -> tuple[str, ...]:
    """The parameters a phase's runs can tell apart. Only agent runs tell the per-call cost, so without one it
    stays what the base profile says; agent runs alone leave the decode parameters to the base too, since their
    rollout time is mostly calls and tool waits: a fit of both would blame the decode for the calls and
    mispredict every plan without an agent. A weight-sync link figure is fitted only from runs whose method reads
    it (SYNC_METHOD_FIGURES): a broadcast run says nothing of the host path."""
    sync_figures = set(SYNC_METHOD_FIGURES.values())
    if sync_figures & set(names):
        read = {SYNC_METHOD_FIGURES[sync_method(r.plan)] for r in usable}
        names = tuple(n for n in names if n not in sync_figures or n in read)
    if not AGENT_PARAMS & set(names):
        return names
    agents = sum(r.work.agent is not None for r in usable)
    if agents == 0:
        return tuple(n for n in names if n not in AGENT_PARAMS)
    if agents == len(usable):
        return tuple(n for n in names if n in AGENT_PARAMS)
    return names


def calibrate(base: TargetProfile, runs: list[Run]) -> TargetProfile:
    """The calibrated profile: fitted efficiencies, the uncertainty the residuals show, and a record."""
    kinds = {r.plan.target for r in runs}
    if kinds != {base.id}:
        raise CalibrationError(f"runs are on target(s) {', '.join(sorted(kinds))}, not {base.id}")
    target, fitted = fit(base, runs)
    runs = _distinct_names(runs)
    ratios = []
    record = {
        "base": f"{base.id} (sha256 of the base profile below)",
        "runs": ", ".join(f"{r.name} ({r.steps} steps)" for r in runs),
        "fitted": ", ".join(f"{k}={v:.4g}" for k, v in sorted(fitted.items())),
    }
    for run in runs:
        before, after = predict(run.plan, base, run.work), predict(run.plan, target, run.work)
        if not all(math.isfinite(v) for v in (*before.values(), *after.values())):
            raise CalibrationError(f"{run.name}: the cost model has no finite time for its measured workload")
        ratios.append(after["step"] / run.measured["step"])
        record[f"run.{run.name}"] = ", ".join(
            f"{phase} measured {run.measured[phase]:.3g} s, predicted {after[phase]:.3g} s (was {before[phase]:.3g})"
            for phase in ("step", "rollout", "train", "sync")
            if phase in run.measured
        )
        ds = run.plan.algorithm.dynamic_sampling
        if run.generated_per_kept is not None and ds is not None:
            record[f"run.{run.name}.dynamic_sampling"] = (
                f"generated {run.generated_per_kept:.3g} groups per kept one (planned "
                f"{ds.expected_generated_per_kept:.3g}): algorithm.dynamic_sampling.expected_keep_rate "
                f"{1 / run.generated_per_kept:.3g} for this task"
            )
        if run.draft_acceptance is not None:
            record[f"run.{run.name}.draft_acceptance"] = (
                f"engines accepted {run.draft_acceptance:.3g} of draft tokens (planned "
                f"{run.plan.sampling.draft_acceptance or 0:.3g}): rollout.mtp.acceptance_rate "
                f"{min(0.99, max(0.01, run.draft_acceptance)):.2f} for this model and task"
            )
    spread = max(abs(log(r)) for r in ratios)
    uncertainty = round(max(MIN_UNCERTAINTY, exp(2 * spread)), 3)
    sources = dict(target.sources)
    for name in fitted:
        sources[f"efficiency.{name}"] = f"rlc calibrate: fitted to {record['runs']}"
    sources["estimate_uncertainty"] = "rlc calibrate: twice the largest step-time residual of the fit, at least 1.15"
    sources["estimate_uncertainty_fast"] = "rlc calibrate: unset, the residuals' band is stated both ways"
    update = {"estimate_uncertainty": uncertainty, "estimate_uncertainty_fast": None}
    return target.model_copy(update={**update, "sources": sources, "calibration": record})


def _distinct_names(runs: list[Run]) -> list[Run]:
    """Runs named apart in the record: folders of one name (every `rlc run` writes `.../run`) are numbered."""
    names = [r.name for r in runs]
    if len(set(names)) == len(names):
        return runs
    return [replace(r, name=f"{r.name}-{i}") for i, r in enumerate(runs, start=1)]


def measured_phases(run_dir: Path) -> dict[str, float]:
    """A run's medians per phase, named as `rlc explain` names them (and, with dynamic sampling, the groups it
    generated per kept one)."""
    run = load_run(run_dir)
    names = {"rollout": "rollout", "train": "train", "sync": "weight sync", "step": "step"}
    out = {names[k]: v for k, v in run.measured.items()}
    from rlc.compiler.explain import DRAFT_ACCEPTANCE, GENERATED_PER_KEPT

    if run.generated_per_kept is not None:
        out[GENERATED_PER_KEPT] = run.generated_per_kept
    if run.draft_acceptance is not None:
        out[DRAFT_ACCEPTANCE] = run.draft_acceptance
    return out
