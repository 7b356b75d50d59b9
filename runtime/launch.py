"""`rlc run`: check what the plan needs, start Ray and the roles, run the controller, shut down cleanly.

Everything that can be wrong with the inputs (run directory, model folder, dataset, reward function, a
checkpoint from another plan, free disk) is checked before any actor starts, and reported as a `RunError`
with a clear message. An earlier run in the run directory is never deleted (see `run_dir`), and one driver
holds the run directory's lock for the whole run. Ctrl-C and SIGTERM stop a run cleanly: the step in progress
is finished and checkpointed, and the run ends with `RunStopped` (a partial run is not a finished one)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlc.messages import first_line
from rlc.runtime.errors import RunError, RuntimeGapError, RunUsageError
from rlc.runtime.host_moves import HostMovesError
from rlc.runtime.launch_request import launch_request
from rlc.runtime.preflight import Weights
from rlc.runtime.ray_start import start_ray
from rlc.runtime.role_actors import build_roles, check_built_layout
from rlc.runtime.run_end import STOP_SIGNALS, RunStopped, actor_death, run_controller, stop_left_to_this_process
from rlc.runtime.run_inputs import load_inputs, prepare_model
from rlc.runtime.run_outputs import finish_run_record, replay_schedule, write_run_record, write_run_report
from rlc.schemas.layout_file import write_layout_record
from rlc.schemas.plan import Plan


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
    schedule = replay_schedule(plan, Path(replay), run_dir, resume) if replay is not None else None
    if resume and overwrite:  # before the lock, which would create the run directory
        raise RunUsageError("--resume continues the earlier run and --overwrite moves it aside: pass one of them")
    # One driver per run directory, from before its first look at the directory until Ray is shut down.
    with lock_run_dir(run_dir, log, create=not resume):
        return _run_locked(plan, run_dir, resume, overwrite, replay, schedule, log)


def _run_locked(  # type: ignore[no-untyped-def]
    plan: Plan, run_dir: Path, resume: bool, overwrite: bool, replay: Path | None, schedule: Any, log
) -> int:
    """`run_plan` once this process holds the run directory's lock."""
    found = _resume_point(run_dir) if resume and not overwrite else None
    model_path, _ = _preflight(plan, run_dir, resume, overwrite, log)
    if found is not None:
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
    with stop_left_to_this_process():  # a job-wide SIGTERM must not stop the embedded Ray before the checkpoint
        parts = RunParts(started_ray=start_ray(plan, log))
    # After ray.init, which sets its own SIGTERM handler (exit at once): a second signal gets that back.
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        if not parts.started_ray:  # a cluster: every node must see what the roles read, and reach the others
            from rlc.runtime.nodes import check_nodes

            check_nodes(plan, run_dir, log)
        _start_roles(plan, run_dir, model_path, found[1] if found else None, replay, parts, log)
        controller = _controller(plan, run_dir, tokenizer, reward_fn, found, schedule, replay, parts, log)
        return _train(controller, run_dir, replay, previous, log)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        parts.shut_down(plan, run_dir)


def _resume_point(run_dir: Path) -> tuple[Path, Any]:
    """The newest complete checkpoint and its state, before the pre-flight (which would create the run directory
    and build the model)."""
    from rlc.runtime.checkpoint import CheckpointError, latest_checkpoint

    try:
        found = latest_checkpoint(run_dir)
    except CheckpointError as exc:
        raise RunError(f"--resume: {exc}; resume from an earlier checkpoint by moving this one aside") from None
    if found is None:
        raise RunError(f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}")
    return found


@dataclass
class RunParts:
    """What a run started, so that whatever happens it is all shut down, in order."""

    started_ray: bool
    placement_groups: list[Any] = field(default_factory=list)  # released at the end when Ray is not ours
    trainer: Any = None
    pool: Any = None
    reference: Any = None
    teachers: Any = None
    runners: Any = None
    controller: Any = None

    def shut_down(self, plan: Plan, run_dir: Path) -> None:
        """Record the run's measured memory peaks (when the ranks still answer), end every actor, and stop Ray
        (ours) or release the placement groups (a cluster's)."""

        if self.controller is not None and self.trainer is not None:
            with contextlib.suppress(Exception):
                write_layout_record(run_dir, plan, self.trainer.built_layouts())
        if self.controller is not None:
            self.controller.close()
        for part in (self.runners, self.teachers, self.pool, self.reference, self.trainer):
            if part is not None:
                try:
                    part.shutdown()
                except Exception as exc:  # a dead actor: one line, not Ray's whole report again
                    print(f"rlc: warning: shutdown: {first_line(exc)}", file=sys.stderr)
        if self.started_ray:
            from rlc.runtime.local_ray_stop import stop_local_ray

            stop_local_ray()
            return
        from ray.util.placement_group import remove_placement_group

        for pg in self.placement_groups:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)


def _start_roles(  # type: ignore[no-untyped-def]
    plan: Plan, run_dir: Path, model_path: Path, start: Any, replay: Path | None, parts: RunParts, log
) -> None:
    """Trainer, engines, reference and teachers, with the trainer's layout checked against the plan's and the
    run's records written."""
    from ray.exceptions import RayActorError

    log("starting trainer and rollout engines")
    try:
        parts.trainer, parts.pool, parts.reference, parts.teachers = build_roles(
            plan, model_path, start.version if start else 0, parts.placement_groups
        )
    except RayActorError as exc:
        raise RunError(f"a role of the run failed to start ({actor_death(exc)})") from None
    trainer = parts.trainer
    mismatches = check_built_layout(plan, trainer.built_layouts())
    if mismatches:
        raise RunError("the trainer did not build the plan's layout: " + "; ".join(mismatches))
    write_layout_record(run_dir, plan, trainer.built_layouts())
    log(f"trainer layout as planned: {plan.roles_of('train')[0].layout.summary()}")  # type: ignore[union-attr]
    write_run_record(run_dir, plan, trainer, parts.pool, parts.reference, replay, log)


def _controller(  # type: ignore[no-untyped-def]
    plan: Plan,
    run_dir: Path,
    tokenizer: Any,
    reward_fn: Any,
    found: tuple[Path, Any] | None,
    schedule: Any,
    replay: Path | None,
    parts: RunParts,
    log,
) -> Any:
    """The loop with the plan's workflow (generate-and-score, agents, or a replay), its weight path ready and, on
    resume, the checkpoint's weights on the engines."""
    from rlc.runtime.controller import Controller

    workflow: Any = None  # generate-and-score
    if plan.agent is not None:
        from rlc.runtime.agent.launch import build_runners
        from rlc.runtime.agent.workflow import AgentWorkflow

        parts.runners = build_runners(plan, launch_request(plan))
        workflow = functools.partial(AgentWorkflow, runners=parts.runners.actors)
    elif schedule is not None:
        from rlc.runtime.workflows.replay import ReplayWorkflow

        log(f"replaying {schedule.steps} recorded step(s) of {replay}")
        workflow = functools.partial(ReplayWorkflow, schedule=schedule)
    start = found[1] if found else None
    controller = Controller(
        plan, run_dir, tokenizer, reward_fn, parts.pool, parts.trainer, start=start, workflow=workflow
    )
    parts.controller = controller
    try:
        controller.prepare_weight_path()
    except HostMovesError as exc:
        raise RunError(str(exc)) from None
    controller.reference = parts.reference
    controller.teachers = parts.teachers
    if parts.teachers is not None:
        parts.teachers.log = controller.logger.message
    if found is not None:
        checkpoint, start = found
        parts.trainer.load_checkpoint(str(checkpoint))
        run_controller(lambda: controller._sync_weights(start.version), run_dir)
        log(f"resumed from {checkpoint.name} at step {start.step}")
    return controller


def _train(controller: Any, run_dir: Path, replay: Path | None, previous: dict[Any, Any], log) -> int:  # type: ignore[no-untyped-def]
    """Run the loop to the plan's last step; Ctrl-C or SIGTERM finish the step in progress, checkpoint it and end
    the run with `RunStopped` (a second signal stops at once)."""
    stopped_by: list[str] = []

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
    steps = run_controller(controller.run, run_dir, stopped_by)
    if stopped_by:
        steps = run_controller(controller.finish_after_stop, run_dir, stopped_by)
    if steps < controller.total_steps:
        with contextlib.suppress(OSError, ValueError):  # the stop is what must be reported
            finish_run_record(run_dir, replay, log)
        raise RunStopped(steps, controller.total_steps, stopped_by[0] if stopped_by else "", run_dir)
    log(f"done: {steps} step(s); metrics in {run_dir / 'metrics.jsonl'}")
    finish_run_record(run_dir, replay, log)
    write_run_report(run_dir, log)
    return steps
