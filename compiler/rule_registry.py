"""The registry of semantic rules: every check registers here under a stable code (RLC2xx) and `validate`
runs them all, so a user sees every problem in one pass. Rules live in their own modules (`rules`,
`agent_rules`), which register on import."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pydantic import BaseModel

from rlc.compiler import codes
from rlc.compiler.diagnostics import Diagnostic, Severity
from rlc.compiler.load import LineMap
from rlc.compiler.resolve import Problem


@dataclass
class RuleContext:
    problem: Problem
    lines: LineMap
    file: str

    def diag(self, code: str, path: str, message: str, hint: str = "", severity: Severity = "error") -> Diagnostic:
        via = self.lines.override_for(path)
        if via is not None:  # the value came from the command line, not from the line the path is on
            message += f" (from `--set {via}`)"
        return Diagnostic(code, message, path, severity, hint, self.lines.line_for(path), self.file)


RuleFn = Callable[[RuleContext], Iterator[Diagnostic]]


@dataclass(frozen=True)
class Rule:
    code: str
    summary: str
    check: RuleFn


RULES: list[Rule] = []


def rule(code: str, summary: str) -> Callable[[RuleFn], RuleFn]:
    """Register a semantic check under a stable code, which must be in the registry (`codes.CODES`) with the
    same summary."""
    if codes.CODES.get(code) != summary:
        raise ValueError(f"rule {code} ({summary!r}) is not registered as such in compiler/codes.py")

    def register(fn: RuleFn) -> RuleFn:
        RULES.append(Rule(code, summary, fn))
        return fn

    return register


def set_off_default(model: BaseModel, name: str) -> bool:
    """Whether the spec set `name` to something other than its default (not merely spelled the default out)."""
    return name in model.model_fields_set and getattr(model, name) != type(model).model_fields[name].default
