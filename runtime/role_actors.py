"""The run's Ray actors from the launch request: placement groups, trainer ranks, rollout engines, teachers, and the
check that the trainer built the layout the plan states."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rlc.runtime.errors import RunError
from rlc.runtime.launch_request import ActorRequest, LaunchRequest, launch_request
from rlc.runtime.run_end import actor_leaves_stop_to_driver
from rlc.runtime.weight_push import sync_method
from rlc.schemas.plan import Plan, Role

PLACEMENT_TIMEOUT_S = 300


def _placement_groups(request: LaunchRequest, created: list[Any]) -> dict[str, Any]:
    """Create and wait for every placement group of the request; each is recorded in `created` first so the
    caller can release it."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group

    groups: dict[str, Any] = {}
    for g in request.placement_groups:
        pg = placement_group(g.bundles, strategy=g.strategy, name=g.name)
        created.append(pg)
        groups[g.name] = pg
    for g in request.placement_groups:
        try:
            ray.get(groups[g.name].ready(), timeout=PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            free = {k: v for k, v in sorted(ray.available_resources().items()) if not k.startswith("node:")}
            raise RunError(
                f"Ray could not place {g.name} within {PLACEMENT_TIMEOUT_S} s: it needs bundles {g.bundles}; "
                f"free resources are {free}"
            ) from None
    return groups


def _strategy(groups: dict[str, Any], actor: ActorRequest) -> Any:
    """The actor's planned bundle. An engine across nodes also captures the group for what it starts: vLLM reads
    the captured group in its actor, picks its Ray executor and places its workers on the planned bundles."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(
        placement_group=groups[actor.placement_group],
        placement_group_bundle_index=actor.bundle_index,
        placement_group_capture_child_tasks=True if actor.worker_bundles else None,
    )


#: The train role's `engine` settings the trainer takes (the plan states them; the trainer derives none).
TRAINER_ENGINE_KEYS = (
    "logprob_chunk_tokens",
    "packing",
    "packing_algorithm",
    "packed_attention",
    "betas",
    "eps",
    "router_aux_loss_coef",
    "routing_replay",
)


def train_config(plan: Plan, role: Role) -> dict[str, Any]:
    """The trainer's settings that are not its layout: optimizer, sampling temperature, batching, LoRA."""
    return {
        "lr": plan.algorithm.lr,
        "weight_decay": plan.algorithm.weight_decay,
        "max_grad_norm": plan.algorithm.grad_clip,
        "temperature": plan.sampling.temperature,
        "seed": plan.algorithm.seed,
        "deterministic": plan.reproducibility.torch_deterministic,
        **{k: v for k, v in role.engine.items() if k in TRAINER_ENGINE_KEYS},
        "lora": plan.lora.model_dump() if plan.lora else None,
        "weight_sync": sync_method(plan),
    }


def build_roles(plan: Plan, model_path: Path, version: int, created: list[Any]) -> tuple[Any, Any, Any, Any]:
    """Placement groups, the trainer group, the rollout engines, the reference policy and the teachers,
    exactly as `launch_request(plan)` (what `--dry-run` prints) describes them.

    A LoRA run has no reference group: the trainer scores with adapters disabled.
    """
    from rlc.runtime.rollout.pool import RolloutPool
    from rlc.runtime.train.group import TrainerGroup

    request = launch_request(plan)
    groups = _placement_groups(request, created)
    actor = plan.roles_of("train")[0]
    rollout = plan.roles_of("rollout")[0]
    assert actor.layout is not None
    ranks = [a for a in request.actors if a.kind == "trainer"]
    refs = [a for a in request.actors if a.kind == "reference"]
    env = {**plan.env, **actor.env}
    train_cfg = train_config(plan, actor)

    def group_of(members: list[ActorRequest], cfg: dict[str, Any]) -> Any:
        return TrainerGroup(
            actor.devices,
            str(model_path),
            plan.platform,
            cfg,
            layout=actor.layout,
            placement_group=groups[members[0].placement_group],
            bundle_indices=[a.bundle_index for a in members],
            num_cpus=0,
            resources=members[0].resources,
            env=env,
            rank_env=[a.device_env(plan.platform) for a in members],
            wait=False,  # `_wait_started` waits for every role together
        )

    engine_env = {**plan.env, **rollout.env}
    engine_args = {**rollout.engine, "model": str(model_path)}
    engines = [a for a in request.actors if a.role == rollout.name]

    generations: dict[int, int] = {}

    def make_engine(index: int, stamp: int) -> Any:
        # Named so operators (and the failure tests) can find them: rlc-rollout-<index>[-r<restart>].
        generation = generations.get(index, 0)
        generations[index] = generation + 1
        spec = engines[index]
        env = {**engine_env, **spec.device_env(plan.platform), **spec.worker_env()}
        cls = _engine_actor_class(spec, generation, groups, env)
        # Agents call vLLM's OpenAI server inside the actor.
        agent = (plan.agent.model_dump(), plan.sampling.model_dump()) if plan.agent is not None else (None, None)
        stamped = version if stamp == 0 else stamp
        hosts = spec.core_host_starts(plan.platform, engine_env)
        return cls.remote(
            engine_args,
            plan.platform,
            env,
            stamped,
            plan.schedule.weight_update,
            *agent,
            core_hosts=hosts,
            routing_capture=rollout.routing_capture,  # who records the experts R3 replays (the plan's choice)
        )

    def trainers() -> dict[str, Any]:
        started = {
            "the trainer": group_of(ranks, train_cfg),
            "the reference policy": group_of(refs, {**train_cfg, "lr": 0.0, "weight_sync": None}) if refs else None,
        }
        for group in started.values():
            for worker in getattr(group, "workers", ()):
                # A job-wide SIGTERM is the driver's (`run_end.leave_stop_to_driver`; engines apply it as they start
                # vLLM). A rank starts no process that would inherit it, so nothing waits for this.
                worker.__ray_call__.remote(actor_leaves_stop_to_driver)
        return started

    # Every role starts at once, engines first (theirs is the longest start-up), except where trainers and
    # engines share an accelerator: vLLM sizes its cache from the device memory it finds free, so there the
    # trainers must be resident before any engine starts.
    sharing = plan.platform != "cpu" and plan.schedule.mode == "colocated"
    started = trainers() if sharing else {}
    if sharing:
        _wait_started(started)
    pool = RolloutPool(plan, make_engine)
    teachers = build_teachers(plan, request, groups) if plan.distill else None
    started.update({"the rollout engines": pool, "the teachers": teachers})
    if not sharing:
        started.update(trainers())
    _wait_started(started)
    return started["the trainer"], pool, started["the reference policy"], teachers


def _wait_started(roles: dict[str, Any]) -> None:
    """Wait, within one bound, for every role's actors to be built, all starting at once. An actor that fails
    while starting raises its RayActorError as soon as it does (the caller names it); a role still not ready
    at the bound is named."""
    import ray

    from rlc.runtime.rollout.pool import ENGINE_START_TIMEOUT_S

    owner = {ref: name for name, role in roles.items() if role is not None for ref in role.ready_refs()}
    waiting = list(owner)
    deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
    while waiting:
        ready, waiting = ray.wait(waiting, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = sorted({owner[ref] for ref in waiting})
            raise RunError(
                f"{', '.join(late)} did not start within {ENGINE_START_TIMEOUT_S} s; the actors' logs are in the "
                "Ray session's logs folder"
            )
        ray.get(ready)  # raises the error of an actor that failed while starting


def build_teachers(plan: Plan, request: LaunchRequest, groups: dict[str, Any]) -> Any:
    """Forward-only teacher engines on their planned bundles, named rlc-teacher-<name>-<i>."""
    from rlc.runtime.distill import TeacherPool

    generations: dict[tuple[str, int], int] = {}

    def make_teacher(role_name: str, index: int) -> Any:
        # rlc-teacher-<name>-<index>[-r<restart>]: a restart never waits for the dead actor's name to be freed.
        generation = generations.get((role_name, index), 0)
        generations[(role_name, index)] = generation + 1
        role = plan.role(role_name)
        spec = [a for a in request.actors if a.role == role_name][index]
        env = {**plan.env, **role.env, **spec.device_env(plan.platform), **spec.worker_env()}
        cls = _engine_actor_class(spec, generation, groups, env)
        hosts = spec.core_host_starts(plan.platform, {**plan.env, **role.env})
        return cls.remote(dict(role.engine), plan.platform, env, 0, core_hosts=hosts)

    return TeacherPool(plan, make_teacher)


def check_built_layout(plan: Plan, built: list[dict[str, Any]]) -> list[str]:
    """Every way the trainer ranks' built layouts differ from the plan's layout (empty: they match)."""
    role = plan.roles_of("train")[0]
    layout = role.layout
    assert layout is not None
    want = {
        "mesh": {"dp": layout.dp, "cp": layout.cp, "tp": layout.tp},
        "tp": layout.tp,
        "ep": layout.ep,
        "pp": layout.pp,
        "shard_group": layout.shard_group,
        "cp_kind": layout.cp_kind if layout.cp > 1 else None,
        "param_dtype": layout.precision.param_dtype,
        "compute_dtype": layout.precision.compute_dtype,
        "reduce_dtype": layout.precision.reduce_dtype,
        "recompute": layout.recompute,
        "offload_params": layout.offload_params,
        "offload_optimizer": layout.offload_optimizer,
    }
    found = []
    for rank, entry in enumerate(built):
        got = entry["built"]
        if got["coords"] != layout.coordinates(rank):
            found.append(f"rank {rank}: mesh position {got['coords']} instead of {layout.coordinates(rank)}")
        found += [f"rank {rank}: {k} is {got[k]!r}, the plan says {v!r}" for k, v in want.items() if got[k] != v]
    return found


def _engine_actor_class(spec: ActorRequest, generation: int, groups: dict[str, Any], env: dict[str, str]) -> Any:
    """The Ray actor class of one engine (rollout or teacher) in its placement bundle, named after the request and,
    once restarted, its generation (`-r<n>`: a restart never waits for the dead actor's name to be freed)."""
    from rlc.runtime.rollout.engine import rollout_engine_actor

    return rollout_engine_actor(
        name=spec.name + (f"-r{generation}" if generation else ""),
        num_cpus=0,
        resources=spec.resources,
        scheduling_strategy=_strategy(groups, spec),
        runtime_env={"env_vars": env},
    )
