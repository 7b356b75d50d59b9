"""Layout search: split devices between roles and pick each role's parallel degrees and budgets.

Roles are independent given their pools, so each role's best layouts per pool are found once (memoised in
the context: `trainer_search`, `engine_search`), the device allocation (`allocation`) prices pools best-first
against lower bounds, and the candidates (`candidates`) are ranked. The search is exact with respect to
`exhaustive=True`, which turns every shortcut off for tests, and monotone in devices: a plan may leave devices
idle, so a larger cluster never gets a slower plan.
"""

from __future__ import annotations

from rlc.compiler.allocation import allocate, pool_sizes
from rlc.compiler.candidates import Candidate, SearchResult, runner_up_verdict
from rlc.compiler.engine_search import (
    MAX_AUTO_FRACTION,
    groups_in_nodes,
    rollout_search,
    teacher_search,
    width_notes,
)
from rlc.compiler.options import RoleSearch, RolloutOption, TeacherOption, TrainOption
from rlc.compiler.resolve import Problem
from rlc.compiler.search_context import Context, lora_rollout_mode, make_context, train_precision, weight_update
from rlc.compiler.trainer_search import train_search


def search(problem: Problem, exhaustive: bool = False) -> SearchResult:
    """Find the fastest layout that fits (and the ranked rest) for the problem's mode."""
    return search_context(make_context(problem, exhaustive))


def search_context(ctx: Context) -> SearchResult:
    """Search colocated and/or disaggregated layouts; on failure keep the most telling misses."""
    result = SearchResult(None, [], {})
    cands, failures = allocate(ctx, result)
    result.failures = {} if cands else failures
    unique: dict[str, Candidate] = {}
    for c in sorted(cands, key=Candidate.key):
        unique.setdefault(c.summary, c)
    result.ranked = list(unique.values())
    result.best = result.ranked[0] if result.ranked else None
    return result


__all__ = [
    "MAX_AUTO_FRACTION",
    "Candidate",
    "Context",
    "RoleSearch",
    "RolloutOption",
    "SearchResult",
    "TeacherOption",
    "TrainOption",
    "groups_in_nodes",
    "lora_rollout_mode",
    "make_context",
    "pool_sizes",
    "rollout_search",
    "runner_up_verdict",
    "search",
    "search_context",
    "teacher_search",
    "train_precision",
    "train_search",
    "weight_update",
    "width_notes",
]
