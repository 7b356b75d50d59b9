"""Checkpoint directories: written atomically, found again on `--resume`, pruned to the newest few.

A checkpoint is `RUN/checkpoints/step-NNNNNN/` holding the trainer's Hugging Face weights and optimizer
state (written by the trainer ranks) and `controller.json` (step, version, data cursor, RNG). It is built
under a temporary name and renamed into place only when complete, so an interrupted save never leaves a
checkpoint that `--resume` would trust.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

CONTROLLER_FILE = "controller.json"
COMPLETE_MARKER = "COMPLETE"
_NAME = re.compile(r"^step-(\d{6,})$")


@dataclass
class ControllerState:
    """What the controller needs to continue exactly where it stopped."""

    step: int
    version: int
    data_cursor: int
    rng: dict[str, Any] = field(default_factory=dict)
    plan_hash: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ControllerState:
        """The state written by `to_json`; ValueError saying what is wrong with anything else."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)}")
        for name in ("step", "version", "data_cursor"):
            value = data.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
        if not isinstance(data.get("rng", {}), dict) or not isinstance(data.get("plan_hash", ""), str):
            raise ValueError("rng must be an object and plan_hash a string")
        return cls(**data)


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def staging_dir(run_dir: Path, step: int) -> Path:
    """Where a checkpoint is assembled before it is renamed into place."""
    path = checkpoints_dir(run_dir) / f".step-{step:06d}.tmp"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def finalize(run_dir: Path, staged: Path, state: ControllerState, keep: int) -> Path:
    """Write the controller state and marker, rename into place, then prune older checkpoints."""
    (staged / CONTROLLER_FILE).write_text(state.to_json())
    (staged / COMPLETE_MARKER).write_text(f"{state.step}\n")
    final = checkpoints_dir(run_dir) / f"step-{state.step:06d}"
    if final.exists():
        shutil.rmtree(final)
    staged.rename(final)
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (incomplete or temporary ones are ignored)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _NAME.match(path.name)
        if match and (path / COMPLETE_MARKER).is_file() and (path / CONTROLLER_FILE).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


class CheckpointError(ValueError):
    """A complete checkpoint whose controller state cannot be read (a hand edit or a damaged disk)."""


def latest_checkpoint(run_dir: Path) -> tuple[Path, ControllerState] | None:
    """The newest complete checkpoint and its controller state; CheckpointError when that state is unreadable."""
    found = complete_checkpoints(run_dir)
    if not found:
        return None
    path = found[-1]
    try:
        return path, ControllerState.from_json((path / CONTROLLER_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{path / CONTROLLER_FILE} is unreadable: {exc}") from None
