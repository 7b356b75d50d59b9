"""`rlc run`: verify a plan directory, then print its dry run or execute it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from rlc.cli.app import (
    EXIT_FINDINGS,
    EXIT_OK,
    EXIT_USAGE,
    ExplainFormat,
    usage_error,
)


def _worker_env_notice(plan: Any, compiled: Any) -> str | None:
    """For `rlc run --allow-modified` of an edited plan.json: the environment variables it sets, said plainly to
    reach the run's Ray workers (a variable can name code: a PYTHONPATH entry, LD_PRELOAD, a plugin), each marked
    where the edit added or changed it against the manifest's copy of the compiled plan."""
    compiled = compiled if isinstance(compiled, dict) else {}
    compiled_roles = {r.get("name"): r for r in compiled.get("roles", []) if isinstance(r, dict)}

    def names(env: dict[str, str], before: Any) -> str:
        before = before if isinstance(before, dict) else {}
        shown = []
        for key, value in sorted(env.items()):
            if key not in before:
                key += " (added by the edit)"
            elif before[key] != value:
                key += " (changed by the edit)"
            shown.append(key)
        return ", ".join(shown)

    lines = []
    if plan.env:
        lines.append(f"env, for every Ray worker of the run: {names(plan.env, compiled.get('env'))}")
    for role in plan.roles:
        if role.env:
            before = compiled_roles.get(role.name, {}).get("env")
            lines.append(f"roles[{role.name}].env, for that role's Ray workers: {names(role.env, before)}")
    if not lines:
        return None
    return (
        "rlc run: --allow-modified: warning: this modified plan sets environment variables, and they apply to "
        "every Ray worker of the run: code a variable names (a PYTHONPATH entry, LD_PRELOAD, a plugin) runs in "
        "those processes, with the run's access to data, devices and the cluster:\n"
        + "\n".join(f"    {line}" for line in lines)
    )


def run(
    plan_dir: Annotated[Path, typer.Argument(help="Plan directory from `rlc compile`.", show_default=False)],
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Where metrics and checkpoints go.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the newest complete checkpoint.")] = False,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Start over an earlier run, moving it aside to RUN.old-N (never deleted)."),
    ] = False,
    allow_modified: Annotated[
        bool, typer.Option("--allow-modified", help="Run a plan whose files no longer match its manifest.")
    ] = False,
    replay: Annotated[
        Path | None,
        typer.Option(
            "--replay",
            help="Run again with the requests (prompts, policy versions) and batches recorded in this run "
            "directory's rollouts.jsonl; writes to --run-dir, by default RUNDIR.replay.",
            show_default=False,
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Print the placement groups, actors, trainer mesh, engines and sync path."),
    ] = False,
    output_format: Annotated[
        ExplainFormat, typer.Option("--format", help="Dry-run output: text or json.")
    ] = ExplainFormat.text,
) -> None:
    """Verify a plan directory and execute it (Ray, vLLM rollout, FSDP2 training)."""
    if not plan_dir.is_dir():
        raise usage_error(f"{plan_dir} is not a plan directory; create one with `rlc compile SPEC -o {plan_dir}`")
    if resume and overwrite:
        raise usage_error("--resume continues the earlier run and --overwrite moves it aside: pass one of them")
    if output_format == ExplainFormat.json and not dry_run:
        raise usage_error("--format json is the dry run's output: pass --dry-run with it (a run prints progress)")
    if replay is not None and not (replay / "rollouts.jsonl").is_file():
        raise usage_error(f"--replay {replay}: no rollouts.jsonl there; pass the directory of a run rlc recorded")
    plan = _verified_plan(plan_dir, allow_modified)
    from rlc.runtime.trackers import tracker_problems

    trackers = tracker_problems(plan.loggers)
    if dry_run:  # the plan alone: no runtime needed
        for problem in trackers:  # the run would refuse to start here; the dry run still shows its layout
            typer.echo(f"rlc run: warning: {problem} (the run itself will not start without it)", err=True)
        _print_dry_run(plan, plan_dir, output_format)
    target_dir = run_dir or (Path(f"{replay}.replay") if replay is not None else Path(plan.run_dir))
    if target_dir.resolve() == plan_dir.resolve():
        raise usage_error(
            f"the run directory {target_dir} is the plan directory: a run there would mix its files into the plan "
            "(and --overwrite would move plan.json aside); pass another --run-dir, or compile with another output.dir"
        )
    _require_runtime()
    if trackers:  # before Ray or any actor starts, not a ModuleNotFoundError once the run is up
        typer.echo("\n".join(f"rlc run: error: {problem}" for problem in trackers), err=True)
        raise typer.Exit(EXIT_USAGE)
    again = f"{plan_dir} --run-dir {target_dir}" if run_dir or replay else str(plan_dir)
    _execute(plan, run_dir, again, resume=resume, overwrite=overwrite, replay=replay)


def _verified_plan(plan_dir: Path, allow_modified: bool) -> Any:
    """The directory's plan once its manifest checks pass (exit 1 with every finding otherwise); with
    --allow-modified, what differs from the compiled plan is printed first, and any environment an edit sets."""
    from rlc.compiler.diagnostics import Report, render_text
    from rlc.compiler.manifest import PLAN_FILE, load_plan, plan_problem, read_manifest, verify_plan_dir

    report = Report(str(plan_dir))
    report.extend(verify_plan_dir(plan_dir, allow_modified=allow_modified))
    if report.diagnostics:
        typer.echo(render_text([report]), err=True)
    if not report.ok:
        raise typer.Exit(EXIT_FINDINGS)
    # plan.json itself differs from the compiled plan (edited, or edited and rehashed in the manifest)
    plan_edited = allow_modified and any(d.file == str(plan_dir / PLAN_FILE) for d in report.diagnostics)
    if allow_modified and report.diagnostics:
        from rlc.compiler.plan_changes import describe_modifications, plan_json_changes

        changed = describe_modifications(plan_dir)
        manifest = read_manifest(plan_dir) or {}
        if plan_edited and "compiled_plan" in manifest and not any(x.startswith(f"{PLAN_FILE}:") for x in changed):
            changed = [*plan_json_changes(plan_dir, manifest["compiled_plan"]), *changed]  # its hash was made to match
        if changed:
            typer.echo("rlc run: --allow-modified: running a plan that differs from the compiled one:", err=True)
            typer.echo("\n".join(f"    {line}" for line in changed), err=True)
    try:
        plan = load_plan(plan_dir)
    except (OSError, ValueError) as exc:
        raise usage_error(f"cannot read plan {plan_dir}: {plan_problem(exc)}") from None
    if plan_edited and (notice := _worker_env_notice(plan, (read_manifest(plan_dir) or {}).get("compiled_plan"))):
        typer.echo(notice, err=True)
    return plan


def _print_dry_run(plan: Any, plan_dir: Path, output_format: ExplainFormat) -> None:
    """What the run would ask Ray for; exits 0, or 2 when the runtime would refuse the plan."""
    from rlc.compiler.manifest import plan_problem
    from rlc.runtime.launch_request import launch_request, render_request

    try:
        request = launch_request(plan)
    except ValueError as exc:
        raise usage_error(f"cannot read plan {plan_dir}: {plan_problem(exc)}") from None
    if output_format == ExplainFormat.json:
        typer.echo(json.dumps(request.to_json(), indent=2, sort_keys=True))
    else:
        typer.echo(render_request(request))
    raise typer.Exit(EXIT_USAGE if request.refusals else EXIT_OK)


def _execute(plan: Any, run_dir: Path | None, again: str, **how: Any) -> None:
    """Run the plan; each way it can end early is one line and an exit code (`again`: the command's arguments
    that continue this run, for the stop message)."""
    from rlc.runtime.errors import RunError, RuntimeGapError, RunUsageError
    from rlc.runtime.launch import RunStopped, refuse_gaps, run_plan

    try:
        refuse_gaps(plan)
        run_plan(plan, run_dir, **how)
    except RunStopped as exc:  # Ctrl-C or SIGTERM: a partial run, checkpointed, is not a finished one
        typer.echo(f"rlc run: {str(exc).replace('PLANDIR', again)}", err=True)
        raise typer.Exit(EXIT_FINDINGS) from None
    except RuntimeGapError as exc:
        lines = "\n".join(f"    - {gap}" for gap in exc.gaps)
        code = "RLC708"
        typer.echo(
            f"rlc run: error[{code}]: this runtime cannot execute plan {plan.name}:\n{lines}\n"
            "    hint: recompile with a layout it runs (e.g. pin train.backend: fsdp2 for a dense model); "
            "`rlc run --dry-run` shows what would start",
            err=True,
        )
        raise typer.Exit(EXIT_USAGE) from None
    except RunUsageError as exc:
        typer.echo(f"rlc run: error: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    except RunError as exc:
        typer.echo(f"rlc run: error: {str(exc).replace('PLANDIR', again)}", err=True)
        raise typer.Exit(EXIT_FINDINGS) from None


#: What `rlc run` imports; the light install (`pip install rlc`) has none of them.
RUNTIME_MODULES = ("torch", "ray", "vllm", "transformers", "safetensors")


def _require_runtime() -> None:
    """Refuse `rlc run` on the light install with the extra to install, not a ModuleNotFoundError."""
    from importlib.util import find_spec

    missing = [name for name in RUNTIME_MODULES if find_spec(name) is None]
    if missing:
        typer.echo(
            f"rlc run: error: the runtime is not installed (missing: {', '.join(missing)}): "
            "install `rlc[cpu]` here, or `rlc[npu]` on Ascend hosts",
            err=True,
        )
        raise typer.Exit(EXIT_USAGE)
