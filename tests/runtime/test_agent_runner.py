"""Environment workers run agents under stated rules: rewards, errors, hangs and bad returns, all bounded."""

from __future__ import annotations

import asyncio

import pytest

from rlc.agents.llm import Endpoint
from rlc.runtime.agent.failures import AgentGuard
from rlc.runtime.agent.runner import AgentRunner, Episode, reward_of
from rlc.runtime.errors import RunError

ENDPOINT = Endpoint("http://127.0.0.1:9/v1", "key-1", "rlc-tiny-agent", 8, 3, 5.0).to_dict()


def episode(path: str, timeout_s: float = 5.0) -> Episode:
    runner = AgentRunner(f"tests.agent_fixtures:{path}", concurrency=2)
    try:
        return asyncio.run(runner.run_episode({"prompt": "1+1=", "answer": "2", "index": 0}, ENDPOINT, timeout_s))
    finally:
        runner.shutdown()


def test_rewards_from_numbers_and_dicts() -> None:
    got = episode("returns_dict")
    assert (got.key, got.status, got.reward, got.error) == ("key-1", "ok", 0.5, "")
    assert reward_of(1) == (1.0, "") and reward_of(True) == (1.0, "")
    for bad in (None, "1.0", float("nan"), {"score": 1}, [1.0], 10**400, 1e39, {"reward": -1e39}):
        value, why = reward_of(bad)
        assert value is None and why


def test_an_agent_that_raises_is_an_error_naming_the_exception_and_where() -> None:
    got = episode("raises")
    assert got.status == "error" and "ValueError: the sandbox is on fire" in got.error
    assert "agent_fixtures.py" in got.where


def test_a_bad_return_is_an_error() -> None:
    got = episode("returns_text")
    assert got.status == "error" and "not a number" in got.error


@pytest.mark.timeout(60)  # the agents sleep an hour: only the episode clock can end them in time
@pytest.mark.parametrize("fn", ["hangs", "hangs_async"])
def test_a_hanging_agent_times_out_on_time(fn: str) -> None:
    got = episode(fn, timeout_s=0.5)
    assert got.status == "timeout" and "0.5 s" in got.error


def test_an_unknown_agent_path_fails_at_start_with_a_did_you_mean() -> None:
    with pytest.raises(ImportError, match="did you mean 'raises'"):
        AgentRunner("tests.agent_fixtures:raise")
    with pytest.raises(ImportError, match="cannot import module"):
        AgentRunner("no_such_module_here:run")


def test_endpoint_helpers() -> None:
    llm = Endpoint(**ENDPOINT)
    kwargs = llm.litellm_kwargs()
    assert kwargs["model"] == "openai/rlc-tiny-agent" and kwargs["api_base"] == llm.base_url
    assert kwargs["api_key"] == "key-1" and kwargs["num_retries"] == 0
    env = llm.env()
    assert env["OPENAI_BASE_URL"] == llm.base_url and env["OPENAI_API_KEY"] == "key-1"
    client = llm.openai()
    assert str(client.base_url).rstrip("/") == llm.base_url and client.max_retries == 0


def test_failures_count_until_the_stated_share_then_stop_the_run() -> None:
    messages: list[str] = []
    guard = AgentGuard("pkg.mod:run", window=20, share=0.1, log=messages.append)  # 2 of 20 allowed
    ok = Episode("k", "ok", 1.0)
    for _ in range(10):
        guard.record(ok, "1+1=")
    guard.record(Episode("k", "error", error="raised ValueError: x"), "1+1=")
    guard.record(Episode("k", "timeout", error="did not return"), "2+2=")
    assert len(messages) == 2 and "scored 0" in messages[0] and "re-issued" in messages[1]
    assert guard.take() == {"error": 1, "timeout": 1}
    with pytest.raises(RunError, match=r"3 of the last 13 trajectories failed.*past 2 \(10% of a batch of 20\)"):
        guard.record(Episode("k", "error", error="raised ValueError: x"), "3+3=")


def test_mini_swe_tasks_name_their_test_and_workplace(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from rlc.agents.mini_swe import parse_task

    problem, spec = parse_task({"prompt": "fix add", "answer": json.dumps({"repo": str(tmp_path), "test": "pytest"})})
    assert problem == "fix add" and spec == {"repo": str(tmp_path), "test": "pytest"}
    for answer, why in [
        ("pytest", "must be JSON"),
        (json.dumps({"repo": str(tmp_path)}), "test"),
        (json.dumps({"test": "x", "repo": str(tmp_path / "missing")}), "not a directory"),
        (json.dumps({"test": "x", "repos": "y"}), "unknown keys"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_task({"prompt": "p", "answer": answer})
