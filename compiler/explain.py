"""`rlc explain`: show a plan's layout, memory, step-time split and runners-up as tables.

A plan must explain itself: which devices each role got and with what degrees, how full each device is and
with what, where a step's time goes, and why the runners-up lost. Rendering only; the plan holds the facts.
"""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rlc.schemas.plan import Plan

BAR_WIDTH = 30


def _ids(role) -> str:  # type: ignore[no-untyped-def]
    parts = []
    for nd in role.placement:
        ids = nd.local_ids
        span = (
            f"{ids[0]}-{ids[-1]}"
            if ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 1
            else ",".join(map(str, ids))
        )
        parts.append(f"n{nd.node}:{span}")
    return " ".join(parts)


def _bar(items: dict[str, float], capacity: float) -> str:
    """A text bar: one letter per item, proportional to GiB, against the capacity."""
    out = ""
    for name, gib in items.items():
        cells = round(gib / capacity * BAR_WIDTH) if capacity else 0
        out += name[0].upper() * cells
    return (out + "." * BAR_WIDTH)[: max(BAR_WIDTH, len(out))]


def layout_table(plan: Plan) -> Table:
    table = Table(title=f"{plan.name}: {plan.schedule.mode} on {plan.cluster.total_devices} {plan.target} devices")
    for col in ("role", "devices", "ids", "tp", "pp", "cp", "ep", "dp", "backend"):
        table.add_column(col)
    for r in plan.roles:
        p = r.parallel
        table.add_row(r.name, str(r.devices), _ids(r), *(str(v) for v in (p.tp, p.pp, p.cp, p.ep, p.dp)), r.backend)
    return table


def memory_table(plan: Plan) -> Table:
    table = Table(title="memory per device (GiB)")
    for col in ("role", "phase", "items", "total", "capacity", "bar"):
        table.add_column(col)
    for r in plan.roles:
        m = r.memory
        items = ", ".join(f"{k} {v:.1f}" for k, v in m.items.items() if v >= 0.05)
        table.add_row(
            r.name, m.phase, items, f"{m.total_gib:.1f}", f"{m.capacity_gib:.1f}", _bar(m.items, m.capacity_gib)
        )
    return table


def time_table(plan: Plan) -> Table:
    e = plan.estimates
    table = Table(title=f"step time {e.step_time_s:.1f} s, {e.tokens_per_s:,.0f} trained tokens/s")
    for col in ("phase", "seconds"):
        table.add_column(col)
    for name, value in (
        ("rollout", e.rollout_s),
        ("train", e.train_s),
        ("weight sync", e.weight_sync_s),
        ("switch", e.switch_s),
    ):
        table.add_row(name, f"{value:.2f}")
    return table


def runners_table(plan: Plan) -> Table:
    table = Table(title="runners-up")
    for col in ("layout", "tok/s", "why it lost"):
        table.add_column(col)
    for c in plan.runners_up:
        # escaped: a summary like "train 16 (...)" or an older "[fsdp2 d16 ...]" is text, not Rich markup
        table.add_row(escape(c.summary), f"{c.tokens_per_s:,.0f}", escape(c.verdict))
    return table


def explain_plan(plan: Plan, console: Console) -> None:
    """Print the layout, memory, step-time and runners-up tables."""
    console.print(layout_table(plan))
    for r in plan.roles:
        if r.layout is not None:
            console.print(f"{r.name} trainer layout: {escape(r.layout.summary())}")
    for table in (memory_table(plan), time_table(plan), runners_table(plan)):
        console.print(table)
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}")
    for gap in plan.runtime_gaps:
        console.print(f"[red]rlc run refuses this plan:[/red] {escape(gap)}")


def explain_json(plan: Plan) -> str:
    """The same facts as a stable JSON document (sorted keys)."""
    payload: dict[str, Any] = {
        "name": plan.name,
        "mode": plan.schedule.mode,
        "roles": [
            {
                "name": r.name,
                "devices": r.devices,
                "placement": [nd.model_dump() for nd in r.placement],
                "parallel": r.parallel.model_dump(),
                "backend": r.backend,
                "memory": r.memory.model_dump(),
                "notes": r.notes,
                **({"layout": r.layout.model_dump(), "layout_summary": r.layout.summary()} if r.layout else {}),
            }
            for r in plan.roles
        ],
        "runtime_gaps": plan.runtime_gaps,
        "estimates": plan.estimates.model_dump(),
        "runners_up": [c.model_dump() for c in plan.runners_up],
        "warnings": plan.warnings,
    }
    return json.dumps(payload, indent=2, sort_keys=True)
