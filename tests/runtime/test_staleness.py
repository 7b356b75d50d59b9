"""The admission rule that bounds off-policyness."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from loop_fixtures import fake_loop

from rlc.runtime.staleness import StalenessGate


def test_zero_staleness_is_synchronous() -> None:
    gate = StalenessGate(batch_samples=8, max_staleness=0)
    assert gate.can_admit(8, version=0)
    gate.admit(8)
    assert not gate.can_admit(1, version=0)
    assert gate.can_admit(8, version=1)


def test_staleness_two_allows_three_batches_ahead() -> None:
    gate = StalenessGate(batch_samples=4, max_staleness=2)
    for _ in range(3):
        assert gate.can_admit(4, version=0)
        gate.admit(4)
    assert not gate.can_admit(4, version=0)
    assert gate.can_admit(4, version=1)


@given(st.integers(1, 16), st.integers(0, 4), st.lists(st.integers(1, 8), max_size=40))
def test_trained_samples_never_exceed_the_bound(batch: int, staleness: int, chunks: list[int]) -> None:
    """Simulate: admit chunks whenever allowed; train whenever a batch is ready; every trained sample's
    version lag stays within max_staleness."""
    gate = StalenessGate(batch_samples=batch, max_staleness=staleness)
    version = 0
    finished: list[int] = []  # versions of finished samples, oldest first
    for chunk in chunks:
        while not gate.can_admit(chunk, version):
            if len(finished) < batch:
                break
            trained, finished = finished[:batch], finished[batch:]
            assert all(version - v <= staleness for v in trained)
            version += 1
        if gate.can_admit(chunk, version):
            gate.admit(chunk)
            finished.extend([version] * chunk)
    while len(finished) >= batch:
        trained, finished = finished[:batch], finished[batch:]
        assert all(version - v <= staleness for v in trained)
        version += 1


def test_the_workflow_admits_a_whole_batch_when_requests_do_not_divide_it() -> None:
    """20 prompts in requests of 8 at staleness 0: the third request is short (4), so the batch completes
    (a whole third request would not fit and the run waited for ever)."""
    import types

    from rlc.runtime.workflows.generate import GenerateWorkflow

    submitted: list[tuple[int, int]] = []
    loop = fake_loop(
        gate=StalenessGate(batch_samples=20 * 2, max_staleness=0),
        prompts=types.SimpleNamespace(take=lambda n: list(range(n)), pop_notice=lambda: None),
    )
    wf = GenerateWorkflow(loop)  # type: ignore[arg-type]
    wf.submit = lambda engine, items, request_id=None: submitted.append((engine, len(items)))  # type: ignore[method-assign]
    wf.fill()
    assert [n for _, n in submitted] == [8, 8, 4]
    assert loop.gate.submitted == 40 and loop.gate.room(0) == 0


def test_an_idle_trainer_with_a_whole_batch_waiting_does_not_wait_on_rollouts() -> None:
    """Asynchronous runs finish the next batch while the trainer works; once that step is done the loop must
    hand the waiting batch over at once, not first wait out a rollout still generating (that wait cost the
    quickstart at max_staleness 1 about 50 ms of a ~150 ms step)."""

    from rlc.runtime.controller import collect_timeout

    assert collect_timeout(training=False, has_batch=False) > 0  # short of a batch: only a rollout gives work
    assert collect_timeout(training=False, has_batch=True) == 0
    assert collect_timeout(training=True, has_batch=True) > 0  # the trainer is busy: its end wakes the loop


@pytest.mark.timeout(60)  # the wait's own bound is an hour: only the trainer's end can end it in time
def test_the_trainers_end_wakes_a_wait_on_rollouts() -> None:
    """The loop waits on rollouts and the trainer at once (no polling): a step that ends while every request
    is still generating ends the wait at once, not when the wait's bound runs out."""
    import threading
    from concurrent.futures import Future

    from rlc.runtime.controller import collect_timeout
    from rlc.runtime.workflows.generate import GenerateWorkflow

    generating: Future = Future()  # never finishes during the test

    class Request:
        def future(self) -> Future:
            return generating

    loop = fake_loop(training=Future())
    wf = GenerateWorkflow(loop)  # type: ignore[arg-type]
    wf.inflight = {Request(): object()}  # type: ignore[dict-item]
    threading.Timer(0.05, loop.training.set_result, [None]).start()
    wf.collect(timeout=3600.0)
    assert loop.training.done() and len(wf.inflight) == 1  # nothing collected: the request is still running
    # a bound remains for the loop's other checks (stop, engine restarts)
    assert collect_timeout(training=False, has_batch=wf.has_batch()) > 0


def test_an_interrupted_sample_trains_each_token_with_its_own_version_and_log_prob() -> None:
    """A sample a weight update interrupted: its tokens' behaviour log-probs go to the loss as the engine sampled
    them (old policy before the update, new after), and the staleness it reports is per token."""
    from rlc.runtime.prompts import PromptItem
    from rlc.runtime.workflows.generate import GenerateWorkflow, Group

    wf = GenerateWorkflow(fake_loop(version=3))  # type: ignore[arg-type]
    item = PromptItem(cursor=0, prompt="1+1=", answer="2", domain=None, prompt_ids=(5, 6))
    group = Group(
        item,
        output_ids=[[7, 8, 9, 10], [7, 2]],
        logprobs=[[-0.1, -0.2, -0.3, -0.4], [-0.5, -0.6]],
        versions=[1, 3],
        rewards=[1.0, 0.0],
        token_versions=[[1, 1, 2, 2], [3, 3]],
    )
    batch, stats, _ = wf.build_batch([group])
    assert batch["behaviour_logprobs"][0] == [0.0, 0.0, -0.1, -0.2, -0.3, -0.4]
    assert batch["loss_mask"][0] == [0, 0, 1, 1, 1, 1]
    assert stats["staleness/max"] == 2.0  # the tokens sampled by version 1
    assert stats["staleness/mean"] == pytest.approx((2 + 2 + 1 + 1 + 0 + 0) / 6)
