"""A plan directory holds regular files only: a FIFO, a device (a link to /dev/zero), a socket, or a link out of
the plan directory is refused by name before anything reads it, instead of hanging `rlc run` and `rlc diff` while
hashing. Links that stay inside (a Kubernetes ConfigMap volume) still verify."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from plan_fixtures import CPU_SPEC, cpu_plan, spec_from

from rlc.compiler.emit import emit_plan_dir
from rlc.compiler.manifest import SpecialFileError, list_files, load_plan, verify_plan_dir

RLC = [sys.executable, "-m", "rlc"]


@pytest.fixture
def plan_dir(tmp_path: Path) -> Path:
    out = tmp_path / "plan"
    plan = cpu_plan(model_path=str(tmp_path / "model"), run_dir=str(tmp_path / "run"), build_tiny=False)
    emit_plan_dir(plan, spec_from(CPU_SPEC), out, provenance={})
    return out


def _errors(plan_dir: Path, allow_modified: bool = False) -> list[tuple[str, str]]:
    return [(d.code, d.message) for d in verify_plan_dir(plan_dir, allow_modified=allow_modified)]


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("allow_modified", [False, True])
def test_a_fifo_is_refused_by_name_without_blocking(plan_dir: Path, allow_modified: bool) -> None:
    _fifo(plan_dir / "SUMMARY.md")
    found = verify_plan_dir(plan_dir, allow_modified=allow_modified)
    assert [(d.code, d.severity) for d in found] == [("RLC701", "error")]  # --allow-modified cannot relax it
    assert found[0].message.startswith("SUMMARY.md is a named pipe (FIFO), not a regular file")
    assert found[0].file == str(plan_dir / "SUMMARY.md")


@pytest.mark.timeout(60)
def test_a_link_to_dev_zero_is_refused(plan_dir: Path) -> None:
    (plan_dir / "SUMMARY.md").unlink()
    (plan_dir / "SUMMARY.md").symlink_to("/dev/zero")
    assert _errors(plan_dir, allow_modified=True) == [
        (
            "RLC701",
            "SUMMARY.md (a symbolic link to /dev/zero) is a character device, not a regular file; a plan directory "
            "holds regular files only",
        )
    ]


@pytest.mark.timeout(60)
def test_a_socket_a_dangling_link_and_a_link_out_are_refused(plan_dir: Path, tmp_path: Path) -> None:
    (plan_dir / "rayjob.yaml").unlink()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(plan_dir / "rayjob.yaml"))
        outside = tmp_path / "outside.md"
        outside.write_bytes((plan_dir / "SUMMARY.md").read_bytes())  # the same bytes: only the place is wrong
        (plan_dir / "SUMMARY.md").unlink()
        (plan_dir / "SUMMARY.md").symlink_to(outside)
        (plan_dir / "launch.sh").unlink()
        (plan_dir / "launch.sh").symlink_to(tmp_path / "gone")
        messages = dict((m.split(" ")[0], m) for _, m in _errors(plan_dir))
    assert "is a socket, not a regular file" in messages["rayjob.yaml"]
    assert f"(a symbolic link to {outside}) lies outside the plan directory" in messages["SUMMARY.md"]
    assert "cannot be read (a symbolic link that leads nowhere)" in messages["launch.sh"]


@pytest.mark.timeout(60)
def test_a_fifo_manifest_or_plan_json_does_not_block(plan_dir: Path) -> None:
    _fifo(plan_dir / "plan.json")
    with pytest.raises(SpecialFileError, match=r"plan\.json is a named pipe"):
        load_plan(plan_dir)  # what `rlc explain PLANDIR` reads
    _fifo(plan_dir / "manifest.json")
    codes = _errors(plan_dir)
    assert [c for c, _ in codes] == ["RLC701", "RLC701"]
    assert any(m.startswith("manifest.json is a named pipe") for _, m in codes)


@pytest.mark.timeout(60)
def test_a_directory_link_out_of_the_plan_is_not_walked(plan_dir: Path) -> None:
    (plan_dir / "roles").rename(plan_dir / "roles.moved")
    (plan_dir / "roles").symlink_to("/")  # walking it would read the whole file system
    assert "roles" in list_files(plan_dir)
    found = _errors(plan_dir)
    assert ("RLC701", "roles (a symbolic link to /) is a directory, not a regular file; a plan directory holds "
            "regular files only") in found  # fmt: skip


def test_links_inside_the_plan_still_verify(plan_dir: Path) -> None:
    (plan_dir / "..data").mkdir()
    (plan_dir / "SUMMARY.md").rename(plan_dir / "..data" / "SUMMARY.md")
    (plan_dir / "SUMMARY.md").symlink_to(Path("..data") / "SUMMARY.md")
    assert verify_plan_dir(plan_dir) == []


@pytest.mark.parametrize("command", ["run", "diff"])
def test_the_cli_names_the_file_and_exits_non_zero(plan_dir: Path, tmp_path: Path, command: str) -> None:
    _fifo(plan_dir / "SUMMARY.md")
    args = [str(plan_dir)] if command == "run" else [str(plan_dir), str(plan_dir)]
    result = subprocess.run([*RLC, command, *args], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == (1 if command == "run" else 2), result.stdout + result.stderr
    assert "error[RLC701]" in result.stderr and "SUMMARY.md is a named pipe (FIFO)" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr and "local Ray" not in result.stdout
