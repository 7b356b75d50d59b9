"""The command line under hostile input: exit codes stay in 0/1/2 and nothing prints a traceback.

Mutated specs go through `rlc validate`, `rlc compile` and `rlc explain` in-process (typer's runner, so an
uncaught exception surfaces as `result.exception`); corrupt plan directories go through `diff`, `explain`
and `run`.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from paths import REPO
from spec_mutants import mutated_specs
from typer.testing import CliRunner

from rlc.cli import app

runner = CliRunner()


def _clean(result, *allowed: int) -> None:  # type: ignore[no-untyped-def]
    assert result.exit_code in (allowed or (0, 1, 2)), (result.exit_code, result.output[-2000:])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(mutated_specs())
def test_cli_on_mutated_specs_exits_0_1_2(case: tuple[str, str | None, list[str]]) -> None:
    text, target, overrides = case
    args = [f"--set={o}" for o in overrides] + ([f"--target={target}"] if target else [])
    with tempfile.TemporaryDirectory() as work:
        spec = Path(work) / "spec.yaml"
        spec.write_text(text)
        _clean(runner.invoke(app, ["validate", str(spec), *args]))
        compiled = runner.invoke(app, ["compile", str(spec), "-o", str(Path(work) / "plan"), *args])
        _clean(compiled)
        explained = runner.invoke(app, ["explain", str(spec), "--format", "json", *args])
        _clean(explained)
        json.loads(explained.output)  # errors too, as JSON


@pytest.fixture
def plan_dir(tmp_path: Path) -> Path:
    out = tmp_path / "plan"
    result = runner.invoke(app, ["compile", str(REPO / "examples" / "a2-qwen3-8b-grpo.yaml"), "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("damage", ["garbage", "not-a-plan", "empty"])
def test_diff_and_explain_on_a_corrupt_plan_are_clear(plan_dir: Path, damage: str) -> None:
    text = {"garbage": "{not json", "not-a-plan": '{"name": 3}', "empty": ""}[damage]
    (plan_dir / "plan.json").write_text(text)
    diffed = runner.invoke(app, ["diff", str(plan_dir), str(REPO / "examples" / "a2-qwen3-8b-grpo.yaml")])
    _clean(diffed, 2)
    assert "RLC707" in diffed.output and "plan.json cannot be read" in diffed.output
    explained = runner.invoke(app, ["explain", str(plan_dir)])
    _clean(explained, 2)
    assert "cannot read plan" in explained.output
    ran = runner.invoke(app, ["run", str(plan_dir)])
    _clean(ran, 1)
    assert "plan.json changed after compile" in ran.output


def test_explain_json_reports_errors_as_json(tmp_path: Path) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: x\ntarget: a2\nmodel: {name: qwen3-8b, path: /m}\ndata: {train: /d.jsonl}\nmode: wrong\n")
    result = runner.invoke(app, ["explain", str(spec), "--format", "json"])
    _clean(result, 1)
    payload = json.loads(result.output)
    assert payload["ok"] is False
    assert [d["code"] for d in payload["files"][0]["diagnostics"]] == ["RLC104"]


def test_models_piped_are_whole_lines_with_head_counts() -> None:
    result = runner.invoke(app, ["models"])  # the runner's stdout is not a terminal, like a pipe
    _clean(result, 0)
    header, *rows = [line.split("\t") for line in result.output.splitlines()]
    assert header[:7] == ["id", "params (B)", "active (B)", "layers", "hidden", "heads", "kv heads"]
    big = next(r for r in rows if r[0] == "qwen3-235b-a22b")
    assert big[5:7] == ["64", "4"]
    targets = runner.invoke(app, ["targets"])
    assert any(line.startswith("a3\t") for line in targets.output.splitlines())


def test_run_on_the_light_install_says_what_to_install(plan_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    result = runner.invoke(app, ["run", str(plan_dir)])
    _clean(result, 2)
    assert "the runtime is not installed (missing: torch)" in result.output
    assert "install `rlc[cpu]`" in result.output
