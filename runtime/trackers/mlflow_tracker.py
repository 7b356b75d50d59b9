"""MLflow, in a SQLite store under the run directory: RUN/mlflow/mlflow.db (`mlflow ui --backend-store-uri
sqlite:///RUN/mlflow/mlflow.db` shows it).

SQLite rather than a `file:` store: MLflow 3 keeps the file store in maintenance mode and refuses it unless
MLFLOW_ALLOW_FILE_STORE is set. Through an `MlflowClient` bound to that store, not MLflow's process-wide active run,
so nothing else in the process (a user's reward code that uses MLflow) is redirected. The plan's summary becomes
the run's params (flattened to dotted keys); a resumed rlc run reopens the same MLflow run (its id is kept in
RUN/mlflow), and the steps it logs again after the checkpoint get a second, later value at those steps.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from rlc.runtime.checkpoint import write_durably
from rlc.runtime.trackers import ID_FILE

FOLDER = "mlflow"

#: MLflow's per-request limits for `log_batch` (params, metrics), and a param value length every store accepts.
MAX_PARAMS, MAX_METRICS, MAX_PARAM_CHARS = 100, 1000, 500


class MlflowTracker:
    name = "mlflow"

    def __init__(self, client: Any, run_id: str) -> None:
        self._client = client
        self.run_id = run_id

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in values.items()]
        for first in range(0, len(metrics), MAX_METRICS):
            self._client.log_batch(self.run_id, metrics=metrics[first : first + MAX_METRICS])

    def close(self, finished: bool) -> None:
        self._client.set_terminated(self.run_id, status="FINISHED" if finished else "KILLED")


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config as MLflow params: dotted keys, and values as text (lists and nulls as JSON)."""
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            params.update(flatten(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
            params[name] = text[:MAX_PARAM_CHARS]
    return params


def start(run_dir: Path, run_name: str, config: dict[str, Any], start_step: int) -> MlflowTracker:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no usage reports sent from a training run
    from mlflow.entities import Param, RunStatus
    from mlflow.tracking import MlflowClient

    folder = (run_dir / FOLDER).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    id_file = folder / ID_FILE
    if start_step > 0 and id_file.is_file():
        run_id = id_file.read_text().strip()
        client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        return MlflowTracker(client, run_id)
    experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "rlc"
    experiment = client.get_experiment_by_name(experiment_name)
    experiment_id = (
        experiment.experiment_id
        if experiment is not None
        else client.create_experiment(experiment_name, artifact_location=(folder / "artifacts").as_uri())
    )
    run = client.create_run(experiment_id, run_name=run_name)
    params = [Param(key, value) for key, value in flatten(config).items()]
    for first in range(0, len(params), MAX_PARAMS):
        client.log_batch(run.info.run_id, params=params[first : first + MAX_PARAMS])
    write_durably(id_file, f"{run.info.run_id}\n")
    return MlflowTracker(client, run.info.run_id)
