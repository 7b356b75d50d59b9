"""Weights & Biases in offline mode: the run's history goes to RUN/wandb/offline-run-*, which `wandb sync` uploads.

Offline, because a run must not depend on reaching wandb.ai (nor slow down when it cannot). The W&B run id is kept
in RUN/wandb, so a resumed rlc run continues the same W&B run (`resume="allow"`); each attempt writes its own
offline-run folder, and `wandb sync` of them in order makes one run. Console capture is off: rlc's own output stays
as it is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlc.runtime.trackers import tracker_run_id

FOLDER = "wandb"


class WandbTracker:
    name = "wandb"

    def __init__(self, run: Any) -> None:
        self._run = run

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self, finished: bool) -> None:
        import wandb

        self._run.finish(exit_code=0 if finished else 1)
        # `finish` can return before W&B's service has written the last records of an offline run; `teardown`
        # waits for it (and stops it: the driver starts no other W&B run), so the run folder is whole once rlc
        # says the run is done.
        wandb.teardown()


def start(run_dir: Path, run_name: str, config: dict[str, Any], start_step: int) -> WandbTracker:
    os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # no crash reports sent from a training run
    import wandb

    run_id, resumed = tracker_run_id(run_dir / FOLDER, start_step)
    run = wandb.init(
        project=os.environ.get("WANDB_PROJECT") or "rlc",
        name=run_name,
        id=run_id,
        resume="allow" if resumed else None,
        dir=str(run_dir),  # W&B writes into DIR/wandb
        mode="offline",
        config=config,
        settings=wandb.Settings(console="off"),
    )
    return WandbTracker(run)
