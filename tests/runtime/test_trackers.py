"""The trackers `output.loggers` can name beside jsonl and tensorboard (W&B, SwanLab, MLflow): each run's metrics
and config are read back from what the tracker itself wrote, a resume continues the tracker's run, a tracker that
fails never costs metrics.jsonl a step, and a tracker that is not installed is named with its extra before a run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from plan_fixtures import CPU_SPEC, cpu_plan, spec_from
from tracker_readers import mlflow_client, read_jsonl, read_mlflow, read_swanlab, read_wandb
from typer.testing import CliRunner

from rlc.cli import app
from rlc.compiler.emit import emit_plan_dir
from rlc.runtime import trackers
from rlc.runtime.metrics import MetricsLogger
from rlc.runtime.trackers import ID_FILE, plan_config, tracker_problems

CONFIG = {"name": "quick", "model": {"id": "rlc-tiny", "params_b": 0.001}, "algorithm": {"lr": 5e-4}}


def _log(run_dir: Path, loggers: list[str], steps: range, offset: float = 0.0, start_step: int = 0) -> MetricsLogger:
    """Log `steps` as a run would (numbers, a boolean, text, a NaN) and close; returns the closed logger."""
    logger = MetricsLogger(run_dir, loggers, total_steps=4, start_step=start_step, run_name="quick", config=CONFIG)
    for step in steps:
        logger.log(
            {"step": step, "reward/mean": step + offset, "time/step_s": 0.5, "done": True, "note": "x", "gap": None}
        )
    logger.close()
    return logger


def test_wandb_offline_run_holds_every_step_and_the_config_and_a_resume_continues_it(tmp_path: Path) -> None:
    _log(tmp_path, ["jsonl", "wandb"], range(1, 5))
    (first,) = read_wandb(tmp_path)
    assert first.run_id == (tmp_path / "wandb" / ID_FILE).read_text().strip()
    assert first.series == read_jsonl(tmp_path)  # booleans, text and nulls stay in metrics.jsonl
    assert first.series["reward/mean"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    assert first.config == CONFIG

    _log(tmp_path, ["jsonl", "wandb"], range(3, 5), offset=0.5, start_step=2)  # resumed from the step-2 checkpoint
    runs = read_wandb(tmp_path)
    assert [run.run_id for run in runs] == [first.run_id, first.run_id]  # `wandb sync` makes them one run
    assert runs[1].series["reward/mean"] == [(3, 3.5), (4, 4.5)]


def test_swanlab_offline_run_holds_every_step_and_the_config_and_a_resume_continues_it(tmp_path: Path) -> None:
    _log(tmp_path, ["jsonl", "swanlab"], range(1, 5))
    (first,) = read_swanlab(tmp_path)
    assert first.run_id == (tmp_path / "swanlab" / ID_FILE).read_text().strip()
    assert first.series == read_jsonl(tmp_path)
    assert first.config == CONFIG

    _log(tmp_path, ["jsonl", "swanlab"], range(3, 5), offset=0.5, start_step=2)
    runs = read_swanlab(tmp_path)
    assert [run.run_id for run in runs] == [first.run_id, first.run_id]
    assert runs[1].series["reward/mean"] == [(3, 3.5), (4, 4.5)]


def test_mlflow_run_holds_every_step_and_the_plan_as_params_and_a_resume_reopens_it(tmp_path: Path) -> None:
    _log(tmp_path, ["jsonl", "mlflow"], range(1, 3))  # stopped at step 2 of 4
    (run,) = read_mlflow(tmp_path)
    assert run.run_id == (tmp_path / "mlflow" / ID_FILE).read_text().strip()
    assert run.series == read_jsonl(tmp_path)
    assert run.config == {"name": "quick", "model.id": "rlc-tiny", "model.params_b": "0.001", "algorithm.lr": "0.0005"}
    client = mlflow_client(tmp_path)
    assert client.get_run(run.run_id).info.status == "KILLED"  # a stopped run, to resume
    assert client.get_run(run.run_id).info.run_name == "quick"

    _log(tmp_path, ["jsonl", "mlflow"], range(3, 5), offset=0.5, start_step=2)
    (resumed,) = read_mlflow(tmp_path)  # the same run, not a second one
    assert resumed.run_id == run.run_id
    assert resumed.series["reward/mean"] == [(1, 1.0), (2, 2.0), (3, 3.5), (4, 4.5)]
    assert client.get_run(run.run_id).info.status == "FINISHED"


def test_all_five_loggers_hold_the_same_steps(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log(tmp_path, ["jsonl", "tensorboard", "wandb", "swanlab", "mlflow"], range(1, 5))
    expected = read_jsonl(tmp_path)
    assert [step for step, _ in expected["reward/mean"]] == [1, 2, 3, 4]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    board = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert board == expected
    for name, runs in (("wandb", read_wandb), ("swanlab", read_swanlab), ("mlflow", read_mlflow)):
        (run,) = runs(tmp_path)
        assert run.series == expected, name


def test_a_tracker_that_fails_mid_run_stops_alone_and_metrics_jsonl_keeps_every_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = MetricsLogger(tmp_path, ["jsonl", "wandb", "swanlab"], total_steps=3, run_name="quick", config=CONFIG)
    wandb_tracker = logger.trackers[0]
    real_log = wandb_tracker._run.log  # type: ignore[attr-defined]

    def failing(values: dict[str, float], step: int) -> None:
        if step == 2:
            raise OSError("No space left on device")
        real_log(values, step=step)

    wandb_tracker._run.log = failing  # type: ignore[attr-defined]
    for step in (1, 2, 3):
        logger.log({"step": step, "reward/mean": float(step)})
    logger.close()
    assert "wandb failed at step 2 (OSError: No space left on device)" in capsys.readouterr().out
    assert logger.trackers == []  # every tracker closed
    expected = read_jsonl(tmp_path)
    assert [step for step, _ in expected["reward/mean"]] == [1, 2, 3]
    assert read_swanlab(tmp_path)[0].series == expected  # the other tracker went on
    assert read_wandb(tmp_path)[0].series["reward/mean"] == [(1, 1.0)]


def test_a_tracker_that_cannot_start_leaves_the_run_to_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import wandb

    def refuse(**_: object) -> None:
        raise RuntimeError("wandb-core did not start\nmore detail")

    monkeypatch.setattr(wandb, "init", refuse)
    _log(tmp_path, ["jsonl", "wandb"], range(1, 3))
    out = capsys.readouterr().out
    assert "wandb did not start (RuntimeError: wandb-core did not start); this run logs without it" in out
    assert [step for step, _ in read_jsonl(tmp_path)["reward/mean"]] == [1, 2]


def _uninstalled(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    real = trackers.find_spec
    monkeypatch.setattr(trackers, "find_spec", lambda name: None if name in modules else real(name))


def test_a_tracker_not_installed_is_named_with_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    _uninstalled(monkeypatch, "swanlab", "alembic")
    assert tracker_problems(["jsonl", "tensorboard", "wandb"]) == []
    assert tracker_problems(["jsonl", "swanlab", "mlflow"]) == [
        "output.loggers names swanlab, but swanlab is not installed here: pip install 'rlc[trackers]' "
        "(or: pip install swanlab)",
        "output.loggers names mlflow, but alembic is not installed here: pip install 'rlc[trackers]' "
        "(or: pip install mlflow-skinny sqlalchemy alembic)",
    ]
    assert tracker_problems(["comet"]) == [
        "output.loggers names 'comet', which is no logger rlc knows (it logs to jsonl, tensorboard, wandb, swanlab, "
        "mlflow)"
    ]


def test_a_tracker_started_without_its_library_says_which_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _uninstalled(monkeypatch, "wandb")
    _log(tmp_path, ["jsonl", "wandb"], range(1, 2))
    assert "wandb did not start (ImportError: output.loggers names wandb, but wandb is not installed here: " in (
        capsys.readouterr().out
    )
    assert not (tmp_path / "wandb").exists()


def _plan_dir(tmp_path: Path, loggers: list[str]) -> Path:
    plan = cpu_plan(run_dir=str(tmp_path / "run"))
    plan.loggers = loggers
    spec = spec_from(CPU_SPEC, [f"output.loggers=[{','.join(loggers)}]"])
    emit_plan_dir(plan, spec, tmp_path / "plan", provenance={})
    return tmp_path / "plan"


def test_rlc_run_refuses_a_tracker_that_is_not_installed_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan_dir = _plan_dir(tmp_path, ["jsonl", "swanlab"])
    _uninstalled(monkeypatch, "swanlab")
    runner = CliRunner()
    dry = runner.invoke(app, ["run", str(plan_dir), "--dry-run"])
    assert dry.exit_code == 0, dry.output  # the layout is still shown
    assert "rlc run: warning: output.loggers names swanlab, but swanlab is not installed here: pip install " in (
        dry.output
    )
    run = runner.invoke(app, ["run", str(plan_dir)])
    assert run.exit_code == 2, run.output
    assert "rlc run: error: output.loggers names swanlab, but swanlab is not installed here: " in run.output
    assert "rlc[trackers]" in run.output and "Traceback" not in run.output
    assert not (tmp_path / "run").exists()  # refused before the run directory was touched


def test_a_spec_names_known_loggers_each_once() -> None:
    from rlc.compiler.validate import check_text

    def errors(loggers: str) -> set[tuple[str, str, str]]:
        checked = check_text(CPU_SPEC + f"output: {{loggers: {loggers}}}\n", "spec.yaml")
        return {(d.path, d.message, d.hint) for d in checked.report.errors}

    assert errors("[jsonl, comet]") == {
        (
            "output.loggers.1",
            "'comet' is not allowed",
            "expected 'jsonl', 'tensorboard', 'wandb', 'swanlab' or 'mlflow'",
        )
    }
    assert errors("[jsonl, mlflow, mlflow]") == {("output.loggers", "each logger once; repeated: mlflow", "")}
    assert errors("[jsonl, tensorboard, wandb, swanlab, mlflow]") == set()


def test_compiling_and_a_dry_run_import_no_tracker(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(CPU_SPEC + "output: {loggers: [jsonl, tensorboard, wandb, swanlab, mlflow]}\n")
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from rlc.cli import app\n"
        f"out = CliRunner().invoke(app, ['compile', {str(spec)!r}, '-o', {str(tmp_path / 'plan')!r}])\n"
        "assert out.exit_code == 0, out.output\n"
        f"out = CliRunner().invoke(app, ['run', {str(tmp_path / 'plan')!r}, '--dry-run'])\n"
        "assert out.exit_code == 0, out.output\n"
        "print(','.join(m for m in ('wandb', 'swanlab', 'mlflow') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
    assert json.loads((tmp_path / "plan" / "plan.json").read_text())["loggers"][2:] == ["wandb", "swanlab", "mlflow"]


def test_the_plan_summary_is_the_trackers_config() -> None:
    config = plan_config(cpu_plan())
    assert config["name"] == "quickstart" and config["target"] == "cpu"
    assert config["algorithm"]["lr"] == cpu_plan().algorithm.lr
    assert config["schedule"]["steps"] == cpu_plan().schedule.steps
    assert config["roles"]["actor"]["kind"] == "train" and config["roles"]["rollout"]["backend"] == "vllm"
    assert config["roles"]["actor"]["layout"] == cpu_plan().roles[0].layout.summary()  # type: ignore[union-attr]
    assert config["roles"]["rollout"]["layout"] == "tp1 pp1 cp1 ep1 dp1"
    assert json.loads(json.dumps(config)) == config  # what every tracker can store
