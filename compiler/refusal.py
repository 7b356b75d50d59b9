"""Why nothing fits, and what to change: the RLC301 diagnostics of a refused spec.

Each role that cannot fit gets its closest memory breakdown against the device, at the spec line that caused
it. The hints are checked, not guessed: the node count is the smallest at which the whole planner finds a
plan (the search is monotone in devices, so a bisection finds it), and every placement pin is tried removed,
so a refusal caused by a pin names that pin and what the planner would use instead.
"""

from __future__ import annotations

from dataclasses import replace

from rlc.compiler import search
from rlc.compiler.diagnostics import Diagnostic
from rlc.compiler.load import LineMap
from rlc.compiler.memory import MemoryBreakdown
from rlc.compiler.resolve import Problem

#: Largest cluster the node-count hint looks at, as a multiple of the spec's and absolutely.
MAX_NODE_FACTOR = 64
MAX_NODES = 1024
#: Trainer pins tried removed, in the order a hint names them.
TRAIN_PINS = ("cp", "cp_kind", "tp", "pp", "ep", "recompute", "offload", "micro_batch_tokens", "backend", "devices")
ROLLOUT_PINS = ("tp", "ep", "memory_fraction", "max_num_seqs", "devices")


def with_nodes(problem: Problem, nodes: int) -> Problem:
    spec = problem.spec
    cluster = spec.cluster.model_copy(update={"nodes": nodes})
    return replace(problem, spec=spec.model_copy(update={"cluster": cluster}))


def fits(problem: Problem) -> bool:
    return search.search(problem).best is not None


def nodes_that_fit(problem: Problem) -> int | None:
    """Smallest node count at which the planner finds a plan for this spec (pins kept), or None up to the cap.

    Feasibility only grows with nodes (a plan may leave devices idle), so doubling finds a feasible count and
    bisection the smallest.
    """
    low = problem.spec.cluster.nodes
    cap = min(MAX_NODES, low * MAX_NODE_FACTOR)
    high = low * 2
    while high <= cap and not fits(with_nodes(problem, high)):
        low, high = high, high * 2
    if high > cap:
        return None
    while high - low > 1:
        mid = (low + high) // 2
        if fits(with_nodes(problem, mid)):
            high = mid
        else:
            low = mid
    return high


def _unpinned(problem: Problem, role: str, name: str) -> Problem:
    spec = problem.spec
    pins = getattr(spec.placement, role)
    placement = spec.placement.model_copy(update={role: pins.model_copy(update={name: None})})
    update: dict = {"placement": placement}
    if role == "train" and name in ("recompute", "offload", "micro_batch_tokens", "backend"):
        # the same choice can also come from the `train:` section; unpinning means both
        defaults = {"recompute": "auto", "offload": type(spec.train.offload)(), "backend": "auto"}
        update["train"] = spec.train.model_copy(update={name: defaults.get(name)})
    return replace(problem, spec=spec.model_copy(update=update))


def pinned_causes(problem: Problem) -> list[tuple[str, str]]:
    """(path, hint) for each pin whose removal alone lets the planner find a plan, with what it would use."""
    spec = problem.spec
    out: list[tuple[str, str]] = []
    for role, names in (("train", TRAIN_PINS), ("rollout", ROLLOUT_PINS)):
        pins = getattr(spec.placement, role)
        train_section = spec.train if role == "train" else None
        for name in names:
            value = getattr(pins, name)
            if value is None and train_section is not None and name in ("recompute", "backend"):
                own = getattr(train_section, name)
                value = None if own == "auto" else own
            if value is None and train_section is not None and name == "offload":
                off = train_section.offload
                value = off if (off.params or off.optimizer) else None
            if value is None:
                continue
            best = search.search(_unpinned(problem, role, name)).best
            if best is None:
                continue
            chosen = _chosen(best, role, name)
            shown = value if not hasattr(value, "model_dump") else value.model_dump()
            out.append(
                (
                    f"placement.{role}.{name}",
                    f"the pinned {role} {name} {shown} rules it out; unpinned, the planner uses {chosen}",
                )
            )
    return out


def _chosen(best: search.Candidate, role: str, name: str) -> str:
    if role == "rollout":
        return f"{name} {getattr(best.rollout.layout, name)} ({best.summary})"
    layout = best.train.layout
    value = {
        "devices": layout.world_size,
        "offload": f"params={layout.offload_params} optimizer={layout.offload_optimizer}",
    }.get(name)
    return f"{name} {getattr(layout, name) if value is None else value} ({layout.summary()})"


def _fixes(problem: Problem, role: str, b: MemoryBreakdown) -> list[str]:
    """Other changes that shrink the role's memory, most effective first (suggestions, not checked)."""
    spec = problem.spec
    fixes: list[str] = []
    if role == "train":
        pin = spec.placement.train
        acts = b.items.get("activations", 0.0) + b.items.get("logits", 0.0)
        if spec.lora is None and problem.target.kind != "cpu":
            fixes.append("lora")
        if acts > 0.2 * b.total_gib and not pin.cp and spec.rollout.max_total_len >= 8192:
            fixes.append("train.cp=2")
        if not (spec.train.offload.params and spec.train.offload.optimizer) and not pin.offload:
            fixes.append("train.offload")
        if acts > 0.2 * b.total_gib and spec.train.recompute not in ("full", "auto"):
            fixes.append("train.recompute: full")
        if acts > 0.3 * b.total_gib:
            fixes.append("a shorter rollout.max_response_len")
        return fixes
    if role.startswith("teacher"):
        fixes.append(f"placement.teachers.{role.removeprefix('teacher-')}.tp")
    else:
        fixes.append(f"a larger placement.{role}.tp")
    if b.items.get("kv_cache", 1.0) <= 0.0 or "sequence" in b.verdict():
        fixes.append("a shorter rollout.max_response_len")
    if spec.mode != "disaggregated":
        fixes.append("mode: disaggregated")
    return fixes


def _where(problem: Problem, role: str, lines: LineMap, pinned: list[tuple[str, str]]) -> str:
    """The spec path to report at: a pin that causes it, else the role's pins, else what sizes the role."""
    for path, _ in pinned:
        if path.startswith(f"placement.{role.split('-')[0]}"):
            return path
    spec = problem.spec
    if role == "train" and spec.placement.train.model_fields_set:
        return "placement.train"
    if role == "rollout" and spec.placement.rollout.model_fields_set:
        return "placement.rollout"
    if role.startswith("teacher-"):
        return f"placement.teachers.{role.removeprefix('teacher-')}"
    candidates = ["cluster.nodes", "cluster", "model"] if role == "train" else ["rollout", "cluster.nodes", "model"]
    return next((p for p in candidates if tuple(p.split(".")) in lines.lines), candidates[-1])


def infeasible(problem: Problem, result: search.SearchResult, lines: LineMap, file: str) -> list[Diagnostic]:
    """RLC301 per role that cannot fit: the closest breakdown, the capacity, and checked fixes."""
    target = problem.target
    pinned = pinned_causes(problem)
    nodes = nodes_that_fit(problem)
    found: list[Diagnostic] = []
    for role, rs in sorted(result.failures.items()):
        b = rs.closest
        if b is None:
            message = f"{role} cannot be placed: {rs.reason or 'no layout satisfies the pins and topology'}"
            fixes = ["check placement pins"]
        else:
            if b.problems and b.total_gib <= b.capacity_gib:
                message = f"{role}: {b.problems[0]}"
            else:
                message = (
                    f"{role} needs {b.total_gib:.1f} GiB per device ({b.describe()}) but {target.id} devices "
                    f"have {b.capacity_gib:.1f} GiB usable"
                )
                if rs.closest_layout is not None and hasattr(rs.closest_layout, "summary"):
                    message += f" (closest layout: {rs.closest_layout.summary()})"
            fixes = _fixes(problem, "rollout" if role.startswith("rollout") else role, b)
        if rs.tried:
            message += f"; tried {rs.tried}"
        mine = [hint for path, hint in pinned if path.startswith(f"placement.{role.split('-')[0]}.")]
        head = mine + ([f"cluster.nodes >= {nodes} (checked: the planner fits it there)"] if nodes else [])
        path = _where(problem, role, lines, pinned)
        hint = "; ".join(head + (["or try " + ", ".join(fixes)] if fixes else []))
        found.append(Diagnostic("RLC301", message, path, "error", hint, lines.line_for(path), file))
    if not found:
        hint = f"cluster.nodes >= {nodes}" if nodes else "add nodes or relax placement pins"
        found.append(
            Diagnostic(
                "RLC301", "no layout fits this cluster", "cluster.nodes", "error", hint, lines.line_for("cluster"), file
            )
        )
    return found
