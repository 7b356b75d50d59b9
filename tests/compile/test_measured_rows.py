"""A damaged metrics.jsonl is one `RUN/metrics.jsonl:LINE: ...` message and exit 2 from calibrate, explain and
report, never a traceback nor a silent nonsense profile; the half-written last line of a killed run is skipped.

Each run directory holds the compiled quickstart plan and twelve step rows, one of them changed.
"""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from paths import REPO
from typer.testing import CliRunner

from rlc.cli import app
from rlc.compiler.pipeline import compile_file
from rlc.schemas.metrics_file import MEASURED_BOUNDS, MetricsError, read_metrics_rows

runner = CliRunner()
QUICKSTART = REPO / "examples" / "quickstart.yaml"
STEPS = 12
BAD_LINE = 8  # the changed row, past the warm-up steps calibrate skips


@pytest.fixture(scope="module")
def plan_json() -> str:
    compiled = compile_file(QUICKSTART)
    assert compiled.plan is not None, [d.message for d in compiled.report.diagnostics]
    return compiled.plan.model_dump_json()


def _row(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "time/rollout_s": 0.2,
        "time/train_s": 0.3,
        "time/weight_sync_s": 0.05,
        "time/step_s": 0.6,
        "train/tokens": 900.0,
        "response_len/mean": 2.5,
        "reward/mean": 0.5,
    }


def _lines(**changed: Any) -> list[str]:
    """The metrics lines of a run, the row on BAD_LINE with `changed` keys ('/' spelled '__')."""
    lines = []
    for step in range(1, STEPS + 1):
        row = _row(step)
        if step == BAD_LINE:
            row.update({k.replace("__", "/"): v for k, v in changed.items()})
        lines.append(json.dumps(row))
    return lines


def _run(tmp_path: Path, plan_json: str, metrics: str | bytes) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text(plan_json)
    path = run / "metrics.jsonl"
    if isinstance(metrics, bytes):
        path.write_bytes(metrics)
    else:
        path.write_text(metrics)
    return run


def _commands(run: Path, tmp_path: Path) -> dict[str, list[str]]:
    return {
        "calibrate": ["calibrate", str(run), "-o", str(tmp_path / "profiles")],
        "explain run": ["explain", str(run)],
        "explain --measured": ["explain", str(QUICKSTART), "--measured", str(run)],
        "report": ["report", str(run)],
    }


def _refused_by_all(run: Path, tmp_path: Path, line: int, *words: str) -> None:
    """Every command exits 2 with one message naming RUN/metrics.jsonl:LINE and `words`, and writes nothing."""
    for name, args in _commands(run, tmp_path).items():
        result = runner.invoke(app, args, env={"COLUMNS": "300"})
        assert result.exit_code == 2, (name, result.output, result.exception)
        assert result.exception is None or isinstance(result.exception, SystemExit), (name, result.exception)
        assert f"error: {run / 'metrics.jsonl'}:{line}: " in result.output, (name, result.output)
        for word in words:
            assert word in result.output, (name, word, result.output)
        assert "Traceback" not in result.output and "holds no steps" not in result.output, name
    assert not (tmp_path / "profiles").exists() and not (run / "report").exists()


BAD_VALUES = {
    "string step time": ({"time__step_s": "fast"}, ['"time/step_s" is "fast", not a number']),
    "null train time": ({"time__train_s": None}, ['"time/train_s" is null, not a number']),
    "zero step time": ({"time__step_s": 0}, ['"time/step_s" is 0, below 1e-06']),
    "negative step time": ({"time__step_s": -0.5}, ['"time/step_s" is -0.5, below']),
    "NaN step time": ({"time__step_s": float("nan")}, ['"time/step_s" is NaN, not a finite number']),
    "infinite train time": ({"time__train_s": float("inf")}, ['"time/train_s" is Infinity, not a finite number']),
    "huge train time": ({"time__train_s": 1e300}, ['"time/train_s" is 1e+300, above 1e+06']),
    "boolean rollout time": ({"time__rollout_s": True}, ['"time/rollout_s" is true, not a number']),
    "negative token count": ({"train__tokens": -900}, ['"train/tokens" is -900, below 0']),
    "negative response length": ({"response_len__mean": -2.5}, ['"response_len/mean" is -2.5, below 0']),
    "string step number": ({"step": "eight"}, ['"step" is "eight", not a number']),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_a_bad_value_names_the_line_and_key(tmp_path: Path, plan_json: str, case: str) -> None:
    changed, words = BAD_VALUES[case]
    run = _run(tmp_path, plan_json, "\n".join(_lines(**changed)) + "\n")
    if case == "string step number":
        _refused_by_all(run, tmp_path, BAD_LINE, *words)
        return
    # Values only calibrate and explain read: the report charts what is a number and leaves the rest as gaps
    # (the run's own logger writes a NaN as null).
    for name, args in _commands(run, tmp_path).items():
        result = runner.invoke(app, args, env={"COLUMNS": "300"})
        if name == "report":
            assert result.exit_code == 0, result.output
            continue
        assert result.exit_code == 2, (name, result.output, result.exception)
        assert f"error: {run / 'metrics.jsonl'}:{BAD_LINE}: " in result.output, (name, result.output)
        assert all(w in result.output for w in words), (name, result.output)
    assert not (tmp_path / "profiles").exists()


def test_a_row_that_is_not_an_object(tmp_path: Path, plan_json: str) -> None:
    lines = _lines()
    lines[BAD_LINE - 1] = "5"
    run = _run(tmp_path, plan_json, "\n".join(lines) + "\n")
    _refused_by_all(run, tmp_path, BAD_LINE, "5 is not a JSON object")
    lines[BAD_LINE - 1] = "[1, 2]"
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    _refused_by_all(run, tmp_path, BAD_LINE, "[1, 2] is not a JSON object")


def test_random_bytes(tmp_path: Path, plan_json: str) -> None:
    noise = b"\xff\xfe\x80" + random.Random(0).randbytes(4096)
    run = _run(tmp_path, plan_json, noise)
    _refused_by_all(run, tmp_path, 1, "not UTF-8 text")


def test_a_bad_line_in_the_middle_is_an_error_with_its_line_number(tmp_path: Path, plan_json: str) -> None:
    lines = _lines()
    lines[BAD_LINE - 1] = lines[BAD_LINE - 1][:33]  # cut short, but more lines follow: not a killed run
    run = _run(tmp_path, plan_json, "\n".join(lines) + "\n")
    _refused_by_all(run, tmp_path, BAD_LINE, "not JSON")
    # The last line, cut short but followed by its newline: the writer finished it, so it is damaged too.
    lines = [*_lines(), _lines()[0][:33]]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    _refused_by_all(run, tmp_path, STEPS + 1, "not JSON")


def test_a_killed_runs_truncated_last_line_is_skipped(tmp_path: Path, plan_json: str) -> None:
    run = _run(tmp_path, plan_json, "\n".join(_lines()) + "\n" + json.dumps(_row(STEPS + 1))[:33])
    for name, args in _commands(run, tmp_path).items():
        result = runner.invoke(app, args, env={"COLUMNS": "300"})
        assert result.exit_code == 0, (name, result.output, result.exception)
    assert (tmp_path / "profiles" / "cpu.yaml").is_file()
    assert f"({STEPS - 5} steps)" in (tmp_path / "profiles" / "cpu.yaml").read_text()
    assert (run / "report" / "index.html").is_file()


def test_calibrated_notes_stay_finite_at_the_bounds(tmp_path: Path, plan_json: str) -> None:
    """The largest times and token counts the reader lets through still give a profile with finite numbers."""
    lines = []
    for step in range(1, STEPS + 1):
        row = _row(step)
        row.update({k: b.high for k, b in MEASURED_BOUNDS.items() if k.startswith(("time/", "train/", "response"))})
        lines.append(json.dumps(row))
    run = _run(tmp_path, plan_json, "\n".join(lines) + "\n")
    result = runner.invoke(app, _commands(run, tmp_path)["calibrate"])
    assert result.exit_code == 0, result.output
    profile = yaml.safe_load((tmp_path / "profiles" / "cpu.yaml").read_text())
    numbers = [v for v in profile["efficiency"].values() if isinstance(v, float)]
    assert numbers and all(math.isfinite(v) for v in [*numbers, profile["estimate_uncertainty"]])
    notes = " ".join(str(v) for v in profile["calibration"].values())
    assert not re.search(r"\b(nan|inf)\b", notes, re.IGNORECASE), notes


def test_reader_line_numbers_count_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n\n  \n{"step": 2, "time/step_s": "slow"}\n')
    assert [r["step"] for r in read_metrics_rows(path)] == [1, 2]  # only the step is checked by default
    with pytest.raises(MetricsError, match=rf'^{path}:4: "time/step_s" is "slow", not a number'):
        read_metrics_rows(path, MEASURED_BOUNDS)
    path.write_text('{"step": 1}\n{"step": 2, "time/st')
    assert [r["step"] for r in read_metrics_rows(path, MEASURED_BOUNDS)] == [1]
    path.write_text("")
    assert read_metrics_rows(path) == []


def test_calibrate_and_report_outputs_never_replace_the_users_files(tmp_path: Path, plan_json: str) -> None:
    """A hand-tuned profile or a folder of the user's is refused without --force; earlier outputs refresh."""
    run = _run(tmp_path, plan_json, "\n".join(_lines()) + "\n")
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "cpu.yaml").write_text("id: cpu\n# my hand-tuned profile\n")
    refused = runner.invoke(app, ["calibrate", str(run), "-o", str(profiles)])
    assert refused.exit_code == 2 and "is not a profile `rlc calibrate` wrote" in refused.output
    assert (profiles / "cpu.yaml").read_text() == "id: cpu\n# my hand-tuned profile\n"
    assert runner.invoke(app, ["calibrate", str(run), "-o", str(profiles), "--force"]).exit_code == 0
    assert runner.invoke(app, ["calibrate", str(run), "-o", str(profiles)]).exit_code == 0  # its own: refreshed

    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("<h1>my site</h1>")
    refused = runner.invoke(app, ["report", str(run), "-o", str(site)])
    assert refused.exit_code == 2 and "not an rlc report" in refused.output
    assert (site / "index.html").read_text() == "<h1>my site</h1>" and len(list(site.iterdir())) == 1


def test_a_run_given_twice_to_calibrate_is_refused(tmp_path: Path, plan_json: str) -> None:
    run = _run(tmp_path, plan_json, "\n".join(_lines()) + "\n")
    twice = runner.invoke(app, ["calibrate", str(run), str(run), "-o", str(tmp_path / "profiles")])
    assert twice.exit_code == 2 and "given more than once" in twice.output
    assert not (tmp_path / "profiles").exists()
