"""`rlc calibrate`: fitted profiles predict other specs on the same hardware, and compile picks them up.

The runs here are synthetic: their metrics are what a known "true" cpu profile predicts for the plan, with
step-to-step noise, so the test knows the answer. A real run is calibrated on in the commit that added this
(quickstart on two cores: see the README's calibration section).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_dir_fixtures import write_run_dir
from typer.testing import CliRunner

from rlc.cli import app
from rlc.compiler import calibrate
from rlc.compiler.pipeline import compile_text
from rlc.schemas.profiles import TARGETS_ENV
from rlc.schemas.registry import load_target

runner = CliRunner()

SPEC = """name: cal
target: cpu
model: {name: rlc-tiny}
mode: disaggregated
algorithm: {group_size: 8, batch_prompts: BATCH, max_staleness: 0, steps: 20}
data: {train: arithmetic, digits: 1}
reward: {fn: exact_match}
rollout: {max_prompt_len: 8, max_response_len: 4}
train: {micro_batch_tokens: 512}
"""
TRUTH = {
    "train_mfu": 0.02,
    "micro_batch_overhead_s": 0.03,
    "decode_bandwidth_efficiency": 0.05,
    "step_overhead_s": 0.08,
    "weight_sync_overhead_s": 0.02,
}


def _plan(batch: int, targets: list[Path] | None = None):  # type: ignore[no-untyped-def]
    compiled = compile_text(SPEC.replace("BATCH", str(batch)), "cal.yaml", targets=targets)
    assert compiled.plan is not None, [d.message for d in compiled.report.diagnostics]
    return compiled.plan


def _truth():  # type: ignore[no-untyped-def]
    cpu = load_target("cpu")
    return cpu.model_copy(update={"efficiency": cpu.efficiency.model_copy(update=TRUTH)})


def _write_run(tmp_path: Path, batch: int, steps: int = 30) -> Path:
    """A run directory whose times are the true profile's predictions for its own measured lengths, ±5%."""
    plan = _plan(batch)
    prompt, response = 5.0, 2.5
    truth = calibrate.predict(plan, _truth(), calibrate.run_workload(plan, prompt, response))
    tokens = (prompt + response) * plan.schedule.batch_samples
    return write_run_dir(tmp_path / f"run-{batch}", plan, truth, tokens, steps, **{"response_len/mean": response})


def test_calibrated_profile_predicts_another_batch_size(tmp_path: Path) -> None:
    run = calibrate.load_run(_write_run(tmp_path, 16))
    fitted = calibrate.calibrate(load_target("cpu"), [run])
    other = _plan(32)
    work = calibrate.run_workload(other, 5.0, 2.5)
    truth = calibrate.predict(other, _truth(), work)["step"]
    after = calibrate.predict(other, fitted, work)["step"]
    before = calibrate.predict(other, load_target("cpu"), work)["step"]
    assert abs(after / truth - 1) < 0.10, (after, truth)
    assert abs(before / truth - 1) > 0.25, (before, truth)  # the shipped estimate was far off
    assert fitted.calibration["runs"] == "run-16 (25 steps)"
    assert fitted.estimate_uncertainty >= calibrate.MIN_UNCERTAINTY


def test_calibrate_cli_and_compile_with_targets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _write_run(tmp_path, 16)
    out = tmp_path / "profiles"
    result = runner.invoke(app, ["calibrate", str(run), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "cpu.yaml").is_file() and "wrote" in result.output
    plan = _plan(32, targets=[out])
    assert plan.profile["source"] == str(out) and plan.profile["calibration.runs"].startswith("run-16")
    shipped = _plan(32)
    assert shipped.profile["source"] == "shipped" and shipped.estimates.step_time_s != plan.estimates.step_time_s
    monkeypatch.setenv(TARGETS_ENV, str(out))
    assert _plan(32).profile["source"] == str(out)


def test_explain_shows_measured_and_profile(tmp_path: Path) -> None:
    run = _write_run(tmp_path, 16)
    out = tmp_path / "profiles"
    assert runner.invoke(app, ["calibrate", str(run), "-o", str(out)]).exit_code == 0
    spec = tmp_path / "cal.yaml"
    spec.write_text(SPEC.replace("BATCH", "16"))
    # Wide enough that the profile line (which names the temporary folder) is not wrapped by the terminal width.
    args = ["explain", str(spec), "--targets", str(out), "--measured", str(run)]
    result = runner.invoke(app, args, env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "measured" in result.output and "runs: run-16 (25 steps)" in result.output
    assert "target profile cpu:" in result.output and "profiles" in result.output
    data = json.loads(
        runner.invoke(
            app, ["explain", str(spec), "--targets", str(out), "--measured", str(run), "--format", "json"]
        ).output
    )
    assert set(data["measured"]) >= {"step", "train", "rollout", "weight sync"}
    assert data["profile"]["source"] == str(out) and len(data["step_time_band_s"]) == 2
    assert all("notes" in r for r in data["roles"])


def test_bad_run_dir_is_a_usage_error(tmp_path: Path) -> None:
    result = runner.invoke(app, ["calibrate", str(tmp_path), "-o", str(tmp_path / "o")])
    assert result.exit_code == 2 and "plan.json and metrics.jsonl" in result.output


def test_a_speculative_run_is_priced_at_the_acceptance_its_engines_had(tmp_path: Path) -> None:
    """The plan states the acceptance the estimate assumed; calibrate prices the run at the measured one (a rollout
    at 0.2 acceptance is slower than at 0.7), records it with the spec key to set, and explain lines the two up."""
    text = SPEC.replace("BATCH", "16").replace(
        "rollout: {max_prompt_len: 8, max_response_len: 4}",
        "model: {name: rlc-tiny-hybrid-mtp}\nrollout: {max_prompt_len: 8, max_response_len: 4, mtp: {}}",
    )
    text = text.replace("model: {name: rlc-tiny}\n", "")
    compiled = compile_text(text, "mtp.yaml")
    plan = compiled.plan
    assert plan is not None and plan.sampling.draft_acceptance == 0.7
    truth = calibrate.predict(plan, _truth(), calibrate.run_workload(plan, 5.0, 2.5))
    tokens = 7.5 * plan.schedule.batch_samples
    extra = {"response_len/mean": 2.5, "spec_decode/acceptance_rate": 0.2}
    run = calibrate.load_run(write_run_dir(tmp_path / "mtp-run", plan, truth, tokens, 30, **extra))
    assert run.draft_acceptance == pytest.approx(0.2) and run.work.mtp_acceptance == pytest.approx(0.2)
    planned = calibrate.predict(plan, _truth(), calibrate.run_workload(plan, 5.0, 2.5))["rollout"]
    assert calibrate.predict(plan, _truth(), run.work)["rollout"] > planned
    record = calibrate.calibrate(load_target("cpu"), [run]).calibration
    assert (
        "engines accepted 0.2 of draft tokens (planned 0.7): rollout.mtp.acceptance_rate 0.20"
        in (record["run.mtp-run.draft_acceptance"])
    )
    assert calibrate.measured_phases(tmp_path / "mtp-run")["draft acceptance"] == pytest.approx(0.2)
