"""Every estimator, ratio, clip, correction and aggregation against its formula on hand-computed tensors."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from rlc.runtime.algo.advantages import (  # noqa: E402
    advantages,
    batch_normalised,
    reinforce_pp_advantages,
    reinforce_pp_rows,
    rloo_advantages,
)
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


def test_grpo_std_convention_is_selectable() -> None:
    """population divides the group's variance by n (rlc's default), sample by n − 1 (verl's, torch.std's)."""
    pop, sample = math.sqrt(1 / 4), math.sqrt(1 / 3)  # group 0: [1, 0, 0, 1], squared deviations sum to 1
    assert advantages("grpo", REWARDS, 4)[0].item() == pytest.approx(0.5 / pop, rel=1e-5)
    assert advantages("grpo", REWARDS, 4, group_std="sample")[0].item() == pytest.approx(0.5 / sample, rel=1e-5)


def test_reinforce_pp_batchnorm_normalises_over_the_batch() -> None:
    # mean 1.25, population variance 7.5 / 8 = 0.9375
    std = math.sqrt(0.9375)
    want = [(r - 1.25) / std for r in REWARDS.tolist()]
    assert close(advantages("reinforce_pp_batchnorm", REWARDS, 4), want, 1e-4)
    # Token-weighted moments: rewards [1, 0] with 3 and 1 tokens: mean 3/4, variance (3/16 + 9/16) / 4 = 3/16.
    got = advantages("reinforce_pp_batchnorm", torch.tensor([1.0, 0.0]), 1, lengths=[3, 1])
    assert close(got, [0.25 / math.sqrt(3 / 16), -0.75 / math.sqrt(3 / 16)], 1e-4)
    assert torch.equal(batch_normalised(torch.tensor([2.0, 2.0, 2.0])), torch.zeros(3))
    with pytest.raises(ValueError, match="per token"):
        advantages("reinforce_pp", REWARDS, 4)  # the published one needs the KL of every token


def test_reinforce_pp_is_the_papers_per_token_advantage() -> None:
    """Hu et al. 2025, eq. 8-10: A_t = r − β·Σ_{i≥t} KL_i with KL_i = log π_behave − log π_ref (k1), normalised over
    every response token of the batch. Two samples as training rows (prompt positions masked out)."""
    beta = 0.1
    masks = [[0, 0, 1, 1], [0, 1]]
    behaviour = [[0.0, 0.0, -0.5, -1.0], [0.0, -2.0]]
    reference = [[0.0, -9.0, -0.7, -0.6], [-3.0, -1.5]]  # prompt positions are never read
    # KL: sample 0 [0.2, -0.4], sample 1 [-0.5]. Returns: 1 − 0.1·(0.2 − 0.4) = 1.02, 1 − 0.1·(−0.4) = 1.04,
    # 0 − 0.1·(−0.5) = 0.05; over the three tokens: mean 0.70333…, population std 0.46204…
    returns = [1.02, 1.04, 0.05]
    mean = sum(returns) / 3
    std = math.sqrt(sum((g - mean) ** 2 for g in returns) / 3)
    want = [(g - mean) / (std + 1e-6) for g in returns]
    got = reinforce_pp_rows([1.0, 0.0], [[0], [1]], masks, behaviour, reference, beta, "k1")
    assert got[0][:2] == [0.0, 0.0] and got[1][0] == 0.0
    assert got[0][2:] + got[1][1:] == pytest.approx(want, abs=1e-6)
    # β = 0 is the token-weighted batch-normalised reward (reinforce_pp_batchnorm).
    plain = reinforce_pp_rows([1.0, 0.0], [[0], [1]], masks, behaviour, reference, 0.0, "k1")
    batchnorm = advantages("reinforce_pp_batchnorm", torch.tensor([1.0, 0.0]), 1, lengths=[2, 1]).tolist()
    assert plain[0][2:] + plain[1][1:] == pytest.approx([batchnorm[0]] * 2 + [batchnorm[1]], abs=1e-6)


def test_reinforce_pp_spans_a_trajectorys_rows() -> None:
    """An agent trajectory of two rows is one response: the second row's KL reaches the first row's returns."""
    kl = [torch.tensor([0.2, -0.4]), torch.tensor([0.3])]
    whole = reinforce_pp_advantages([1.0, 0.0], kl, 0.5)
    rows = reinforce_pp_rows(
        [1.0, 0.0], [[0, 1], [2]], [[1, 0], [1], [1]], [[0.2, 0.0], [-0.4], [0.3]], [[0.0] * 2, [0.0], [0.0]], 0.5
    )
    assert [rows[0][0], rows[1][0], rows[2][0]] == pytest.approx(torch.cat(whole).tolist(), abs=1e-6)
    assert rows[0][1] == 0.0


@pytest.mark.parametrize("kind", ["k1", "k2"])
def test_the_kl_reward_stays_in_float64(kind: str) -> None:
    """REINFORCE++'s KL reward is float64 as its returns are: a log-ratio of 1e-10, lost in float32's rounding of
    log-probs near -1, survives."""
    from rlc.runtime.algo.loss import kl_penalty

    behaviour = torch.tensor([-1.0 + 1e-10], dtype=torch.float64)
    kl = kl_penalty(behaviour, torch.tensor([-1.0], dtype=torch.float64), kind)
    assert kl.dtype == torch.float64 and float(kl) > 0.0


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_batchnorm", "reinforce_pp_baseline"])
def test_group_statistics_do_not_overflow(name: str) -> None:
    """Rewards near float32's maximum (their sum overflows float32) still give finite advantages."""
    rewards = torch.tensor([3e38, 3e38, 0.0, 0.0])
    adv = advantages(name, rewards, 4, lengths=[1000, 1000, 1000, 1000])
    assert adv.dtype == torch.float32 and bool(torch.isfinite(adv).all()), adv
    big = torch.tensor([1e12, -1e12, 1e12, 0.0])  # the largest magnitude the run accepts
    assert bool(torch.isfinite(advantages(name, big, 2, lengths=[4000, 1, 1, 4000])).all())
    kl = [torch.full((1000,), 5.0), torch.full((1000,), -5.0)]
    assert all(bool(torch.isfinite(a).all()) for a in reinforce_pp_advantages([1e12, -1e12], kl, 1e3))


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


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_default_loss_is_bounded_for_any_finite_ratio(agg: str) -> None:
    """With the default log-ratio clamp and dual clip no token's loss exceeds c·|A| times its weight: a token whose
    policy moved e^25 from the proximal one over earlier minibatches, on a negative advantage, cannot dominate."""
    cfg = PolicyLoss(agg=agg)  # type: ignore[arg-type]
    assert cfg.dual_clip == 3.0 and cfg.log_ratio_clamp == 20.0
    logp = torch.tensor([25.0, 0.1, -30.0, 80.0, -0.2], requires_grad=True)  # log-ratios against proximal 0
    adv = torch.tensor([-2.0, 1.0, -1.0, 0.5, -1.0])
    weights = torch.tensor(aggregation_weights([2, 3], agg, 5, 2, None)).repeat_interleave(torch.tensor([2, 3]))  # type: ignore[arg-type]
    loss, stats = _loss(logp, adv, cfg, weights=weights)
    per_token_bound = (cfg.dual_clip * adv.abs() * weights).sum()
    assert math.isfinite(loss.item()) and abs(loss.item()) <= per_token_bound.item() + 1e-6
    assert float(stats["dual_clip_fraction"]) == pytest.approx(1 / 5)
    (grad,) = torch.autograd.grad(loss, logp)
    assert bool(torch.isfinite(grad).all()) and grad[0] == 0  # the dual-clipped token carries no gradient
    # Turned off (older plans' meaning), the same token's loss is e^25·|A|.
    unbounded, _ = _loss(logp, adv, PolicyLoss(agg=agg, dual_clip=None, log_ratio_clamp=None), weights=weights)  # type: ignore[arg-type]
    assert unbounded.item() > 1e9 * weights[0].item()


def test_log_ratio_clamp_bounds_the_ratio() -> None:
    logp = torch.tensor([30.0])
    _, stats = _loss(logp, torch.tensor([1.0]), PolicyLoss())
    assert float(stats["ratio_mean"]) == pytest.approx(math.exp(20.0), rel=1e-5)
    _, stats = _loss(logp, torch.tensor([1.0]), PolicyLoss(log_ratio_clamp=5.0))
    assert float(stats["ratio_mean"]) == pytest.approx(math.exp(5.0), rel=1e-5)


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
    with pytest.raises(ValueError, match="log_ratio_clamp"):
        PolicyLoss(log_ratio_clamp=0.0)
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
