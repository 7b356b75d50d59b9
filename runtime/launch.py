"""`rlc run`: check what the plan needs, start Ray and the roles, run the controller, shut down cleanly.

Everything that can be wrong with the inputs (model folder, dataset, reward function, a checkpoint from
another plan) is checked before any actor starts, and reported as a `RunError` with a clear message.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from rlc.schemas.plan import Plan

PLACEMENT_TIMEOUT_S = 300


class RunError(RuntimeError):
    """A problem with the run's inputs or environment, reported to the user without a traceback."""


def _model_path(plan: Plan) -> Path:
    if plan.model.path is None:
        raise RunError("the plan has no model path")
    return Path(plan.model.path)


def prepare_model(plan: Plan, log) -> Path:  # type: ignore[no-untyped-def]
    """Build the quickstart model when the plan asks for it; otherwise check the folder is a HF model."""
    path = _model_path(plan)
    if plan.model.build_tiny and not (path / "config.json").is_file():
        from rlc.runtime.tasks.tiny_model import build_tiny_model

        log(f"building the quickstart model in {path} (one-time, a few seconds)")
        build_tiny_model(path, seed=plan.algorithm.seed)
    if not path.is_dir():
        raise RunError(f"model folder not found: {path} (model.path in the spec; it must exist on every node)")
    if not (path / "config.json").is_file():
        raise RunError(f"{path} is not a Hugging Face model folder: config.json is missing")
    if not any(path.glob("*.safetensors")):
        raise RunError(f"{path} has no *.safetensors weights")
    for teacher in plan.distill.teachers if plan.distill else []:
        where = Path(teacher.model.path or "")
        if not (where / "config.json").is_file() or not any(where.glob("*.safetensors")):
            raise RunError(
                f"teacher {teacher.name}: no Hugging Face model at {teacher.model.path} (distill.teachers[].model.path "
                "in the spec; it must exist on every node)"
            )
    return path


def load_inputs(plan: Plan, model_path: Path) -> tuple[Any, Any]:
    """The tokenizer and reward function; raises RunError for a bad dataset or reward path."""
    from transformers import AutoTokenizer

    from rlc.runtime.prompts import PromptStream
    from rlc.runtime.tasks.datasets import DatasetError
    from rlc.runtime.tasks.rewards import RewardLoadError, load_reward

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    except (OSError, ValueError) as exc:
        raise RunError(f"cannot load the tokenizer from {model_path}: {exc}") from None
    try:
        reward_fn = load_reward(plan.data.reward)
    except RewardLoadError as exc:
        raise RunError(str(exc)) from None
    try:
        PromptStream(plan.data, tokenizer, plan.algorithm.seed, plan.sampling.max_prompt_len).check()
    except (DatasetError, ValueError, StopIteration) as exc:
        raise RunError(f"cannot read the training data: {exc}") from None
    return tokenizer, reward_fn


def _check_resources(plan: Plan, resource: str) -> None:
    """A Ray that cannot hold the plan would leave placement waiting forever: say what is missing instead."""
    import ray

    have = ray.cluster_resources().get(resource, 0)
    need = plan.cluster.total_devices
    if have < need:
        raise RunError(
            f"the Ray cluster offers {have:g} `{resource}` but the plan needs {need}: start every node with "
            f"`launch.sh` (or `ray start --resources='{{\"{resource}\": N}}'`), or run in a fresh process"
        )


def start_ray(plan: Plan, log) -> bool:  # type: ignore[no-untyped-def]
    """Join the cluster when launched as a Ray job; otherwise start an embedded local Ray sized by the plan.

    Returns whether this call started Ray (and so must shut it down).
    """
    import ray

    from rlc.schemas.registry import load_target

    target = load_target(plan.target)
    if ray.is_initialized():
        _check_resources(plan, target.ray_resource)
        return False
    if os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_JOB_ID"):
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=True)
        _check_resources(plan, target.ray_resource)
        return False
    devices = plan.cluster.total_devices
    cpus = max(os.cpu_count() or 1, devices + 2)
    log(f"starting a local Ray with {devices} logical `{target.ray_resource}` device(s)")
    ray.init(
        num_cpus=cpus,
        resources={target.ray_resource: devices},
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": dict(plan.env)},
    )
    return True


def _placement_group(bundles: list[dict[str, float]], name: str, created: list[Any]) -> Any:
    """Create and wait for a placement group; it is recorded in `created` first so the caller can release it."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group

    pg = placement_group(bundles, strategy="PACK", name=name)
    created.append(pg)
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except GetTimeoutError:
        free = {k: v for k, v in sorted(ray.available_resources().items()) if not k.startswith("node:")}
        raise RunError(
            f"Ray could not place role {name} within {PLACEMENT_TIMEOUT_S} s: it needs bundles {bundles}; "
            f"free resources are {free}"
        ) from None
    return pg


def build_roles(plan: Plan, model_path: Path, version: int, created: list[Any]) -> tuple[Any, Any, Any, Any]:
    """Placement groups, the trainer group, the rollout engines, the reference policy and the teachers.

    Colocated, trainer ranks and engines share one placement group: each device's logical resource is
    split between the trainer rank and the engine on it (they take turns; see colocate.PhaseSwitcher).
    A LoRA run has no reference group: the trainer scores with adapters disabled.
    """
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rlc.runtime.controller import RolloutPool
    from rlc.runtime.rollout.engine import rollout_engine_actor
    from rlc.runtime.train.group import TrainerGroup
    from rlc.schemas.registry import load_target

    resource = load_target(plan.target).ray_resource
    actor = plan.roles_of("train")[0]
    rollout = plan.roles_of("rollout")[0]
    colocated = plan.schedule.mode == "colocated"
    if colocated:
        # Engine i uses devices [i·tp, (i+1)·tp); it is anchored on its first device's bundle.
        train_pg = rollout_pg = _placement_group([{resource: 1}] * actor.devices, "rlc-colocated", created)
    else:
        train_pg = _placement_group([{resource: 1}] * actor.devices, "rlc-actor", created)
        rollout_pg = _placement_group([{resource: rollout.parallel.tp}] * rollout.replicas, "rlc-rollout", created)
    train_cfg = {
        "lr": plan.algorithm.lr,
        "weight_decay": plan.algorithm.weight_decay,
        "max_grad_norm": plan.algorithm.grad_clip,
        "temperature": plan.sampling.temperature,
        "seed": plan.algorithm.seed,
        # The trainer's micro-batching and log-prob chunking follow the plan (its memory model assumes them).
        **{k: v for k, v in actor.engine.items() if k in ("micro_batch_tokens", "logprob_chunk_tokens", "packing")},
        # FSDP2 recomputes activations per decoder layer (full); selective maps to the same on this backend.
        "gradient_checkpointing": actor.engine.get("recompute", "none") != "none",
        "lora": plan.lora.model_dump() if plan.lora else None,
    }
    env = {**plan.env, **actor.env}
    separate_reference = plan.algorithm.kl_coef > 0 and plan.lora is None
    # A KL reference shares the trainer's devices (each takes half of a device's logical resource); colocated,
    # the engines take the other half.
    share = (0.5 if separate_reference else 1.0) * (0.5 if colocated else 1.0)
    trainer = TrainerGroup(
        actor.devices,
        str(model_path),
        plan.platform,
        train_cfg,
        placement_group=train_pg,
        num_cpus=0,
        resources={resource: share},
        env=env,
    )
    reference = None
    if separate_reference:
        reference = TrainerGroup(
            actor.devices,
            str(model_path),
            plan.platform,
            {**train_cfg, "lr": 0.0},
            placement_group=train_pg,
            num_cpus=0,
            resources={resource: share},
            env=env,
        )
    engine_env = {**plan.env, **rollout.env}
    engine_args = {**rollout.engine, "model": str(model_path)}

    generations: dict[int, int] = {}

    def make_engine(index: int, stamp: int) -> Any:
        # Named so operators (and the failure tests) can find them: rlc-rollout-<index>[-r<restart>].
        generation = generations.get(index, 0)
        generations[index] = generation + 1
        name = f"rlc-rollout-{index}" + (f"-r{generation}" if generation else "")
        cls = rollout_engine_actor(
            name=name,
            num_cpus=0,
            resources={resource: 0.5 if colocated else rollout.parallel.tp},
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=rollout_pg,
                placement_group_bundle_index=index * rollout.parallel.tp if colocated else index,
            ),
            runtime_env={"env_vars": engine_env},
            max_concurrency=1,
        )
        return cls.remote(engine_args, plan.platform, engine_env, version if stamp == 0 else stamp)

    pool = RolloutPool(plan, make_engine)
    teachers = build_teachers(plan, resource, created) if plan.distill else None
    pool.wait_ready()
    if teachers is not None:
        teachers.wait_ready()
    return trainer, pool, reference, teachers


def build_teachers(plan: Plan, resource: str, created: list[Any]) -> Any:
    """Forward-only teacher engines, one placement group per teacher role, named rlc-teacher-<name>-<i>."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rlc.runtime.distill import TeacherPool
    from rlc.runtime.rollout.engine import rollout_engine_actor

    groups = {
        t.role: _placement_group(
            [{resource: plan.role(t.role).parallel.tp}] * plan.role(t.role).replicas, f"rlc-{t.role}", created
        )
        for t in plan.distill.teachers  # type: ignore[union-attr]
    }

    generations: dict[tuple[str, int], int] = {}

    def make_teacher(role_name: str, index: int) -> Any:
        # rlc-teacher-<name>-<index>[-r<restart>]: a restart never waits for the dead actor's name to be freed.
        generation = generations.get((role_name, index), 0)
        generations[(role_name, index)] = generation + 1
        role = plan.role(role_name)
        env = {**plan.env, **role.env}
        cls = rollout_engine_actor(
            name=f"rlc-{role_name}-{index}" + (f"-r{generation}" if generation else ""),
            num_cpus=0,
            resources={resource: role.parallel.tp},
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=groups[role_name], placement_group_bundle_index=index
            ),
            runtime_env={"env_vars": env},
            max_concurrency=1,
        )
        return cls.remote(dict(role.engine), plan.platform, env, 0)

    return TeacherPool(plan, make_teacher)


def run_plan(plan: Plan, run_dir: Path | None = None, resume: bool = False) -> int:
    """Execute a verified plan; returns the number of steps trained in total."""
    from rlc.runtime.checkpoint import latest_checkpoint

    run_dir = Path(run_dir or plan.run_dir)
    log = lambda text: print(f"rlc: {text}", flush=True)  # noqa: E731
    start = None
    if resume:
        found = latest_checkpoint(run_dir)
        if found is None:
            raise RunError(f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}")
        checkpoint, start = found
        if start.plan_hash and start.plan_hash != plan.spec_hash:
            raise RunError(
                f"--resume: {checkpoint} was written by another plan (spec hash {start.plan_hash[:12]}, this plan "
                f"{plan.spec_hash[:12]}); use a fresh --run-dir"
            )
        if start.step >= plan.schedule.steps:
            log(f"{checkpoint.name} already reached step {start.step} of {plan.schedule.steps}; nothing to do")
            return start.step
    elif (run_dir / "metrics.jsonl").exists() and (run_dir / "checkpoints").exists():
        log(f"{run_dir} holds an earlier run; starting over (use --resume to continue it)")
        shutil.rmtree(run_dir / "checkpoints")
    run_dir.mkdir(parents=True, exist_ok=True)
    model_path = prepare_model(plan, log)
    tokenizer, reward_fn = load_inputs(plan, model_path)
    (run_dir / "plan.json").write_text(plan.model_dump_json(indent=2) + "\n")

    import ray

    from rlc.runtime.controller import Controller

    started_ray = start_ray(plan, log)
    placement_groups: list[Any] = []  # released at the end when Ray is not ours to shut down
    trainer = pool = controller = teachers = reference = None
    previous = signal.getsignal(signal.SIGINT)
    try:
        log("starting trainer and rollout engines")
        trainer, pool, reference, teachers = build_roles(
            plan, model_path, start.version if start else 0, placement_groups
        )
        controller = Controller(plan, run_dir, tokenizer, reward_fn, pool, trainer, start=start)
        controller.reference = reference
        controller.teachers = teachers
        if teachers is not None:
            teachers.log = controller.logger.message
        if start is not None:
            trainer.load_checkpoint(str(checkpoint))
            controller._sync_weights(start.version)
            log(f"resumed from {checkpoint.name} at step {start.step}")

        def interrupt(signum: int, frame: Any) -> None:
            log("interrupted: finishing the current step's bookkeeping and shutting down")
            controller.stop()
            signal.signal(signal.SIGINT, previous)

        signal.signal(signal.SIGINT, interrupt)
        steps = controller.run()
        log(f"done: {steps} step(s); metrics in {run_dir / 'metrics.jsonl'}")
        return steps
    finally:
        signal.signal(signal.SIGINT, previous)
        if controller is not None:
            controller.close()
        for part in (teachers, pool, reference, trainer):
            if part is not None:
                try:
                    part.shutdown()
                except Exception as exc:
                    print(f"rlc: warning: shutdown: {exc}", file=sys.stderr)
        if started_ray:
            ray.shutdown()
        else:
            from ray.util.placement_group import remove_placement_group

            for pg in placement_groups:
                with contextlib.suppress(Exception):
                    remove_placement_group(pg)
