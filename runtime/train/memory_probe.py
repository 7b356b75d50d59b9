"""Measured peak memory of one trainer rank per phase, to set beside the planner's estimate.

On accelerators this is the allocator's peak (``max_memory_allocated``, reset at each phase start). On cpu,
where "device memory" is the worker process's share of host RAM, it is the resident-set high-water mark
(``VmHWM``, reset by writing 5 to ``/proc/self/clear_refs``) above the process's resident size just before
the model was loaded: interpreter, torch and transformers themselves are outside the budget, as in the cpu
target's definition of usable memory. Freed heap that glibc keeps (it does not return small frees to the
OS) would carry one phase's peak into the next, so each phase starts with ``malloc_trim``. Where the
high-water mark cannot be reset the figure is the peak since start and is flagged as such.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ..platform import Platform

__all__ = ["PeakMemory", "measured"]

F = TypeVar("F", bound=Callable[..., Any])

GIB = 1024**3
CPU_FIRST_CALLS = 5
CPU_EVERY = 25
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _trim_heap() -> None:
    """Return freed heap to the OS (glibc), so the resident size is what is live."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class PeakMemory:
    """Per-phase peaks in GiB; the maximum over every time a phase ran."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self.peaks: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.resettable = True
        self.baseline_bytes = 0
        if platform.name == "cpu":
            self.baseline_bytes = (_status_kib("VmRSS") or 0) * 1024

    def _module(self):  # type: ignore[no-untyped-def]
        import torch

        self.platform._ensure_backend()
        return getattr(torch, self.platform.device_type)

    def wants(self, phase: str) -> bool:
        """Whether this call of `phase` is measured. Accelerators: every call (resetting the allocator's peak
        is free). cpu: the first `CPU_FIRST_CALLS` and then every `CPU_EVERY`-th, because resetting the
        high-water mark walks the process's page tables and trims the heap, ~40 ms a call on the quickstart
        (18% of its train step); micro-batches keep their token budget, so later calls peak alike."""
        n = self.calls[phase] = self.calls.get(phase, 0) + 1
        return self.platform.name != "cpu" or n <= CPU_FIRST_CALLS or n % CPU_EVERY == 0

    def start(self) -> None:
        """Reset the high-water mark: the next `stop` reports this phase's peak."""
        if self.platform.name == "cpu":
            _trim_heap()
            try:
                _CLEAR_REFS.write_text("5")
            except OSError:
                self.resettable = False
            return
        self._module().reset_peak_memory_stats()

    def stop(self, phase: str) -> float:
        """Record and return the peak since `start` (GiB)."""
        if self.platform.name == "cpu":
            peak = ((_status_kib("VmHWM") or 0) * 1024 - self.baseline_bytes) / GIB
        else:
            peak = self._module().max_memory_allocated() / GIB
        self.peaks[phase] = max(self.peaks.get(phase, 0.0), peak)
        return peak

    def report(self) -> dict[str, object]:
        kind = "allocator peak" if self.platform.name != "cpu" else "resident-set peak above the pre-load baseline"
        return {
            "method": kind if self.resettable else kind + " (high-water mark not resettable: peak since start)",
            "baseline_gib": round(self.baseline_bytes / GIB, 4),
            "peak_gib": {k: round(v, 4) for k, v in sorted(self.peaks.items())},
            "measured_calls": "every call"
            if self.platform.name != "cpu"
            else f"the first {CPU_FIRST_CALLS} of each phase, then every {CPU_EVERY}th",
        }


def measured(phase: str) -> Callable[[F], F]:
    """Record the peak memory of a trainer method under `phase` (the instance's `memory` probe)."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.memory.wants(phase):
                return fn(self, *args, **kwargs)
            self.memory.start()
            try:
                return fn(self, *args, **kwargs)
            finally:
                self.memory.stop(phase)

        return run  # type: ignore[return-value]

    return wrap
