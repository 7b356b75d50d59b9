"""Experiment trackers beside metrics.jsonl: Weights & Biases, SwanLab and MLflow, each through its own library.

Each one writes under the run directory and never uses the network: W&B and SwanLab in their offline modes (their
`sync` commands upload a run later), MLflow to a SQLite store. Only the trackers a plan names are imported, when the
run starts; `tracker_problems` lets `rlc run` (and its dry run) refuse a plan whose tracker is not installed before
anything starts. metrics.jsonl is written before any tracker sees a step, so a tracker that fails loses nothing.
"""

from __future__ import annotations

import importlib
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rlc.runtime.checkpoint import write_durably

if TYPE_CHECKING:
    from rlc.schemas.plan import Plan

#: The sinks metrics.py writes itself (they come with the runtime).
BUILTIN_LOGGERS: tuple[str, ...] = ("jsonl", "tensorboard")

#: The pip extra that installs every tracker.
EXTRA = "trackers"

#: The file in a tracker's folder that holds its run's id, so that a resumed rlc run continues the same run.
ID_FILE = "rlc-run-id"


@dataclass(frozen=True)
class TrackerKind:
    """A tracker `output.loggers` can name: the modules it imports and the module of rlc that drives it."""

    name: str
    modules: tuple[str, ...]
    requirement: str
    driver: str


TRACKERS: dict[str, TrackerKind] = {
    kind.name: kind
    for kind in (
        TrackerKind("wandb", ("wandb",), "wandb", "wandb_tracker"),
        TrackerKind("swanlab", ("swanlab",), "swanlab", "swanlab_tracker"),
        # mlflow-skinny has no SQL store of its own: SQLAlchemy and Alembic make it (MLflow's full package has them).
        TrackerKind(
            "mlflow", ("mlflow", "sqlalchemy", "alembic"), "mlflow-skinny sqlalchemy alembic", "mlflow_tracker"
        ),
    )
}


class Tracker(Protocol):
    """One open tracker run: a step's numeric metrics go in, and it is closed once at the end."""

    name: str

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self, finished: bool) -> None: ...


def tracker_problems(loggers: Iterable[str]) -> list[str]:
    """What stops the named loggers from starting here: a name rlc does not know (a hand-edited plan), or a tracker
    whose library is not installed, with the extra that installs it."""
    problems = []
    for name in loggers:
        if name in BUILTIN_LOGGERS:
            continue
        kind = TRACKERS.get(name)
        if kind is None:
            known = ", ".join([*BUILTIN_LOGGERS, *TRACKERS])
            problems.append(f"output.loggers names {name!r}, which is no logger rlc knows (it logs to {known})")
            continue
        missing = [module for module in kind.modules if find_spec(module) is None]
        if missing:
            problems.append(
                f"output.loggers names {name}, but {', '.join(missing)} is not installed here: "
                f"pip install 'rlc[{EXTRA}]' (or: pip install {kind.requirement})"
            )
    return problems


def open_tracker(name: str, run_dir: Path, run_name: str, config: dict[str, Any], start_step: int) -> Tracker:
    """Start tracker `name` for the run in `run_dir` (importing its library only now); `start_step` > 0 resumes."""
    kind = TRACKERS[name]
    problems = tracker_problems([name])
    if problems:
        raise ImportError(problems[0])
    driver = importlib.import_module(f"{__name__}.{kind.driver}")
    return driver.start(run_dir, run_name, config, start_step)


def tracker_run_id(folder: Path, start_step: int) -> tuple[str, bool]:
    """The id of the tracker's run and whether it continues an earlier one: a resumed rlc run (`start_step` > 0)
    reuses the id kept in the folder; a new run draws one and keeps it there."""
    path = folder / ID_FILE
    if start_step > 0 and path.is_file():
        kept = path.read_text().strip()
        if kept:
            return kept, True
    folder.mkdir(parents=True, exist_ok=True)
    new = secrets.token_hex(8)
    write_durably(path, f"{new}\n")
    return new, False


def plan_config(plan: Plan) -> dict[str, Any]:
    """The plan's summary that each tracker records as the run's config (MLflow: its params): what was trained with
    which settings on which layout, and what the planner expected of it."""
    data = plan.model_dump(mode="json")
    keep = ("name", "rlc_version", "spec_hash", "target", "cluster", "model", "algorithm", "sampling", "data")
    config: dict[str, Any] = {key: data[key] for key in keep}
    config["schedule"] = {key: value for key, value in data["schedule"].items() if key != "offload"}
    for key in ("lora", "distill", "agent"):
        if data.get(key) is not None:
            config[key] = data[key]
    config["roles"] = {
        role.name: {
            "kind": role.kind,
            "backend": role.backend,
            "devices": role.devices,
            "replicas": role.replicas,
            "layout": role.layout.summary() if role.layout is not None else _parallel(role.parallel.model_dump()),
        }
        for role in plan.roles
    }
    config["estimates"] = data["estimates"]
    return config


def _parallel(degrees: dict[str, int]) -> str:
    return " ".join(f"{name}{degree}" for name, degree in degrees.items())
