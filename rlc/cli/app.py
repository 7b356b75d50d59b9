"""The `rlc` Typer application: exit codes, shared options and usage errors; the commands register on it from
their modules (`spec_commands`, `run_command`, `run_dir_commands`, `catalog_commands`)."""

from __future__ import annotations

import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from rlc import __version__

__all__ = [
    "EXIT_FINDINGS",
    "EXIT_OK",
    "EXIT_USAGE",
    "ExplainFormat",
    "OutputFormat",
    "SetOption",
    "TargetOption",
    "TargetsOption",
    "app",
    "check_target",
    "main",
    "usage_error",
]

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


def usage_error(message: str) -> typer.Exit:
    """Print `message` as a usage error; the caller raises what this returns (exit 2)."""
    typer.echo(f"rlc: error: {message}", err=True)
    return typer.Exit(EXIT_USAGE)


def check_target(target: str | None) -> None:
    """Refuse an unknown -t/--target with the nearest name."""
    if target is None:
        return
    from rlc.schemas.spec import TARGET_NAMES

    if target not in TARGET_NAMES:
        from rlc.compiler.load import did_you_mean

        guess = did_you_mean(target, list(TARGET_NAMES))
        hint = f" (did you mean {guess}?)" if guess else ""
        raise usage_error(f"unknown target {target!r}{hint}; choose one of {', '.join(TARGET_NAMES)}")


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


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
