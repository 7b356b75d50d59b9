"""Hostile specs: YAML shapes that used to crash or hang the loader, numbers past what hardware means, NUL bytes.

Each must end as diagnostics with a code, quickly; every numeric field of the spec has an upper bound, and a
spec with every bounded field at its bound still validates and compiles. The time bounds here are blow-up
guards (`BLOWUP_CPU_S`); the speed goal, two CPU-seconds a spec, is measured by `scripts/fuzz_specs.py`.
"""

from __future__ import annotations

import copy
import time
import types
import typing
from typing import Any

import pytest
import yaml
from annotated_types import Le, Lt
from plan_fixtures import A2_SPEC
from pydantic import BaseModel
from spec_mutants import ARCH, BASES, BLOWUP_CPU_S, _bomb, run_case

from rlc.compiler.load import MAX_NODES, MAX_SPEC_BYTES, load_spec_text
from rlc.compiler.validate import check_loaded
from rlc.schemas.spec import Spec

GOOD = A2_SPEC


def diagnostics(text: str, overrides: list[str] | None = None) -> list[tuple[str, str, str]]:
    report = check_loaded(load_spec_text(text, "spec.yaml", overrides=overrides)).report
    return [(d.code, d.path, d.message) for d in report.errors]


def timed(text: str, overrides: list[str] | None = None) -> tuple[list[tuple[str, str, str]], float]:
    """Diagnostics and the CPU seconds they took (CPU time, so a busy machine does not fail the bound)."""
    start = time.process_time()
    found = diagnostics(text, overrides)
    return found, time.process_time() - start


@pytest.fixture
def node_visits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the loader's node visits (its recursion goes through the module name, so this sees every one)."""
    from rlc.compiler import load

    visits = [0]
    walk = load._walk_nodes

    def counted(*args: Any) -> None:
        visits[0] += 1
        walk(*args)

    monkeypatch.setattr(load, "_walk_nodes", counted)
    return visits


# ----------------------------------------------------------------------------------------- YAML shapes


@pytest.fixture(params=["libyaml", "python"])
def loader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each shape test runs with libyaml's parser and with PyYAML's pure-Python one (hosts without libyaml)."""
    from rlc.compiler import load

    if request.param == "python":
        monkeypatch.setattr(load, "_Loader", load._DepthLimitedLoader)
    elif not hasattr(yaml, "CSafeLoader"):
        pytest.skip("PyYAML without libyaml")
    return request.param


@pytest.mark.parametrize(
    "attack",
    ["recursive: &r [*r]", "recursive: &r {self: *r}", "model: &m {name: qwen3-8b, path: /m, arch: *m}"],
)
def test_recursive_aliases_are_a_diagnostic(attack: str, loader: str, node_visits: list[int]) -> None:
    found, seconds = timed(GOOD + attack + "\n")
    assert [c for c, _, _ in found] == ["RLC007"], found
    assert "refers to a value that contains it" in found[0][2]
    assert node_visits[0] < 200  # the spec's own nodes, then the first repeat on the alias's path
    assert seconds < BLOWUP_CPU_S


@pytest.mark.parametrize("merge", [False, True], ids=["aliases", "merge-keys"])
def test_alias_bombs_are_bounded(merge: bool, loader: str, node_visits: list[int]) -> None:
    bomb = _bomb(9, 9, merge=merge)  # 9^9 ≈ 387 million values once expanded
    assert len(bomb) < 1000
    found, seconds = timed(GOOD + bomb + "\n")
    assert [c for c, _, _ in found] == ["RLC007"], found
    assert f"more than {MAX_NODES:,} values" in found[0][2]
    assert node_visits[0] == MAX_NODES + 1  # the walk stops at its budget, before anything is constructed
    assert seconds < BLOWUP_CPU_S


@pytest.mark.parametrize("depth", [50, 5000])
def test_deep_nesting_is_a_diagnostic(depth: int, loader: str) -> None:
    found, seconds = timed(GOOD + "deep: " + "[" * depth + "]" * depth + "\n")
    # libyaml stops past 1,000 levels itself (RLC001); below that, and in pure Python, rlc stops at 32 (RLC007).
    expected = "RLC001" if depth > 1000 and loader == "libyaml" else "RLC007"
    assert [c for c, _, _ in found] == [expected], found
    assert "nesting" in found[0][2]
    assert seconds < BLOWUP_CPU_S  # PyYAML's own scanner is quadratic in flow depth: about 1 s at 5,000


def test_plain_anchors_and_merge_keys_still_work(loader: str) -> None:
    text = GOOD.replace("cluster: {nodes: 2}", "cluster: {<<: {nodes: 2}}").replace(
        "path: /models/Qwen3-8B", "path: &weights /models/Qwen3-8B"
    )
    text += "distill: {teachers: [{name: t, model: {name: qwen3-8b, path: *weights}}]}\n"
    loaded = load_spec_text(text, "spec.yaml")
    assert loaded.spec is not None, loaded.report.diagnostics
    assert loaded.spec.cluster.nodes == 2
    assert loaded.spec.distill is not None and loaded.spec.distill.teachers[0].model.path == "/models/Qwen3-8B"


def test_size_cap_covers_text_as_well_as_files() -> None:
    text = GOOD + "# " + "x" * MAX_SPEC_BYTES + "\n"
    assert [c for c, _, _ in diagnostics(text)] == ["RLC004"]


def test_override_values_are_bounded_too(loader: str, node_visits: list[int]) -> None:
    found, seconds = timed(GOOD, ["cluster.nodes=&a [*a]"])
    assert [c for c, _, _ in found] == ["RLC006"] and "contains it" in found[0][2]
    refs = ", ".join(["*a{}"] * 8)
    levels = ["&a0 [1, 1, 1, 1, 1, 1, 1, 1]"] + [f"&a{i} [{refs.format(*[i - 1] * 8)}]" for i in range(1, 9)]
    bomb = "[" + ", ".join(levels) + "]"
    found, seconds = timed(GOOD, [f"cluster.nodes={bomb}"])
    assert [c for c, _, _ in found] == ["RLC006"] and "more than" in found[0][2]
    assert node_visits[0] < 2 * (MAX_NODES + 1)  # the spec's walk and the override's, each within budget
    assert seconds < BLOWUP_CPU_S


# ----------------------------------------------------------------------------------------- numbers and NUL


@pytest.mark.parametrize(
    ("override", "path", "needle"),
    [
        ("cluster.nodes=1e30", "cluster.nodes", ""),  # YAML 1.1 reads 1e30 as text: not a number
        ("cluster.nodes=1.0e30", "cluster.nodes", ""),  # the same (YAML 1.1 floats need a signed exponent)
        ("cluster.nodes=1.0e+30", "cluster.nodes", "exceeded maximum size"),
        ("cluster.nodes=1000000000000000000000000000000", "cluster.nodes", "less than or equal to 1024"),
        ("rollout.max_response_len=99999999999", "rollout.max_response_len", "less than or equal to 16777216"),
        ("algorithm.lr=.inf", "algorithm.lr", "finite number"),
        ("algorithm.kl_coef=.nan", "algorithm.kl_coef", "finite number"),
        ("algorithm.steps=-1", "algorithm.steps", "greater than or equal to 1"),
    ],
)
def test_huge_and_non_finite_numbers_are_refused(override: str, path: str, needle: str) -> None:
    found, seconds = timed(GOOD, [override])
    assert [(c, p) for c, p, _ in found] in ([("RLC104", path)], [("RLC102", path)]), found
    assert needle in found[0][2]
    assert seconds < BLOWUP_CPU_S
    hint = check_loaded(load_spec_text(GOOD, "spec.yaml", overrides=[override])).report.errors[0].hint
    assert hint.startswith("allowed: ") and "value" in hint


@pytest.mark.parametrize(
    "where",
    [
        'model: {name: qwen3-8b, path: "/models/a\\0b"}',
        'data: {train: "/data/a\\0b.jsonl"}',
        'output: {dir: "runs/\\0x"}',
        'data: {train: /data/x.jsonl, prompt_key: "p\\0"}',
    ],
)
def test_nul_bytes_are_refused_not_dropped(where: str) -> None:
    key = where.split(":", 1)[0]
    text = "\n".join(line for line in GOOD.splitlines() if not line.startswith(f"{key}:")) + f"\n{where}\n"
    found = diagnostics(text)
    nul = [(c, p) for c, p, m in found if "NUL byte" in m]
    assert len(nul) == 1 and nul[0][0] == "RLC104" and nul[0][1].startswith(key), found


def test_nul_byte_in_an_override_is_refused() -> None:
    found = diagnostics(GOOD, ["model.path=/models/a\x00b"])
    assert [c for c, _, _ in found] == ["RLC006"] and "NUL byte" in found[0][2]


# ----------------------------------------------------------------------------------------- every bound


def _constraints(info: Any, arg: Any) -> list[Any]:
    """annotated_types constraints of a field, wherever pydantic keeps them (on the field, or inside `X | None`)."""
    found = list(info.metadata)
    if typing.get_origin(arg) is typing.Annotated:
        for meta in arg.__metadata__:
            found.extend(getattr(meta, "metadata", [meta]))
    return found


def _numeric_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], type, list]]:
    """(path, int|float, constraints) of every numeric field, through nested sections, lists, dicts and Optional."""
    found: list[tuple[tuple[str, ...], type, list]] = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        origin = typing.get_origin(annotation)
        if origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
        else:
            args = [annotation]
        for arg in args:
            base = typing.get_args(arg)[0] if typing.get_origin(arg) is typing.Annotated else arg
            if base in (int, float):
                found.append(((*prefix, name), base, _constraints(info, arg)))
            elif isinstance(base, type) and issubclass(base, BaseModel):
                found.extend(_numeric_fields(base, (*prefix, name)))
            elif typing.get_origin(base) in (list, dict):
                inner = typing.get_args(base)[-1]
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    key = "0" if typing.get_origin(base) is list else "math"
                    found.extend(_numeric_fields(inner, (*prefix, name, key)))
    return found


def _high(constraints: list[Any]) -> tuple[float | None, bool]:
    """The upper bound and whether it is inclusive."""
    for meta in constraints:
        if isinstance(meta, Le):
            return meta.le, True
        if isinstance(meta, Lt):
            return meta.lt, False
    return None, False


NUMERIC = _numeric_fields(Spec)
MOE = {"num_experts": 8, "experts_per_token": 2, "expert_intermediate_size": 256}


def test_every_numeric_field_has_an_upper_bound() -> None:
    assert len(NUMERIC) > 40
    unbounded = [".".join(path) for path, _, constraints in NUMERIC if _high(constraints)[0] is None]
    assert not unbounded, f"bound these to what hardware can mean: {unbounded}"


def _base(path: tuple[str, ...]) -> dict:
    """A spec that has the section `path` lives in: the a3 golden (teachers, LoRA, MTP) or an inline arch."""
    full = next(b for b in BASES if b.get("distill") and b.get("lora") and b.get("rollout", {}).get("mtp"))
    data = copy.deepcopy(full)
    arch = {**ARCH, "moe": dict(MOE)} if "moe" in path else dict(ARCH)
    if path[:2] == ("model", "arch"):
        data["model"] = {"arch": arch, "path": "/models/x"}
    elif path[:1] == ("distill",) and "arch" in path:
        data["distill"]["teachers"][0]["model"] = {"arch": arch, "path": "/t"}
    return data


def _set_path(data: dict, path: tuple[str, ...], value: Any) -> None:
    node: Any = data
    for part in path[:-1]:
        key: Any = int(part) if isinstance(node, list) else part
        if isinstance(node, dict) and not isinstance(node.get(key), dict | list):
            node[key] = {}
        node = node[key]
    node[path[-1]] = value


@pytest.mark.parametrize(("path", "kind", "constraints"), NUMERIC, ids=[".".join(p) for p, _, _ in NUMERIC])
def test_each_bound_is_enforced_and_compiles_fast_at_the_bound(
    path: tuple[str, ...], kind: type, constraints: list
) -> None:
    high, inclusive = _high(constraints)
    assert high is not None
    at_bound = high if inclusive else (high - 1 if kind is int else high * 0.999)
    data = _base(path)
    _set_path(data, path, kind(at_bound))
    outcome = run_case(yaml.safe_dump(data, sort_keys=False), None, [], limit_s=10)
    assert outcome.kind in ("ok", "findings", "emit-refused"), (path, outcome)
    assert outcome.cpu_seconds < BLOWUP_CPU_S, (path, outcome.cpu_seconds)
    _set_path(data, path, kind(high + 1 if kind is int else high * 2 + 1))
    found = diagnostics(yaml.safe_dump(data, sort_keys=False))
    assert ("RLC104", ".".join(path)) in [(c, p) for c, p, _ in found], found


def test_every_bound_at_once_compiles_fast() -> None:
    data = _base(("model", "arch", "moe", "num_experts"))
    for path, kind, constraints in NUMERIC:
        if path[:2] == ("distill", "0") and "arch" in path:
            continue
        high, inclusive = _high(constraints)
        assert high is not None
        _set_path(data, path, kind(high if inclusive else (high - 1 if kind is int else high * 0.999)))
    outcome = run_case(yaml.safe_dump(data, sort_keys=False), None, [], limit_s=10)
    assert outcome.kind in ("ok", "findings"), outcome
    assert outcome.cpu_seconds < BLOWUP_CPU_S
