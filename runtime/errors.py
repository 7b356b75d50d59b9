"""The errors `rlc run` reports to the user as one `rlc run: error:` line, never as a traceback."""

from __future__ import annotations

import os


class RunError(RuntimeError):
    """A problem with the run's inputs or environment (exit 1)."""


class RunUsageError(RunError):
    """The command line asks for something unsafe or contradictory (exit 2), e.g. starting over an earlier run."""


class RuntimeGapError(RunError):
    """The plan asks for something this runtime does not execute (RLC708): refused before anything starts."""

    def __init__(self, gaps: list[str]) -> None:
        self.gaps = gaps
        super().__init__("this runtime cannot execute the plan: " + "; ".join(gaps))


def resume_command(plan_dir: str = "PLANDIR") -> str:
    """How a stopped run is continued: the launcher's own command where one submitted the run (`launch.sh head`
    sets RLC_RESUME_COMMAND, since its users cannot re-run `rlc run` inside the cluster by hand), else `rlc run`."""
    return os.environ.get("RLC_RESUME_COMMAND") or f"rlc run {plan_dir} --resume"
