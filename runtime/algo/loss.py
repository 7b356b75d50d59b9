"""Policy losses over per-token tensors: AReaL's decoupled PPO, KL estimators, reverse-KL distillation.

All inputs are per-token tensors of one shape (packed ``[T]`` or padded ``[B, S]``) plus a mask that
selects the generated tokens the loss is about. Aggregation is a token mean: the sum over masked
tokens divided by the masked-token count, or by ``token_count`` when the caller accumulates several
micro-batches and wants the mean over the whole batch (pass the global count to every micro-batch).
Stats are detached 0-dim tensors so callers decide when to synchronise (``.item()`` stalls an NPU).
"""

from __future__ import annotations

from typing import Literal

import torch

from .logprobs import entropy_from_logits

__all__ = [
    "decoupled_ppo_loss",
    "entropy_from_logits",
    "kl_penalty",
    "masked_mean",
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
    dual_clip: float | None = None,
    decoupled: bool = True,
    token_count: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AReaL's decoupled PPO objective (Fu et al., 2025, "AReaL"), token-mean over ``mask``.

    Asynchronous rollout means the tokens were sampled by a stale *behaviour* policy. The decoupled
    objective clips against a recent *proximal* policy instead (trust region around what we are
    updating from) and corrects the distribution shift with the importance weight
    ``w = exp(proximal − behaviour)``:

        loss_t = w_t · max(−A_t·r_t, −A_t·clip(r_t, 1−ε, 1+ε_high)),   r_t = exp(logπ_θ − logπ_prox)

    Tokens whose ``w_t`` exceeds ``behave_imp_weight_cap`` are too off-policy to trust and are masked
    out (AReaL's token-level ``mask`` rejection; ``None`` disables it). As in AReaL the denominator
    stays the original masked-token count, so dropping tokens does not re-weight the survivors.

    With ``decoupled=False`` this is plain PPO against the behaviour policy (``proximal_logprobs`` is
    ignored, no importance weight). ``dual_clip`` (> 1) bounds the loss of negative-advantage tokens
    whose ratio explodes (Ye et al., 2020). Only ``logprobs`` should carry gradient.
    """
    if clip <= 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    mask = mask.bool()
    advantages = advantages.detach().to(torch.float32)
    behaviour = behaviour_logprobs.detach().to(torch.float32)
    proximal = proximal_logprobs.detach().to(torch.float32) if decoupled else behaviour
    logp = logprobs.to(torch.float32)

    # Zero the log-ratio off the mask so padding garbage cannot overflow exp().
    log_ratio = torch.where(mask, logp - proximal, torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)
    high = clip if clip_higher is None else clip_higher
    surr_unclipped = -advantages * ratio
    surr_clipped = -advantages * torch.clamp(ratio, 1.0 - clip, 1.0 + high)
    pg = torch.maximum(surr_unclipped, surr_clipped)
    clipped = surr_clipped > surr_unclipped
    if dual_clip is not None:
        bound = -advantages * dual_clip  # positive for negative advantages
        dual = (advantages < 0) & (pg > bound)
        pg = torch.where(advantages < 0, torch.minimum(pg, bound), pg)
    else:
        dual = torch.zeros_like(mask)

    if decoupled:
        weight = torch.exp(torch.where(mask, proximal - behaviour, torch.zeros_like(proximal)))
        weight = torch.where(torch.isfinite(weight), weight, torch.zeros_like(weight))
    else:
        weight = torch.ones_like(pg)
    keep = mask
    if decoupled and behave_imp_weight_cap is not None:
        keep = mask & (weight <= behave_imp_weight_cap)
    pg = pg * weight.detach()

    denom_mask = mask  # original count, as AReaL does
    loss = masked_mean(torch.where(keep, pg, torch.zeros_like(pg)), denom_mask, token_count)

    with torch.no_grad():
        n_keep = keep.sum().clamp(min=1).to(torch.float32)
        n_mask = mask.sum().clamp(min=1).to(torch.float32)
        masked_w = torch.where(mask, weight, torch.zeros_like(weight))
        stats = {
            "clip_fraction": (clipped & keep).sum().to(torch.float32) / n_keep,
            "dual_clip_fraction": (dual & keep).sum().to(torch.float32) / n_keep,
            "behave_imp_weight_mean": masked_w.sum() / n_mask,
            "behave_imp_weight_max": masked_w.max() if mask.any() else torch.zeros(()),
            "behave_capped_fraction": (mask & ~keep).sum().to(torch.float32) / n_mask,
            # k3 estimate of KL(π_prox ‖ π_θ): non-negative and low-variance.
            "approx_kl": masked_mean(kl_penalty(logp.detach(), proximal, kind="k3"), mask),
            "ratio_mean": masked_mean(ratio.detach(), mask),
            "n_tokens": mask.sum().to(torch.float32),
        }
    return loss, stats


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from log-probs of tokens sampled from π (Schulman's k1/k2/k3).

    k1 = log r (unbiased, can be negative), k2 = ½(log r)² (biased, low variance),
    k3 = (1/r − 1) + log r with r = π/π_ref (unbiased and non-negative). The log-ratio is clamped to
    ±20 for k3 so one wild token cannot produce inf.
    """
    log_ratio = logprobs.to(torch.float32) - ref_logprobs.to(torch.float32)
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
