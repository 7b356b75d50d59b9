"""`rlc run` end to end on the CPU default: a real local Ray, a vLLM engine and an FSDP2 trainer.

These start engines (tens of seconds each on two cores), so they are marked slow; CI runs them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from paths import REPO

from rlc.runtime.metrics import REQUIRED_KEYS

QUICKSTART = REPO / "examples" / "quickstart.yaml"
RLC = [sys.executable, "-m", "rlc"]

pytestmark = pytest.mark.slow


def compile_quickstart(tmp_path: Path, *overrides: str) -> Path:
    plan = tmp_path / "plan"
    sets = [f"output.dir={tmp_path / 'run'}", *overrides]
    args = [*RLC, "compile", str(QUICKSTART), "-o", str(plan)]
    for item in sets:
        args += ["--set", item]
    subprocess.run(args, check=True, capture_output=True, text=True)
    return plan


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_interrupt_then_resume_continues_numbering(tmp_path: Path) -> None:
    plan = compile_quickstart(
        tmp_path,
        "algorithm.steps=40",
        "algorithm.max_staleness=1",
        "output.checkpoint_every=5",
        "output.loggers=[jsonl,tensorboard,wandb,swanlab,mlflow]",
    )
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([*RLC, "run", str(plan)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(read_metrics(run_dir)) < 12 and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=180)[0]
    assert "interrupted" in output
    assert "Traceback" not in output, output[-3000:]
    interrupted_at = len(read_metrics(run_dir))
    assert 12 <= interrupted_at < 40
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    assert checkpoints, "a checkpoint must survive the interrupt"
    assert all((c / "COMPLETE").exists() for c in checkpoints)
    resumed_from = int(checkpoints[-1].name.split("-")[1])

    result = subprocess.run([*RLC, "run", str(plan), "--resume"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"resumed from step-{resumed_from:06d}" in result.stdout
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 41))
    for key in REQUIRED_KEYS:
        assert all(key in r for r in rows), f"missing {key}"
    assert all(r["staleness/max"] <= 1 for r in rows)  # the quickstart's max_staleness
    # max_staleness 1: the engine generates the next batch while the trainer trains (RUN/trace.json shows it)
    assert sum(r["time/overlap_s"] > 0 for r in rows) >= len(rows) // 2, [r["time/overlap_s"] for r in rows]
    events = json.loads((run_dir / "trace.json").read_text().rstrip().rstrip(",") + "]")
    names = {e["name"].split(" #")[0] for e in events}
    assert {"generate", "train", "weight sync", "build batch"} <= names
    assert len({e["pid"] for e in events}) == 2  # the first process and the resumed one
    assert (run_dir / "tensorboard").is_dir()
    _assert_trackers_continued(run_dir, interrupted_at, resumed_from)
    from layout_record import assert_layout_as_planned

    from rlc.compiler.manifest import load_plan

    assert_layout_as_planned(run_dir, load_plan(plan))
    assert "report: " in result.stdout and (run_dir / "report" / "reward.png").is_file()  # written at the end
    from rlc.runtime.run_dir import RUN_ARTIFACTS

    # `--overwrite` moves exactly these aside: a file the run writes but the list lacks would be lost to a rerun.
    assert {p.name for p in run_dir.iterdir()} - {"model"} <= set(RUN_ARTIFACTS)  # model: the quickstart's input


def _assert_trackers_continued(run_dir: Path, interrupted_at: int, resumed_from: int) -> None:
    """W&B and SwanLab: one offline record per attempt under one run id, the second holding what metrics.jsonl
    holds from the checkpoint on; MLflow: one run whose latest value at every step is metrics.jsonl's."""
    from tracker_readers import mlflow_client, read_jsonl, read_mlflow, read_swanlab, read_wandb

    expected = read_jsonl(run_dir)
    resumed = {key: [(s, v) for s, v in points if s > resumed_from] for key, points in expected.items()}
    resumed = {key: points for key, points in resumed.items() if points}
    for name, read in (("wandb", read_wandb), ("swanlab", read_swanlab)):
        first, second = read(run_dir)
        assert first.run_id == second.run_id, name
        assert [s for s, _ in first.series["reward/mean"]] == list(range(1, interrupted_at + 1)), name
        assert second.series == resumed, name
        assert first.config["name"] == "quickstart" and first.config["roles"]["actor"]["kind"] == "train", name
    (run,) = read_mlflow(run_dir)
    latest = {key: sorted(dict(points).items()) for key, points in run.series.items()}  # a step's later value wins
    assert latest == expected
    assert run.config["name"] == "quickstart" and run.config["roles.actor.kind"] == "train"
    assert mlflow_client(run_dir).get_run(run.run_id).info.status == "FINISHED"


def test_rollout_engine_killed_mid_run_is_restarted(tmp_path: Path) -> None:
    import ray

    from rlc.compiler.manifest import load_plan
    from rlc.runtime.launch import run_plan

    plan_dir = compile_quickstart(
        tmp_path, "algorithm.steps=16", "algorithm.max_staleness=1", "output.checkpoint_every=100"
    )
    plan = load_plan(plan_dir)
    run_dir = tmp_path / "run"
    killed: list[str] = []

    def killer() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and len(read_metrics(run_dir)) < 4:
            time.sleep(0.1)
        actor = ray.get_actor("rlc-rollout-0")
        ray.kill(actor, no_restart=True)
        killed.append("rlc-rollout-0")

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    steps = run_plan(plan, run_dir)
    thread.join(timeout=10)
    assert killed
    assert steps == 16
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 17))
    assert rows[-1]["rollout/engine_restarts"] >= 1


def test_missing_model_is_clear_before_any_actor(tmp_path: Path) -> None:
    plan = compile_quickstart(tmp_path, "model.path=/nonexistent/model")
    result = subprocess.run([*RLC, "run", str(plan)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "model folder not found: /nonexistent/model" in result.stderr
    assert "Traceback" not in result.stderr
    assert "local Ray" not in result.stdout


def test_bad_dataset_is_clear_before_any_actor(tmp_path: Path) -> None:
    plan = compile_quickstart(tmp_path / "missing", f"data.train={tmp_path / 'missing.jsonl'}")
    result = subprocess.run([*RLC, "run", str(plan)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "dataset file not found" in result.stderr
    assert "local Ray" not in result.stdout
    bad = tmp_path / "data.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\nnot json\n')
    plan = compile_quickstart(tmp_path / "malformed", f"data.train={bad}")
    result = subprocess.run([*RLC, "run", str(plan)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert f"{bad}:2: invalid JSON" in result.stderr
    assert "Traceback" not in result.stderr and "local Ray" not in result.stdout


def test_tampered_plan_is_refused_before_any_import(tmp_path: Path) -> None:
    plan = compile_quickstart(tmp_path)
    plan_json = plan / "plan.json"
    plan_json.write_text(plan_json.read_text().replace('"steps": 600', '"steps": 81'))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([*RLC, "run", str(plan)], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 1
    assert "plan.json" in result.stderr
    assert "recompile" in result.stderr


def test_a_cluster_left_by_ray_start_does_not_capture_the_embedded_ray(tmp_path: Path) -> None:
    """`ray start` records its cluster in Ray's temp dir; without RAY_ADDRESS, `rlc run` still starts its own."""
    from rlc.compiler.manifest import load_plan

    plan_dir = compile_quickstart(tmp_path)
    plan = load_plan(plan_dir)
    ray_tmp = Path(tempfile.mkdtemp(prefix="rlc-ray-", dir="/tmp"))  # short: Ray's unix sockets live under it
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:9\n")  # a cluster that is gone
    program = (
        "import json, ray\n"
        "from rlc.compiler.manifest import load_plan\n"
        "from rlc.runtime.launch import start_ray\n"
        f"plan = load_plan({str(plan_dir)!r})\n"
        "started = start_ray(plan, print)\n"
        "devices = ray.cluster_resources().get(plan.cluster.ray_resource)\n"
        "print(json.dumps({'started': started, 'devices': devices}))\n"
        "ray.shutdown()\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    try:
        result = subprocess.run(
            [sys.executable, "-c", program],
            capture_output=True,
            text=True,
            timeout=180,
            env={**clean, "RAY_TMPDIR": str(ray_tmp)},
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found == {"started": True, "devices": float(plan.cluster.total_devices)}
