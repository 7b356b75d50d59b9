"""GRPO advantages, the decoupled PPO loss, KL estimators, distillation, chunked log-probs."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from rlc.runtime.algo.advantages import group_advantages, token_advantages  # noqa: E402
from rlc.runtime.algo.logprobs import (  # noqa: E402
    chunked_logprobs_entropy,
    entropy_from_logits,
    logprobs_entropy_reference,
    logprobs_from_logits,
)
from rlc.runtime.algo.loss import decoupled_ppo_loss, kl_penalty, masked_mean, reverse_kl_distill  # noqa: E402

torch.set_num_threads(2)


# --- advantages -------------------------------------------------------------------------------


def test_group_advantages_normalised_per_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])
    adv = group_advantages(rewards, group_size=4)
    for g in adv.view(2, 4):
        assert abs(float(g.mean())) < 1e-6
        assert float(g.std(unbiased=False)) == pytest.approx(1.0, abs=1e-4)
    # Sign follows reward relative to the group mean.
    assert adv[0] > 0 and adv[1] < 0


def test_group_advantages_without_std() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv = group_advantages(rewards, group_size=4, scale_by_std=False)
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_group_advantages_all_equal_group_is_zero() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5])
    for scale in (True, False):
        adv = group_advantages(rewards, group_size=3, scale_by_std=scale)
        assert torch.equal(adv, torch.zeros(9))
    assert torch.equal(group_advantages(torch.tensor([2.0, 5.0]), group_size=1), torch.zeros(2))


def test_group_advantages_bad_shape() -> None:
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), group_size=4)


def test_token_advantages_broadcast() -> None:
    out = token_advantages(torch.tensor([1.0, -2.0]), [2, 3])
    assert out.tolist() == [1.0, 1.0, -2.0, -2.0, -2.0]


# --- decoupled PPO ----------------------------------------------------------------------------


def _inputs(n: int = 64, seed: int = 0, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(n, generator=g) * 3
    proximal = behaviour + spread * torch.randn(n, generator=g)
    logp = (proximal + spread * torch.randn(n, generator=g)).requires_grad_(True)
    adv = torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) > 0.2
    return logp, proximal, behaviour, adv, mask


def _plain_ppo(logp, old, adv, mask, clip):
    ratio = torch.exp(logp - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip))
    return (pg * mask).sum() / mask.sum()


def test_decoupled_equals_plain_ppo_when_behaviour_is_proximal() -> None:
    logp, proximal, _, adv, mask = _inputs()
    loss, stats = decoupled_ppo_loss(logp, proximal, proximal, adv, mask, clip=0.2)
    ref = _plain_ppo(logp, proximal, adv, mask.float(), 0.2)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    (g1,) = torch.autograd.grad(loss, logp)
    (g2,) = torch.autograd.grad(ref, logp)
    assert torch.allclose(g1, g2, atol=1e-7)
    assert float(stats["behave_imp_weight_mean"]) == pytest.approx(1.0)
    assert float(stats["behave_capped_fraction"]) == 0.0


def test_not_decoupled_is_plain_ppo_against_behaviour() -> None:
    logp, proximal, behaviour, adv, mask = _inputs()
    loss, _ = decoupled_ppo_loss(logp, proximal, behaviour, adv, mask, decoupled=False)
    ref = _plain_ppo(logp, behaviour, adv, mask.float(), 0.2)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)


def test_decoupled_weights_by_behaviour_importance() -> None:
    logp, proximal, behaviour, adv, mask = _inputs(spread=0.2)
    loss, stats = decoupled_ppo_loss(logp, proximal, behaviour, adv, mask, behave_imp_weight_cap=None)
    w = torch.exp(proximal - behaviour)
    ratio = torch.exp(logp - proximal)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * w
    ref = (pg * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert float(stats["behave_imp_weight_max"]) == pytest.approx(float(w[mask].max()), rel=1e-6)


def test_clipping_stops_gradient_outside_trust_region() -> None:
    prox = torch.zeros(4)
    # ratios 1.5 (A>0: clipped), 0.5 (A<0: clipped), 1.5 (A<0: not clipped), 1.0 (not clipped)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.5, 1.0])).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    mask = torch.ones(4, dtype=torch.bool)
    loss, stats = decoupled_ppo_loss(logp, prox, prox, adv, mask, clip=0.2)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0] == 0 and grad[1] == 0
    assert grad[2] != 0 and grad[3] != 0
    assert float(stats["clip_fraction"]) == pytest.approx(0.5)
    # loss: [-1.2, 0.8 (clamped at 1-ε=0.8 → -(-1)*0.8), 1.5, -1.0] / 4
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 1.5 - 1.0) / 4, rel=1e-6)


def test_clip_higher_and_dual_clip() -> None:
    prox = torch.zeros(2)
    logp = torch.log(torch.tensor([1.25, 5.0])).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, dtype=torch.bool)
    loss, _ = decoupled_ppo_loss(logp, prox, prox, adv, mask, clip=0.2, clip_higher=0.28, dual_clip=None)
    assert loss.item() == pytest.approx((-1.25 + 5.0) / 2, rel=1e-6)  # 1.25 < 1.28: unclipped
    loss, stats = decoupled_ppo_loss(logp, prox, prox, adv, mask, clip=0.2, dual_clip=3.0)
    assert loss.item() == pytest.approx((-1.2 + 3.0) / 2, rel=1e-6)
    assert float(stats["dual_clip_fraction"]) == pytest.approx(0.5)


def test_cap_masks_tokens_but_keeps_denominator() -> None:
    logp = torch.zeros(4, requires_grad=True)
    prox = torch.zeros(4)
    behaviour = torch.tensor([0.0, 0.0, -math.log(10.0), -math.log(2.0)])  # weights 1, 1, 10, 2
    adv = torch.ones(4)
    mask = torch.ones(4, dtype=torch.bool)
    loss, stats = decoupled_ppo_loss(logp, prox, behaviour, adv, mask, behave_imp_weight_cap=5.0)
    # Token 2 (weight 10 > 5) is dropped; the others contribute -A·r·w = -1, -1, -2; divided by 4.
    assert loss.item() == pytest.approx(-(1 + 1 + 2) / 4, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[2] == 0 and grad[3] != 0
    assert float(stats["behave_capped_fraction"]) == pytest.approx(0.25)
    assert float(stats["behave_imp_weight_max"]) == pytest.approx(10.0, rel=1e-5)
    assert float(stats["behave_imp_weight_mean"]) == pytest.approx(3.5, rel=1e-5)


def test_masked_tokens_do_not_matter() -> None:
    logp, proximal, behaviour, adv, mask = _inputs()
    base, _ = decoupled_ppo_loss(logp, proximal, behaviour, adv, mask)
    junk_adv = torch.where(mask, adv, torch.full_like(adv, 1e6))
    junk_beh = torch.where(mask, behaviour, torch.full_like(behaviour, -1e4))
    other, _ = decoupled_ppo_loss(logp, proximal, junk_beh, junk_adv, mask)
    assert base.item() == pytest.approx(other.item(), rel=1e-6)
    assert torch.isfinite(other)


def test_token_count_gives_batch_mean_across_micro_batches() -> None:
    logp, proximal, behaviour, adv, mask = _inputs(n=40)
    whole, _ = decoupled_ppo_loss(logp, proximal, behaviour, adv, mask)
    total = int(mask.sum())
    parts = [
        decoupled_ppo_loss(logp[s], proximal[s], behaviour[s], adv[s], mask[s], token_count=total)[0]
        for s in (slice(0, 13), slice(13, 40))
    ]
    assert sum(p.item() for p in parts) == pytest.approx(whole.item(), rel=1e-6)


def test_approx_kl_zero_when_on_proximal() -> None:
    _, proximal, behaviour, adv, mask = _inputs()
    _, stats = decoupled_ppo_loss(proximal.clone(), proximal, behaviour, adv, mask)
    assert float(stats["approx_kl"]) == pytest.approx(0.0, abs=1e-7)
    assert float(stats["clip_fraction"]) == 0.0


# --- KL and distillation ----------------------------------------------------------------------


def test_kl_estimators_unbiased_on_samples() -> None:
    g = torch.Generator().manual_seed(0)
    p_logits, q_logits = torch.randn(6, generator=g), torch.randn(6, generator=g)
    logp, logq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    exact = float((logp.exp() * (logp - logq)).sum())
    samples = torch.multinomial(logp.exp(), 200_000, replacement=True, generator=g)
    k1 = kl_penalty(logp[samples], logq[samples], "k1").mean()
    k3 = kl_penalty(logp[samples], logq[samples], "k3")
    assert float(k1) == pytest.approx(exact, abs=0.02)
    assert float(k3.mean()) == pytest.approx(exact, abs=0.02)
    assert bool((k3 >= 0).all())
    k2 = kl_penalty(torch.tensor([0.0]), torch.tensor([-2.0]), "k2")
    assert float(k2) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(logp, logq, "k4")  # type: ignore[arg-type]


def test_reverse_kl_distill_gradient_is_score_function() -> None:
    student = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    teacher = torch.tensor([-1.5, -1.0, -0.5])
    mask = torch.tensor([True, True, False])
    loss, stats = reverse_kl_distill(student, teacher, mask)
    assert float(stats["reverse_kl"]) == pytest.approx((0.5 - 1.0) / 2)
    (grad,) = torch.autograd.grad(loss, student)
    # log-ratios [0.5, -1.0] minus their mean (-0.25) as a baseline: advantages [0.75, -0.75], token mean.
    assert torch.allclose(grad, torch.tensor([0.375, -0.375, 0.0]))


def test_reverse_kl_distill_clips_confident_teacher_outliers() -> None:
    student = torch.tensor([-1.0, -0.1, -0.1, -0.1], requires_grad=True)
    teacher = torch.tensor([-30.0, -0.1, -0.1, -0.1])  # the teacher all but forbids the first token
    loss, stats = reverse_kl_distill(student, teacher, torch.ones(4, dtype=torch.bool), advantage_clip=5.0)
    (grad,) = torch.autograd.grad(loss, student)
    assert float(grad.abs().max()) <= 5.0 / 4 + 1e-6
    assert float(grad[0]) > 0  # still pushed down hardest
    assert float(stats["reverse_kl"]) == pytest.approx(29.0 / 4)


def test_masked_mean_empty_mask_is_zero() -> None:
    assert float(masked_mean(torch.ones(3), torch.zeros(3, dtype=torch.bool))) == 0.0


# --- log-probs --------------------------------------------------------------------------------


def test_logprobs_and_entropy_from_logits() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    assert float(entropy_from_logits(logits)) == pytest.approx(math.log(4))
    assert float(logprobs_from_logits(logits, torch.tensor([2]))) == pytest.approx(-math.log(4))
    sharp = entropy_from_logits(torch.tensor([[3.0, 0.0]]), temperature=0.5)
    ref = torch.distributions.Categorical(logits=torch.tensor([6.0, 0.0])).entropy()
    assert float(sharp) == pytest.approx(ref.item(), rel=1e-5)


@pytest.mark.parametrize(("chunk", "temperature"), [(7, 1.0), (16, 0.7), (1000, 1.3)])
def test_chunked_matches_reference_values_and_gradients(chunk: int, temperature: float) -> None:
    g = torch.Generator().manual_seed(1)
    T, H, V = 45, 24, 37
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64).float().requires_grad_(True)
    weight = (0.3 * torch.randn(V, H, generator=g)).requires_grad_(True)
    targets = torch.randint(0, V, (T,), generator=g)
    gl, ge = torch.randn(T, generator=g), torch.randn(T, generator=g)

    lp, ent = chunked_logprobs_entropy(hidden, weight, targets, temperature, chunk_size=chunk)
    lp_ref, ent_ref = logprobs_entropy_reference(hidden, weight, targets, temperature)
    assert torch.allclose(lp, lp_ref, atol=1e-5)
    assert torch.allclose(ent, ent_ref, atol=1e-5)

    grads = torch.autograd.grad((lp * gl).sum() + (ent * ge).sum(), (hidden, weight))
    grads_ref = torch.autograd.grad((lp_ref * gl).sum() + (ent_ref * ge).sum(), (hidden, weight))
    for a, b in zip(grads, grads_ref, strict=True):
        assert torch.allclose(a, b, atol=1e-5), float((a - b).abs().max())


def test_chunked_only_logprob_grad_and_batched_shape() -> None:
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    weight = torch.randn(11, 8, generator=g)  # frozen head: no weight grad requested
    targets = torch.randint(0, 11, (2, 5), generator=g)
    lp, ent = chunked_logprobs_entropy(hidden, weight, targets, chunk_size=3)
    assert lp.shape == (2, 5) and ent.shape == (2, 5)
    (gh,) = torch.autograd.grad(lp.sum(), hidden)
    lp_ref, _ = logprobs_entropy_reference(hidden, weight, targets)
    (gh_ref,) = torch.autograd.grad(lp_ref.sum(), hidden)
    assert torch.allclose(gh, gh_ref, atol=1e-5)


def test_chunked_gradcheck_double() -> None:
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5, (6,), generator=g)

    def f(h, w):
        lp, ent = chunked_logprobs_entropy(h, w, targets, temperature=0.9, chunk_size=4)
        return lp.double(), ent.double()

    # The custom function computes in fp32, so gradcheck with fp32-sized tolerances.
    assert torch.autograd.gradcheck(f, (hidden, weight), eps=1e-3, atol=1e-3, rtol=1e-3)


def test_chunked_rejects_bad_arguments() -> None:
    h, w, t = torch.zeros(3, 2), torch.zeros(4, 2), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs_entropy(h, w, t, temperature=0)
    with pytest.raises(ValueError, match="targets shape"):
        chunked_logprobs_entropy(h, w, t[:2])
