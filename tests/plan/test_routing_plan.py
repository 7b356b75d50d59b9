"""The rollout engines are started with the plan's `routing_capture` (who records the experts rollout routing
replay needs), and the trainer with the plan's `routing_replay` mode."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from paths import EXAMPLES

from rlc.compiler.pipeline import compile_file
from rlc.schemas.plan import Plan

pytest.importorskip("ray")


def _engine_calls(plan: Plan, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The keyword arguments `build_roles` starts each rollout engine actor with (Ray's calls left out)."""
    from rlc.runtime import role_actors
    from rlc.runtime.train import group as group_module

    calls: list[dict] = []

    class Actor:
        def remote(self, *args: object, **kwargs: object) -> object:
            calls.append(kwargs)
            return object()

    monkeypatch.setattr(role_actors, "_placement_groups", lambda request, created: defaultdict(object))
    monkeypatch.setattr(role_actors, "_engine_actor_class", lambda *a: Actor())
    monkeypatch.setattr(role_actors, "_wait_started", lambda roles: None)
    monkeypatch.setattr(group_module, "TrainerGroup", lambda *a, **k: object())
    role_actors.build_roles(plan, Path("/nonexistent/model"), 0, [])
    return calls


@pytest.mark.parametrize(("example", "capture"), [("cpu-moe.yaml", "rlc"), ("quickstart.yaml", None)])
def test_engines_start_with_the_plans_routing_capture(
    example: str, capture: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = compile_file(EXAMPLES / example).plan
    assert plan is not None and plan.roles_of("rollout")[0].routing_capture == capture
    calls = _engine_calls(plan, monkeypatch)
    assert calls and all(c["routing_capture"] == capture for c in calls)


def test_the_trainer_takes_the_plans_routing_replay_mode() -> None:
    from rlc.runtime.role_actors import train_config

    plan = compile_file(EXAMPLES / "cpu-moe.yaml").plan
    assert plan is not None
    actor = plan.roles_of("train")[0]
    assert train_config(plan, actor)["routing_replay"] == "rollout"
