"""Which accelerator a role runs on: cpu, cuda or npu, and what that implies.

Everything that differs between the three (the facts in `schemas.platforms`, and the device operations) is
looked up here, so trainers and
engines never branch on the platform name themselves. ``torch_npu`` is imported lazily, only when an
NPU platform actually touches the device, so this module imports on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlc.schemas.platforms import PLATFORM_FACTS, PlatformFacts, PlatformName

__all__ = ["PLATFORMS", "Platform", "PlatformName", "get_platform"]


@dataclass(frozen=True)
class Platform(PlatformFacts):
    """A platform's facts (`schemas.platforms`) and the device operations trainers and engines need."""

    @property
    def collective_backend(self) -> str:
        """Alias of ``dist_backend`` for readers who think in collectives."""
        return self.dist_backend

    def _ensure_backend(self) -> None:
        # torch_npu registers the "npu" device type and hccl backend on import; nothing else needs it.
        if self.name == "npu":
            import torch_npu  # noqa: F401

    def device_for_rank(self, local_rank: int) -> torch.device:
        """The device a process with this local rank should use (always ``cpu`` on cpu)."""
        if self.name == "cpu":
            return torch.device("cpu")
        self._ensure_backend()
        return torch.device(self.device_type, local_rank)

    def set_device(self, local_rank: int) -> torch.device:
        """Bind the current process to its device (no-op on cpu) and return it."""
        device = self.device_for_rank(local_rank)
        if self.name != "cpu":
            getattr(torch, self.device_type).set_device(device)
        return device

    def empty_cache(self) -> None:
        """Release cached allocator blocks, e.g. after training before the engine wakes up."""
        if self.name == "cpu":
            return
        self._ensure_backend()
        getattr(torch, self.device_type).empty_cache()

    def synchronize(self) -> None:
        """Wait for queued device work, so timings measure the work and not its launch."""
        if self.name == "cpu":
            return
        self._ensure_backend()
        getattr(torch, self.device_type).synchronize()


PLATFORMS: dict[str, Platform] = {name: Platform(**vars(facts)) for name, facts in PLATFORM_FACTS.items()}


def get_platform(name: str | Platform) -> Platform:
    """Look a platform up by name (``cpu``, ``cuda``, ``npu``); a Platform passes through unchanged."""
    if isinstance(name, Platform):
        return name
    try:
        return PLATFORMS[name]
    except KeyError:
        raise ValueError(f"unknown platform {name!r}; expected one of {sorted(PLATFORMS)}") from None
