"""A reward function that raises or returns something other than a finite number: scored 0 up to a stated share
of a batch, reported with the sample that caused it, then the run stops with a clear `rlc run: error:`."""

from __future__ import annotations

import math

import pytest

from rlc.runtime.errors import RunError
from rlc.runtime.tasks.rewards import MAX_FAILED_SHARE, RewardGuard


def _guard(fn, window: int = 100) -> tuple[RewardGuard, list[str]]:  # type: ignore[no-untyped-def]
    logs: list[str] = []
    return RewardGuard(fn, "mylab.rewards:score", window, logs.append), logs


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
    allowed = int(MAX_FAILED_SHARE * 100)
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
    assert f"the run stops past {allowed} (5% of a batch of 100) scored 0" in message
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
