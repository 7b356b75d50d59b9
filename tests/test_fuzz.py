"""Property-based: thousands of mutated specs never raise; they validate or produce diagnostics."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlc.compiler.validate import check_text

ROOT = Path(__file__).parent.parent
BASES = [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "examples").glob("*.yaml"))]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**12), max_value=10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["qwen3-8b", "a3", "cpu", "colocated", "auto", "all-linear", "ngram", "", "0", "-1"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6,
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found.extend(_paths(value, (*prefix, key)))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found.extend(_paths(value, (*prefix, index)))
    return found


def _set(root: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    node = root
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return root


def _delete(root: Any, path: tuple) -> Any:
    if not path:
        return root
    node = root
    for part in path[:-1]:
        node = node[part]
    del node[path[-1]]
    return root


@st.composite
def mutated_specs(draw: st.DrawFn) -> Any:
    spec = copy.deepcopy(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 4))):
        paths = _paths(spec)
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            spec = _set(spec, path, draw(values))
        elif action == "delete" and path:
            spec = _delete(spec, path)
        elif action == "add":
            node = spec
            for part in path:
                node = node[part]
            if isinstance(node, dict):
                node[draw(st.text(min_size=1, max_size=10))] = draw(values)
    return spec


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_specs(), st.sampled_from([None, "cpu", "a2", "a3"]))
def test_mutated_specs_never_raise(spec: Any, target: str | None) -> None:
    text = yaml.safe_dump(spec, sort_keys=False, allow_unicode=True)
    checked = check_text(text, "fuzz.yaml", target=target)
    for d in checked.report.diagnostics:
        assert d.code.startswith("RLC") and d.message


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise(raw: bytes) -> None:
    check_text(raw, "bytes.yaml")


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=300))
def test_random_text_never_raises(text: str) -> None:
    check_text(text, "text.yaml")
