"""Policy losses over per-token tensors: the clipped policy gradient (AReaL's decoupled PPO and its DAPO, GSPO
and off-policy-correction variants), KL estimators, reverse-KL distillation.

All inputs are per-token tensors of one shape (packed ``[T]`` or padded ``[B, S]``) plus a mask that
selects the generated tokens the loss is about. `policy_loss` takes each token's aggregation weight from the
caller (`policy.aggregation_weights`), which fixes the denominators over the whole minibatch; the other losses
are token means: the sum over masked tokens divided by the masked-token count, or by ``token_count`` when the
caller accumulates several micro-batches (pass the global count to every micro-batch).
Stats are detached 0-dim tensors so callers decide when to synchronise (``.item()`` stalls an NPU).
"""

from __future__ import annotations

from typing import Literal

import torch

from .logprobs import entropy_from_logits
from .policy import PolicyLoss

__all__ = [
    "decoupled_ppo_loss",
    "entropy_from_logits",
    "kl_penalty",
    "masked_mean",
    "policy_loss",
    "reverse_kl_distill",
]

KLKind = Literal["k1", "k2", "k3"]


def masked_mean(values: torch.Tensor, mask: torch.Tensor, token_count: float | None = None) -> torch.Tensor:
    """Sum of ``values`` over ``mask`` divided by the mask count (or ``token_count``), 0 if empty."""
    m = mask.to(values.dtype)
    denom = m.sum() if token_count is None else torch.as_tensor(token_count, dtype=values.dtype)
    return (values * m).sum() / denom.clamp(min=1.0)


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
    behave_imp_weight_cap: float | None = 5.0,
    *,
    clip_higher: float | None = None,
    dual_clip: float | None = 3.0,
    log_ratio_clamp: float | None = 20.0,
    decoupled: bool = True,
    token_count: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AReaL's decoupled PPO objective (Fu et al., 2025, "AReaL"), token-mean over ``mask``.

    The token-level, token-mean case of `policy_loss`, with the denominator the masked-token count (or
    ``token_count`` when the caller accumulates several micro-batches and passes the global count).
    """
    cfg = PolicyLoss(
        clip_low=clip,
        clip_high=clip_higher,
        dual_clip=dual_clip,
        log_ratio_clamp=log_ratio_clamp,
        decoupled=decoupled,
        behave_imp_weight_cap=behave_imp_weight_cap,
    )
    mask = mask.bool()
    denom = float(mask.sum()) if token_count is None else float(token_count)
    weights = mask.to(torch.float32) / max(denom, 1.0)
    return policy_loss(logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask, cfg, weights)


def policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: PolicyLoss,
    weights: torch.Tensor,
    seq_ids: torch.Tensor | None = None,
    num_seqs: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped policy-gradient loss ``Σ_t weights_t · keep_t · w_t · pg_t`` and its statistics.

    Asynchronous rollout means the tokens were sampled by a stale *behaviour* policy. The decoupled objective
    (AReaL, Fu et al. 2025) clips against a recent *proximal* policy and corrects the shift with the behaviour
    importance weight ``w_t = π_prox/π_behave``:

        pg_t = max(−A_t·r_t, −A_t·clip(r_t, 1−ε_low, 1+ε_high)),   r_t = π_θ(y_t)/π_prox(y_t)

    ``cfg.clip_high`` above ``clip_low`` is DAPO's clip-higher (Yu et al. 2025). ``cfg.dual_clip`` = c bounds
    a negative-advantage token's loss at −c·A (Ye et al. 2020, "Mastering Complex Control in MOBA Games"), and
    ``cfg.log_ratio_clamp`` clamps log r_t to ±bound before exp (verl: ±20, c = 3): with both, no token's loss
    exceeds c·|A_t| times its weights, however far π_θ moved from π_prox over earlier minibatches; without the
    dual clip a negative-advantage token's loss grows as r_t (e^20·|A| at the clamp, e^25·|A| without it).
    ``cfg.ratio == "sequence"`` is GSPO (Zheng et al. 2025): every token of sequence i uses the length-normalised
    sequence ratio ``s_i = exp(mean_{t∈i} log r_t)`` (gradient through the mean), clipped to its own, much
    narrower range; the behaviour weight stays per token, as AReaL composes GSPO with the decoupled loss.

    The behaviour weight above ``cfg.behave_imp_weight_cap`` = C (``cfg.behave_correction``):
      token_mask         the token is dropped (AReaL's default); the denominators still count it
      token_truncate     w_t ← min(w_t, C): truncated IS (Yao et al. 2025, "Your efficient RL framework
                         secretly brings you off-policy RL training"; verl rollout_is: token)
      sequence_truncate  every token of i weighted by min(Π_{t∈i} w_t, C) (verl rollout_is: sequence)
      sequence_mask      masked IS: sequence i dropped when Π_{t∈i} w_t > C, else weighted by it (Liu et al. 2025,
                         "When speed kills stability"); the denominators still count it
    Both masks keep what they drop in the aggregation's denominators (AReaL's rule), so a dropped token lowers the
    loss scale rather than raising the others' weights; token_mask's counterpart in verl with the same numbers is
    its IcePop threshold mode. verl's rollout_rs instead removes rejected tokens from the loss mask (smaller
    denominators, so the kept tokens weigh more).
    With ``cfg.decoupled`` False this is plain PPO against the behaviour policy (no weight, no correction).

    ``weights`` is each token's aggregation weight (`policy.aggregation_weights`, zero off the mask): the caller
    fixes the denominators over the whole minibatch, so any split into micro-batches and ranks sums to the same
    loss. ``seq_ids`` (needed when ``cfg.needs_sequences``) numbers each token's sequence, 1.. per sequence,
    0 for positions that belong to none; a sequence must be whole in the tensor. ``num_seqs`` (the largest id),
    when the caller knows it, spares reading it from the device. Only ``logprobs`` carries grad.
    """
    mask = mask.bool()
    advantages = advantages.detach().to(torch.float32)
    behaviour = behaviour_logprobs.detach().to(torch.float32)
    proximal = proximal_logprobs.detach().to(torch.float32) if cfg.decoupled else behaviour
    logp = logprobs.to(torch.float32)
    if cfg.needs_sequences and seq_ids is None:
        raise ValueError(f"a {cfg.ratio}-level ratio with {cfg.behave_correction} correction needs seq_ids")

    # Zero the log-ratio off the mask so padding garbage cannot overflow exp().
    log_ratio = torch.where(mask, logp - proximal, torch.zeros_like(logp))
    if cfg.ratio == "sequence":
        assert seq_ids is not None
        log_ratio = torch.where(mask, _segment_mean(log_ratio, mask, seq_ids, num_seqs), torch.zeros_like(logp))
    if cfg.log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    surr_unclipped = -advantages * ratio
    surr_clipped = -advantages * torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.high)
    pg = torch.maximum(surr_unclipped, surr_clipped)
    clipped = surr_clipped > surr_unclipped
    if cfg.dual_clip is not None:
        bound = -advantages * cfg.dual_clip  # positive for negative advantages
        dual = (advantages < 0) & (pg > bound)
        pg = torch.where(advantages < 0, torch.minimum(pg, bound), pg)
    else:
        dual = torch.zeros_like(mask)

    raw_weight, weight, keep, truncated = behaviour_weight(proximal, behaviour, mask, cfg, seq_ids, num_seqs)
    pg = pg * weight.detach()
    loss = (torch.where(keep, pg, torch.zeros_like(pg)) * weights.to(pg.dtype)).sum()

    with torch.no_grad():
        n_keep = keep.sum().clamp(min=1).to(torch.float32)
        n_mask = mask.sum().clamp(min=1).to(torch.float32)
        masked_w = torch.where(mask, raw_weight, torch.zeros_like(raw_weight))
        dropped = mask & ~keep
        stats = {
            "clip_fraction": (clipped & keep).sum().to(torch.float32) / n_keep,
            "dual_clip_fraction": (dual & keep).sum().to(torch.float32) / n_keep,
            "behave_imp_weight_mean": masked_w.sum() / n_mask,
            "behave_imp_weight_max": masked_w.max() if mask.any() else torch.zeros(()),
            "behave_capped_fraction": (dropped | truncated).sum().to(torch.float32) / n_mask,
            "behave_masked_fraction": dropped.sum().to(torch.float32) / n_mask,
            "behave_truncated_fraction": truncated.sum().to(torch.float32) / n_mask,
            # k3 estimate of KL(π_prox ‖ π_θ): non-negative and low-variance.
            "approx_kl": masked_mean(kl_penalty(logp.detach(), proximal, kind="k3"), mask),
            "ratio_mean": masked_mean(ratio.detach(), mask),
            "n_tokens": mask.sum().to(torch.float32),
        }
    return loss, stats


def behaviour_weight(
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    cfg: PolicyLoss,
    seq_ids: torch.Tensor | None = None,
    num_seqs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(raw weight, corrected weight, tokens kept, tokens whose weight was truncated) per `cfg.behave_correction`.

    The raw weight is per token (``π_prox/π_behave``) or, for the sequence corrections, the product over the
    sequence's tokens; a non-finite weight (a token the proximal policy finds impossible) is 0.
    """
    none = torch.zeros_like(mask)
    if not cfg.decoupled:
        return torch.ones_like(proximal), torch.ones_like(proximal), mask, none
    log_w = torch.where(mask, proximal - behaviour, torch.zeros_like(proximal))
    sequence = cfg.behave_correction.startswith("sequence")
    if sequence:
        assert seq_ids is not None
        log_w = torch.where(mask, _segment_sum(log_w, mask, seq_ids, num_seqs), torch.zeros_like(log_w))
    raw = torch.exp(log_w.clamp(max=80.0))
    raw = torch.where(torch.isfinite(raw), raw, torch.zeros_like(raw))
    cap = cfg.behave_imp_weight_cap
    if cap is None:
        return raw, raw, mask, none
    over = mask & (raw > cap)
    if cfg.behave_correction.endswith("mask"):
        return raw, raw, mask & ~over, none
    return raw, torch.clamp(raw, max=cap), mask, over


def _segment_sum(
    values: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int | None = None
) -> torch.Tensor:
    """Each token's sequence total of ``values`` over ``mask`` (differentiable in ``values``)."""
    ids = seq_ids.reshape(-1).long()
    flat = torch.where(mask, values, torch.zeros_like(values)).reshape(-1)
    if num_seqs is None:
        num_seqs = int(ids.max()) if ids.numel() else 0
    totals = torch.zeros(num_seqs + 1, dtype=flat.dtype, device=flat.device)
    return totals.index_add(0, ids, flat)[ids].view_as(values)


def _segment_mean(
    values: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int | None = None
) -> torch.Tensor:
    """Each token's sequence mean of ``values`` over ``mask`` (differentiable in ``values``)."""
    counts = _segment_sum(torch.ones_like(values), mask, seq_ids, num_seqs)
    return _segment_sum(values, mask, seq_ids, num_seqs) / counts.clamp(min=1.0)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from log-probs of tokens sampled from π (Schulman's k1/k2/k3).

    k1 = log r (unbiased, can be negative), k2 = ½(log r)² (biased, low variance),
    k3 = (1/r − 1) + log r with r = π/π_ref (unbiased and non-negative). The log-ratio is clamped to
    ±20 for k3 so one wild token cannot produce inf. In float32, or float64 when either input is float64 (as
    REINFORCE++'s KL reward passes them).
    """
    dtype = torch.float64 if torch.float64 in (logprobs.dtype, ref_logprobs.dtype) else torch.float32
    log_ratio = logprobs.to(dtype) - ref_logprobs.to(dtype)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        lr = log_ratio.clamp(-20.0, 20.0)
        return torch.exp(-lr) - 1.0 + lr
    raise ValueError(f"unknown KL estimator {kind!r}; expected 'k1', 'k2' or 'k3'")


def reverse_kl_distill(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    token_count: float | None = None,
    advantage_clip: float | None = 5.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """On-policy distillation: minimise reverse KL(student ‖ teacher) on tokens the student sampled.

    The per-token estimate is ``student − teacher`` log-prob of the sampled token. Differentiating
    that estimate directly has zero expected gradient (E_s[∇log s] = 0), so the loss is the
    score-function form ``sg(student − teacher) · log s``, whose gradient is the true reverse-KL
    gradient; i.e. the negative per-token KL acts as an advantage. The reported ``reverse_kl`` is
    the estimate itself.

    Variance: a confident teacher gives the student's wrong tokens a log-ratio of 10 or more, which
    swamps every other gradient once the global norm is clipped. Two standard remedies: the batch's
    mean log-ratio is subtracted as a baseline (a constant, so the gradient stays unbiased), and the
    centred log-ratio is clipped to ``±advantage_clip`` (biased, bounded; ``None`` disables it).
    """
    s = student_logprobs.to(torch.float32)
    per_token = (s - teacher_logprobs.to(torch.float32)).detach()
    bool_mask = mask.bool()
    advantage = per_token - masked_mean(per_token, bool_mask) if bool_mask.any() else per_token
    if advantage_clip is not None:
        advantage = advantage.clamp(-advantage_clip, advantage_clip)
    loss = masked_mean(advantage * s, bool_mask, token_count)
    stats = {"reverse_kl": masked_mean(per_token, mask.bool()), "n_tokens": mask.bool().sum().float()}
    return loss, stats
