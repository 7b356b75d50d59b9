"""The `rlc` command line.

Only the light compile-path libraries are imported at module level (typer, and lazily pydantic, pyyaml,
jinja2, rich); `rlc run` imports the runtime (torch, ray, vllm) after the plan has been verified.
Exit codes: 0 ok, 1 findings (invalid spec, refused plan, plans differ; a run that failed, or that Ctrl-C or
SIGTERM stopped before its last step), 2 usage error.

The application and its shared options are in `app`; the commands live in modules by what they work on and are
registered here, in the order `rlc --help` lists them.
"""

from __future__ import annotations

from rlc.cli import catalog_commands, run_command, run_dir_commands, spec_commands
from rlc.cli.app import app, main

__all__ = ["COMMANDS", "app", "main"]

COMMANDS = (
    ("validate", spec_commands.validate),
    ("compile", spec_commands.compile_),
    ("explain", spec_commands.explain),
    ("diff", spec_commands.diff),
    ("run", run_command.run),
    ("calibrate", run_dir_commands.calibrate),
    ("export", run_dir_commands.export),
    ("schema", spec_commands.schema),
    ("init", spec_commands.init),
    ("report", run_dir_commands.report),
    ("doctor", run_dir_commands.doctor),
    ("models", catalog_commands.models),
    ("targets", catalog_commands.targets),
)
for _name, _command in COMMANDS:
    app.command(name=_name)(_command)
