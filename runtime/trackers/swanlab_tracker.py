"""SwanLab, logging locally: the run goes to RUN/swanlab/run-*, which `swanlab sync` uploads.

SwanLab's `offline` mode, which writes every metric and the config under the run directory and needs no account or
network. (Its older `local` mode adds a dashboard database through swanboard, which SwanLab no longer maintains; the
offline record is what its tools read.) The run id is kept in RUN/swanlab, so a resumed rlc run continues the same
SwanLab run (`resume="allow"`); each attempt writes its own run-* folder under that id, and `swanlab sync` uploads
them into one run. Terminal capture is off, and rlc keeps its own Ctrl-C handling (a checkpointed stop).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

from rlc.runtime.trackers import tracker_run_id

FOLDER = "swanlab"


class SwanlabTracker:
    name = "swanlab"

    def __init__(self, run: Any) -> None:
        self._run = run

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self, finished: bool) -> None:
        self._run.finish(state="success" if finished else "aborted")


def start(run_dir: Path, run_name: str, config: dict[str, Any], start_step: int) -> SwanlabTracker:
    import swanlab

    folder = run_dir / FOLDER
    run_id, resumed = tracker_run_id(folder, start_step)
    settings = swanlab.Settings(
        mode="offline",
        log_dir=folder,
        interactive=False,
        terminal=swanlab.Settings.Terminal(proxy_type="none"),
        run=swanlab.Settings.Run(id=run_id, resume="allow" if resumed else "never"),
    )
    main = threading.current_thread() is threading.main_thread()
    sigint = signal.getsignal(signal.SIGINT) if main else None
    run = swanlab.init(
        project=os.environ.get("SWANLAB_PROJ_NAME") or "rlc", name=run_name, config=config, settings=settings
    )
    if main:  # SwanLab's handler would end its run at the first Ctrl-C, before rlc's checkpointed stop
        signal.signal(signal.SIGINT, sigint)
    return SwanlabTracker(run)
