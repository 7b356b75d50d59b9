"""A plan.json edited and rehashed in manifest.json is still refused: the manifest keeps the compiled plan's own
hash (`plan_hash`) and a copy of it (`compiled_plan`) to compare with."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from plan_fixtures import CPU_SPEC, cpu_plan, spec_from
from typer.testing import CliRunner

from rlc.cli import app
from rlc.compiler.emit import emit_plan_dir
from rlc.compiler.manifest import verify_plan_dir

runner = CliRunner()


@pytest.fixture
def plan_dir(tmp_path: Path) -> Path:
    plan = cpu_plan(model_path=str(tmp_path / "no-model"), run_dir=str(tmp_path / "run"), build_tiny=False)
    out = tmp_path / "plan"
    emit_plan_dir(plan, spec_from(CPU_SPEC), out, provenance={})
    return out


def _edit_and_rehash(plan_dir: Path, *, plan_hash_too: bool = False, env: dict[str, str] | None = None) -> None:
    """What a hand edit that wants to go unnoticed does: change plan.json, then its sha256 in the manifest."""
    data = json.loads((plan_dir / "plan.json").read_text())
    data["schedule"]["steps"] += 1
    if env is not None:
        data["env"] = {**data.get("env", {}), **env}
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    (plan_dir / "plan.json").write_text(text)
    digest = hashlib.sha256(text.encode()).hexdigest()
    manifest = json.loads((plan_dir / "manifest.json").read_text())
    manifest["files"]["plan.json"] = digest
    if plan_hash_too:
        manifest["plan_hash"] = digest
    (plan_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))


@pytest.mark.parametrize("plan_hash_too", [False, True])
def test_a_rehashed_plan_is_refused(plan_dir: Path, plan_hash_too: bool) -> None:
    _edit_and_rehash(plan_dir, plan_hash_too=plan_hash_too)
    found = verify_plan_dir(plan_dir)
    assert [(d.code, d.severity) for d in found] == [("RLC705", "error")]
    assert "plan.json is not the plan rlc compile wrote" in found[0].message
    assert "copy of the compiled plan" in found[0].message
    assert found[0].file == str(plan_dir / "plan.json") and "--allow-modified" in found[0].hint
    assert [(d.code, d.severity) for d in verify_plan_dir(plan_dir, allow_modified=True)] == [("RLC705", "warning")]


def test_a_plain_edit_is_reported_once(plan_dir: Path) -> None:
    path = plan_dir / "plan.json"
    data = json.loads(path.read_text())
    data["schedule"]["steps"] += 1
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    found = verify_plan_dir(plan_dir)
    assert [(d.code, d.message) for d in found] == [("RLC705", "plan.json changed after compile (sha256 mismatch)")]


def test_a_manifest_that_lost_its_plan_hash_is_refused(plan_dir: Path) -> None:
    manifest = json.loads((plan_dir / "manifest.json").read_text())
    del manifest["plan_hash"]
    (plan_dir / "manifest.json").write_text(json.dumps(manifest))
    (found,) = verify_plan_dir(plan_dir)
    assert found.code == "RLC705" and "lost its plan_hash" in found.message


@pytest.mark.parametrize("dry_run", [True, False])
def test_rlc_run_refuses_a_rehashed_plan(plan_dir: Path, dry_run: bool) -> None:
    _edit_and_rehash(plan_dir)
    result = runner.invoke(app, ["run", str(plan_dir), *(["--dry-run"] if dry_run else [])])
    assert result.exit_code == 1, result.output
    assert "error[RLC705]" in result.output and "plan.json is not the plan rlc compile wrote" in result.output
    assert "Traceback" not in result.output


def test_allow_modified_names_the_changes_and_the_workers_environment(plan_dir: Path) -> None:
    _edit_and_rehash(plan_dir, env={"PYTHONPATH": "/home/someone/patches"})
    result = runner.invoke(app, ["run", str(plan_dir), "--dry-run", "--allow-modified"])
    assert result.exit_code == 0, result.output
    assert "warning[RLC705]" in result.output
    assert "running a plan that differs from the compiled one" in result.output
    assert "schedule.steps" in result.output  # the value the edit changed, although its hash was made to match
    assert "apply to every Ray worker of the run" in result.output
    assert "PYTHONPATH (added by the edit)" in result.output


def test_allow_modified_without_environment_says_nothing_of_it(plan_dir: Path) -> None:
    _edit_and_rehash(plan_dir)
    result = runner.invoke(app, ["run", str(plan_dir), "--dry-run", "--allow-modified"])
    assert result.exit_code == 0, result.output
    assert "schedule.steps" in result.output
    assert "Ray worker" not in result.output  # the CPU plan sets no environment
