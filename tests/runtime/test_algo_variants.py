"""Every estimator, ratio, clip, correction and aggregation against its formula on hand-computed tensors."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from rlc.runtime.algo.advantages import advantages, batch_normalised, rloo_advantages  # noqa: E402
from rlc.runtime.algo.loss import policy_loss  # noqa: E402
from rlc.runtime.algo.overlong import is_truncated, overlong_penalty  # noqa: E402
from rlc.runtime.algo.policy import PolicyLoss, aggregation_weights  # noqa: E402

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])  # two groups of four


def close(a: torch.Tensor, b: list[float], tol: float = 1e-5) -> bool:
    return torch.allclose(a, torch.tensor(b), atol=tol)


# --- advantage estimators ---------------------------------------------------------------------


def test_dr_grpo_is_the_group_mean_baseline_without_std() -> None:
    adv = advantages("dr_grpo", REWARDS, 4, normalize_std=True)  # normalize_std is grpo's alone
    assert close(adv, [0.5, -0.5, -0.5, 0.5, 1.0, -1.0, 0.0, 0.0])


def test_grpo_divides_by_the_group_std() -> None:
    std0, std1 = 0.5, math.sqrt(0.5)  # population std of each group
    want = [0.5 / std0, -0.5 / std0, -0.5 / std0, 0.5 / std0, 1 / std1, -1 / std1, 0.0, 0.0]
    assert close(advantages("grpo", REWARDS, 4), want, 1e-4)
    assert close(advantages("grpo", REWARDS, 4, normalize_std=False), [0.5, -0.5, -0.5, 0.5, 1.0, -1.0, 0.0, 0.0])


def test_rloo_is_the_leave_one_out_baseline() -> None:
    # Sample 0 of group 0: 1 − (0 + 0 + 1)/3 = 2/3; sample 0 of group 1: 3 − (1 + 2 + 2)/3 = 4/3.
    assert close(rloo_advantages(REWARDS, 4), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 4 / 3, -4 / 3, 0.0, 0.0])
    assert torch.equal(advantages("rloo", torch.tensor([1.0, 1.0, 0.0, 0.0]), 2), torch.zeros(4))
    with pytest.raises(ValueError, match="group_size >= 2"):
        advantages("rloo", REWARDS, 1)


def test_reinforce_pp_normalises_over_the_batch() -> None:
    # mean 1.25, population variance 7.5 / 8 = 0.9375
    std = math.sqrt(0.9375)
    want = [(r - 1.25) / std for r in REWARDS.tolist()]
    assert close(advantages("reinforce_pp", REWARDS, 4), want, 1e-4)
    # Token-weighted moments: rewards [1, 0] with 3 and 1 tokens: mean 3/4, variance (3/16 + 9/16) / 4 = 3/16.
    got = advantages("reinforce_pp", torch.tensor([1.0, 0.0]), 1, lengths=[3, 1])
    assert close(got, [0.25 / math.sqrt(3 / 16), -0.75 / math.sqrt(3 / 16)], 1e-4)
    assert torch.equal(batch_normalised(torch.tensor([2.0, 2.0, 2.0])), torch.zeros(3))


def test_reinforce_pp_baseline_centres_per_group_then_normalises() -> None:
    centred = [0.5, -0.5, -0.5, 0.5, 1.0, -1.0, 0.0, 0.0]  # batch mean 0, variance 3/8
    want = [c / math.sqrt(0.375) for c in centred]
    assert close(advantages("reinforce_pp_baseline", REWARDS, 4), want, 1e-4)


def test_unknown_estimator() -> None:
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        advantages("ppo", REWARDS, 4)


# --- ratio and clipping -----------------------------------------------------------------------


def _loss(logp, adv, cfg, weights=None, prox=None, behaviour=None, seq_ids=None):
    mask = torch.ones_like(logp, dtype=torch.bool)
    prox = torch.zeros_like(logp) if prox is None else prox
    behaviour = prox if behaviour is None else behaviour
    weights = torch.ones_like(logp) if weights is None else weights
    return policy_loss(logp, prox, behaviour, adv, mask, cfg, weights, seq_ids)


def test_asymmetric_clip_is_dapo_clip_higher() -> None:
    logp = torch.log(torch.tensor([1.3, 1.25, 0.75])).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0])
    cfg = PolicyLoss(clip_low=0.2, clip_high=0.28)
    loss, stats = _loss(logp, adv, cfg, weights=torch.full((3,), 1 / 3))
    # 1.3 clipped at 1.28; 1.25 inside [0.8, 1.28] (clipped under a symmetric 0.2); 0.75 clipped at 0.8 (A < 0).
    assert loss.item() == pytest.approx((-1.28 - 1.25 + 0.8) / 3, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0] == 0 and grad[2] == 0 and grad[1].item() == pytest.approx(-1.25 / 3, rel=1e-6)
    assert float(stats["clip_fraction"]) == pytest.approx(2 / 3)
    symmetric, _ = _loss(logp, adv, PolicyLoss(clip_low=0.2), weights=torch.full((3,), 1 / 3))
    assert symmetric.item() == pytest.approx((-1.2 - 1.2 + 0.8) / 3, rel=1e-6)


def test_dual_clip_bounds_negative_advantage_losses() -> None:
    logp = torch.log(torch.tensor([5.0, 2.0, 5.0])).requires_grad_(True)
    adv = torch.tensor([-1.0, -1.0, 1.0])
    loss, stats = _loss(logp, adv, PolicyLoss(clip_low=0.2, dual_clip=3.0))
    assert loss.item() == pytest.approx(3.0 + 2.0 - 1.2, rel=1e-6)  # min(5, 3), 2 (under 3), max(−5, −1.2)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0] == 0 and grad[2] == 0 and grad[1].item() == pytest.approx(2.0, rel=1e-6)
    assert float(stats["dual_clip_fraction"]) == pytest.approx(1 / 3)


def test_gspo_sequence_ratio_is_length_normalised_and_clipped_per_sequence() -> None:
    log_r = torch.tensor([0.001, 0.003, -0.0001, 0.0003, 0.0004], dtype=torch.float64)
    logp = log_r.float().requires_grad_(True)
    seq = torch.tensor([1, 1, 2, 2, 2])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0])
    cfg = PolicyLoss(ratio="sequence", clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean")
    weights = torch.tensor(aggregation_weights([2, 3], "seq-mean-token-mean", 5, 2, None)).repeat_interleave(
        torch.tensor([2, 3])
    )
    loss, stats = _loss(logp, adv, cfg, weights=weights, seq_ids=seq)
    s1, s2 = math.exp(0.002), math.exp(0.0002)  # s1 = 1.002 is past 1 + 4e-4: clipped; s2 is inside the range
    assert s1 > 1 + 4e-4 and 1 - 3e-4 < s2 < 1 + 4e-4
    want = 0.25 * 2 * -(1 + 4e-4) + (1 / 6) * 3 * s2
    assert loss.item() == pytest.approx(want, abs=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    # Clipped sequence: no gradient. The other is GSPO's (1/G)·(−A)·s_i·(1/|y_i|)·∇log π per token: each of its three
    # tokens' loss (1/6)·s2 moves with the mean of all three log-ratios, so d/dlogp_t = 3 · (1/6)·s2·(1/3) = s2/6.
    assert torch.equal(grad[:2], torch.zeros(2))
    assert close(grad[2:], [s2 / 6] * 3, 1e-6)
    assert float(stats["clip_fraction"]) == pytest.approx(2 / 5)
    # The token ratio would clip none of these (all within ±0.2).
    token, _ = _loss(logp, adv, PolicyLoss(clip_low=0.2), weights=weights)
    assert token.item() != pytest.approx(loss.item(), abs=1e-6)


def test_gspo_needs_sequence_ids() -> None:
    with pytest.raises(ValueError, match="seq_ids"):
        _loss(torch.zeros(2), torch.ones(2), PolicyLoss(ratio="sequence"))


# --- off-policy corrections of the behaviour weight ------------------------------------------

# Two sequences; behaviour weights w = π_prox/π_behave of [3, 2] (product 6) and [0.5, 1.5] (product 0.75).
W = [3.0, 2.0, 0.5, 1.5]
SEQ = torch.tensor([1, 1, 2, 2])


@pytest.mark.parametrize(
    ("correction", "cap", "want", "masked", "truncated"),
    [
        ("token_mask", 2.5, -(2.0 + 0.5 + 1.5), 1 / 4, 0.0),
        ("token_truncate", 2.5, -(2.5 + 2.0 + 0.5 + 1.5), 0.0, 1 / 4),
        ("sequence_truncate", 4.0, -(4.0 * 2 + 0.75 * 2), 0.0, 2 / 4),
        ("sequence_mask", 4.0, -(0.75 * 2), 2 / 4, 0.0),
        ("token_mask", 5.0, -sum(W), 0.0, 0.0),
    ],
)
def test_behaviour_corrections(correction: str, cap: float, want: float, masked: float, truncated: float) -> None:
    behaviour = -torch.log(torch.tensor(W))
    logp = torch.zeros(4, requires_grad=True)  # ratio 1 against a proximal log-prob of 0
    cfg = PolicyLoss(behave_correction=correction, behave_imp_weight_cap=cap)  # type: ignore[arg-type]
    loss, stats = _loss(logp, torch.ones(4), cfg, behaviour=behaviour, seq_ids=SEQ)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert float(stats["behave_masked_fraction"]) == pytest.approx(masked)
    assert float(stats["behave_truncated_fraction"]) == pytest.approx(truncated)
    assert float(stats["behave_capped_fraction"]) == pytest.approx(masked + truncated)


def test_no_correction_without_the_decoupled_loss() -> None:
    behaviour = -torch.log(torch.tensor(W))
    logp = behaviour.clone().requires_grad_(True)  # ratio against the behaviour policy: 1
    cfg = PolicyLoss(decoupled=False, behave_correction="sequence_mask", behave_imp_weight_cap=4.0)
    loss, stats = _loss(logp, torch.ones(4), cfg, prox=torch.zeros(4), behaviour=behaviour, seq_ids=SEQ)
    assert loss.item() == pytest.approx(-4.0) and float(stats["behave_capped_fraction"]) == 0.0


# --- aggregation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("agg", "want"),
    [
        ("token-mean", (-3 + 2) / 4),
        ("seq-mean-token-sum", (-3 + 2) / 2),
        ("seq-mean-token-mean", (-1 + 2) / 2),
        ("seq-mean-token-sum-norm", (-3 + 2) / (2 * 4)),
    ],
)
def test_aggregations(agg: str, want: float) -> None:
    """Sequence 1: three tokens, advantage 1; sequence 2: one token, advantage −2; ratio 1 (loss −A per token)."""
    per_seq = aggregation_weights([3, 1], agg, 4, 2, 4)  # type: ignore[arg-type]
    weights = torch.tensor([per_seq[0]] * 3 + [per_seq[1]])
    loss, _ = _loss(torch.zeros(4), torch.tensor([1.0, 1.0, 1.0, -2.0]), PolicyLoss(), weights=weights)
    assert loss.item() == pytest.approx(want, rel=1e-6)


def test_policy_loss_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="dual_clip"):
        PolicyLoss(dual_clip=1.0)
    with pytest.raises(ValueError, match="agg_norm_tokens"):
        PolicyLoss(agg="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        PolicyLoss(agg="mean")  # type: ignore[arg-type]
    legacy = {"clip": 0.1, "clip_higher": 0.3, "decoupled": False, "behave_imp_weight_cap": 3.0, "kl_coef": 0.1}
    assert PolicyLoss.from_cfg(legacy) == PolicyLoss(
        clip_low=0.1, clip_high=0.3, decoupled=False, behave_imp_weight_cap=3.0
    )
    assert legacy == {"kl_coef": 0.1}  # what it read is consumed; the rest is the caller's


# --- DAPO overlong ----------------------------------------------------------------------------


def test_soft_overlong_punishment() -> None:
    assert [overlong_penalty(n, 20, 4) for n in (10, 16, 17, 18, 20, 21)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(18, 20, 4, penalty=2.0) == -1.0
    assert overlong_penalty(20, 20, 0) == 0.0


def test_truncated_means_cut_at_the_limit_without_eos() -> None:
    assert is_truncated([1, 2, 3], 3, [9]) and not is_truncated([1, 2, 9], 3, [9]) and not is_truncated([1, 2], 3, [9])
