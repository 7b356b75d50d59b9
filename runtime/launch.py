"""`rlc run`: check what the plan needs, start Ray and the roles, run the controller, shut down cleanly.

Everything that can be wrong with the inputs (model folder, dataset, reward function, a checkpoint from
another plan) is checked before any actor starts, and reported as a `RunError` with a clear message.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from rlc.runtime.host_moves import HostMovesError
from rlc.runtime.launch_request import ActorRequest, LaunchRequest, launch_request
from rlc.schemas.plan import Plan, Role

PLACEMENT_TIMEOUT_S = 300


class RunError(RuntimeError):
    """A problem with the run's inputs or environment, reported to the user without a traceback."""


class RuntimeGapError(RunError):
    """The plan asks for something this runtime does not execute (RLC707): refused before anything starts."""

    def __init__(self, gaps: list[str]) -> None:
        self.gaps = gaps
        super().__init__("this runtime cannot execute the plan: " + "; ".join(gaps))


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
        build_tiny_model(path, seed=plan.algorithm.seed, max_positions=plan.model.tiny_max_positions or 512)
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


def _check_resources(plan: Plan) -> None:
    """A Ray that cannot hold the plan would leave placement waiting forever: say what is missing instead."""
    import ray

    resource = plan.cluster.ray_resource
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

    resource = plan.cluster.ray_resource
    if ray.is_initialized():
        _check_resources(plan)
        return False
    if os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_JOB_ID"):
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=True)
        _check_resources(plan)
        return False
    devices = plan.cluster.total_devices
    cpus = max(os.cpu_count() or 1, devices + 2)
    log(f"starting a local Ray with {devices} logical `{resource}` device(s)")
    ray.init(
        num_cpus=cpus,
        resources={resource: devices},
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": dict(plan.env)},
    )
    return True


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
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(
        placement_group=groups[actor.placement_group], placement_group_bundle_index=actor.bundle_index
    )


def train_config(plan: Plan, role: Role) -> dict[str, Any]:
    """The trainer's settings that are not its layout: optimizer, sampling temperature, batching, LoRA."""
    return {
        "lr": plan.algorithm.lr,
        "weight_decay": plan.algorithm.weight_decay,
        "max_grad_norm": plan.algorithm.grad_clip,
        "temperature": plan.sampling.temperature,
        "seed": plan.algorithm.seed,
        **{k: v for k, v in role.engine.items() if k in ("logprob_chunk_tokens", "packing", "packed_attention")},
        "lora": plan.lora.model_dump() if plan.lora else None,
    }


def build_roles(plan: Plan, model_path: Path, version: int, created: list[Any]) -> tuple[Any, Any, Any, Any]:
    """Placement groups, the trainer group, the rollout engines, the reference policy and the teachers,
    exactly as `launch_request(plan)` (what `--dry-run` prints) describes them.

    A LoRA run has no reference group: the trainer scores with adapters disabled.
    """
    from rlc.runtime.controller import RolloutPool
    from rlc.runtime.rollout.engine import rollout_engine_actor
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
        )

    trainer = group_of(ranks, train_cfg)
    reference = group_of(refs, {**train_cfg, "lr": 0.0}) if refs else None
    engine_env = {**plan.env, **rollout.env}
    engine_args = {**rollout.engine, "model": str(model_path)}
    engines = [a for a in request.actors if a.role == rollout.name]

    generations: dict[int, int] = {}

    def make_engine(index: int, stamp: int) -> Any:
        # Named so operators (and the failure tests) can find them: rlc-rollout-<index>[-r<restart>].
        generation = generations.get(index, 0)
        generations[index] = generation + 1
        spec = engines[index]
        cls = rollout_engine_actor(
            name=spec.name + (f"-r{generation}" if generation else ""),
            num_cpus=0,
            resources=spec.resources,
            scheduling_strategy=_strategy(groups, spec),
            runtime_env={"env_vars": engine_env},
            max_concurrency=1,
        )
        return cls.remote(engine_args, plan.platform, engine_env, version if stamp == 0 else stamp)

    pool = RolloutPool(plan, make_engine)
    teachers = build_teachers(plan, request, groups) if plan.distill else None
    pool.wait_ready()
    if teachers is not None:
        teachers.wait_ready()
    return trainer, pool, reference, teachers


def build_teachers(plan: Plan, request: LaunchRequest, groups: dict[str, Any]) -> Any:
    """Forward-only teacher engines on their planned bundles, named rlc-teacher-<name>-<i>."""
    from rlc.runtime.distill import TeacherPool
    from rlc.runtime.rollout.engine import rollout_engine_actor

    generations: dict[tuple[str, int], int] = {}

    def make_teacher(role_name: str, index: int) -> Any:
        # rlc-teacher-<name>-<index>[-r<restart>]: a restart never waits for the dead actor's name to be freed.
        generation = generations.get((role_name, index), 0)
        generations[(role_name, index)] = generation + 1
        role = plan.role(role_name)
        spec = [a for a in request.actors if a.role == role_name][index]
        env = {**plan.env, **role.env}
        cls = rollout_engine_actor(
            name=spec.name + (f"-r{generation}" if generation else ""),
            num_cpus=0,
            resources=spec.resources,
            scheduling_strategy=_strategy(groups, spec),
            runtime_env={"env_vars": env},
            max_concurrency=1,
        )
        return cls.remote(dict(role.engine), plan.platform, env, 0)

    return TeacherPool(plan, make_teacher)


def check_built_layout(plan: Plan, built: list[dict[str, Any]]) -> list[str]:
    """Every way the trainer ranks' built layouts differ from the plan's layout (empty: they match)."""
    role = plan.roles_of("train")[0]
    layout = role.layout
    assert layout is not None
    want = {
        "mesh": {"dp": layout.dp, "cp": layout.cp, "tp": layout.tp},
        "tp": layout.tp,
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


def layout_record(plan: Plan, built: list[dict[str, Any]]) -> dict[str, Any]:
    """`RUN/layout.json`: the plan's layout, what each rank built, and predicted vs measured peak memory."""
    role = plan.roles_of("train")[0]
    assert role.layout is not None
    return {
        "role": role.name,
        "plan_layout": role.layout.model_dump(),
        "layout_summary": role.layout.summary(),
        "predicted_memory_gib": {"total": role.memory.total_gib, "items": role.memory.items},
        "ranks": built,
    }


def write_layout_record(run_dir: Path, plan: Plan, built: list[dict[str, Any]]) -> Path:
    path = run_dir / "layout.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(layout_record(plan, built), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def refuse_gaps(plan: Plan) -> None:
    """What this runtime cannot execute stops the run before anything starts (`RuntimeGapError`)."""
    gaps = launch_request(plan).refusals
    if gaps:
        raise RuntimeGapError(gaps)


def run_plan(plan: Plan, run_dir: Path | None = None, resume: bool = False) -> int:
    """Execute a verified plan; returns the number of steps trained in total."""
    from rlc.runtime.checkpoint import latest_checkpoint

    refuse_gaps(plan)
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
        mismatches = check_built_layout(plan, trainer.built_layouts())
        if mismatches:
            raise RunError("the trainer did not build the plan's layout: " + "; ".join(mismatches))
        write_layout_record(run_dir, plan, trainer.built_layouts())
        log(f"trainer layout as planned: {plan.roles_of('train')[0].layout.summary()}")  # type: ignore[union-attr]
        controller = Controller(plan, run_dir, tokenizer, reward_fn, pool, trainer, start=start)
        try:
            controller.prepare_weight_path()
        except HostMovesError as exc:
            raise RunError(str(exc)) from None
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
        if controller is not None and trainer is not None:
            with contextlib.suppress(Exception):  # the measured peaks of the whole run, when the ranks still answer
                write_layout_record(run_dir, plan, trainer.built_layouts())
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
