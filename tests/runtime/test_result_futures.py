"""ResultFutures: one wait over in-flight requests and the trainer's step, returning what finished."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from rlc.runtime.result_futures import ResultFutures


class Request:
    """Stands for a Ray ObjectRef: ``future()`` is the one call ResultFutures makes on it."""

    def __init__(self) -> None:
        self.result: Future = Future()
        self.calls = 0

    def future(self) -> Future:
        self.calls += 1
        return self.result


def test_returns_every_finished_request_and_keeps_the_rest() -> None:
    done_a, done_b, running = Request(), Request(), Request()
    done_a.result.set_result("a")
    done_b.result.set_exception(RuntimeError("engine died"))
    waiter = ResultFutures()
    ready = dict(waiter.wait([done_a, done_b, running], also=None, timeout=5.0))
    assert set(ready) == {done_a, done_b}
    assert ready[done_a].result() == "a" and isinstance(ready[done_b].exception(), RuntimeError)
    # The running request keeps the future made for it: Ray is asked once per request.
    running.result.set_result("c")
    assert [ref for ref, _ in waiter.wait([running], also=None, timeout=5.0)] == [running]
    assert running.calls == 1


def test_a_request_dropped_by_the_caller_is_forgotten() -> None:
    dropped = Request()
    waiter = ResultFutures()
    waiter.wait([dropped], also=None, timeout=0.01)
    dropped.result.set_result("late")
    assert waiter.wait([], also=None, timeout=0.01) == []  # no longer in flight: never reported


@pytest.mark.timeout(60)  # the wait's own bound is an hour: only the other future can end it in time
def test_the_other_future_ends_the_wait_without_a_result() -> None:
    trainer: Future = Future()
    trainer.set_result(None)
    assert ResultFutures().wait([Request()], also=trainer, timeout=3600.0) == []
