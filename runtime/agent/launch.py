"""Starting the agentic roles: the environment workers on their planned bundles, and what engines serve.

Called by `launch.run_plan` when the plan has an agent; everything placed is read off the plan (through
`launch_request`), like the other roles.
"""

from __future__ import annotations

import contextlib
from typing import Any

from rlc.runtime.errors import RunError
from rlc.runtime.launch_request import LaunchRequest
from rlc.schemas.plan import Plan

__all__ = ["RunnerPool", "build_runners", "check_agent"]


def check_agent(plan: Plan) -> None:
    """Import the agent function before any actor starts, so a typo is one clear line."""
    from rlc.runtime.user_code import load_callable

    if plan.agent is not None:
        load_callable(plan.agent.run, "agent", RunError)


class RunnerPool:
    """The environment workers' actors."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self.actors = []


def build_runners(plan: Plan, request: LaunchRequest) -> RunnerPool:
    """One `AgentRunner` per environment worker, in its bundle of the environments placement group (if any)."""
    import ray
    from ray.util.placement_group import get_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rlc.runtime.agent.runner import agent_runner_actor
    from rlc.runtime.ray_resources import ray_options

    agent = plan.agent
    assert agent is not None
    role = plan.role(agent.role)
    env = {**plan.env, **role.env}
    actors = []
    for spec in [a for a in request.actors if a.role == agent.role]:
        options: dict[str, Any] = {
            "name": spec.name,
            "runtime_env": {"env_vars": env},
            "max_concurrency": agent.concurrency_per_worker + 8,
            "num_cpus": 0,
        }
        if spec.placement_group:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=get_placement_group(spec.placement_group),
                placement_group_bundle_index=spec.bundle_index,
            )
            options.update(ray_options({"resources": {k: v for k, v in spec.resources.items() if k != "memory"}}))
            if spec.resources.get("memory"):
                options["memory"] = spec.resources["memory"]
        actors.append(agent_runner_actor(**options).remote(agent.run, agent.concurrency_per_worker, env))
    try:
        ray.get([a.ready.remote() for a in actors], timeout=300)
    except Exception as exc:
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        raise RunError(f"the environment workers did not start: {type(exc).__name__}: {exc}") from None
    return RunnerPool(actors)
