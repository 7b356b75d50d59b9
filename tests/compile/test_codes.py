"""The diagnostic-code registry: every code the sources report is registered, every registered code is used,
and every rule is registered under its own code."""

from __future__ import annotations

import re

import pytest
from paths import REPO

from rlc.compiler import codes, rule_registry, validate

SOURCES = [p for d in ("compiler", "rlc", "runtime", "schemas") for p in (REPO / d).rglob("*.py")]


def _reported() -> set[str]:
    found: set[str] = set()
    for path in SOURCES:
        if path.name == "codes.py":
            continue
        found |= set(re.findall(r"\"(RLC\d{3})\"", path.read_text()))
    return found


def test_every_reported_code_is_registered() -> None:
    assert _reported() - set(codes.CODES) == set()


def test_every_registered_code_is_reported() -> None:
    assert set(codes.CODES) - _reported() == set()


def test_rules_declare_registered_codes() -> None:
    for registered in validate.RULES:
        assert codes.summary(registered.code) == registered.summary
    assert len({r.code for r in validate.RULES}) == len(validate.RULES)


def test_an_unregistered_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="not registered"):
        rule_registry.rule("RLC299", "not a rule")
