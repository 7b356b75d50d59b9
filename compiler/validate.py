"""`rlc validate`: load, resolve and check a spec, collecting every diagnostic in one report."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlc.compiler.diagnostics import Report
from rlc.compiler.load import LineMap, load_spec_file, load_spec_text
from rlc.compiler.resolve import Problem, resolve
from rlc.compiler.rules import run_rules


@dataclass
class Checked:
    """A spec after every check: the problem is set only when there are no errors."""

    problem: Problem | None
    report: Report
    lines: LineMap


def check_loaded(result_spec, report: Report, lines: LineMap) -> Checked:  # type: ignore[no-untyped-def]
    if result_spec is None:
        return Checked(None, report, lines)
    problem, found = resolve(result_spec, lines, report.file)
    report.extend(found)
    if problem is None:
        return Checked(None, report, lines)
    report.extend(run_rules(problem, lines, report.file))
    return Checked(problem if report.ok else None, report, lines)


def check_file(path: str | Path, *, target: str | None = None, overrides: list[str] | None = None) -> Checked:
    loaded = load_spec_file(path, target=target, overrides=overrides)
    return check_loaded(loaded.spec, loaded.report, loaded.lines)


def check_text(text: str | bytes, file: str = "<spec>", *, target: str | None = None) -> Checked:
    loaded = load_spec_text(text, file, target=target)
    return check_loaded(loaded.spec, loaded.report, loaded.lines)
