"""`rlc run`: check what the plan needs, start Ray and the roles, run the controller, shut down cleanly.

Everything that can be wrong with the inputs (run directory, model folder, dataset, reward function, a
checkpoint from another plan, free disk) is checked before any actor starts, and reported as a `RunError`
with a clear message. An earlier run in the run directory is never deleted (see `run_dir`), and one driver
holds the run directory's lock for the whole run. Ctrl-C and SIGTERM stop a run cleanly: the step in progress
is finished and checkpointed, and the run ends with `RunStopped` (a partial run is not a finished one).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rlc.compiler.diagnostics import first_line
from rlc.compiler.node_setup import NODE_RESOURCE_UNITS, node_resource
from rlc.runtime.errors import RunError, RuntimeGapError, RunUsageError, resume_command
from rlc.runtime.host_moves import HostMovesError
from rlc.runtime.launch_request import ActorRequest, LaunchRequest, launch_request
from rlc.runtime.model_family import check_model_family
from rlc.runtime.preflight import Weights, check_model_folder
from rlc.runtime.weight_push import sync_method
from rlc.schemas.plan import Plan, Role

__all__ = ["RunError", "RunStopped", "RunUsageError", "prepare_model", "run_plan"]

T = TypeVar("T")

PLACEMENT_TIMEOUT_S = 300


def _model_path(plan: Plan) -> Path:
    if plan.model.path is None:
        raise RunError("the plan has no model path")
    return Path(plan.model.path)


def prepare_model(plan: Plan, log) -> tuple[Path, Weights]:  # type: ignore[no-untyped-def]
    """Build the quickstart model when the plan asks for it; check every model folder is complete and sound."""
    path = _model_path(plan)
    if plan.model.build_tiny and not (path / "config.json").is_file():
        from rlc.runtime.tasks.tiny_model import build_tiny_model

        log(f"building the quickstart model in {path} (one-time, a few seconds)")
        try:
            build_tiny_model(
                path,
                seed=plan.algorithm.seed,
                max_positions=plan.model.tiny_max_positions or 512,
                task="calculator" if plan.model.id == "rlc-tiny-agent" else "addition",
                architecture="moe" if plan.model.experts else "dense",
            )
        except (OSError, ValueError) as exc:
            raise RunError(f"cannot build the quickstart model in {path}: {exc}") from None
    weights = check_model_folder(path, "model.path")
    check_model_family(path, plan.model)
    for teacher in plan.distill.teachers if plan.distill else []:
        if not teacher.model.path:
            raise RunError(f"teacher {teacher.name}: the plan has no model path (distill.teachers[].model.path)")
        check_model_folder(Path(teacher.model.path), f"teacher {teacher.name}: distill.teachers[].model.path")
    return path, weights


def load_inputs(plan: Plan, model_path: Path) -> tuple[Any, Any]:
    """The tokenizer and reward function; raises RunError for a bad dataset or reward path."""
    from transformers import AutoTokenizer

    from rlc.runtime.prompts import PromptStream
    from rlc.runtime.tasks.datasets import DatasetError
    from rlc.runtime.tasks.rewards import RewardLoadError, load_reward

    try:
        # Local files only: a folder missing a file must fail here, not wait on the Hugging Face Hub.
        tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
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
    offered = ray.cluster_resources()
    have = offered.get(resource, 0)
    need = plan.cluster.total_devices
    if have < need:
        raise RunError(
            f"the Ray cluster offers {have:g} `{resource}` but the plan needs {need}: start every node with "
            f"`launch.sh` (or `ray start --resources='{{\"{resource}\": N}}'`), or run in a fresh process"
        )
    if plan.cluster.nodes > 1:  # the placement bundles ask for them (`launch_request`)
        missing = [k for k in range(plan.cluster.nodes) if offered.get(node_resource(k), 0) < 1]
        if missing:
            raise RunError(
                f"no node of the Ray cluster is the plan's node {', '.join(f'n{k}' for k in missing)} (it declares "
                f"`{node_resource(missing[0])}`): start each worker with the plan's launch.sh, "
                f"`RLC_NODE_RANK={missing[0]} launch.sh worker` for n{missing[0]}"
            )


#: The embedded local Ray keeps no idle worker processes: the run's actors have workers of their own and its only
#: plain task (the trainer's address probe) runs once, while each idle worker polls its raylet (measured on the
#: quickstart: three idle workers, ~2 ms of CPU each per 0.24 s step, on the same two cores as the actors). Nor does
#: it prestart workers for the driver: two of those started, imported Ray and sat idle for the whole run (~0.8
#: CPU-seconds each at start-up, measured per process on the quickstart); actors start their own on demand. It
#: neither records task events (the state API's task list, which rlc's own trace and metrics replace) nor collects
#: Ray's internal metrics: with both on, its GCS, raylet and dashboard agent took about 3.1 CPU-ms per quickstart
#: step together, without them 1.8-2.0 (measured per process over 240 steps, `max_staleness` 1). A cluster
#: started by `launch.sh` keeps Ray's defaults.
EMBEDDED_RAY_CONFIG = {
    "num_workers_soft_limit": 0,
    "prestart_worker_first_driver": False,
    "enable_worker_prestart": False,
    "task_events_report_interval_ms": 0,
    "enable_metrics_collection": False,
}


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
        address = os.environ.get("RAY_ADDRESS", "auto")
        hint = "start it (launch.sh), or unset RAY_ADDRESS to run on a Ray of this machine"
        unreachable = ray_address_unreachable(address)
        if unreachable:  # ray.init would retry for minutes, printing only its own warnings
            raise RunError(f"cannot join the Ray cluster at RAY_ADDRESS={address}: {unreachable}; {hint}")
        try:
            ray.init(address=address, log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RunError(f"cannot join the Ray cluster at RAY_ADDRESS={address}: {first_line(exc)}; {hint}") from None
        _check_resources(plan)
        return False
    # One machine's Ray would claim every node's accelerators and run on this one. On cpu the nodes and devices
    # are logical (the embedded default), so a multi-node cpu plan runs here as its placement groups say.
    if plan.cluster.nodes > 1 and plan.platform != "cpu":
        raise RunUsageError(
            f"plan {plan.name} spans {plan.cluster.nodes} nodes, and no Ray cluster was given (RAY_ADDRESS): start "
            "the nodes with the plan's launch.sh (`launch.sh head` here, `launch.sh worker` on the others), which "
            "submits the run"
        )
    devices = plan.cluster.total_devices
    cpus = max(os.cpu_count() or 1, devices + 2)
    # A cpu plan of several logical nodes runs here: this one Ray stands for all of them.
    nodes = {node_resource(k): NODE_RESOURCE_UNITS for k in range(plan.cluster.nodes)} if plan.cluster.nodes > 1 else {}
    log(f"starting a local Ray with {devices} logical `{resource}` device(s)")
    # "local": a new instance even where `ray start` left a cluster on this machine (Ray would otherwise join
    # the one named in its temp dir's ray_current_cluster and then refuse the sizes given here).
    ray.init(
        address="local",
        num_cpus=cpus,
        resources={resource: devices, **nodes},
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": dict(plan.env)},
        _system_config=EMBEDDED_RAY_CONFIG,
    )
    return True


#: How long a cluster's GCS port may take to accept a connection before the run says it is unreachable.
RAY_CONNECT_TIMEOUT_S = 10.0


def ray_address_unreachable(address: str) -> str:
    """Why a `host:port` Ray address does not accept connections (empty when it does, or is not host:port)."""
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return ""
    try:
        with socket.create_connection((host, int(port)), timeout=RAY_CONNECT_TIMEOUT_S):
            return ""
    except OSError as exc:
        return f"nothing answers on {host}:{port} within {RAY_CONNECT_TIMEOUT_S:g} s ({exc.strerror or exc})"


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


#: The train role's `engine` settings the trainer takes (the plan states them; the trainer derives none).
TRAINER_ENGINE_KEYS = (
    "logprob_chunk_tokens",
    "packing",
    "packed_attention",
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
    from rlc.runtime.rollout.engine import rollout_engine_actor
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
        env = {**engine_env, **spec.device_env(plan.platform)}
        cls = rollout_engine_actor(
            name=spec.name + (f"-r{generation}" if generation else ""),
            num_cpus=0,
            resources=spec.resources,
            scheduling_strategy=_strategy(groups, spec),
            runtime_env={"env_vars": env},
        )
        # Agents call vLLM's OpenAI server inside the actor.
        agent = (plan.agent.model_dump(), plan.sampling.model_dump()) if plan.agent is not None else (None, None)
        stamped = version if stamp == 0 else stamp
        return cls.remote(engine_args, plan.platform, env, stamped, plan.schedule.weight_update, *agent)

    def trainers() -> dict[str, Any]:
        return {
            "the trainer": group_of(ranks, train_cfg),
            "the reference policy": group_of(refs, {**train_cfg, "lr": 0.0, "weight_sync": None}) if refs else None,
        }

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
    from rlc.runtime.rollout.engine import rollout_engine_actor

    generations: dict[tuple[str, int], int] = {}

    def make_teacher(role_name: str, index: int) -> Any:
        # rlc-teacher-<name>-<index>[-r<restart>]: a restart never waits for the dead actor's name to be freed.
        generation = generations.get((role_name, index), 0)
        generations[(role_name, index)] = generation + 1
        role = plan.role(role_name)
        spec = [a for a in request.actors if a.role == role_name][index]
        env = {**plan.env, **role.env, **spec.device_env(plan.platform)}
        cls = rollout_engine_actor(
            name=spec.name + (f"-r{generation}" if generation else ""),
            num_cpus=0,
            resources=spec.resources,
            scheduling_strategy=_strategy(groups, spec),
            runtime_env={"env_vars": env},
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
    """What this runtime cannot execute stops the run before anything starts (`RuntimeGapError`); a plan the
    launch request cannot be read off (edited by hand) is a `RunUsageError`."""
    try:
        gaps = launch_request(plan).refusals
    except ValueError as exc:
        raise RunUsageError(f"cannot read the plan: {exc}") from None
    if gaps:
        raise RuntimeGapError(gaps)


def _preflight(plan: Plan, run_dir: Path, resume: bool, overwrite: bool, log) -> tuple[Path, Weights]:  # type: ignore[no-untyped-def]
    """Run-directory and input checks that must pass before Ray or any actor starts."""
    from rlc.runtime.preflight import check_free_disk, checkpoint_bytes
    from rlc.runtime.run_dir import check_location, ensure_writable, guard_earlier_run

    if resume and overwrite:
        raise RunUsageError("--resume continues the earlier run and --overwrite moves it aside: pass one of them")
    check_location(run_dir)
    if not resume:
        inputs = [plan.model.path, plan.data.train if not plan.data.builtin else None]
        inputs += [t.model.path for t in plan.distill.teachers] if plan.distill else []
        guard_earlier_run(run_dir, overwrite=overwrite, keep=inputs, log=log)
    ensure_writable(run_dir)
    model_path, weights = prepare_model(plan, log)
    disk_sync = plan.schedule.weight_sync in ("disk", "inplace")
    need = checkpoint_bytes(weights, lora=plan.lora is not None, disk_sync=disk_sync)
    check_free_disk(run_dir, need, plan.schedule.keep_checkpoints, log)
    return model_path, weights


#: Signals that stop a run cleanly, as Ctrl-C does: SIGTERM is what `kill`, schedulers (Slurm, Kubernetes) and
#: `ray job stop` send first.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunStopped(RunError):
    """A signal stopped the run before its last step: it finished the step in progress and checkpointed it, and
    `rlc run` exits non-zero (a partial run is not a finished one)."""

    def __init__(self, step: int, total: int, signal_name: str, run_dir: Path) -> None:
        self.step, self.total = step, total
        by = f" ({signal_name})" if signal_name else ""
        super().__init__(f"stopped at step {step} of {total}{by}; {_last_checkpoint(run_dir)}")


def _last_checkpoint(run_dir: Path) -> str:
    """Where a stopped run's newest checkpoint is, and how to continue from it."""
    from rlc.runtime.checkpoint import CheckpointError, latest_checkpoint

    try:
        found = latest_checkpoint(run_dir)
    except CheckpointError:
        found = None
    if found is None:
        return _resumable(run_dir)
    return f"the last checkpoint is {found[0]} (step {found[1].step}): continue with `{resume_command()}`"


def _resumable(run_dir: Path) -> str:
    from rlc.runtime.checkpoint import CheckpointError, latest_checkpoint

    try:
        found = latest_checkpoint(run_dir)
    except CheckpointError as exc:
        return f"the newest checkpoint cannot be resumed ({exc})"
    if found is None:
        return "no checkpoint was completed, so a new run starts from the beginning (pass --overwrite)"
    return f"the newest complete checkpoint is {found[0].name}: continue with `{resume_command()}`"


def _actor_death(exc: Exception) -> str:
    """One line for a dead actor: its class and the error that killed it (the last line of the remote traceback,
    e.g. ``ValueError: ...``), else the first line Ray printed."""
    text = str(exc).strip()
    named = re.search(r"class_name: (\S+)", text) or re.search(r"ray::[\w.-]+:(\w+)\.__init__", text)
    who = f"{named.group(1)}: " if named else ""
    raised = [line.strip() for line in text.splitlines() if re.match(r"\s*\w+(\.\w+)*(Error|Exception): ", line)]
    cause = raised[-1] if raised else (text.splitlines()[0] if text else type(exc).__name__)
    return who + cause


def _run_controller(work: Callable[[], T], run_dir: Path) -> T:
    """The training loop (or the resume's first sync), with a dead actor, a wait past its bound, a full disk or
    a failed write turned into a resumable message."""
    from ray.exceptions import GetTimeoutError, RayActorError

    from rlc.runtime.checkpoint import disk_full
    from rlc.runtime.stall import StallError

    try:
        return work()
    except StallError as exc:
        raise RunError(f"{exc}. The run stopped: {_resumable(run_dir)}") from None
    except GetTimeoutError as exc:  # a TimeoutError, hence an OSError: not a failed write
        stopped = f"the run stopped: {_resumable(run_dir)}"
        raise RunError(
            f"a role of the run stopped answering ({first_line(exc, 'no answer in time')}); {stopped}"
        ) from None
    except RayActorError as exc:
        death = _actor_death(exc)
        raise RunError(f"a Ray actor of the run died ({death}); the run stopped: {_resumable(run_dir)}") from None
    except RunError:  # already says what happened
        raise
    except Exception as exc:  # a trainer's OSError comes inside a RayTaskError, whose own errno is None
        full = disk_full(exc)
        if full is not None:
            raise RunError(_disk_full_message(full, exc, run_dir)) from None
        cause = vars(exc).get("cause", exc)
        if not isinstance(cause, OSError):
            raise
        where = f" ({cause.filename})" if cause.filename else ""
        why = cause.strerror or first_line(cause, type(cause).__name__)
        raise RunError(
            f"writing the run's files failed: {why}{where}; the run stopped: {_resumable(run_dir)}"
        ) from None


def _disk_full_message(full: OSError, exc: BaseException, run_dir: Path) -> str:
    """What to do about a full disk: during a checkpoint, that the previous one is intact (the half-written one
    is removed, which also gives back its space); elsewhere, which file could not be written."""
    import errno
    import shutil

    from rlc.runtime.checkpoint import CheckpointError, checkpoints_dir, latest_checkpoint, staging_dirs

    quota = full.errno == errno.EDQUOT
    what = "the disk quota is exceeded on" if quota else "no space left on"
    free = "free space (or raise the quota)" if quota else "free space"
    if not _during_checkpoint(full, exc, run_dir):
        where = f" ({full.filename})" if full.filename else ""
        return (
            f"writing the run's files failed: {full.strerror or 'No space left on device'}{where}; the run "
            f"stopped: {free} on the device holding {run_dir}, then {_resumable(run_dir)}"
        )
    partial = staging_dirs(run_dir)
    for folder in partial:  # never trusted by --resume, and the space is what the next try needs
        shutil.rmtree(folder, ignore_errors=True)
    removed = f" (the partial {', '.join(p.name for p in partial)} was removed)" if partial else ""
    head = f"{what} the device holding {checkpoints_dir(run_dir)} while writing a checkpoint{removed}"
    try:
        found = latest_checkpoint(run_dir)
    except CheckpointError as bad:
        return f"{head}; the previous checkpoint cannot be resumed ({bad}); {free} and start again with --overwrite"
    if found is None:
        return f"{head}; no checkpoint was completed before it: {free} and start again with --overwrite"
    return f"{head}; the previous checkpoint {found[0].name} is intact: {free} and `{resume_command()}`"


def _during_checkpoint(full: OSError, exc: BaseException, run_dir: Path) -> bool:
    """Whether a full disk stopped a checkpoint: the failed file is under RUN/checkpoints, or the error came
    through the checkpoint's code (`Controller._checkpoint`, the trainer's `save_checkpoint`, `finalize`)."""
    import traceback

    from rlc.runtime.checkpoint import checkpoints_dir

    if full.filename:
        try:
            Path(os.fsdecode(full.filename)).resolve().relative_to(checkpoints_dir(run_dir).resolve())
            return True
        except (ValueError, OSError, RuntimeError):
            pass
    names = {"_checkpoint", "save_checkpoint", "finalize", "staging_dir"}
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and not any(current is s for s in seen):
        seen.append(current)
        if any(frame.f_code.co_name in names for frame, _ in traceback.walk_tb(current.__traceback__)):
            return True
        current = current.__cause__ or current.__context__
    return False


def _write_run_record(
    run_dir: Path, plan: Plan, trainer: Any, pool: Any, reference: Any, replay: Path | None, log
) -> None:  # type: ignore[no-untyped-def]
    """RUN/reproducibility.json and RUN/nodes.json; a run never fails for want of them."""
    from rlc.runtime.nodes import record_nodes
    from rlc.runtime.run_record import gather_processes, write_record

    try:
        record_nodes(run_dir, launch_request(plan), actor_nodes(plan, trainer, pool, reference), log)
    except Exception as exc:  # an actor that cannot answer
        log(f"warning: which node runs which actor could not be recorded: {first_line(exc)}")

    try:
        processes = gather_processes(trainer, pool.engines)
    except Exception as exc:  # an actor that cannot answer: the record says so
        processes = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    write_record(run_dir, plan, processes, replay)
    if not plan.reproducibility.deterministic:
        log("runs of this plan may differ: " + "; ".join(plan.reproducibility.reasons))


def actor_nodes(plan: Plan, trainer: Any, pool: Any, reference: Any) -> dict[str, str]:
    """Each started actor's name → the Ray node id it runs on (trainer and reference ranks, rollout engines)."""
    import ray

    train = plan.roles_of("train")[0].name
    rollout = plan.roles_of("rollout")[0].name
    where = {f"rlc-{train}-rank{h['rank']}": h["node_id"] for h in trainer.hosts_info()}
    if reference is not None:
        where.update({f"rlc-reference-rank{h['rank']}": h["node_id"] for h in reference.hosts_info()})
    engines = ray.get([e.node_id() for e in pool.engines], timeout=60)
    where.update({f"rlc-{rollout}-{i}": node for i, node in enumerate(engines)})
    return where


def _finish_run_record(run_dir: Path, replay: Path | None, log) -> None:  # type: ignore[no-untyped-def]
    from rlc.runtime.run_record import finish_record

    record = finish_record(run_dir, replay)
    found = record.get("replay")
    if found:
        if found["first_difference"] is None:
            keys = ", ".join(found["compared"])
            log(f"replay: every one of {found['steps']} step(s) equals the recorded run ({keys})")
        else:
            log(f"replay: differs from the recorded run from step {found['first_difference']} on")


def _write_report(run_dir: Path, log) -> None:  # type: ignore[no-untyped-def]
    """The run's HTML report; a run never fails for want of it."""
    from rlc.runtime.report import write_report

    try:
        written = write_report(run_dir)
    except RunUsageError as exc:  # matplotlib is not installed
        log(f"no report: {exc}")
    except (RunError, OSError, ValueError) as exc:
        log(f"warning: the report could not be written: {exc}")
    else:
        log(f"report: {written.html}")


def _replay_schedule(plan: Plan, recorded: Path, run_dir: Path, resume: bool) -> Any:
    """The recorded run's schedule, once it is certain this plan made that run and the replay goes elsewhere."""
    from rlc.runtime.rollout_log import ReplaySchedule

    if resume:
        raise RunUsageError("--replay starts a new run from a recorded one; it cannot be combined with --resume")
    if plan.agent is not None:
        raise RunUsageError(
            "--replay feeds back recorded prompts and batches; agent rollouts depend on their tools and are not "
            "replayed yet (rollout.agent)"
        )
    if run_dir.resolve() == recorded.resolve():
        raise RunUsageError(f"--replay reads {recorded}; write the replay to another directory with --run-dir")
    try:
        made_by = json.loads((recorded / "plan.json").read_text(encoding="utf-8"))["spec_hash"]
    except (OSError, ValueError, KeyError, TypeError):
        made_by = None
    if not isinstance(made_by, str):
        raise RunError(f"--replay: {recorded} is not a run directory (no readable plan.json with its spec hash)")
    if made_by != plan.spec_hash:
        raise RunError(
            f"--replay: {recorded} was made by another plan (spec hash {made_by[:12]}, this plan "
            f"{plan.spec_hash[:12]}); replay it with the plan that made it"
        )
    if not plan.reproducibility.seeded_sampling:
        raise RunError(
            "--replay: this plan does not seed its sampling (algorithm.deterministic is false, or an older rlc "
            "compiled it), so its samples cannot be generated again; compile it with deterministic auto or true"
        )
    return ReplaySchedule.load(recorded, plan.schedule.batch_prompts)


def run_plan(
    plan: Plan,
    run_dir: Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    replay: Path | None = None,
) -> int:
    """Execute a verified plan; returns the number of steps trained in total.

    Without `resume`, a run directory holding an earlier run is refused (`RunUsageError`) unless
    `overwrite`, which moves that run aside to `RUN.old-N/`. With `replay` (a run directory this plan
    made), the recorded requests and batches are fed back (`runtime/workflows/replay.py`) into `run_dir`, by default
    `RUN.replay`.
    """
    from rlc.runtime.nodes import absolute_paths
    from rlc.runtime.run_dir import lock_run_dir

    refuse_gaps(plan)
    if replay is not None and run_dir is None:
        run_dir = Path(f"{Path(replay)}.replay")
    # Every node must read the same files: relative paths are taken from here, once, before any actor starts.
    plan = absolute_paths(plan)
    run_dir = Path(os.path.abspath(run_dir or plan.run_dir))
    log = lambda text: print(f"rlc: {text}", flush=True)  # noqa: E731
    schedule = _replay_schedule(plan, Path(replay), run_dir, resume) if replay is not None else None
    if resume and overwrite:  # before the lock, which would create the run directory
        raise RunUsageError("--resume continues the earlier run and --overwrite moves it aside: pass one of them")
    # One driver per run directory, from before its first look at the directory until Ray is shut down.
    with lock_run_dir(run_dir, log, create=not resume):
        return _run_locked(plan, run_dir, resume, overwrite, replay, schedule, log)


def _run_locked(  # type: ignore[no-untyped-def]
    plan: Plan, run_dir: Path, resume: bool, overwrite: bool, replay: Path | None, schedule: Any, log
) -> int:
    """`run_plan` once this process holds the run directory's lock."""
    from rlc.runtime.checkpoint import CheckpointError, latest_checkpoint

    start = None
    if resume and not overwrite:  # before the pre-flight, which would create the run directory and build the model
        try:
            found = latest_checkpoint(run_dir)
        except CheckpointError as exc:
            raise RunError(f"--resume: {exc}; resume from an earlier checkpoint by moving this one aside") from None
        if found is None:
            raise RunError(f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}")
    model_path, _ = _preflight(plan, run_dir, resume, overwrite, log)
    if resume:
        checkpoint, start = found
        if start.plan_hash and start.plan_hash != plan.spec_hash:
            raise RunError(
                f"--resume: {checkpoint} was written by another plan (spec hash {start.plan_hash[:12]}, this plan "
                f"{plan.spec_hash[:12]}); use a fresh --run-dir"
            )
        if start.step >= plan.schedule.steps:
            log(f"{checkpoint.name} already reached step {start.step} of {plan.schedule.steps}; nothing to do")
            return start.step
    tokenizer, reward_fn = load_inputs(plan, model_path)
    if plan.agent is not None:
        from rlc.runtime.agent.launch import check_agent

        check_agent(plan)
    (run_dir / "plan.json").write_text(plan.model_dump_json(indent=2) + "\n")

    import ray
    from ray.exceptions import RayActorError

    from rlc.runtime.controller import Controller

    started_ray = start_ray(plan, log)
    placement_groups: list[Any] = []  # released at the end when Ray is not ours to shut down
    trainer = pool = controller = teachers = reference = runners = None
    # After ray.init, which sets its own SIGTERM handler (exit at once): a second signal gets that back.
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    stopped_by: list[str] = []
    try:
        if not started_ray:  # a cluster: every node must see what the roles read, and reach the others
            from rlc.runtime.nodes import check_nodes

            check_nodes(plan, run_dir, log)
        log("starting trainer and rollout engines")
        try:
            trainer, pool, reference, teachers = build_roles(
                plan, model_path, start.version if start else 0, placement_groups
            )
        except RayActorError as exc:
            raise RunError(f"a role of the run failed to start ({_actor_death(exc)})") from None
        mismatches = check_built_layout(plan, trainer.built_layouts())
        if mismatches:
            raise RunError("the trainer did not build the plan's layout: " + "; ".join(mismatches))
        write_layout_record(run_dir, plan, trainer.built_layouts())
        log(f"trainer layout as planned: {plan.roles_of('train')[0].layout.summary()}")  # type: ignore[union-attr]
        _write_run_record(run_dir, plan, trainer, pool, reference, replay, log)
        workflow: Any = None  # generate-and-score
        if plan.agent is not None:
            from rlc.runtime.agent.launch import build_runners
            from rlc.runtime.agent.workflow import AgentWorkflow

            runners = build_runners(plan, launch_request(plan))
            workflow = functools.partial(AgentWorkflow, runners=runners.actors)
        elif schedule is not None:
            from rlc.runtime.workflows.replay import ReplayWorkflow

            log(f"replaying {schedule.steps} recorded step(s) of {replay}")
            workflow = functools.partial(ReplayWorkflow, schedule=schedule)
        controller = Controller(plan, run_dir, tokenizer, reward_fn, pool, trainer, start=start, workflow=workflow)
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
            _run_controller(lambda: controller._sync_weights(start.version), run_dir)
            log(f"resumed from {checkpoint.name} at step {start.step}")

        def interrupt(signum: int, frame: Any) -> None:
            name = signal.Signals(signum).name
            stopped_by.append(name)
            controller.stop()
            for sig, handler in previous.items():  # a second signal stops at once
                signal.signal(sig, handler)
            with contextlib.suppress(RuntimeError):  # the signal came during a print: stdout is not reentrant
                log(
                    f"interrupted ({name}): finishing the current step, writing a checkpoint and shutting down "
                    "(send the signal again to stop at once, without the checkpoint)"
                )

        for sig in STOP_SIGNALS:
            signal.signal(sig, interrupt)
        steps = _run_controller(controller.run, run_dir)
        if stopped_by:
            steps = _run_controller(controller.finish_after_stop, run_dir)
        if steps < controller.total_steps:
            with contextlib.suppress(OSError, ValueError):  # the stop is what must be reported
                _finish_run_record(run_dir, replay, log)
            raise RunStopped(steps, controller.total_steps, stopped_by[0] if stopped_by else "", run_dir)
        log(f"done: {steps} step(s); metrics in {run_dir / 'metrics.jsonl'}")
        _finish_run_record(run_dir, replay, log)
        _write_report(run_dir, log)
        return steps
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if controller is not None and trainer is not None:
            with contextlib.suppress(Exception):  # the measured peaks of the whole run, when the ranks still answer
                write_layout_record(run_dir, plan, trainer.built_layouts())
        if controller is not None:
            controller.close()
        for part in (runners, teachers, pool, reference, trainer):
            if part is not None:
                try:
                    part.shutdown()
                except Exception as exc:  # a dead actor: one line, not Ray's whole report again
                    print(f"rlc: warning: shutdown: {first_line(exc)}", file=sys.stderr)
        if started_ray:
            ray.shutdown()
        else:
            from ray.util.placement_group import remove_placement_group

            for pg in placement_groups:
                with contextlib.suppress(Exception):
                    remove_placement_group(pg)
