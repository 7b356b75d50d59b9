"""The search is sound: pruning never loses the exhaustive optimum, and more devices never give a slower plan.

`search(..., exhaustive=True)` turns off every shortcut: every degree tuple, recompute, offload and token budget
of every trainer pool, every rollout pool after it. The fast grid runs in the default suite; the large-cluster
cases of issue 13 (Qwen3-235B-A22B on 8-20 A3 nodes, DeepSeek-V3 on 16-128 nodes) are marked slow.
"""

from __future__ import annotations

import itertools

import pytest

from rlc.compiler import search
from rlc.compiler.validate import check_text


def problem(model: str, nodes: int, target: str, extra: str = ""):  # type: ignore[no-untyped-def]
    data = "" if "data:" in extra else "data: {train: arithmetic}\n"
    text = f"name: t\nmodel: {{name: {model}, path: /m}}\ncluster: {{nodes: {nodes}}}\n{data}{extra}"
    checked = check_text(text, "spec.yaml", target=target)
    assert checked.problem is not None, [d.message for d in checked.report.diagnostics]
    return checked.problem


def _same_best(p) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    pruned, full = search.search(p), search.search(p, exhaustive=True)
    assert (pruned.best is None) == (full.best is None)
    if pruned.best is None or full.best is None:
        return 0.0, 0.0
    assert pruned.best.summary == full.best.summary
    return pruned.best.step.step_s, full.best.step.step_s


#: Dense and MoE catalog models on both NPU targets, on one and two nodes (three and eight in the slow grid).
FAST_GRID = [
    (model, target, nodes)
    for model in ("qwen3-8b", "qwen3-32b", "qwen3-30b-a3b")
    for target in ("a2", "a3")
    for nodes in (1, 2)
]


@pytest.mark.parametrize(("model", "target", "nodes"), FAST_GRID)
def test_pruned_equals_exhaustive(model: str, target: str, nodes: int) -> None:
    _same_best(problem(model, nodes, target))


@pytest.mark.parametrize(("model", "nodes"), [("qwen3-32b", 2), ("qwen3-30b-a3b", 2)])
def test_pruned_equals_exhaustive_with_minibatches(model: str, nodes: int) -> None:
    """Several optimizer steps per batch: the trainer's lower bound prices each step's pipeline fill and drain."""
    _same_best(problem(model, nodes, "a3", "algorithm: {batch_prompts: 32, group_size: 8, minibatches: 8}\n"))


@pytest.mark.parametrize("nodes", [1, 2, 3])
def test_pruned_equals_exhaustive_with_teachers(nodes: int) -> None:
    extra = (
        "mode: disaggregated\ndata: {train: arithmetic, domain_key: d}\ndistill:\n  teachers:\n"
        "    - {name: math, model: {name: qwen3-32b, path: /t1}, domain: math}\n"
        "    - {name: code, model: {name: qwen3-14b, path: /t2}, domain: code}\n"
    )
    _same_best(problem("qwen3-8b", nodes, "a3", extra))


SLOW_GRID = [
    (model, target, nodes)
    for model in ("qwen3-8b", "qwen3-32b", "qwen3-30b-a3b", "qwen2.5-72b")
    for target in ("a2", "a3")
    for nodes in (3, 8, 32)
    # Left out here and for DeepSeek-V3 on 128 A3 nodes: their exhaustive searches take 3.5 minutes together on
    # two cores; the other 235B and DeepSeek-V3 cases cover MoE layouts on large clusters.
    if not (model == "qwen3-30b-a3b" and nodes == 32)
]
SLOW_GRID += [("qwen3-235b-a22b", "a3", n) for n in range(8, 21)] + [
    ("deepseek-v3", target, n) for target in ("a3", "a2") for n in (16, 32, 64, 128) if (target, n) != ("a3", 128)
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "target", "nodes"), SLOW_GRID)
def test_large_clusters_match_exhaustive(model: str, target: str, nodes: int) -> None:
    """Up to 128 nodes, and issue 13's cases: the pruned plan is the exhaustive one (the issue asks for 5%)."""
    pruned, full = _same_best(problem(model, nodes, target))
    assert pruned <= full * 1.05


def _steps(model: str, target: str, nodes: range, extra: str = "") -> list[float]:
    out = []
    for n in nodes:
        best = search.search(problem(model, n, target, extra)).best
        out.append(best.step.step_s if best else float("inf"))
    return out


MONOTONE = [
    ("qwen3-8b", "a2", range(1, 9), ""),
    ("qwen3-30b-a3b", "a3", range(1, 7), ""),
    ("qwen3-32b", "a2", range(1, 7), "mode: colocated\n"),
    ("qwen3-8b", "a3", range(1, 5), "mode: disaggregated\n"),
    pytest.param("qwen3-235b-a22b", "a3", range(8, 21), "", marks=pytest.mark.slow),
    pytest.param("deepseek-v3", "a3", range(16, 129, 8), "", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("model", "target", "nodes", "extra"), MONOTONE)
def test_more_devices_never_slower(model: str, target: str, nodes: range, extra: str) -> None:
    """A plan may leave devices idle, so every layout possible on N nodes is possible on N + 1."""
    steps = _steps(model, target, nodes, extra)
    for n, (fewer, more) in zip(nodes, itertools.pairwise(steps), strict=False):
        assert more <= fewer * (1 + 1e-9), (n, fewer, more)


def test_issue_13_large_moe_cases() -> None:
    """Qwen3-235B on 14 and 16 A3 nodes planned 3x slower than on 12 (odd coarse splits never refined)."""
    s12, s14, s16 = _steps("qwen3-235b-a22b", "a3", range(12, 17, 2))
    assert s14 <= s12 and s16 <= s14
    best = search.search(problem("qwen3-235b-a22b", 14, "a3")).best
    assert best is not None and best.mode == "disaggregated"
