"""`rlc diff` data: settings and the consequences they cause, keyed by dotted path."""

from __future__ import annotations

from pathlib import Path

import pytest
from plan_fixtures import A2_SPEC, a2_plan, a3_plan, spec_from

from rlc.compiler.diff import diff_plans, flatten, plan_from_path, render_diff, same_plan
from rlc.compiler.emit import emit_plan_dir


def test_identical_plans_have_no_changes() -> None:
    assert diff_plans(a2_plan(), a2_plan()) == []
    assert render_diff([]) == "plans are identical\n"


def test_node_count_change_reports_devices_and_memory_it_causes() -> None:
    changes = {c.path: c for c in diff_plans(a2_plan(1), a2_plan(2))}
    nodes = changes["cluster.nodes"]
    assert (nodes.old, nodes.new, nodes.op, nodes.derived) == (1, 2, "change", False)
    for path, old, new in [
        ("cluster.total_devices", 8, 16),
        ("roles.actor.devices", 4, 8),
        ("roles.actor.parallel.dp", 4, 8),
        ("roles.rollout.devices", 4, 8),
    ]:
        assert (changes[path].old, changes[path].new, changes[path].derived) == (old, new, True)
    memory = changes["roles.actor.memory.total_gib"]
    assert memory.derived and memory.new < memory.old
    assert changes["roles.actor.memory.items.optimizer"].derived
    # the rollout pool moved to the second node: one placement removed, one added, keyed by node
    assert changes["roles.rollout.placement.node0"].op == "remove"
    assert changes["roles.rollout.placement.node1"].op == "add"
    ordered = list(changes)
    assert ordered.index("cluster.nodes") < ordered.index("cluster.total_devices"), "settings come first"


def test_render_shows_settings_then_consequences() -> None:
    text = render_diff(diff_plans(a2_plan(1), a2_plan(2)))
    settings, consequences = text.split("consequences (derived by the compiler):")
    assert "~ cluster.nodes: 1 → 2  (+1)" in settings
    assert "~ roles.actor.devices: 4 → 8  (+4)" in consequences
    assert "+ roles.rollout.placement.node1:" in consequences
    assert text.rstrip().endswith("removed)")


def test_added_role_and_sections_are_single_entries() -> None:
    changes = {c.path: c for c in diff_plans(a2_plan(), a3_plan())}
    assert changes["lora"].old is None and changes["lora"].new["rank"] == 16
    assert not changes["lora"].derived
    added = changes["roles.teacher-math"]
    assert added.op == "add" and added.derived and added.new["devices"] == 8
    assert not any(p.startswith("roles.teacher-math.") for p in changes)


def test_flatten_keys_lists_by_name() -> None:
    flat = flatten(a3_plan().model_dump(mode="json"))
    assert flat["roles.teacher-code.parallel.tp"] == 2
    assert flat["roles.actor.placement.node0.local_ids"] == list(range(16))
    assert flat["distill.teachers.math.model.path"] == "/models/Qwen3-32B-math"


def test_plan_dirs_and_specs(tmp_path: Path) -> None:
    spec = spec_from(A2_SPEC)
    emit_plan_dir(a2_plan(1), spec, tmp_path / "one", provenance={})
    emit_plan_dir(a2_plan(2), spec, tmp_path / "two", provenance={})
    (a, found_a), (b, found_b) = plan_from_path(tmp_path / "one"), plan_from_path(tmp_path / "two")
    assert found_a == found_b == [] and a is not None and b is not None
    assert any(c.path == "cluster.nodes" for c in diff_plans(a, b))
    (tmp_path / "one" / "manifest.json").unlink()
    missing, found = plan_from_path(tmp_path / "one")
    assert missing is None and found[0].code == "RLC701"
    pytest.importorskip("rlc.compiler.planner")
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(A2_SPEC)
    one, _ = plan_from_path(spec_file, overrides=["cluster.nodes=1"])
    two, _ = plan_from_path(spec_file)
    assert one is not None and two is not None
    changes = {c.path: c for c in diff_plans(one, two)}
    assert (changes["cluster.nodes"].old, changes["cluster.nodes"].new) == (1, 2)
    assert changes["cluster.total_devices"].derived
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    plan, found = plan_from_path(bad)
    assert plan is None and any(d.severity == "error" for d in found)


def test_a_spec_and_its_resolved_spec_give_the_same_plan(tmp_path: Path) -> None:
    """`spec.resolved.yaml` states what the spec left to the compiler: only the spec hash differs, and diff says
    it is the same plan (exit 0), not a difference."""
    import subprocess
    import sys

    pytest.importorskip("rlc.compiler.planner")
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(A2_SPEC)
    plan_dir = tmp_path / "plan"
    cli = [sys.executable, "-m", "rlc"]
    subprocess.run([*cli, "compile", str(spec_file), "-o", str(plan_dir)], check=True, capture_output=True)
    resolved = plan_dir / "spec.resolved.yaml"
    one, _ = plan_from_path(spec_file)
    two, _ = plan_from_path(resolved)
    assert one is not None and two is not None
    changes = diff_plans(one, two)
    assert {c.path for c in changes} <= {"spec_hash", "runners_up"} and any(c.path == "spec_hash" for c in changes)
    assert same_plan(changes) and render_diff(changes).startswith("same plan: what runs is identical")
    result = subprocess.run([*cli, "diff", str(spec_file), str(resolved)], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("same plan"), result.stdout + result.stderr
    edited = tmp_path / "edited.yaml"
    edited.write_text(resolved.read_text().replace("batch_prompts: 64", "batch_prompts: 32"))
    result = subprocess.run([*cli, "diff", str(spec_file), str(edited)], capture_output=True, text=True)
    assert result.returncode == 1 and "schedule.batch_prompts: 64 → 32" in result.stdout, result.stdout
    assert "same plan" not in result.stdout
