"""Commands on run directories and the host: calibrate, export, report, doctor."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlc.cli.app import (
    EXIT_FINDINGS,
    EXIT_OK,
    ExplainFormat,
    TargetsOption,
    usage_error,
)


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
    from rlc.schemas.metrics_file import MetricsError
    from rlc.schemas.profiles import ProfileError, find_target, target_dirs, write_profile

    twice = sorted({str(d) for d in run_dirs if sum(o.resolve() == d.resolve() for o in run_dirs) > 1})
    if twice:
        raise usage_error(f"{', '.join(twice)} given more than once: each run counts once in the fit")
    try:
        runs = [load_run(d) for d in run_dirs]
        ids = sorted({r.plan.target for r in runs})
        if len(ids) != 1:
            raise CalibrationError(f"runs are on several targets ({', '.join(ids)}); calibrate one target at a time")
        base, source = find_target(ids[0], target_dirs(targets))
        profile = calibrate(base, runs)
    except (CalibrationError, MetricsError, ProfileError) as exc:
        raise usage_error(str(exc)) from None
    profile = profile.model_copy(update={"calibration": {**profile.calibration, "base": f"{base.id} from {source}"}})
    try:
        path = write_profile(profile, output, force=force)
    except ProfileError as exc:
        raise usage_error(str(exc)) from None
    except OSError as exc:
        raise usage_error(f"cannot write {output}: {exc.strerror or exc}") from None
    for key, value in profile.calibration.items():
        typer.echo(f"{key}: {value}")
    typer.echo(
        f"wrote {path} (uncertainty x{profile.estimate_uncertainty:g}); use: rlc compile SPEC --targets {output}"
    )


def export(
    run_dir: Annotated[
        Path, typer.Argument(help="Run directory (holds checkpoints/ and plan.json).", show_default=False)
    ],
    merged: Annotated[
        bool,
        typer.Option(
            "--merged",
            help="Accepted for compatibility: every export is merged (LoRA adapters folded into the base weights).",
        ),
    ] = True,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Output folder (new or empty).", show_default=False)
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an output folder that an earlier export wrote.")
    ] = False,
) -> None:
    """Write the newest checkpoint of a run as a Hugging Face model folder (LoRA adapters merged in); weights holding
    NaN or inf are refused, naming the tensor."""
    del merged  # the only export there is
    if not run_dir.is_dir():
        raise usage_error(f"{run_dir} is not a run directory")
    from rlc.runtime.export import ExportError, export_merged

    try:
        out = export_merged(run_dir, output, force=force)
    except ExportError as exc:
        typer.echo(f"rlc export: error: {exc}", err=True)
        raise typer.Exit(EXIT_FINDINGS) from None
    typer.echo(f"wrote {out}")


def report(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (holds metrics.jsonl).", show_default=False)],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Folder (default: RUNDIR/report).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Write into a folder that holds other files.")] = False,
) -> None:
    """A self-contained HTML page and PNGs of a run's metrics, next to the plan's predictions."""
    from rlc.runtime.errors import RunError, RunUsageError
    from rlc.runtime.report import is_report_dir, write_report

    if not run_dir.is_dir():
        raise usage_error(f"{run_dir} is not a run directory")
    if output is not None and not force and not is_report_dir(output):
        raise usage_error(
            f"{output} holds files that are not an rlc report; the report's index.html and charts would replace "
            "any of the same names: choose a new or empty folder, or --force"
        )
    try:
        written = write_report(run_dir, output)
    except RunUsageError as exc:
        raise usage_error(str(exc)) from None
    except RunError as exc:
        typer.echo(f"rlc report: error: {exc}", err=True)
        raise typer.Exit(EXIT_FINDINGS) from None
    except OSError as exc:
        raise usage_error(f"cannot write the report: {exc.strerror or exc} ({exc.filename})") from None
    typer.echo(f"wrote {written.html} ({len(written.pngs)} charts)")


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
