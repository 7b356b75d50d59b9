"""Shared check for end-to-end runs: the trainer built exactly the plan's layout (RUN/layout.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def assert_layout_as_planned(run_dir: Path, plan: Any) -> dict:
    """layout.json's plan layout is the plan's, and every rank's built layout matches it; returns the record."""
    from rlc.runtime.launch import check_built_layout

    record = json.loads((run_dir / "layout.json").read_text())
    role = plan.roles_of("train")[0]
    assert record["plan_layout"] == role.layout.model_dump()
    assert len(record["ranks"]) == role.layout.world_size
    assert check_built_layout(plan, record["ranks"]) == []
    for rank in record["ranks"]:
        assert set(rank["memory"]["peak_gib"]) >= {"load", "train"}
    return record
