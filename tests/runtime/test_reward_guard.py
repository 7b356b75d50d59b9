"""A reward function that raises, hangs, or returns something other than a finite number: scored 0 up to the
plan's share of a batch, reported with the sample that caused it, then the run stops with a clear `rlc run: error:`."""

from __future__ import annotations

import math
import re
import signal
import threading
import time

import pytest

from rlc.runtime.errors import RunError
from rlc.runtime.tasks.rewards import RewardGuard
from rlc.schemas.spec import Reward

DEFAULT = Reward()


def _guard(fn, window: int = 100, **policy: float) -> tuple[RewardGuard, list[str]]:  # type: ignore[no-untyped-def]
    logs: list[str] = []
    policy = {"timeout_s": DEFAULT.timeout_s, "max_failed_share": DEFAULT.max_failed_share} | policy
    return RewardGuard(fn, "mylab.rewards:score", window, logs.append, **policy), logs


def _raises(completion: str, answer: str) -> float:
    raise ValueError(f"cannot parse {completion!r}")


@pytest.mark.parametrize(
    ("fn", "problem"),
    [
        (_raises, "raised ValueError: cannot parse '7'"),
        (lambda c, a: math.nan, "returned nan"),
        (lambda c, a: math.inf, "returned inf"),
        (lambda c, a: None, "returned None"),
        (lambda c, a: "high", "returned the string 'high', not a number"),
        (lambda c, a: "1.0", "returned the string '1.0', not a number"),
        (lambda c, a: [1.0], "returned a list, not a number"),
    ],
    ids=["raises", "nan", "inf", "none", "string", "numeric-string", "list"],
)
def test_bad_rewards_score_zero_then_stop_naming_the_sample(fn, problem: str) -> None:  # type: ignore[no-untyped-def]
    guard, logs = _guard(fn)
    allowed = int(DEFAULT.max_failed_share * 100)
    assert [guard("7", "7", prompt="3+4=") for _ in range(allowed)] == [0.0] * allowed
    assert len(logs) == 1  # the first failure is reported, once
    assert logs[0].startswith(f"warning: reward 'mylab.rewards:score' {problem} (prompt '3+4=', completion '7'")
    assert f"up to {allowed} such sample(s) per 100" in logs[0]
    assert guard.take_failed() == allowed and guard.take_failed() == 0
    with pytest.raises(RunError) as stopped:
        guard("7", "7", prompt="3+4=")
    message = str(stopped.value)
    assert message.startswith(f"reward 'mylab.rewards:score' {problem} (prompt '3+4=', completion '7', answer '7')")
    assert f"{allowed + 1} of the last {allowed + 1} samples failed" in message
    assert f"the run stops past {allowed} (5% of a batch of 100, reward.max_failed_share) scored 0" in message
    assert "fix the reward function" in message and "--resume" in message


def test_good_values_pass_through_and_failures_age_out_of_the_window() -> None:
    calls = {"n": 0}

    def flaky(completion: str, answer: str) -> float:
        calls["n"] += 1
        if calls["n"] % 25 == 0:  # 4%: under the 5% policy
            raise TimeoutError("verifier timed out")
        return True if completion == answer else 0  # bools and ints are numbers

    guard, logs = _guard(flaky)
    scores = [guard("1", "1", prompt="p") for _ in range(1000)]
    assert scores.count(0.0) == 40 and scores.count(1.0) == 960
    assert len(logs) == 1


def test_numpy_and_torch_scalars_are_numbers() -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    for value in (np.float32(0.5), np.int64(1), torch.tensor(0.25)):
        guard, logs = _guard(lambda c, a, v=value: v)
        assert guard("x", "y") == pytest.approx(float(value))
        assert not logs


def test_long_samples_are_clipped_in_messages() -> None:
    guard, _ = _guard(lambda c, a: None, window=1)
    with pytest.raises(RunError) as stopped:
        guard("z" * 10_000, "a", prompt="p" * 10_000)
    assert len(str(stopped.value)) < 800 and "(10000 chars)" in str(stopped.value)


def _spins(completion: str, answer: str) -> float:
    while True:
        pass


def _catastrophic_regex(completion: str, answer: str) -> float:
    return float(bool(re.match(r"(a+)+$", "a" * 64 + "b")))


def _swallows_exceptions(completion: str, answer: str) -> float:
    try:
        time.sleep(60)
    except Exception:
        return 1.0
    return 1.0


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize("fn", [_spins, _catastrophic_regex, _swallows_exceptions], ids=["loop", "regex", "except"])
def test_a_reward_that_hangs_is_interrupted_and_scores_zero(fn) -> None:  # type: ignore[no-untyped-def]
    guard, logs = _guard(fn, window=20, timeout_s=0.2, max_failed_share=0.1)
    assert guard("7", "7", prompt="3+4=") == 0.0 and guard("7", "7") == 0.0
    assert logs[0].startswith(
        "warning: reward 'mylab.rewards:score' did not return within 0.2 s (reward.timeout_s) (prompt '3+4='"
    )
    assert guard.take_failed() == 2
    with pytest.raises(RunError, match=r"did not return within 0\.2 s .* 3 of the last 3 samples failed"):
        guard("7", "7")
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # no alarm left behind


def test_the_plan_states_the_policy() -> None:
    guard, _ = _guard(lambda c, a: None, window=10, max_failed_share=0.5)
    assert [guard("x", "y") for _ in range(5)] == [0.0] * 5
    with pytest.raises(RunError, match=r"past 5 \(50% of a batch of 10"):
        guard("x", "y")


@pytest.mark.timeout(60, method="thread")
def test_an_alarm_pending_before_scoring_gets_its_remaining_time_back() -> None:
    fired: list[float] = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(time.monotonic()))
    try:
        guard, _ = _guard(lambda c, a: time.sleep(0.3) or 1.0)
        armed = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 2.0)
        assert guard.score_group(["a", "b"], "a") == [1.0, 1.0]  # theirs is held off while scoring ...
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert not fired and 0 < remaining <= 1.4  # ... and keeps what was left of it
        time.sleep(remaining + 0.2)
        assert len(fired) == 1 and fired[0] - armed >= 1.95
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        assert guard.score_group(["a"], "a") == [1.0]  # one due during scoring fires right after it
        time.sleep(0.05)
        assert len(fired) == 2
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_off_the_main_thread_the_call_runs_unbounded() -> None:
    out: list[float] = []
    guard, logs = _guard(lambda c, a: time.sleep(0.3) or 2.0, timeout_s=0.05)
    worker = threading.Thread(target=lambda: out.extend(guard.score_group(["x"], "y")))
    worker.start()
    worker.join(10)
    assert out == [2.0] and not logs


def _swallows_everything(completion: str, answer: str) -> float:
    for _ in range(3):  # a bare `except:` that retries: the alarm repeats until the call gives up
        try:
            time.sleep(60)
        except BaseException:  # the user mistake this test is about
            continue
    return 1.0


@pytest.mark.timeout(60, method="thread")
def test_a_repeating_alarm_outlasts_a_reward_that_swallows_it() -> None:
    guard, _ = _guard(_swallows_everything, timeout_s=0.1)
    started = time.monotonic()
    assert guard.score_group(["x"], "y") == [1.0]  # it returned a number in the end, after three interruptions
    assert time.monotonic() - started < 5 and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


@pytest.mark.timeout(60, method="thread")
def test_a_pending_repeating_alarm_keeps_its_interval() -> None:
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    try:
        signal.setitimer(signal.ITIMER_REAL, 5.0, 1.0)
        guard, _ = _guard(lambda c, a: 1.0)
        assert guard.score_group(["x"], "y") == [1.0]
        remaining, interval = signal.getitimer(signal.ITIMER_REAL)
        assert 4.0 < remaining <= 5.0 and interval == pytest.approx(1.0)
        assert signal.getsignal(signal.SIGALRM) is not None and signal.getsignal(signal.SIGALRM).__name__ == "<lambda>"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
