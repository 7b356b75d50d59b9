"""The one compile pipeline: load → resolve → rules → plan, used by validate, compile, explain and diff.

Every command that turns a spec into findings or a plan goes through `compile_file` / `compile_text`, so a
spec `rlc validate` accepts is one `rlc compile` plans, and the fit check (the whole planner) runs in both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlc.compiler.diagnostics import Report
from rlc.compiler.load import LineMap
from rlc.compiler.resolve import Problem
from rlc.compiler.validate import Checked, check_file, check_text
from rlc.schemas.plan import Plan


@dataclass
class Compiled:
    """A spec after every check and, unless planning was skipped or refused, its plan."""

    problem: Problem | None
    report: Report
    lines: LineMap
    plan: Plan | None = None

    @property
    def ok(self) -> bool:
        return self.report.ok


def plan_checked(checked: Checked, *, plan: bool = True) -> Compiled:
    """Run the planner on a checked spec (its RLC3xx findings join the report), unless `plan` is False."""
    out = Compiled(checked.problem, checked.report, checked.lines)
    if not plan or checked.problem is None:
        return out
    from rlc.compiler.planner import build_plan

    out.plan, found = build_plan(checked.problem, checked.lines, checked.report.file)
    out.report.extend(found)
    return out


def compile_file(
    path: str | Path,
    *,
    target: str | None = None,
    overrides: list[str] | None = None,
    plan: bool = True,
    targets: Sequence[Path] | None = None,
) -> Compiled:
    """Check a spec file and plan it (`plan=False`: the checks only); `targets`: profile directories."""
    return plan_checked(check_file(path, target=target, overrides=overrides, targets=targets), plan=plan)


def compile_text(
    text: str | bytes,
    file: str = "<spec>",
    *,
    target: str | None = None,
    plan: bool = True,
    targets: Sequence[Path] | None = None,
) -> Compiled:
    """Check spec text and plan it (`plan=False`: the checks only); `targets`: profile directories."""
    return plan_checked(check_text(text, file, target=target, targets=targets), plan=plan)
