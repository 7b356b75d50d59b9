"""Rewards beyond the accepted magnitude: `10**400` (no float at all), `1e39` (inf once the advantages are float32)
and `3e38` (finite in float32, NaN advantages) are failed rewards like NaN, counted and reported with their sample,
never a traceback or NaN advantages."""

from __future__ import annotations

from fractions import Fraction

import pytest

from rlc.runtime.errors import RunError
from rlc.runtime.tasks.rewards import MAX_REWARD, RewardGuard, as_score
from rlc.schemas.spec import Reward

DEFAULT = Reward()
BEYOND = "beyond the largest reward magnitude accepted (1e+12), where the advantages would overflow"


class BadFloat:
    def __float__(self) -> float:
        raise RuntimeError("no value yet")


def _guard(value: object) -> tuple[RewardGuard, list[str]]:
    logs: list[str] = []
    guard = RewardGuard(
        lambda c, a: value,
        "mylab.rewards:score",
        100,
        logs.append,
        timeout_s=DEFAULT.timeout_s,
        max_failed_share=DEFAULT.max_failed_share,
    )
    return guard, logs


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (10**400, f"returned 10000000000000000000... (401 characters), {BEYOND}"),
        (-(10**400), f"returned -1000000000000000000... (402 characters), {BEYOND}"),
        (Fraction(10**400, 3), "returned Fraction(10000000000... ("),
        (1e39, f"returned 1e+39, {BEYOND}"),
        (-1e39, f"returned -1e+39, {BEYOND}"),
        (3e38, f"returned 3e+38, {BEYOND}"),
        (10**13, f"returned 1e+13, {BEYOND}"),
        (BadFloat(), "returned a BadFloat that does not convert to a number (RuntimeError)"),
    ],
    ids=["huge-int", "huge-negative-int", "huge-fraction", "1e39", "-1e39", "3e38", "1e13-int", "float-raises"],
)
def test_a_reward_beyond_the_bound_is_a_failed_sample(value: object, problem: str) -> None:
    guard, logs = _guard(value)
    allowed = int(DEFAULT.max_failed_share * 100)
    assert [guard("7", "7", prompt="3+4=") for _ in range(allowed)] == [0.0] * allowed
    assert guard.take_failed() == allowed
    assert len(logs) == 1 and logs[0].startswith(f"warning: reward 'mylab.rewards:score' {problem}")
    assert "(prompt '3+4=', completion '7'" in logs[0]
    with pytest.raises(RunError, match=r"\(prompt '3\+4=', completion '7', answer '7'\)"):
        guard("7", "7", prompt="3+4=")


def test_rewards_up_to_the_bound_still_score() -> None:
    for value in (MAX_REWARD, -MAX_REWARD, 1e11, True, 10**12):
        guard, logs = _guard(value)
        assert guard("7", "7") == float(value) and logs == [] and guard.take_failed() == 0
    np = pytest.importorskip("numpy")
    assert as_score(np.float32(2.5)) == (2.5, None)
    assert as_score(np.float64(1e39))[1] == f"returned 1e+39, {BEYOND}"
