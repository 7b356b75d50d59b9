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

from rlc.compiler.routing import plan_routing, routing_lines
from rlc.compiler.sync_lines import sync_rows
from rlc.schemas.plan import Plan

#: The row of the time table that compares dynamic sampling's over-sampling with the plan's.
GENERATED_PER_KEPT = "generated per kept (x)"
DRAFT_ACCEPTANCE = "draft acceptance"

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


def memory_table(plan: Plan, measured: dict[str, dict[str, float]] | None = None) -> Table:
    """Per role: the estimate item by item; with a run's layout.json, the measured peak of the same phase."""
    table = Table(title="memory per device (GiB)")
    cols = ("role", "phase", "items", "total", *(("measured",) if measured else ()), "capacity", "bar")
    for col in cols:
        table.add_column(col)
    for r in plan.roles:
        m = r.memory
        items = ", ".join(f"{k} {v:.2g}" for k, v in m.items.items() if v >= 0.005)
        row = [r.name, m.phase, items, f"{m.total_gib:.3g}"]
        if measured:
            got = measured.get(r.name, {}).get(m.phase)
            row.append(f"{got:.3g} ({got / m.total_gib:.2f}x)" if got is not None and m.total_gib else "-")
        table.add_row(*row, f"{m.capacity_gib:.3g}", _bar(m.items, m.capacity_gib))
    return table


def phases(plan: Plan) -> list[tuple[str, float]]:
    e = plan.estimates
    return [
        ("rollout", e.rollout_s),
        ("train", e.train_s),
        ("weight sync", e.weight_sync_s),
        ("switch", e.switch_s),
        ("fixed per step", e.overhead_s),
    ]


def time_table(plan: Plan, measured: dict[str, float] | None = None) -> Table:
    e = plan.estimates
    low, high = e.band
    title = (
        f"step time {e.step_time_s:.3g} s (likely {low:.3g}-{high:.3g} s, {e.band_text}), "
        f"{e.tokens_per_s:,.0f} trained tokens/s"
    )
    table = Table(title=title)
    for col in ("phase", "seconds", *(("measured",) if measured else ())):
        table.add_column(col)
    rows = [*phases(plan), ("step", e.step_time_s)]
    ds = plan.algorithm.dynamic_sampling
    if ds is not None:  # not seconds: the groups generated per trained one, which the rollout time includes
        rows.append((GENERATED_PER_KEPT, ds.expected_generated_per_kept))
    if plan.sampling.draft_acceptance is not None:  # a share: the rollout time assumed it per draft token
        rows.append((DRAFT_ACCEPTANCE, plan.sampling.draft_acceptance))
    for name, value in rows:
        row = [name, f"{value:.3g}"]
        if measured:
            got = measured.get(name)
            row.append(f"{got:.3g}" if got is not None else "-")
        table.add_row(*row)
    return table


def profile_lines(plan: Plan) -> list[str]:
    """Which target profile the estimates used, and for a calibrated one what it was fitted on."""
    p = plan.profile
    if not p:
        return []
    head = f"target profile {plan.target}: {p.get('source', '?')} (sha256 {p.get('sha256', '?')[:12]})"
    return [head] + [f"  {k.removeprefix('calibration.')}: {v}" for k, v in sorted(p.items()) if k.startswith("calib")]


def reproducibility_lines(plan: Plan) -> list[str]:
    """Whether runs of the plan repeat exactly, and why not."""
    r = plan.reproducibility
    kernels = "on" if r.deterministic_kernels else "off"
    head = f"reproducible: {'yes' if r.deterministic else 'no'} (deterministic kernels {kernels}"
    head += f", cost: {r.cost})" if r.deterministic_kernels and r.cost else ")"
    return [head] + [f"  not repeatable: {reason}" for reason in r.reasons]


def runners_table(plan: Plan) -> Table:
    table = Table(title="runners-up")
    for col in ("layout", "tok/s", "lost on", "why it lost"):
        table.add_column(col)
    for c in plan.runners_up:
        # escaped: a summary like "train 16 (...)" or an older "[fsdp2 d16 ...]" is text, not Rich markup
        table.add_row(escape(c.summary), f"{c.tokens_per_s:,.0f}", c.lost_on, escape(c.verdict))
    return table


def sync_table(plan: Plan) -> Table | None:
    """Which weight-sync method the plan runs, its estimate and bytes per engine worker, and the others priced
    (None for a plan compiled before the planner priced them)."""
    rows = sync_rows(plan)
    if not rows:
        return None
    table = Table(title=f"weight sync: {plan.schedule.weight_sync}")
    for col in ("method", "seconds", "per engine worker", "verdict"):
        table.add_column(col)
    for row in rows:
        table.add_row(*(escape(x) for x in row))
    return table


def explain_plan(
    plan: Plan,
    console: Console,
    measured: dict[str, float] | None = None,
    measured_memory: dict[str, dict[str, float]] | None = None,
) -> None:
    """Print the layout, memory, step-time and runners-up tables (with what a run measured when given)."""
    console.print(layout_table(plan))
    for r in plan.roles:
        if r.layout is not None:
            console.print(f"{r.name} trainer layout: {escape(r.layout.summary())}")
    console.print(memory_table(plan, measured_memory))
    for r in plan.roles:
        for note in r.notes:
            console.print(f"{r.name}: {escape(note)}")
    routing = plan_routing(plan)
    for line in routing_lines(routing, why=False) if routing else []:  # the actor's note above says why
        console.print(escape(line))
    console.print(time_table(plan, measured))
    sync = sync_table(plan)
    if sync is not None:
        console.print(sync)
    if plan.schedule.weight_sync_note:
        console.print(f"weight sync: {escape(plan.schedule.weight_sync_note)}")
    console.print(runners_table(plan))
    for line in profile_lines(plan):
        console.print(escape(line))
    for line in reproducibility_lines(plan):
        console.print(escape(line))
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}")
    for gap in plan.runtime_gaps:
        console.print(f"[red]rlc run refuses this plan:[/red] {escape(gap)}")


def explain_json(
    plan: Plan, measured: dict[str, float] | None = None, measured_memory: dict[str, dict[str, float]] | None = None
) -> str:
    """The same facts as the text, as a stable JSON document (sorted keys)."""
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
        "routing": plan_routing(plan),
        "estimates": plan.estimates.model_dump(),
        "weight_sync": {
            "method": plan.schedule.weight_sync,
            "senders": plan.schedule.weight_sync_senders,
            "slicing": plan.schedule.weight_sync_slicing,
            "note": plan.schedule.weight_sync_note,
            "options": [o.model_dump() for o in plan.schedule.weight_sync_options],
        },
        "step_time_band_s": list(plan.estimates.band),
        "profile": plan.profile,
        "reproducibility": plan.reproducibility.model_dump(),
        **({"measured": measured} if measured else {}),
        **({"measured_memory_gib": measured_memory} if measured_memory else {}),
        "headroom_gib": {r.name: round(r.memory.capacity_gib - r.memory.total_gib, 3) for r in plan.roles},
        "runners_up": [c.model_dump() for c in plan.runners_up],
        "warnings": plan.warnings,
    }
    return json.dumps(payload, indent=2, sort_keys=True)
