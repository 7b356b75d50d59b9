"""The run's bound on a stall: work in flight and nothing finishing for longer than the plan allows.

A rollout engine that hangs without dying, or a trainer step that never returns, would otherwise leave the run
waiting silently forever (the engine pool's health check counts a busy engine as alive). The controller marks
progress whenever a generate request, an agent episode or a train step finishes; past the plan's
`schedule.stall_timeout_s` without any, it stops the run with what was in flight and for how long.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rlc.runtime.errors import RunError


class StallError(RunError):
    """Nothing finished within the plan's stall bound; the message says what was in flight."""


class StallWatch:
    def __init__(self, limit_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit_s = limit_s
        self._clock = clock
        self._last = clock()

    def progress(self) -> None:
        """Something finished: the bound starts again."""
        self._last = self._clock()

    def check(self, in_flight: Callable[[], str]) -> None:
        """Raise StallError when nothing has finished for longer than the bound."""
        idle = self._clock() - self._last
        if idle > self.limit_s:
            raise StallError(
                f"nothing finished for {idle:.0f} s, past the plan's stall bound of {self.limit_s:.0f} s "
                f"(schedule.stall_timeout_s); in flight: {in_flight() or 'nothing'}"
            )
