"""The `rlc` command line.

Only the light compile-path libraries are imported at module level (typer, and lazily pydantic, pyyaml,
jinja2, rich); `rlc run` imports the runtime (torch, ray, vllm) after the plan has been verified.
Exit codes: 0 ok, 1 findings (invalid spec, refused plan, plans differ; a run that failed, or that Ctrl-C or
SIGTERM stopped before its last step), 2 usage error.
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from rlc import __version__

app = typer.Typer(
    name="rlc",
    help="Compile and run asynchronous RL post-training plans for Ascend A2/A3 clusters (and a cpu default).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2


class OutputFormat(StrEnum):
    text = "text"
    json = "json"
    github = "github"


class ExplainFormat(StrEnum):
    text = "text"
    json = "json"


TargetOption = Annotated[
    str | None, typer.Option("--target", "-t", help="Hardware target; overrides the spec's `target`.")
]
TargetsOption = Annotated[
    list[Path] | None,
    typer.Option(
        "--targets",
        help="Directory of target profiles (e.g. from `rlc calibrate`) that shadow the shipped ones (repeatable; "
        "also RLC_TARGETS).",
    ),
]
SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a spec value: --set algorithm.lr=2e-6 (repeatable)."),
]


def _usage_error(message: str) -> typer.Exit:
    typer.echo(f"rlc: error: {message}", err=True)
    return typer.Exit(EXIT_USAGE)


def _check_target(target: str | None) -> None:
    if target is None:
        return
    from rlc.schemas.spec import TARGET_NAMES

    if target not in TARGET_NAMES:
        from rlc.compiler.load import did_you_mean

        guess = did_you_mean(target, list(TARGET_NAMES))
        hint = f" (did you mean {guess}?)" if guess else ""
        raise _usage_error(f"unknown target {target!r}{hint}; choose one of {', '.join(TARGET_NAMES)}")


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"rlc {__version__}")
        raise typer.Exit(EXIT_OK)


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version_callback, is_eager=True, help="Show the version.")
    ] = False,
) -> None:
    """rlc: a spec in, a plan out, a run from the plan."""


@app.command()
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

    _check_target(target)
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

    _check_target(target)
    checked = compile_file(spec, target=target, overrides=overrides, targets=targets)
    report: Report = checked.report
    plan = checked.plan
    if plan is None or not report.ok:
        render = render_json if output_format == OutputFormat.json else render_text
        typer.echo(render([report]))
        raise typer.Exit(EXIT_FINDINGS)
    return checked, plan, report


@app.command(name="compile")
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
        raise _usage_error(
            f"output.dir {plan.run_dir} is the plan directory -o {output}: runs write their files there; give the "
            "plan and its runs different folders"
        )
    try:
        files = emit_plan_dir(plan, checked.problem.spec, output, provenance=provenance)
    except (PlanDirError, ValueError) as exc:
        raise _usage_error(str(exc)) from None
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise _usage_error(f"cannot write plan directory {output}: {exc.strerror or exc}{where}") from None
    shown = [d for d in report.diagnostics if d.severity != "info"]
    if shown:
        typer.echo(render_text([report]))
    e = plan.estimates
    typer.echo(
        f"wrote {output}/ ({len(files)} files): {plan.schedule.mode}, "
        + ", ".join(f"{r.name} {r.devices} dev" for r in plan.roles)
        + f"; step ~{e.step_time_s:.3g} s, {e.tokens_per_s:,.0f} trained tok/s"
    )


@app.command()
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
        raise _usage_error(
            f"{source} is not a spec: explain takes a spec (YAML), a plan directory or a run directory; for a "
            f"plan file, pass its folder ({source.parent})"
        )
    if source.is_dir() and (target or set_ or targets):
        raise _usage_error(
            f"-t, --set and --targets shape a plan from a spec; {source} is already compiled: recompile its spec "
            "with them, or explain the folder without them"
        )
    if source.is_dir() and not (source / "manifest.json").exists() and (source / "plan.json").is_file():
        from rlc.schemas.plan import Plan

        try:  # a run directory: the plan it ran, and what it measured
            plan = Plan.model_validate_json((source / "plan.json").read_text())
        except (OSError, ValueError) as exc:
            raise _usage_error(f"cannot read {source / 'plan.json'}: {plan_problem(exc)}") from None
        runs = [source, *runs]
    elif source.is_dir():
        from rlc.compiler.manifest import load_plan

        try:
            plan = load_plan(source)
        except (OSError, ValueError) as exc:
            raise _usage_error(f"cannot read plan {source}: {plan_problem(exc)}") from None
    else:
        as_json = OutputFormat.json if output_format == ExplainFormat.json else None
        _, plan, _ = _plan_spec(source, target, set_ or [], as_json, targets=targets)
    _check_same_plan(plan, measured or [])
    shown, memory = _measured(runs, required=bool(measured))
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
            raise _usage_error(f"--measured {run}: not a run directory (no readable plan.json)") from None
        if (target, model) != (plan.target, plan.model.id):
            raise _usage_error(
                f"--measured {run} ran {model} on {target}, but this plan is {plan.model.id} on {plan.target}: its "
                "times say nothing about this plan"
            )


def _measured(runs: list[Path], required: bool) -> tuple[dict[str, float] | None, dict[str, dict[str, float]] | None]:
    """Mean phase times and highest memory peaks over `runs`; a run too short to time is shown without times
    unless it was asked for with --measured (`required`)."""
    from rlc.compiler.calibrate import CalibrationError, MetricsError, measured_phases
    from rlc.compiler.run_memory import MeasuredMemoryError, measured_memory

    times, memory = [], {}
    for run in runs:
        try:
            times.append(measured_phases(run))
        except CalibrationError as exc:
            if required or isinstance(exc, MetricsError):  # a damaged metrics.jsonl is reported, not hidden
                raise _usage_error(str(exc)) from None
        try:
            for role, phases in measured_memory(run).items():
                held = memory.setdefault(role, {})
                for phase, gib in phases.items():
                    held[phase] = max(held.get(phase, 0.0), gib)
        except MeasuredMemoryError:
            pass  # an older run, or one that stopped before its trainer was built: no memory to show
    shown = {k: sum(r[k] for r in times if k in r) / len(times) for k in times[0]} if times else None
    return shown, memory or None


@app.command()
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

    _check_target(target)
    if target and a.is_dir() and b.is_dir():
        raise _usage_error("-t compiles a spec for a target; both sides are compiled plans, so it would change nothing")
    plans = []
    for path in (a, b):
        if not path.exists():
            raise _usage_error(f"{path} does not exist")
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


@app.command()
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
    from rlc.compiler.diagnostics import Report, render_text
    from rlc.compiler.manifest import PLAN_FILE, load_plan, plan_problem, read_manifest, verify_plan_dir

    if not plan_dir.is_dir():
        raise _usage_error(f"{plan_dir} is not a plan directory; create one with `rlc compile SPEC -o {plan_dir}`")
    if resume and overwrite:
        raise _usage_error("--resume continues the earlier run and --overwrite moves it aside: pass one of them")
    if output_format == ExplainFormat.json and not dry_run:
        raise _usage_error("--format json is the dry run's output: pass --dry-run with it (a run prints progress)")
    if replay is not None and not (replay / "rollouts.jsonl").is_file():
        raise _usage_error(f"--replay {replay}: no rollouts.jsonl there; pass the directory of a run rlc recorded")
    report = Report(str(plan_dir))
    report.extend(verify_plan_dir(plan_dir, allow_modified=allow_modified))
    if report.diagnostics:
        typer.echo(render_text([report]), err=True)
    if not report.ok:
        raise typer.Exit(EXIT_FINDINGS)
    # plan.json itself differs from the compiled plan (edited, or edited and rehashed in the manifest)
    plan_edited = allow_modified and any(d.file == str(plan_dir / PLAN_FILE) for d in report.diagnostics)
    if allow_modified and report.diagnostics:
        from rlc.compiler.plan_changes import _plan_lines, describe_modifications

        changed = describe_modifications(plan_dir)
        manifest = read_manifest(plan_dir) or {}
        if plan_edited and "compiled_plan" in manifest and not any(x.startswith(f"{PLAN_FILE}:") for x in changed):
            changed = [*_plan_lines(plan_dir, manifest["compiled_plan"]), *changed]  # its hash was made to match
        if changed:
            typer.echo("rlc run: --allow-modified: running a plan that differs from the compiled one:", err=True)
            typer.echo("\n".join(f"    {line}" for line in changed), err=True)
    try:
        plan = load_plan(plan_dir)
    except (OSError, ValueError) as exc:
        raise _usage_error(f"cannot read plan {plan_dir}: {plan_problem(exc)}") from None
    if plan_edited and (notice := _worker_env_notice(plan, (read_manifest(plan_dir) or {}).get("compiled_plan"))):
        typer.echo(notice, err=True)
    from rlc.runtime.launch_request import launch_request, render_request
    from rlc.runtime.trackers import tracker_problems

    trackers = tracker_problems(plan.loggers)
    if dry_run:  # the plan alone: no runtime needed
        for problem in trackers:  # the run would refuse to start here; the dry run still shows its layout
            typer.echo(f"rlc run: warning: {problem} (the run itself will not start without it)", err=True)
        try:
            request = launch_request(plan)
        except ValueError as exc:
            raise _usage_error(f"cannot read plan {plan_dir}: {plan_problem(exc)}") from None
        if output_format == ExplainFormat.json:
            typer.echo(json.dumps(request.to_json(), indent=2, sort_keys=True))
        else:
            typer.echo(render_request(request))
        raise typer.Exit(EXIT_USAGE if request.refusals else EXIT_OK)
    target_dir = run_dir or (Path(f"{replay}.replay") if replay is not None else Path(plan.run_dir))
    if target_dir.resolve() == plan_dir.resolve():
        raise _usage_error(
            f"the run directory {target_dir} is the plan directory: a run there would mix its files into the plan "
            "(and --overwrite would move plan.json aside); pass another --run-dir, or compile with another output.dir"
        )
    _require_runtime()
    if trackers:  # before Ray or any actor starts, not a ModuleNotFoundError once the run is up
        typer.echo("\n".join(f"rlc run: error: {problem}" for problem in trackers), err=True)
        raise typer.Exit(EXIT_USAGE)
    from rlc.runtime.errors import RunError, RuntimeGapError, RunUsageError
    from rlc.runtime.launch import RunStopped, refuse_gaps, run_plan

    try:
        refuse_gaps(plan)
        run_plan(plan, run_dir, resume=resume, overwrite=overwrite, replay=replay)
    except RunStopped as exc:  # Ctrl-C or SIGTERM: a partial run, checkpointed, is not a finished one
        again = f"{plan_dir} --run-dir {target_dir}" if run_dir or replay else str(plan_dir)
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
        typer.echo(f"rlc run: error: {exc}", err=True)
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


@app.command()
def calibrate(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run directories (plan.json + metrics.jsonl).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory to write <target>.yaml into.")],
    targets: TargetsOption = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace a <target>.yaml there that calibrate did not write.")
    ] = False,
) -> None:
    """Fit the target's efficiencies and overheads to measured runs and write a calibrated target profile
    (use it with `rlc compile --targets DIR` or RLC_TARGETS=DIR)."""
    from rlc.compiler.calibrate import CalibrationError, calibrate, load_run
    from rlc.compiler.profiles import ProfileError, find_target, target_dirs, write_profile

    twice = sorted({str(d) for d in run_dirs if sum(o.resolve() == d.resolve() for o in run_dirs) > 1})
    if twice:
        raise _usage_error(f"{', '.join(twice)} given more than once: each run counts once in the fit")
    try:
        runs = [load_run(d) for d in run_dirs]
        ids = sorted({r.plan.target for r in runs})
        if len(ids) != 1:
            raise CalibrationError(f"runs are on several targets ({', '.join(ids)}); calibrate one target at a time")
        base, source = find_target(ids[0], target_dirs(targets))
        profile = calibrate(base, runs)
    except (CalibrationError, ProfileError) as exc:
        raise _usage_error(str(exc)) from None
    profile = profile.model_copy(update={"calibration": {**profile.calibration, "base": f"{base.id} from {source}"}})
    try:
        path = write_profile(profile, output, force=force)
    except ProfileError as exc:
        raise _usage_error(str(exc)) from None
    except OSError as exc:
        raise _usage_error(f"cannot write {output}: {exc.strerror or exc}") from None
    for key, value in profile.calibration.items():
        typer.echo(f"{key}: {value}")
    typer.echo(
        f"wrote {path} (uncertainty x{profile.estimate_uncertainty:g}); use: rlc compile SPEC --targets {output}"
    )


@app.command()
def export(
    run_dir: Annotated[
        Path, typer.Argument(help="Run directory (holds checkpoints/ and plan.json).", show_default=False)
    ],
    merged: Annotated[
        bool, typer.Option("--merged", help="Fold LoRA adapters into the base weights (a plain HF model).")
    ] = False,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Output folder (new or empty).", show_default=False)
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an output folder that an earlier export wrote.")
    ] = False,
) -> None:
    """Write the newest checkpoint of a run as a Hugging Face model folder."""
    if not merged:
        raise _usage_error("only merged export exists so far: pass --merged")
    if not run_dir.is_dir():
        raise _usage_error(f"{run_dir} is not a run directory")
    from rlc.runtime.export import ExportError, export_merged

    try:
        out = export_merged(run_dir, output, force=force)
    except ExportError as exc:
        typer.echo(f"rlc export: error: {exc}", err=True)
        raise typer.Exit(EXIT_FINDINGS) from None
    typer.echo(f"wrote {out}")


@app.command()
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
        raise _usage_error(f"{output} exists and is not a spec schema rlc wrote; choose another file, or --force")
    try:
        output.write_text(text)
    except OSError as exc:
        raise _usage_error(f"cannot write {output}: {exc.strerror or exc}") from None


def _is_spec_schema(path: Path, title: str) -> bool:
    """Whether `path` holds a spec schema (any version) that `rlc schema -o` may refresh."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("title") == title and "properties" in data


@app.command()
def init(
    name: Annotated[str, typer.Argument(help="Experiment name.")] = "my-rl-run",
    target: Annotated[str, typer.Option("--target", "-t", help="Hardware target.")] = "cpu",
    output: Annotated[Path | None, typer.Option("--output", "-o", help="File to write (default: <name>.yaml).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a starter spec for a target."""
    from rlc.compiler.starter import SCHEMA_NEIGHBOUR, starter_spec
    from rlc.schemas.schema_file import schema_text

    _check_target(target)
    try:
        text = starter_spec(name, target)
    except ValueError as exc:
        raise _usage_error(str(exc)) from None
    path = output or Path(f"{name}.yaml")
    if path.exists() and not force:
        raise _usage_error(f"{path} exists; pass --force to overwrite")
    schema_path = path.parent / SCHEMA_NEIGHBOUR
    try:
        path.write_text(text)
        if not schema_path.exists():
            schema_path.write_text(schema_text())
    except OSError as exc:
        raise _usage_error(f"cannot write {exc.filename or path}: {exc.strerror or exc}") from None
    typer.echo(f"wrote {path} (schema: {schema_path}); next: rlc validate {path}")


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (holds metrics.jsonl).", show_default=False)],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Folder (default: RUNDIR/report).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Write into a folder that holds other files.")] = False,
) -> None:
    """A self-contained HTML page and PNGs of a run's metrics, next to the plan's predictions."""
    from rlc.runtime.errors import RunError, RunUsageError
    from rlc.runtime.report import is_report_dir, write_report

    if not run_dir.is_dir():
        raise _usage_error(f"{run_dir} is not a run directory")
    if output is not None and not force and not is_report_dir(output):
        raise _usage_error(
            f"{output} holds files that are not an rlc report; the report's index.html and charts would replace "
            "any of the same names: choose a new or empty folder, or --force"
        )
    try:
        written = write_report(run_dir, output)
    except RunUsageError as exc:
        raise _usage_error(str(exc)) from None
    except RunError as exc:
        typer.echo(f"rlc report: error: {exc}", err=True)
        raise typer.Exit(EXIT_FINDINGS) from None
    except OSError as exc:
        raise _usage_error(f"cannot write the report: {exc.strerror or exc} ({exc.filename})") from None
    typer.echo(f"wrote {written.html} ({len(written.pngs)} charts)")


@app.command()
def doctor(
    run_dir: Annotated[Path, typer.Option("--run-dir", help="Where runs will write (its disk is checked).")] = Path(),
    output_format: Annotated[ExplainFormat, typer.Option("--format", "-f", help="text or json.")] = ExplainFormat.text,
) -> None:
    """What is installed, which devices are seen, Ray, /dev/shm and disk (exit 0 ok, 1 a run would fail here)."""
    import json

    from rlc.runtime.doctor import run_checks

    checks = run_checks(run_dir)
    failed = any(c.status == "fail" for c in checks)
    if output_format == ExplainFormat.json:
        typer.echo(json.dumps({"ok": not failed, "checks": [c.to_json() for c in checks]}, indent=2, sort_keys=True))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            typer.echo(f"{c.status:4s}  {c.name:{width}s}  {c.detail}")
        typer.echo("doctor: " + ("a run would fail here (see fail above)" if failed else "ready"))
    raise typer.Exit(EXIT_FINDINGS if failed else EXIT_OK)


def _print_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """A rich table on a terminal; tab-separated lines when piped, so nothing is truncated for grep or cut."""
    if not sys.stdout.isatty():
        for row in (header, *rows):
            typer.echo("\t".join(row))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(*header)
    for row in rows:
        table.add_row(*row)
    Console().print(table)


@app.command()
def models() -> None:
    """List the model catalog (head counts are what TP, CP and EP degrees must divide)."""
    from rlc.schemas.registry import load_arch, model_ids

    rows = []
    for model_id in model_ids():
        arch = load_arch(model_id)
        moe = f"{arch.moe.num_experts}x top-{arch.moe.experts_per_token}" if arch.moe else "-"
        rows.append(
            (
                arch.id,
                f"{arch.params_b:g}",
                f"{arch.active_params_b:g}",
                str(arch.num_layers),
                str(arch.hidden_size),
                str(arch.num_attention_heads),
                str(arch.num_kv_heads),
                arch.attention.kind,
                moe,
                str(arch.mtp_layers),
            )
        )
    header = ("id", "params (B)", "active (B)", "layers", "hidden", "heads", "kv heads", "attention", "MoE", "MTP")
    _print_table(header, rows)


@app.command()
def targets(targets: TargetsOption = None) -> None:
    """List the hardware targets, and which profile compile would use for each (a calibrated one shadows the
    shipped one: --targets, RLC_TARGETS)."""
    from rlc.compiler.profiles import ProfileError, find_target, profile_files, target_dirs
    from rlc.schemas.registry import target_ids

    try:
        dirs = target_dirs(targets)
        ids = sorted({*target_ids(), *(p.stem for d in dirs for p in profile_files(d))})
        found = [find_target(target_id, dirs) for target_id in ids]
    except ProfileError as exc:
        raise _usage_error(str(exc)) from None
    rows = [
        (
            t.id,
            t.chip,
            str(t.devices_per_node),
            f"{t.hbm_gib:g}",
            f"{t.usable_hbm_gib:g}",
            f"{t.bf16_tflops:g}",
            f"{t.hbm_bandwidth_gbps:g}",
            source,
        )
        for t, source in found
    ]
    header = ("id", "chip", "devices/node", "HBM GiB", "usable GiB", "bf16 TFLOPS", "HBM GB/s", "profile")
    _print_table(header, rows)


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
