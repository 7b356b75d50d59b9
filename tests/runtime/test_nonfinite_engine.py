"""A NaN or infinite behaviour log-prob from an engine stops the run where it enters, naming the engine and the step:
in a generate request's samples and in an agent trajectory's calls, before any reward is scored or any batch built
(the decoupled loss would give such a token weight 0 without a word)."""

from __future__ import annotations

import types
from concurrent.futures import Future

import pytest
from loop_fixtures import fake_loop

from rlc.runtime.errors import RunError
from rlc.runtime.prompts import PromptItem

ITEM = PromptItem(cursor=3, prompt="1+1=", answer="2", domain=None, prompt_ids=(5, 6))


class Request:
    """A finished generate request, as `ResultFutures` sees a Ray object ref."""

    def __init__(self, results: list) -> None:
        self._future: Future = Future()
        self._future.set_result(results)

    def future(self) -> Future:
        return self._future


def _sample(logprobs: list[float]) -> types.SimpleNamespace:
    n = len(logprobs)
    return types.SimpleNamespace(output_ids=[7] * n, logprobs=logprobs, version=0, versions=[0] * n)


def _collect(logprobs: list[list[float]]) -> tuple[object, list[str]]:
    """One request on engine 1 during step 5 with one prompt's samples; returns the workflow and what was scored."""
    from rlc.runtime.workflows.generate import Chunk, GenerateWorkflow

    scored: list[str] = []
    loop = fake_loop(
        step=4,
        stall=types.SimpleNamespace(progress=lambda: None),
        timeline={"time/gather_s": 0.0, "time/reward_s": 0.0},
        rollout_log=types.SimpleNamespace(request=lambda *a: None),
        trace=types.SimpleNamespace(finished=lambda *a, **k: None),
        interrupted_samples=0,
        rollout_tokens=0,
        staleness=0,
        tokenizer=types.SimpleNamespace(eos_token_id=1, decode=lambda ids, **k: "2"),
        scorer=types.SimpleNamespace(
            score_flagged=lambda c, a, prompt: scored.extend(c) or ([1.0] * len(c), [False] * len(c))
        ),
    )
    wf = GenerateWorkflow(loop)  # type: ignore[arg-type]
    wf.inflight = {Request([[_sample(row) for row in logprobs]]): Chunk(engine=1, items=[ITEM], id=12)}
    wf.collect(timeout=1.0)
    return wf, scored


def test_finite_engine_logprobs_are_taken() -> None:
    wf, scored = _collect([[-0.5, -0.25], [-1.0]])
    assert len(wf.finished) == 1 and scored == ["2", "2"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), float("inf")])
def test_a_nonfinite_engine_logprob_stops_the_run_before_scoring(bad: float) -> None:
    with pytest.raises(RunError) as caught:
        _collect([[-0.5, -0.25], [-1.0, bad, -0.5]])
    message = str(caught.value)
    assert message.startswith(f"rollout engine 1 returned a non-finite log-prob ({bad}) for a sampled token of ")
    assert "generate request 12 (sequence 1), at step 5" in message and "--resume" in message
    assert "\n" not in message


def _agent_file(logprobs: tuple[float, ...]) -> object:
    """File one finished agent trajectory from engine 2 during step 8; returns the workflow."""
    from rlc.runtime.agent.runner import Episode
    from rlc.runtime.agent.sessions import SessionRecord
    from rlc.runtime.agent.trajectory import Call
    from rlc.runtime.agent.workflow import AgentGroup, AgentWorkflow, _Pending

    wf = AgentWorkflow.__new__(AgentWorkflow)  # no engines or runners: only the filing of a trajectory runs
    wf.loop = types.SimpleNamespace(step=7, version=0, staleness=0, rollout_tokens=0)  # type: ignore[assignment]
    wf.agent = types.SimpleNamespace(export="trajectory", turn_discount=1.0)  # type: ignore[assignment]
    wf.guard = types.SimpleNamespace(record=lambda *a: None)  # type: ignore[assignment]
    wf.finished, wf._open, wf._slots = [], [], []
    group = AgentGroup(ITEM, size=1)
    wf._open.append(group)
    n = len(logprobs)
    call = Call(prompt_ids=(5, 6), output_ids=(7,) * n, logprobs=logprobs, versions=(0,) * n)
    record = SessionRecord("key", [call], None, 0, 0.1, 0)
    wf._file(_Pending("key", 2, group, 0.0), Episode("key", "ok", 1.0), record)
    return wf


def test_a_nonfinite_logprob_in_an_agent_trajectory_stops_the_run() -> None:
    assert len(_agent_file((-0.5, -0.25)).finished) == 1  # type: ignore[attr-defined]
    with pytest.raises(RunError) as caught:
        _agent_file((-0.5, float("nan")))
    message = str(caught.value)
    assert message.startswith("rollout engine 2 returned a non-finite log-prob (nan) for a sampled token of an agent")
    assert "trajectory of task 3 (sequence 0), at step 8" in message
