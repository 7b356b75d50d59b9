"""What a run leaves beside its metrics: RUN/reproducibility.json, the report, and for a replay the recorded
schedule it follows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlc.messages import first_line
from rlc.runtime.errors import RunError, RunUsageError
from rlc.runtime.launch_request import launch_request
from rlc.schemas.plan import Plan


def write_run_record(
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


def finish_run_record(run_dir: Path, replay: Path | None, log) -> None:  # type: ignore[no-untyped-def]
    from rlc.runtime.run_record import finish_record

    record = finish_record(run_dir, replay)
    found = record.get("replay")
    if found:
        if found["first_difference"] is None:
            keys = ", ".join(found["compared"])
            log(f"replay: every one of {found['steps']} step(s) equals the recorded run ({keys})")
        else:
            log(f"replay: differs from the recorded run from step {found['first_difference']} on")


def write_run_report(run_dir: Path, log) -> None:  # type: ignore[no-untyped-def]
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


def replay_schedule(plan: Plan, recorded: Path, run_dir: Path, resume: bool) -> Any:
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
