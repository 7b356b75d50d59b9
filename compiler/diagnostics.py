"""Diagnostics: the one shape in which rlc reports every problem with a spec or a plan.

Each finding carries a stable code, a dotted path into the spec, the YAML line it came from, a message that
shows the numbers, and a hint that says what to change. Renderers turn a list of them into text, JSON (a
stable contract for CI) or GitHub workflow annotations.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Literal

Severity = Literal["error", "warning", "info"]


@dataclass(frozen=True)
class Diagnostic:
    """One finding about a spec or plan."""

    code: str
    message: str
    path: str = ""
    severity: Severity = "error"
    hint: str = ""
    line: int | None = None
    file: str = ""

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    def location(self) -> str:
        where = self.file or "<spec>"
        return f"{where}:{self.line}" if self.line else where


@dataclass
class Report:
    """All diagnostics for one file, in the order they were found (sorted for output)."""

    file: str
    diagnostics: list[Diagnostic] = field(default_factory=list)

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "error"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def add(self, diagnostic: Diagnostic) -> None:
        self.diagnostics.append(diagnostic)

    def extend(self, diagnostics: list[Diagnostic]) -> None:
        self.diagnostics.extend(diagnostics)

    def sorted(self) -> list[Diagnostic]:
        order = {"error": 0, "warning": 1, "info": 2}
        unique = {(d.code, d.path, d.message): d for d in self.diagnostics}
        return sorted(unique.values(), key=lambda d: (d.line or 0, order[d.severity], d.path, d.code))


def render_text(reports: list[Report]) -> str:
    """Human-readable lines in the compiler style `file:line: error[CODE] path: message`."""
    lines: list[str] = []
    for report in reports:
        for d in report.sorted():
            head = f"{d.location()}: {d.severity}[{d.code}]"
            subject = f" {d.path}:" if d.path else ""
            lines.append(f"{head}{subject} {d.message}")
            if d.hint:
                lines.append(f"    hint: {d.hint}")
        errors, warnings = len(report.errors), sum(d.severity == "warning" for d in report.diagnostics)
        status = "ok" if report.ok else "invalid"
        lines.append(f"{report.file}: {status} ({errors} error(s), {warnings} warning(s))")
    return "\n".join(lines)


def render_json(reports: list[Report]) -> str:
    """The stable machine contract: {"version": 1, "files": [{"file", "ok", "diagnostics": [...]}]}."""
    payload = {
        "version": 1,
        "ok": all(r.ok for r in reports),
        "files": [{"file": r.file, "ok": r.ok, "diagnostics": [d.to_json() for d in r.sorted()]} for r in reports],
    }
    return json.dumps(payload, indent=2, sort_keys=True)


def _escape_github(value: str, *, property_value: bool = False) -> str:
    value = value.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    if property_value:
        value = value.replace(":", "%3A").replace(",", "%2C")
    return value


def render_github(reports: list[Report]) -> str:
    """GitHub Actions workflow commands (`::error file=…,line=…,title=…::message`)."""
    lines: list[str] = []
    for report in reports:
        for d in report.sorted():
            level = {"error": "error", "warning": "warning", "info": "notice"}[d.severity]
            props = [f"file={_escape_github(report.file, property_value=True)}"]
            if d.line:
                props.append(f"line={d.line}")
            props.append(f"title={_escape_github(f'{d.code} {d.path}'.strip(), property_value=True)}")
            text = d.message + (f" (hint: {d.hint})" if d.hint else "")
            lines.append(f"::{level} {','.join(props)}::{_escape_github(text)}")
    return "\n".join(lines)
