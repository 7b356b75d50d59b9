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
    messages: list[str] = []
    attempts: list[int] = []
    push = _built_push(types.SimpleNamespace(revive=lambda: [1]), messages.append)

    def sync_once(version: int, deadline: float) -> None:
        attempts.append(version)
        if len(attempts) == 1:
            raise EngineLost([1])

    push._sync_once = sync_once  # type: ignore[method-assign]
    push._group = ("host", 1)
    restarted: list[int] = []
    push.sync(5, restarted.append)
    assert attempts == [5, 5] and restarted == [1] and push.synced_version == 5
    assert "engine(s) 1 died during the weight sync" in messages[0] and "retrying" in messages[0]


# ------------------------------------------------------------------- connection errors, stuck engines, one bound


def _push(monkeypatch: pytest.MonkeyPatch, failures: list[BaseException], dead: list[int], stuck: list[int]):  # type: ignore[no-untyped-def]
    """A WeightPush whose attempts raise `failures` in turn, whose engines `dead` are dead, and whose engines
    `stuck` had calls still running when an attempt failed; records what it did."""
    seen: dict[str, list] = {"deadlines": [], "revive": [], "messages": []}

    def sync_once(version: int, deadline: float) -> None:
        seen["deadlines"].append(deadline)
        if failures:
            raise failures.pop(0)

    def revive(indices=None, force=False):  # type: ignore[no-untyped-def]
        seen["revive"].append((indices, force))
        return list(indices) if force else list(dead)

    rollout = types.SimpleNamespace(revive=revive, engines=["e0", "e1"], sync_backend="gloo")
    push = _built_push(rollout, seen["messages"].append)
    push._sync_once = sync_once  # type: ignore[method-assign]
    push._group = ("host", 1)
    monkeypatch.setattr(weight_push, "_dead", lambda engines: list(dead))
    monkeypatch.setattr(WeightPush, "_stuck", lambda self: list(stuck))
    return push, seen


def _refused() -> BaseException:
    from ray.exceptions import RayTaskError

    cause = RuntimeError("[gloo/transport/tcp/pair.cc:144] connect [127.0.1.1]:29517: Connection refused")
    return RayTaskError("init_sync_group", "Traceback (most recent call last): ...", cause)


def test_a_connection_error_with_every_engine_alive_stops_at_once_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rlc.runtime.errors import RunError

    push, seen = _push(monkeypatch, [_refused()], dead=[], stuck=[0, 1])
    with pytest.raises(RunError, match="RLC_SOCKET_IFNAME") as caught:
        push.sync(4, lambda index: None)
    assert "Connection refused" in str(caught.value) and "--resume" in str(caught.value)
    assert len(seen["deadlines"]) == 1 and seen["revive"] == []  # not retried as an engine death


def test_a_connection_error_after_an_engine_died_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    push, seen = _push(monkeypatch, [_refused()], dead=[1], stuck=[])
    restarted: list[int] = []
    push.sync(4, restarted.append)
    assert restarted == [1] and len(seen["deadlines"]) == 2


def test_live_engines_stuck_in_a_failed_sync_are_restarted_and_every_retry_shares_one_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    push, seen = _push(monkeypatch, [EngineLost([1]), EngineLost([1])], dead=[1], stuck=[0, 1])
    restarted: list[int] = []
    push.sync(4, restarted.append)
    assert seen["revive"] == [(None, False), ([0], True), (None, False), ([0], True)]
    assert restarted == [1, 0, 1, 0]
    assert "alive but stuck" in " ".join(seen["messages"])
    assert len(set(seen["deadlines"])) == 1, "each retry got a bound of its own"


def _built_push(rollout: object, message: object) -> WeightPush:
    """A WeightPush of the cpu quickstart's plan over `rollout` (a stand-in pool), a trainer that only leaves its
    sync group, and `message` for what it says."""
    from pathlib import Path

    from plan_fixtures import cpu_plan

    plan = cpu_plan(model_path="m", run_dir="run", build_tiny=False)
    trainer = types.SimpleNamespace(close_weight_sync=lambda: None)
    return WeightPush(plan, trainer, rollout, Path("run"), message, version=0)  # type: ignore[arg-type]
