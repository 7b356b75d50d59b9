"""`rlc validate`: load, resolve and check a spec, collecting every diagnostic in one report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlc.compiler import agent_rules, algorithm_rules, rules
from rlc.compiler.diagnostics import Diagnostic, Report
from rlc.compiler.load import LineMap, LoadResult, load_spec_file, load_spec_text
from rlc.compiler.resolve import Problem, resolve
from rlc.compiler.rule_registry import RULES, RuleContext

RULE_MODULES = (rules, agent_rules, algorithm_rules)  # importing them registers their rules


@dataclass
class Checked:
    """A spec after every check: the problem is set only when there are no errors."""

    problem: Problem | None
    report: Report
    lines: LineMap


def check_loaded(loaded: LoadResult, targets: Sequence[Path] | None = None) -> Checked:
    """Resolve names and run the semantic rules on a loaded spec.

    A structurally broken file still gets its semantic checks, on the spec with the broken values
    removed, so one pass reports every problem; such a file never yields a problem to plan.
    """
    report, lines = loaded.report, loaded.lines
    spec = loaded.spec or loaded.repaired
    if spec is None:
        return Checked(None, report, lines)
    problem, found = resolve(spec, lines, report.file, targets)
    report.extend(found)
    if problem is not None:
        report.extend(run_rules(problem, lines, report.file))
    usable = problem is not None and loaded.spec is not None and report.ok
    return Checked(problem if usable else None, report, lines)


def check_file(
    path: str | Path,
    *,
    target: str | None = None,
    overrides: list[str] | None = None,
    targets: Sequence[Path] | None = None,
) -> Checked:
    return check_loaded(load_spec_file(path, target=target, overrides=overrides), targets)


def check_text(
    text: str | bytes, file: str = "<spec>", *, target: str | None = None, targets: Sequence[Path] | None = None
) -> Checked:
    return check_loaded(load_spec_text(text, file, target=target), targets)


def run_rules(problem: Problem, lines: LineMap, file: str) -> list[Diagnostic]:
    """Every registered rule on one problem (none stops the others)."""
    ctx = RuleContext(problem, lines, file)
    found: list[Diagnostic] = []
    for registered in RULES:
        found.extend(registered.check(ctx))
    return found
