"""The plan's weight-sync options as rows: what SUMMARY.md and `rlc explain` show of `schedule.weight_sync_options`."""

from __future__ import annotations

from rlc.schemas.plan import Plan

__all__ = ["SYNC_ROWS", "sync_bytes", "sync_label", "sync_rows"]

#: Weight-sync options SUMMARY.md and `rlc explain` list (the plan keeps all of them).
SYNC_ROWS = 6


def sync_label(method: str, senders: int, slicing: str) -> str:
    """`broadcast (4 senders, tp slices)`, `inplace`."""
    if method != "broadcast":
        return method
    return f"broadcast ({senders} sender{'s' if senders > 1 else ''}{', tp slices' if slicing == 'tp' else ''})"


def sync_bytes(n: float) -> str:
    """Bytes in the unit that reads best: `1.2 MB`, `41.9 GB`."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def sync_rows(plan: Plan) -> list[tuple[str, str, str, str]]:
    """The plan's priced weight-sync options, chosen first, then the fastest others (SYNC_ROWS in all)."""
    options = plan.schedule.weight_sync_options
    chosen = [o for o in options if o.verdict == "chosen"]
    rest = [o for o in options if o.verdict != "chosen"]
    return [
        (sync_label(o.method, o.senders, o.slicing), f"{o.seconds:.3g}", sync_bytes(o.bytes_per_worker), o.verdict)
        for o in (chosen + rest)[:SYNC_ROWS]
    ]
