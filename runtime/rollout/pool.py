"""`RolloutPool`: the rollout engine actors of a run, and their restart when one dies."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from rlc.runtime.launch_request import engine_workers
from rlc.runtime.rollout.client import EngineClient
from rlc.schemas.plan import Plan
from rlc.schemas.platforms import PLATFORM_FACTS

__all__ = ["ENGINE_START_TIMEOUT_S", "RolloutPool"]

#: Seconds an engine may take to load its model and start (vLLM start-up is tens of seconds here).
ENGINE_START_TIMEOUT_S = 900


class RolloutPool:
    """The rollout engine actors, with restart on failure.

    Both controller threads may find a dead engine (the driver through a failed generate call, the trainer
    thread through a failed weight sync), so restarts happen under a lock and only for engines that are
    really gone.
    """

    def __init__(self, plan: Plan, make_engine) -> None:  # type: ignore[no-untyped-def]
        self.plan = plan
        self._make = make_engine
        role = plan.roles_of("rollout")[0]
        self.replicas = role.replicas
        self.workers = engine_workers(role)  # each a rank of the broadcast group
        self.sync_backend = PLATFORM_FACTS[plan.platform].dist_backend
        self.engines = [EngineClient(make_engine(i, 0)) for i in range(self.replicas)]
        self.restarts = 0
        self._lock = threading.Lock()

    def ready_refs(self) -> list[Any]:
        """One reference per engine that resolves once it is serving (or raises the error that stopped it)."""
        return [e.ready() for e in self.engines]

    def wait_ready(self, timeout: float = ENGINE_START_TIMEOUT_S) -> list[float]:
        import ray

        return ray.get(self.ready_refs(), timeout=timeout)

    def _alive(self, index: int, timeout: float = 120.0) -> bool:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return bool(ray.get(self.engines[index].healthy(), timeout=timeout))
        except RayActorError:
            return False
        except GetTimeoutError:
            return True  # busy (queued behind a long generate), not dead

    def revive(self, indices: list[int] | None = None, force: bool = False) -> list[int]:
        """Restart whichever of `indices` (default: all) are dead, or all of them with ``force`` (an actor
        alive around a dead vLLM core); returns the restarted ones.

        A restarted engine holds the base weights, so it is stamped with version -1 until the controller
        loads the current weights into it: anything it generates before then is recognisably stale.
        """
        import ray

        restarted = []
        with self._lock:
            for index in indices if indices is not None else range(len(self.engines)):
                if not force and self._alive(index):
                    continue
                with contextlib.suppress(Exception):
                    ray.kill(self.engines[index].actor, no_restart=True)
                self.engines[index] = EngineClient(self._make(index, -1))
                ray.get(self.engines[index].ready(), timeout=ENGINE_START_TIMEOUT_S)
                self.restarts += 1
                restarted.append(index)
        return restarted

    def shutdown(self) -> None:
        import ray

        for engine in self.engines:
            with contextlib.suppress(Exception):
                ray.kill(engine.actor, no_restart=True)
        self.engines = []
