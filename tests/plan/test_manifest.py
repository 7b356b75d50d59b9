"""Plan directory verification: `rlc run` refuses anything that is not exactly what `rlc compile` wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plan_fixtures import A3_SPEC, a3_plan, spec_from

from rlc import __version__
from rlc.compiler.emit import emit_plan_dir
from rlc.compiler.manifest import load_plan, major_minor, verify_plan_dir


@pytest.fixture
def plan_dir(tmp_path: Path) -> Path:
    out = tmp_path / "plan"
    emit_plan_dir(a3_plan(), spec_from(A3_SPEC), out, provenance={})
    return out


def _codes(found) -> list[tuple[str, str]]:
    return [(d.code, d.severity) for d in found]


def _edit_manifest(plan_dir: Path, **changes: object) -> None:
    path = plan_dir / "manifest.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_fresh_plan_verifies_and_loads(plan_dir: Path) -> None:
    assert verify_plan_dir(plan_dir) == []
    assert load_plan(plan_dir) == a3_plan()


def test_tampered_file_is_refused_naming_it(plan_dir: Path) -> None:
    path = plan_dir / "roles" / "rollout.json"
    path.write_text(path.read_text().replace("0.6", "0.95"))
    found = verify_plan_dir(plan_dir)
    assert _codes(found) == [("RLC705", "error")]
    assert "roles/rollout.json" in found[0].message and found[0].file.endswith("roles/rollout.json")
    assert "rlc compile" in found[0].hint and "--allow-modified" in found[0].hint
    relaxed = verify_plan_dir(plan_dir, allow_modified=True)
    assert _codes(relaxed) == [("RLC705", "warning")]


def test_missing_file_is_an_error_even_when_modifications_are_allowed(plan_dir: Path) -> None:
    (plan_dir / "launch.sh").unlink()
    for allow in (False, True):
        found = verify_plan_dir(plan_dir, allow_modified=allow)
        assert _codes(found) == [("RLC704", "error")]
        assert "launch.sh" in found[0].message and "rlc compile" in found[0].hint


def test_extra_file_is_refused(plan_dir: Path) -> None:
    (plan_dir / "roles" / "sneaky.json").write_text("{}")
    found = verify_plan_dir(plan_dir)
    assert _codes(found) == [("RLC706", "error")]
    assert "roles/sneaky.json" in found[0].message
    assert _codes(verify_plan_dir(plan_dir, allow_modified=True)) == [("RLC706", "warning")]


def test_configmap_internals_are_not_extra_files(plan_dir: Path) -> None:
    (plan_dir / "..data").mkdir()
    (plan_dir / "..data" / "plan.json").write_text("{}")
    assert verify_plan_dir(plan_dir) == []


def test_configmap_volume_layout_verifies(plan_dir: Path) -> None:
    """A ConfigMap volume holds the files under ..data/ and links each top-level entry (roles/ too) into it."""
    data = plan_dir / "..2026_01_01_00_00_00.000000001"
    data.mkdir()
    for entry in sorted(p for p in plan_dir.iterdir() if not p.name.startswith("..")):
        entry.rename(data / entry.name)
    (plan_dir / "..data").symlink_to(data.name)
    for entry in sorted(data.iterdir()):
        (plan_dir / entry.name).symlink_to(Path("..data") / entry.name)
    assert verify_plan_dir(plan_dir) == []
    assert load_plan(plan_dir) == a3_plan()


def test_unknown_plan_format_is_refused(plan_dir: Path) -> None:
    _edit_manifest(plan_dir, plan_format=99)
    found = verify_plan_dir(plan_dir)
    assert _codes(found) == [("RLC702", "error")]
    assert "plan format 99" in found[0].message and found[0].file.endswith("manifest.json")


@pytest.mark.parametrize("version", ["9.9.0", "0.99.0", ""])
def test_incompatible_rlc_version_is_refused(plan_dir: Path, version: str) -> None:
    _edit_manifest(plan_dir, rlc_version=version)
    found = verify_plan_dir(plan_dir, allow_modified=True)
    assert _codes(found) == [("RLC703", "error")]
    assert __version__ in found[0].message and "rlc compile" in found[0].hint


def test_same_major_minor_is_compatible(plan_dir: Path) -> None:
    major, minor = major_minor(__version__)
    _edit_manifest(plan_dir, rlc_version=f"{major}.{minor}.99+local")
    assert verify_plan_dir(plan_dir) == []


def test_missing_or_broken_manifest(plan_dir: Path, tmp_path: Path) -> None:
    (plan_dir / "manifest.json").write_text("{not json")
    assert _codes(verify_plan_dir(plan_dir)) == [("RLC701", "error")]
    (plan_dir / "manifest.json").unlink()
    found = verify_plan_dir(plan_dir)
    assert _codes(found) == [("RLC701", "error")] and "manifest.json" in found[0].message
    assert _codes(verify_plan_dir(tmp_path / "nowhere")) == [("RLC701", "error")]


def test_several_problems_are_reported_together(plan_dir: Path) -> None:
    (plan_dir / "SUMMARY.md").write_text("edited")
    (plan_dir / "rayjob.yaml").unlink()
    (plan_dir / "extra.txt").write_text("x")
    codes = sorted(code for code, _ in _codes(verify_plan_dir(plan_dir)))
    assert codes == ["RLC704", "RLC705", "RLC706"]
