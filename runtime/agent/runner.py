"""Environment workers: run the user's agent for one trajectory at a time, many at once, never without a bound.

`AgentRunner.run_episode` calls `run(task, llm)` (awaited if it is a coroutine function, else in a thread) under
the episode's `timeout_s`, and turns whatever happens into an `Episode` outcome: a reward, an error (it raised,
or returned something that is not a reward), or a timeout. It never raises for the agent's faults, so the
controller decides what a failure costs. A thread running a hung plain function cannot be killed; its session
is closed by the controller, so its further model calls fail, and the thread is left to end.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlc.agents.llm import Endpoint
from rlc.runtime.tasks.rewards import as_score
from rlc.runtime.user_code import load_callable

__all__ = ["AgentRunner", "Episode", "agent_runner_actor", "reward_of"]


@dataclass(frozen=True)
class Episode:
    """How one trajectory's agent ended (plain data; travels through Ray)."""

    key: str
    status: str  # ok, error, timeout
    reward: float = 0.0
    error: str = ""  # kind and message of an error or timeout
    where: str = ""  # the agent's innermost frame, for errors
    wall_s: float = 0.0


def reward_of(value: object) -> tuple[float | None, str]:
    """A float reward from what `run` returned (a number, or a dict with a numeric "reward"), or why not."""
    if isinstance(value, dict):
        if "reward" not in value:
            return None, f"returned a dict without a 'reward' key (keys: {', '.join(sorted(map(str, value)))})"
        value = value["reward"]
    if value is None:
        return None, "returned None, not a reward"
    number, why = as_score(value)  # finite in float32, where the advantages are computed
    return (None, why) if why else (number, "")


def _innermost(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a daemon thread of its own: one that hangs is abandoned at the timeout and never holds up
    the others or the process's exit (a thread pool's workers would)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # timed out and cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def target() -> None:
        try:
            value = fn(*args)
        except BaseException as exc:  # handed to the awaiting episode
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, value, None)

    threading.Thread(target=target, name="rlc-agent", daemon=True).start()
    return await future


class AgentRunner:
    """Runs `run(task, llm)` episodes; `concurrency` is how many the controller sends at once (recorded)."""

    def __init__(self, run_path: str, concurrency: int = 8, env: dict[str, str] | None = None) -> None:
        import os

        for k, v in (env or {}).items():
            os.environ[k] = str(v)
        self.run_path = run_path
        self.concurrency = concurrency
        self.fn = load_callable(run_path, "agent")
        self.is_async = inspect.iscoroutinefunction(self.fn)

    def ready(self) -> str:
        return self.run_path

    async def run_episode(self, task: dict[str, Any], endpoint: dict[str, Any], timeout_s: float) -> Episode:
        llm = Endpoint(**endpoint)
        key = llm.api_key
        t0 = time.monotonic()
        try:
            if self.is_async:
                value = await asyncio.wait_for(self.fn(task, llm), timeout_s)
            else:
                value = await asyncio.wait_for(_in_thread(self.fn, task, llm), timeout_s)
        except TimeoutError:
            return Episode(key, "timeout", error=f"did not return within timeout_s ({timeout_s:g} s)", wall_s=timeout_s)
        except Exception as exc:  # the user's code: any failure is the trajectory's
            return Episode(
                key,
                "error",
                error=f"raised {type(exc).__name__}: {exc}",
                where=_innermost(exc),
                wall_s=time.monotonic() - t0,
            )
        reward, problem = reward_of(value)
        if reward is None:
            return Episode(key, "error", error=problem, wall_s=time.monotonic() - t0)
        return Episode(key, "ok", reward=reward, wall_s=time.monotonic() - t0)

    def shutdown(self) -> None:
        """Nothing to release: hung agent threads are daemons and end with the process."""


def agent_runner_actor(**options: Any) -> Any:
    """`AgentRunner` as an async Ray actor (episodes interleave on its event loop)."""
    import ray

    options.setdefault("num_cpus", 0)
    return ray.remote(AgentRunner).options(**options)
