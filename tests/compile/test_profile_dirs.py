"""Target profile directories (--targets, RLC_TARGETS): a binary profile and a mistyped directory are reported
(RLC108 from validate/compile/explain, a usage error from calibrate), never a traceback or a silent fallback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from paths import REPO
from typer.testing import CliRunner

from rlc.cli import app
from rlc.compiler.calibrate import WARMUP_STEPS
from rlc.compiler.pipeline import compile_text
from rlc.schemas.profiles import TARGETS_ENV, ProfileError, read_profile, target_dirs, write_profile
from rlc.schemas.registry import load_target

runner = CliRunner()

QUICKSTART = REPO / "examples" / "quickstart.yaml"
#: Not UTF-8 (0xc0 never starts a character), as `head -c 300 /dev/urandom` almost always is.
BINARY = bytes([0xC0, 0x00, 0xFF, 0x9A]) + bytes(range(256))


@pytest.fixture(autouse=True)
def _no_env_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TARGETS_ENV, raising=False)


def _binary_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "tgt"
    folder.mkdir()
    (folder / "cpu.yaml").write_bytes(BINARY)
    return folder


def _no_traceback(result) -> None:  # type: ignore[no-untyped-def]
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output


def _rlc108(report: dict) -> list[dict]:
    return [d for f in report["files"] for d in f["diagnostics"] if d["code"] == "RLC108"]


def test_binary_profile_is_a_profile_error(tmp_path: Path) -> None:
    path = _binary_dir(tmp_path) / "cpu.yaml"
    with pytest.raises(ProfileError, match=r"cpu\.yaml: not a valid target profile: not UTF-8 text"):
        read_profile(path)


def test_binary_profile_in_targets_is_rlc108(tmp_path: Path) -> None:
    folder = _binary_dir(tmp_path)
    result = runner.invoke(app, ["validate", str(QUICKSTART), "--targets", str(folder)])
    _no_traceback(result)
    assert result.exit_code == 1, result.output
    assert "error[RLC108]" in result.output and "cpu.yaml" in result.output and "not UTF-8" in result.output
    as_json = runner.invoke(app, ["validate", str(QUICKSTART), "--targets", str(folder), "-f", "json"])
    _no_traceback(as_json)
    assert as_json.exit_code == 1
    report = json.loads(as_json.output)
    assert report["ok"] is False
    (found,) = _rlc108(report)
    assert str(folder / "cpu.yaml") in found["message"] and found["path"] == "target"


def test_binary_profile_in_env_fails_compile_explain_cleanly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TARGETS_ENV, str(_binary_dir(tmp_path)))
    compiled = runner.invoke(app, ["compile", str(QUICKSTART), "-o", str(tmp_path / "plan")])
    _no_traceback(compiled)
    assert compiled.exit_code == 1 and "RLC108" in compiled.output and "cpu.yaml" in compiled.output
    assert not (tmp_path / "plan").exists()
    explained = runner.invoke(app, ["explain", str(QUICKSTART)])
    _no_traceback(explained)
    assert explained.exit_code == 1 and "RLC108" in explained.output
    as_json = runner.invoke(app, ["explain", str(QUICKSTART), "-f", "json"])
    assert as_json.exit_code == 1 and _rlc108(json.loads(as_json.output))


def _run_dir(tmp_path: Path) -> Path:
    """A run directory `rlc calibrate` reads (the profile lookup comes before any fitting)."""
    compiled = compile_text(QUICKSTART.read_text(), "quickstart.yaml")
    assert compiled.plan is not None
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text(compiled.plan.model_dump_json())
    row = {"time/rollout_s": 1.0, "time/train_s": 1.0, "time/weight_sync_s": 0.1, "time/step_s": 2.2}
    rows = [{"step": step, **row} for step in range(1, WARMUP_STEPS + 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


@pytest.mark.parametrize("how", ["env", "option"])
def test_binary_profile_fails_calibrate_cleanly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    run = _run_dir(tmp_path)
    folder = _binary_dir(tmp_path)
    args = ["calibrate", str(run), "-o", str(tmp_path / "out")]
    if how == "env":
        monkeypatch.setenv(TARGETS_ENV, str(folder))
    else:
        args += ["--targets", str(folder)]
    result = runner.invoke(app, args)
    _no_traceback(result)
    assert result.exit_code == 2, result.output
    assert "cpu.yaml: not a valid target profile: not UTF-8 text" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_targets_option_must_be_a_directory(tmp_path: Path, kind: str) -> None:
    folder = tmp_path / "calibrated"
    if kind == "file":
        folder.write_text("x\n")
    why = "does not exist" if kind == "missing" else "is not a directory"
    result = runner.invoke(app, ["validate", str(QUICKSTART), "--targets", str(folder)])
    _no_traceback(result)
    assert result.exit_code == 1, result.output
    assert "RLC108" in result.output and f"{folder} (from --targets) {why}" in result.output
    report = json.loads(
        runner.invoke(app, ["validate", str(QUICKSTART), "--targets", str(folder), "-f", "json"]).output
    )
    assert report["ok"] is False and why in _rlc108(report)[0]["message"]


def test_env_targets_must_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "no" / "such"
    monkeypatch.setenv(TARGETS_ENV, str(missing))
    result = runner.invoke(app, ["compile", str(QUICKSTART), "-o", str(tmp_path / "plan")])
    _no_traceback(result)
    assert result.exit_code == 1, result.output  # not a plan from the shipped profile
    assert f"{missing} (from {TARGETS_ENV}) does not exist" in result.output
    assert not (tmp_path / "plan").exists()
    with pytest.raises(ProfileError, match=TARGETS_ENV):
        target_dirs()


def test_each_env_entry_is_checked_and_empty_entries_are_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = tmp_path / "good"
    write_profile(load_target("cpu"), good)
    missing = tmp_path / "missing"
    monkeypatch.setenv(TARGETS_ENV, os.pathsep.join([str(good), str(missing)]))
    with pytest.raises(ProfileError, match="missing"):
        target_dirs()
    monkeypatch.setenv(TARGETS_ENV, f"{good}{os.pathsep}{os.pathsep}")
    assert target_dirs([good]) == [good, good]
    compiled = compile_text(QUICKSTART.read_text(), "quickstart.yaml")
    assert compiled.plan is not None and compiled.plan.profile["source"] == str(good)
