"""`rlc doctor` fails where `rlc run` or `rlc compile` would: a run directory that is a file (or cannot be
written), a broken or missing RLC_TARGETS profile directory, and a Ray address nothing listens on (at once)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlc.cli import app
from rlc.compiler.profiles import TARGETS_ENV, write_profile
from rlc.runtime import doctor
from rlc.schemas.registry import load_target

runner = CliRunner()


@pytest.fixture(autouse=True)
def _quiet_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv(TARGETS_ENV, raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "no-ray"))  # no cluster file there: nothing to probe


def _doctor(*args: str) -> tuple[int, dict[str, list[tuple[str, str]]], str]:
    result = runner.invoke(app, ["doctor", "--format", "json", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    data = json.loads(result.output)
    assert data["ok"] is (result.exit_code == 0)
    checks: dict[str, list[tuple[str, str]]] = {}
    for c in data["checks"]:
        checks.setdefault(c["name"], []).append((c["status"], c["detail"]))
    return result.exit_code, checks, result.output


# --- the run directory -------------------------------------------------------------------------------------------


def test_run_dir_that_is_a_file_fails(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x\n")
    code, checks, _ = _doctor("--run-dir", str(afile))
    assert code == 1
    ((status, detail),) = checks["run dir"]
    assert status == "fail" and "exists and is a file" in detail
    code, checks, _ = _doctor("--run-dir", str(afile / "run"))
    assert code == 1 and "lies under" in checks["run dir"][0][1]
    text = runner.invoke(app, ["doctor", "--run-dir", str(afile)])
    assert text.exit_code == 1 and text.output.splitlines()[-1].startswith("doctor: a run would fail here")


def test_run_dir_not_yet_made_is_ok_and_not_created(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "x"
    code, checks, output = _doctor("--run-dir", str(run_dir))
    assert code == 0, output
    ((status, detail),) = checks["run dir"]
    assert status == "ok" and f"under {tmp_path}" in detail
    assert not (tmp_path / "runs").exists()  # doctor creates nothing the user did not ask for
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # and leaves no write probe behind


def test_existing_run_dir_is_ok(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    code, checks, output = _doctor("--run-dir", str(tmp_path))
    assert code == 0, output
    assert checks["run dir"] == [("ok", f"{tmp_path} is writable")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_run_dir_where_nothing_can_be_created_fails() -> None:
    code, checks, _ = _doctor("--run-dir", "/proc/rlc-doctor-test/run")
    assert code == 1
    ((status, detail),) = checks["run dir"]
    assert status == "fail" and detail.startswith("cannot create /proc/rlc-doctor-test/run under /proc")


def test_unwritable_run_dir_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a read-only mount (or another user's folder) does to the write probe; root ignores chmod."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    from rlc.runtime import run_dir

    monkeypatch.setattr(run_dir, "probe_write", refuse)
    (check,) = doctor.check_run_dir(tmp_path)
    assert check.status == "fail"
    assert check.detail == f"cannot write in {tmp_path}: permission denied; choose another --run-dir"
    (check,) = doctor.check_run_dir(tmp_path / "new")
    assert check.status == "fail" and f"cannot create {tmp_path / 'new'} under {tmp_path}" in check.detail


# --- RLC_TARGETS ----------------------------------------------------------------------------------------------------


def test_no_profile_directories_no_check(tmp_path: Path) -> None:
    code, checks, output = _doctor("--run-dir", str(tmp_path))
    assert code == 0, output
    assert "targets" not in checks


def test_good_profile_directory_is_ok(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_profile(load_target("cpu"), tmp_path / "profiles")
    monkeypatch.setenv(TARGETS_ENV, str(tmp_path / "profiles"))
    code, checks, output = _doctor("--run-dir", str(tmp_path))
    assert code == 0, output
    ((status, detail),) = checks["targets"]
    assert status == "ok" and "profiles cpu" in detail


def test_binary_profile_fails_naming_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "tgt"
    write_profile(load_target("a2"), folder)
    (folder / "cpu.yaml").write_bytes(bytes([0xC0, 0xFF, 0x00]) + bytes(range(200)))
    (folder / "notes.txt").write_bytes(b"\xff\xfe not a profile, not read")
    monkeypatch.setenv(TARGETS_ENV, str(folder))
    code, checks, _ = _doctor("--run-dir", str(tmp_path))
    assert code == 1
    ((status, detail),) = checks["targets"]
    assert status == "fail" and detail.startswith(f"{folder / 'cpu.yaml'}: not a valid target profile")
    text = runner.invoke(app, ["doctor", "--run-dir", str(tmp_path)])
    assert text.exit_code == 1 and "cpu.yaml" in text.output
    assert text.output.splitlines()[-1].startswith("doctor: a run would fail here")


def test_invalid_profile_fails_on_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "tgt"
    folder.mkdir()
    (folder / "cpu.yaml").write_text("id: cpu\nhbm_gib: lots\n")
    (folder / "a2.yaml").write_text("")
    monkeypatch.setenv(TARGETS_ENV, str(folder))
    code, checks, _ = _doctor("--run-dir", str(tmp_path))
    assert code == 1
    assert [s for s, _ in checks["targets"]] == ["fail", "fail"]
    assert [d.split(":")[0] for _, d in checks["targets"]] == [str(folder / "a2.yaml"), str(folder / "cpu.yaml")]
    assert all("\n" not in d for _, d in checks["targets"])


def test_missing_profile_directory_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "calibrated"
    monkeypatch.setenv(TARGETS_ENV, str(missing))
    code, checks, _ = _doctor("--run-dir", str(tmp_path))
    assert code == 1
    ((status, detail),) = checks["targets"]
    assert status == "fail" and f"{missing} (from {TARGETS_ENV}) does not exist" in detail


# --- Ray ------------------------------------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: connecting is refused at once


def test_ray_address_nothing_listens_on_fails_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    port = _closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")

    def no_probe(*args: object, **kwargs: object) -> None:
        raise AssertionError("the slow Ray probe must not run for an address that refuses connections")

    monkeypatch.setattr(doctor.subprocess, "run", no_probe)
    (check,) = doctor.check_ray()  # the refused connection answers; the probe (patched above) never starts
    assert check.status == "fail" and f"nothing answers on 127.0.0.1:{port}" in check.detail
    assert check.detail.startswith(f"RAY_ADDRESS=127.0.0.1:{port}:")


def test_ray_address_that_answers_goes_on_to_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        probed: list[object] = []

        class Done:
            returncode, stdout, stderr = 0, "1 {'CPU': 2.0}", ""

        def probe(*args: object, **kwargs: object) -> Done:
            probed.append(args)
            return Done()

        monkeypatch.setattr(doctor.subprocess, "run", probe)
        (check,) = doctor.check_ray()
    assert probed and check.status == "ok" and "reachable" in check.detail
