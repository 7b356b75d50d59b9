"""Colocated phase moves of the trainer: parameters, gradients and optimizer state to host and back.

Between a colocated run's train phases the engines need the devices, so the plan's offload steps move the
trainer's state to host memory and back (timed; see `runtime/colocate.PhaseSwitcher`). On cpu everything
already lives in host memory, so the moves are no-ops that take 0 s.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["PhaseMoves"]


class PhaseMoves:
    """Mixin of `TrainerWorker`: `offload` / `onload` for colocated phase switches."""

    model: Any
    optimizer: Any
    platform: Any
    device: torch.device
    _offloaded: set[str]

    def offload(self, what: Sequence[str]) -> float:
        """Move ``params`` / ``grads`` / ``optimizer`` state to host memory; returns seconds taken."""
        if self.platform.name == "cpu":
            return 0.0
        t0 = time.perf_counter()
        self._move(what, torch.device("cpu"))
        self._offloaded |= set(what)
        self.platform.synchronize()
        self.platform.empty_cache()
        return time.perf_counter() - t0

    def onload(self, what: Sequence[str]) -> float:
        """Bring back what ``offload`` moved to host memory; returns seconds taken (0.0 on cpu)."""
        if self.platform.name == "cpu":
            return 0.0
        t0 = time.perf_counter()
        self._move([w for w in what if w in self._offloaded], self.device)
        self._offloaded -= set(what)
        self.platform.synchronize()
        return time.perf_counter() - t0

    def _move(self, what: Sequence[str], device: torch.device) -> None:
        if "grads" in what:
            self.optimizer.zero_grad()  # gradients are dead between steps
        if "params" in what:
            self.model.to(device)  # FSDP2 moves the local shards of its DTensor parameters
        if "optimizer" in what and not (self.optimizer.offload and device.type != "cpu"):
            # Offloaded moments stay on the host; the optimizer brings them in one unit at a time.
            self.optimizer.move_state(device)
