"""The errors `rlc run` reports to the user as one `rlc run: error:` line, never as a traceback."""

from __future__ import annotations


class RunError(RuntimeError):
    """A problem with the run's inputs or environment (exit 1)."""


class RunUsageError(RunError):
    """The command line asks for something unsafe or contradictory (exit 2), e.g. starting over an earlier run."""
