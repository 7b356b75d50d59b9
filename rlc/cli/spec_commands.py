"""Commands on specs and plans: validate, compile, explain, diff, schema, init."""

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
    OutputFormat,
    SetOption,
    TargetOption,
    TargetsOption,
    check_target,
    usage_error,
)


def validate(
    specs: Annotated[list[Path], typer.Argument(help="Spec files to check.", show_default=False)],
    target: TargetOption = None,
    set_: SetOption = None,
    output_format: Annotated[
        OutputFormat, typer.Option("--format", "-f", help="text, json (stable contract), github annotations.")
    ] = OutputFormat.text,
    no_plan: Annotated[
        bool, typer.Option("--no-plan", help="Skip the fit check (the planner): spec and rule checks only.")
    ] = False,
    targets: TargetsOption = None,
) -> None:
    """Check specs and report every problem at once, including whether the run fits the cluster (exit 0 clean,
    1 findings, 2 usage)."""
    from rlc.compiler.diagnostics import render_github, render_json, render_text
    from rlc.compiler.pipeline import compile_file

    check_target(target)
    reports = [
        compile_file(path, target=target, overrides=set_ or [], plan=not no_plan, targets=targets).report
        for path in specs
    ]
    render = {"text": render_text, "json": render_json, "github": render_github}[output_format.value]
    text = render(reports)
    if text:
        typer.echo(text)
    raise typer.Exit(EXIT_OK if all(r.ok for r in reports) else EXIT_FINDINGS)


def _plan_spec(  # type: ignore[no-untyped-def]
    spec: Path,
    target: str | None,
    overrides: list[str],
    output_format: OutputFormat | None = None,
    targets: list[Path] | None = None,
):
    """Validate and plan a spec; on findings print them and exit 1."""
    from rlc.compiler.diagnostics import Report, render_json, render_text
    from rlc.compiler.pipeline import compile_file

    check_target(target)
    checked = compile_file(spec, target=target, overrides=overrides, targets=targets)
    report: Report = checked.report
    plan = checked.plan
    if plan is None or not report.ok:
        render = render_json if output_format == OutputFormat.json else render_text
        typer.echo(render([report]))
        raise typer.Exit(EXIT_FINDINGS)
    return checked, plan, report


def compile_(
    spec: Annotated[Path, typer.Argument(help="Spec file.", show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="Plan directory to write.")],
    target: TargetOption = None,
    set_: SetOption = None,
    targets: TargetsOption = None,
) -> None:
    """Plan a run and write the plan directory (plan.json, launch.sh, rayjob.yaml, roles/, SUMMARY.md)."""
    from rlc.compiler.diagnostics import render_text
    from rlc.compiler.emit import PlanDirError, emit_plan_dir
    from rlc.compiler.provenance import compute_provenance

    checked, plan, report = _plan_spec(spec, target, set_ or [], targets=targets)
    assert checked.problem is not None
    provenance = compute_provenance(checked.problem.spec, set_ or [], target_given=target is not None)
    if Path(plan.run_dir).resolve() == output.resolve():
        raise usage_error(
            f"output.dir {plan.run_dir} is the plan directory -o {output}: runs write their files there; give the "
            "plan and its runs different folders"
        )
    try:
        files = emit_plan_dir(plan, checked.problem.spec, output, provenance=provenance)
    except (PlanDirError, ValueError) as exc:
        raise usage_error(str(exc)) from None
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise usage_error(f"cannot write plan directory {output}: {exc.strerror or exc}{where}") from None
    shown = [d for d in report.diagnostics if d.severity != "info"]
    if shown:
        typer.echo(render_text([report]))
    e = plan.estimates
    typer.echo(
        f"wrote {output}/ ({len(files)} files): {plan.schedule.mode}, "
        + ", ".join(f"{r.name} {r.devices} dev" for r in plan.roles)
        + f"; step ~{e.step_time_s:.3g} s, {e.tokens_per_s:,.0f} trained tok/s"
    )


def explain(
    source: Annotated[
        Path, typer.Argument(help="A spec file, a plan directory or a run directory.", show_default=False)
    ],
    target: TargetOption = None,
    set_: SetOption = None,
    output_format: Annotated[ExplainFormat, typer.Option("--format", "-f", help="text or json.")] = ExplainFormat.text,
    targets: TargetsOption = None,
    measured: Annotated[
        list[Path] | None,
        typer.Option(
            "--measured", help="Run directories whose measured step times and memory to show next to the estimate."
        ),
    ] = None,
) -> None:
    """Show the chosen layout, memory per role, the step-time split and the runners-up.

    Given a run directory (or --measured runs), what the run measured is shown beside each estimate.
    """
    from rlc.compiler.explain import explain_json, explain_plan
    from rlc.compiler.manifest import plan_problem

    runs = list(measured or [])
    if source.is_file() and source.suffix == ".json":
        raise usage_error(
            f"{source} is not a spec: explain takes a spec (YAML), a plan directory or a run directory; for a "
            f"plan file, pass its folder ({source.parent})"
        )
    if source.is_dir() and (target or set_ or targets):
        raise usage_error(
            f"-t, --set and --targets shape a plan from a spec; {source} is already compiled: recompile its spec "
            "with them, or explain the folder without them"
        )
    if source.is_dir() and not (source / "manifest.json").exists() and (source / "plan.json").is_file():
        from rlc.schemas.plan import Plan

        try:  # a run directory: the plan it ran, and what it measured
            plan = Plan.model_validate_json((source / "plan.json").read_text())
        except (OSError, ValueError) as exc:
            raise usage_error(f"cannot read {source / 'plan.json'}: {plan_problem(exc)}") from None
        runs = [source, *runs]
    elif source.is_dir():
        from rlc.compiler.manifest import load_plan

        try:
            plan = load_plan(source)
        except (OSError, ValueError) as exc:
            raise usage_error(f"cannot read plan {source}: {plan_problem(exc)}") from None
    else:
        as_json = OutputFormat.json if output_format == ExplainFormat.json else None
        _, plan, _ = _plan_spec(source, target, set_ or [], as_json, targets=targets)
    _check_same_plan(plan, measured or [])
    from rlc.compiler.measured_runs import MeasuredRunsError, measured_over_runs

    try:
        shown, memory = measured_over_runs(runs, required=bool(measured))
    except MeasuredRunsError as exc:
        raise usage_error(str(exc)) from None
    if output_format == ExplainFormat.json:
        typer.echo(explain_json(plan, shown, memory))
        return
    from rich.console import Console

    explain_plan(plan, Console(), shown, memory)


def _check_same_plan(plan: Any, runs: list[Path]) -> None:
    """Measured runs shown beside a plan must be of its target and model: other hardware or another model
    would make every ratio meaningless."""
    for run in runs:
        try:
            ran = json.loads((run / "plan.json").read_text(encoding="utf-8"))
            target, model = ran["target"], ran["model"]["id"]
        except (OSError, ValueError, KeyError, TypeError):
            raise usage_error(f"--measured {run}: not a run directory (no readable plan.json)") from None
        if (target, model) != (plan.target, plan.model.id):
            raise usage_error(
                f"--measured {run} ran {model} on {target}, but this plan is {plan.model.id} on {plan.target}: its "
                "times say nothing about this plan"
            )


def diff(
    a: Annotated[Path, typer.Argument(help="A plan directory or a spec.", show_default=False)],
    b: Annotated[Path, typer.Argument(help="A plan directory or a spec.", show_default=False)],
    target: TargetOption = None,
    output_format: Annotated[ExplainFormat, typer.Option("--format", "-f", help="text or json.")] = ExplainFormat.text,
) -> None:
    """What changed between two plans or specs, including derived changes (exit 0 same plan, 1 different, 2
    error)."""
    import json

    from rlc.compiler.diagnostics import Report, render_text
    from rlc.compiler.diff import diff_plans, plan_from_path, render_diff, same_plan

    check_target(target)
    if target and a.is_dir() and b.is_dir():
        raise usage_error("-t compiles a spec for a target; both sides are compiled plans, so it would change nothing")
    plans = []
    for path in (a, b):
        if not path.exists():
            raise usage_error(f"{path} does not exist")
        plan, found = plan_from_path(path, target=target)
        if plan is None:
            report = Report(str(path))
            report.extend(found)
            typer.echo(render_text([report]), err=True)
            raise typer.Exit(EXIT_USAGE)
        plans.append(plan)
    changes = diff_plans(plans[0], plans[1])
    if output_format == ExplainFormat.json:
        typer.echo(json.dumps([c.to_json() for c in changes], indent=2, sort_keys=True))
    else:
        typer.echo(render_diff(changes) if changes else "no differences")
    raise typer.Exit(EXIT_OK if same_plan(changes) else EXIT_FINDINGS)


def schema(
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write to a file instead.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite a file that is not an earlier schema.")] = False,
) -> None:
    """Print the spec's JSON Schema (for editors and CI)."""
    from rlc.schemas.schema_file import schema_text

    text = schema_text()
    if output is None:
        typer.echo(text, nl=False)
        return
    if output.is_file() and not force and not _is_spec_schema(output, json.loads(text)["title"]):
        raise usage_error(f"{output} exists and is not a spec schema rlc wrote; choose another file, or --force")
    try:
        output.write_text(text)
    except OSError as exc:
        raise usage_error(f"cannot write {output}: {exc.strerror or exc}") from None


def _is_spec_schema(path: Path, title: str) -> bool:
    """Whether `path` holds a spec schema (any version) that `rlc schema -o` may refresh."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("title") == title and "properties" in data


def init(
    name: Annotated[str, typer.Argument(help="Experiment name.")] = "my-rl-run",
    target: Annotated[str, typer.Option("--target", "-t", help="Hardware target.")] = "cpu",
    output: Annotated[Path | None, typer.Option("--output", "-o", help="File to write (default: <name>.yaml).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a starter spec for a target."""
    from rlc.compiler.starter import SCHEMA_NEIGHBOUR, starter_spec
    from rlc.schemas.schema_file import schema_text

    check_target(target)
    try:
        text = starter_spec(name, target)
    except ValueError as exc:
        raise usage_error(str(exc)) from None
    path = output or Path(f"{name}.yaml")
    if path.exists() and not force:
        raise usage_error(f"{path} exists; pass --force to overwrite")
    schema_path = path.parent / SCHEMA_NEIGHBOUR
    try:
        path.write_text(text)
        if not schema_path.exists():
            schema_path.write_text(schema_text())
    except OSError as exc:
        raise usage_error(f"cannot write {exc.filename or path}: {exc.strerror or exc}") from None
    typer.echo(f"wrote {path} (schema: {schema_path}); next: rlc validate {path}")
