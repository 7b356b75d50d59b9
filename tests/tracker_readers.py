"""Read back what each tracker wrote under a run directory, through the tracker's own files and APIs.

Each reader returns {key: [(step, value), ...]} per tracker run, in the order the runs were written, and the run's
config as the tracker recorded it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

Series = dict[str, list[tuple[int, float]]]


@dataclass
class TrackerRun:
    run_id: str
    series: Series = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)


def read_wandb(run_dir: Path) -> list[TrackerRun]:
    """Each offline W&B run folder under RUN/wandb, as W&B's own reader of its .wandb log prints it (`wandb leet
    inspect --json`): its history rows (wandb's `_step` is the step) and config."""
    runs = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        command = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(folder)]
        out = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
        run = TrackerRun(run_id="")
        for line in out.stdout.splitlines():
            record = json.loads(line)
            if record["type"] == "run":
                run.run_id = record["run"]["run_id"]
                update = record["run"].get("config", {}).get("update", {})
                run.config = {key: value for key, value in update.items() if key != "_wandb"}
            elif record["type"] == "history":
                row = record["history"]["item"]
                for key, value in row.items():
                    if not key.startswith("_"):
                        run.series.setdefault(key, []).append((int(row["_step"]), float(value)))
        runs.append(run)
    return runs


def read_swanlab(run_dir: Path) -> list[TrackerRun]:
    """Each SwanLab run folder under RUN/swanlab: the scalars of its record file (read by SwanLab's own reader) and
    its config.yaml."""
    from swanlab.proto.swanlab.record.v1 import record_pb2
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    runs = []
    for path in sorted((run_dir / "swanlab").glob("run-*/run-*.swanlab")):
        run = TrackerRun(run_id="")
        reader = DataStoreReader()
        reader.open(path)
        for raw in reader:
            record = record_pb2.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "start":
                run.run_id = record.start.id
            elif kind == "scalar" and not record.scalar.key.startswith("__swanlab__."):  # not its system monitor
                run.series.setdefault(record.scalar.key, []).append((record.scalar.step, record.scalar.value.number))
        reader.close()
        config = yaml.safe_load((path.parent / "files" / "config.yaml").read_text())
        run.config = {key: entry["value"] for key, entry in config.items()}
        runs.append(run)
    return runs


def mlflow_client(run_dir: Path) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{(run_dir / 'mlflow' / 'mlflow.db').resolve()}")


def read_mlflow(run_dir: Path) -> list[TrackerRun]:
    """Each MLflow run in RUN/mlflow/mlflow.db, through MLflow's client: metric histories (ordered by step, then
    time) and params."""
    client = mlflow_client(run_dir)
    runs = []
    for experiment in client.search_experiments():
        for found in client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"]):
            run = TrackerRun(run_id=found.info.run_id, config=dict(found.data.params))
            for key in found.data.metrics:
                history = client.get_metric_history(found.info.run_id, key)
                ordered = sorted(history, key=lambda m: (m.step, m.timestamp))
                run.series[key] = [(m.step, m.value) for m in ordered]
            runs.append(run)
    return runs


def read_jsonl(run_dir: Path) -> Series:
    """metrics.jsonl as the same series: the numeric values of each step (what the trackers chart)."""
    series: Series = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                series.setdefault(key, []).append((row["step"], float(value)))
    return series
