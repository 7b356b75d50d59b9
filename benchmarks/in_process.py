"""A `RolloutEngine` driven synchronously in this process, for benchmarks that time the engine without Ray's hop.

The engine is vLLM's async engine: its calls are coroutines that must all run on one event loop, which lives in a
thread here; every async method becomes a blocking call.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

__all__ = ["InProcessEngine"]


class InProcessEngine:
    """`RolloutEngine(*args, **kwargs)`, started, with blocking methods."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from rlc.runtime.rollout.engine import RolloutEngine

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-loop", daemon=True)
        self._thread.start()
        self.engine = RolloutEngine(*args, **kwargs)
        self.call(self.engine.ready())

    def call(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.engine, name)
        if asyncio.iscoroutinefunction(attr):
            return lambda *args, **kwargs: self.call(attr(*args, **kwargs))
        return attr

    def shutdown(self) -> None:
        self.call(self.engine.shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
