"""`rlc diff`: a semantic diff of two plans, keyed by dotted path, with consequences flagged as derived.

Both sides are flattened to `path → value`. Lists whose items have a natural key are keyed by it
(`roles.rollout.parallel.tp`, `distill.teachers.math.weight`, `roles.actor.placement.node1`) so that adding a
role or a node does not show up as every later item changing. A change is `derived` when it is a consequence
the compiler computed (devices, placement, degrees, memory, estimates, engine arguments) rather than a setting
that came from the spec, so a reader sees "nodes 1 → 2" first and "actor devices 8 → 16" as what followed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Literal

from rlc.compiler.diagnostics import Diagnostic
from rlc.schemas.plan import Plan

Op = Literal["add", "remove", "change"]
MARK: dict[str, str] = {"add": "+", "remove": "-", "change": "~"}

#: Paths the compiler derives; everything else is a setting (patterns over flattened dotted paths).
DERIVED_PATTERNS: tuple[str, ...] = (
    "cluster.total_devices",
    "cluster.devices_per_node",
    "roles.*",
    "estimates.*",
    "runners_up*",
    "warnings*",
    "spec_hash",
    "env*",
    "schedule.micro_batch_tokens",
    "schedule.batch_samples",
    "schedule.offload*",
    "schedule.weight_sync*",
    "distill.teachers.*.role",
)

#: Key fields by which list items are matched, per list path (after keying of their parents).
_LIST_KEYS: dict[str, tuple[str, str]] = {
    "roles": ("name", ""),
    "roles.*.placement": ("node", "node"),
    "distill.teachers": ("name", ""),
}


@dataclass(frozen=True)
class Change:
    """One difference: `old` is None when added, `new` is None when removed."""

    path: str
    old: Any
    new: Any
    op: Op
    derived: bool

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "op": self.op, "old": self.old, "new": self.new, "derived": self.derived}


def _list_key(path: str) -> tuple[str, str] | None:
    for pattern, key in _LIST_KEYS.items():
        if fnmatchcase(path, pattern) and path.count(".") == pattern.count("."):
            return key
    return None


def flatten(value: Any, path: str = "", out: dict[str, Any] | None = None) -> dict[str, Any]:
    """Dotted path → leaf value. Mappings descend; keyed lists descend by key; other lists are leaves."""
    out = {} if out is None else out
    if isinstance(value, dict):
        if not value:
            out[path] = {}
        for key, item in value.items():
            flatten(item, f"{path}.{key}" if path else str(key), out)
        return out
    key = _list_key(path) if isinstance(value, list) else None
    if key is not None and all(isinstance(item, dict) and key[0] in item for item in value):
        field, prefix = key
        for item in value:
            rest = {k: v for k, v in item.items() if k != field}
            flatten(rest, f"{path}.{prefix}{item[field]}", out)
        if not value:
            out[path] = []
        return out
    out[path] = value
    return out


def is_derived(path: str) -> bool:
    return any(fnmatchcase(path, pattern) for pattern in DERIVED_PATTERNS)


def _collapse(only: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Group leaves of a subtree that exists on one side only (a whole new role) under that subtree's root."""
    roots: dict[str, Any] = {}
    for path in sorted(only):
        parts = path.split(".")
        root = path
        for depth in range(1, len(parts)):
            prefix = ".".join(parts[:depth])
            if not any(p == prefix or p.startswith(prefix + ".") for p in other):
                root = prefix
                break
        roots.setdefault(root, {})[path[len(root) + 1 :] if root != path else ""] = only[path]
    return {root: (leaves[""] if list(leaves) == [""] else _unflatten(leaves)) for root, leaves in roots.items()}


def _unflatten(leaves: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in leaves.items():
        node = tree
        *parents, last = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def _subtree(leaves: dict[str, Any], root: str) -> dict[str, Any]:
    return _unflatten({p[len(root) + 1 :]: v for p, v in leaves.items() if p.startswith(root + ".")})


def _reshaped(left: dict[str, Any], right: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """A leaf on one side that is a section on the other (`lora: null` → a LoRA block): one change, not many.

    Consumes the affected paths from `left` and `right`.
    """
    found: list[tuple[str, Any, Any]] = []
    for one, other, forward in ((left, right, True), (right, left, False)):
        for path in sorted(p for p in one if p not in other and any(q.startswith(p + ".") for q in other)):
            tree = _subtree(other, path)
            found.append((path, one[path], tree) if forward else (path, tree, one[path]))
            del one[path]
            for q in [q for q in other if q.startswith(path + ".")]:
                del other[q]
    return found


def diff_plans(a: Plan, b: Plan) -> list[Change]:
    """Every difference from plan `a` to plan `b`: settings first, then derived consequences, each by path."""
    left = flatten(a.model_dump(mode="json"))
    right = flatten(b.model_dump(mode="json"))
    changes: list[Change] = []
    for path, old, new in _reshaped(left, right):
        changes.append(Change(path, old, new, "change", is_derived(path)))
    for path in sorted(left.keys() & right.keys()):
        if left[path] != right[path]:
            changes.append(Change(path, left[path], right[path], "change", is_derived(path)))
    removed = _collapse({p: left[p] for p in left.keys() - right.keys()}, right)
    added = _collapse({p: right[p] for p in right.keys() - left.keys()}, left)
    changes += [Change(p, v, None, "remove", is_derived(p)) for p, v in removed.items()]
    changes += [Change(p, None, v, "add", is_derived(p)) for p, v in added.items()]
    return sorted(changes, key=lambda c: (c.derived, c.path))


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(", ", ": "))


def _delta(old: Any, new: Any) -> str:
    numbers = (int, float)
    if isinstance(old, numbers) and isinstance(new, numbers) and not isinstance(old, bool | str):
        if isinstance(new, bool):
            return ""
        diff = new - old
        return f"  ({'+' if diff > 0 else ''}{diff:.4g})"
    return ""


def change_text(c: Change) -> str:
    """One change as `~ path: old → new`, `+ path: new` or `- path: old`."""
    if c.op == "change":
        return f"~ {c.path}: {_show(c.old)} → {_show(c.new)}{_delta(c.old, c.new)}"
    if c.op == "add":
        return f"+ {c.path}: {_show(c.new)}"
    return f"- {c.path}: {_show(c.old)}"


#: Derived paths that record how the compiler got to a plan, not what runs.
_NOT_RUN = ("spec_hash", "runners_up")


def same_plan(changes: list[Change]) -> bool:
    """Whether what runs is identical: every difference is the spec hash or the alternatives the search weighed.
    That is the case when the specs differ only where one leaves a value to the compiler (`auto`, an unset
    default) and the other states what the compiler chose, as a plan's `spec.resolved.yaml` does next to its
    spec (with less left open, the search weighs other runners-up)."""
    return all(c.path.split(".")[0] in _NOT_RUN for c in changes)


def render_diff(changes: list[Change]) -> str:
    """Terraform-style text: `~ path: old → new`, settings first, then the consequences they caused."""
    if not changes:
        return "plans are identical\n"
    lines: list[str] = []
    if same_plan(changes):
        lines.append(
            "same plan: what runs is identical; the specs differ only where one leaves a value to the compiler "
            "and the other states what it chose"
        )
    settings = [c for c in changes if not c.derived]
    derived = [c for c in changes if c.derived]
    for title, group in (("settings", settings), ("consequences (derived by the compiler)", derived)):
        if not group:
            continue
        lines.append(f"{title}:")
        lines.extend(f"  {change_text(c)}" for c in group)
    counts = {op: sum(c.op == op for c in changes) for op in ("change", "add", "remove")}
    lines.append(
        f"{len(settings)} setting(s) and {len(derived)} derived value(s) differ "
        f"({counts['change']} changed, {counts['add']} added, {counts['remove']} removed)"
    )
    return "\n".join(lines) + "\n"


def plan_from_path(
    path: Path, *, target: str | None = None, overrides: list[str] | None = None
) -> tuple[Plan | None, list[Diagnostic]]:
    """A plan from a plan directory (verified, then loaded) or from a spec file (compiled in memory)."""
    path = Path(path)
    if path.is_dir():
        from rlc.compiler.manifest import load_plan, plan_problem, verify_plan_dir

        found = verify_plan_dir(path, allow_modified=True)
        if any(d.severity == "error" for d in found):
            return None, found
        try:
            return load_plan(path), found
        except (OSError, ValueError) as exc:  # a hand-edited plan.json (modified files are only warned about)
            reason = plan_problem(exc)
            where = str(path / "plan.json")
            unreadable = Diagnostic(
                "RLC707", f"plan.json cannot be read: {reason}", where, hint="recompile the plan", file=where
            )
            return None, [*found, unreadable]
    from rlc.compiler.pipeline import compile_file  # the planner is only needed when a side is a spec

    compiled = compile_file(path, target=target, overrides=overrides)
    return compiled.plan, compiled.report.sorted()
