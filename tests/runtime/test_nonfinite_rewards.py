"""Every reward the run accepts keeps every estimator's advantages, and the loss over them, finite: the bound on the
reward magnitude (`MAX_REWARD`) is what stands between a reward function's 3e38 and NaN weights."""

from __future__ import annotations

import math

import pytest
import torch

from rlc.runtime.algo.advantages import ESTIMATORS, advantages, reinforce_pp_advantages
from rlc.runtime.algo.loss import policy_loss
from rlc.runtime.algo.policy import PolicyLoss
from rlc.runtime.tasks.rewards import MAX_REWARD, as_score

GROUP = 64


def _extreme_rewards(groups: int = 16) -> torch.Tensor:
    """Each group mixes both extremes with zeros: the largest spread and squared deviations the bound allows."""
    pattern = [MAX_REWARD, -MAX_REWARD, 0.0, MAX_REWARD]
    return torch.tensor([pattern[i % len(pattern)] for i in range(groups * GROUP)], dtype=torch.float64)


def _estimate(name: str, rewards: torch.Tensor) -> torch.Tensor:
    """The estimator's advantages over million-token responses: one per sample, or (an estimator with a per-token
    KL reward) one per response token, 100k-token responses each with a KL of 1 nat per token."""
    if name == "reinforce_pp":
        tokens = 100_000
        rows = reinforce_pp_advantages(rewards[: 2 * GROUP], [torch.ones(tokens)] * (2 * GROUP), kl_coef=1.0)
        return torch.stack([row[:: tokens // 8] for row in rows]).flatten()
    lengths = [1_000_000 - 7 * i for i in range(rewards.numel())]
    return advantages(name, rewards, GROUP, lengths=lengths)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_every_estimator_is_finite_at_the_reward_bound(name: str) -> None:
    rewards = _extreme_rewards()
    assert all(as_score(float(r))[1] is None for r in rewards.tolist())  # each of them is an accepted reward
    adv = _estimate(name, rewards)
    assert torch.isfinite(adv).all(), f"{name}: non-finite advantages from rewards within ±{MAX_REWARD:g}"
    # The policy loss over them, token-weighted, at a ratio away from 1 (clipped on one side, not the other).
    tokens = 32
    lp = torch.full((adv.numel(), tokens), -1.0)
    behaviour = lp - 0.1
    token_adv = adv.float()[:, None].expand(-1, tokens)
    mask = torch.ones_like(lp, dtype=torch.bool)
    weights = torch.full_like(lp, 1.0 / lp.numel())
    loss, _ = policy_loss(lp, lp, behaviour, token_adv, mask, PolicyLoss(), weights, None, adv.numel())
    assert math.isfinite(float(loss))


def test_a_reward_past_the_bound_fails_with_its_reason() -> None:
    for value in (3e38, -3e38, MAX_REWARD * 10):
        score, problem = as_score(value)
        assert score == 0.0 and problem is not None and f"{MAX_REWARD:g}" in problem
