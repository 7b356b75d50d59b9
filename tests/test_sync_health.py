"""An engine that dies during a weight sync is named and restarted within a health check, not at the stall bound.

A vLLM core killed mid-broadcast can leave the engine's collective RPC waiting for ever; the sync then waited for the
plan's stall bound (540 s of silence measured) before anything was said.
"""

from __future__ import annotations

import types

import pytest

from rlc.runtime import weight_push
from rlc.runtime.weight_push import EngineLost, WeightPush


class Engine:
    def __init__(self, healthy: bool) -> None:
        self._healthy = healthy

    def healthy(self) -> tuple[str, bool]:
        return ("health", self._healthy)


def _fake_ray(monkeypatch: pytest.MonkeyPatch, waits: list[float]) -> None:
    import ray

    def wait(refs, num_returns, timeout):  # type: ignore[no-untyped-def]
        waits.append(timeout)
        return [], list(refs)  # the sync's calls never return

    def get(ref, timeout=None):  # type: ignore[no-untyped-def]
        if isinstance(ref, tuple) and ref[0] == "health":
            return ref[1]
        return []

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", get)


def test_a_dead_engine_is_named_at_the_first_health_check(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    _fake_ray(monkeypatch, waits)
    with pytest.raises(EngineLost, match=r"engine\(s\) 3 died during the weight sync"):
        weight_push._bounded(["call"], {2: Engine(True), 3: Engine(False)})
    assert waits == [weight_push.HEALTH_EVERY_S]  # one wait of one health period, not the sync's whole bound


def test_healthy_engines_keep_the_sync_waiting_until_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlc.runtime.errors import RunError

    waits: list[float] = []
    _fake_ray(monkeypatch, waits)
    monkeypatch.setattr(weight_push, "SYNC_TIMEOUT_S", 0.0)
    with pytest.raises(RunError, match="did not finish within"):
        weight_push._bounded(["call"], {0: Engine(True)})


def test_the_sync_restarts_the_lost_engine_and_syncs_again() -> None:
    push = object.__new__(WeightPush)
    messages: list[str] = []
    attempts: list[int] = []

    def sync_once(version: int) -> None:
        attempts.append(version)
        if len(attempts) == 1:
            raise EngineLost([1])

    push._sync_once = sync_once  # type: ignore[method-assign]
    push.message = messages.append
    push.trainer = types.SimpleNamespace(close_weight_sync=lambda: None)
    push.rollout = types.SimpleNamespace(revive=lambda: [1])
    push._group = ("host", 1)
    restarted: list[int] = []
    push.sync(5, restarted.append)
    assert attempts == [5, 5] and restarted == [1] and push.synced_version == 5
    assert "engine(s) 1 died during the weight sync" in messages[0] and "retrying" in messages[0]
