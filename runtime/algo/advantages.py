"""Critic-free advantage estimators: each sample's reward judged against a baseline from its group or batch.

GRPO replaces a learned critic with the group itself: for the ``n`` samples drawn from one prompt,
advantage = (reward − group mean) / (group std + eps). A group whose rewards are all equal carries
no learning signal, so its advantages are exactly zero (not 0/eps noise). `advantages` dispatches on the
plan's per-sample estimator name (grpo, dr_grpo, rloo, reinforce_pp_batchnorm, reinforce_pp_baseline);
REINFORCE++ as published is per token (`reinforce_pp_advantages`), since its reward carries a per-token KL.

Statistics are taken in float64: rewards near float32's maximum (sums of two overflow float32) still give finite
advantages, returned as float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from .loss import KLKind, kl_penalty

Estimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_batchnorm", "reinforce_pp_baseline"]
ESTIMATORS: tuple[str, ...] = Estimator.__args__  # type: ignore[attr-defined]
GroupStd = Literal["population", "sample"]


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    unbiased_std: bool = False,
) -> torch.Tensor:
    """Group-normalised advantages for a flat reward vector laid out group after group.

    ``rewards`` has shape ``[num_groups * group_size]`` (samples of one prompt are contiguous, as the
    rollout side emits them). ``scale_by_std=False`` gives Dr. GRPO's mean-only baseline, which avoids
    up-weighting nearly-solved or nearly-hopeless prompts. ``unbiased_std`` divides the group's variance by n − 1
    (the sample std, as verl's GRPO) instead of n (the population std). Returns float32 of the same shape.
    """
    grouped = _grouped(rewards, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    centred = grouped - mean
    if scale_by_std:
        # A single-sample group has no spread (and unbiased std would be nan).
        std = grouped.std(dim=1, keepdim=True, unbiased=unbiased_std) if group_size > 1 else torch.zeros_like(mean)
        centred = centred / (std + eps)
    # An all-equal group has no signal; force exact zeros rather than rounding residue.
    degenerate = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
    centred = torch.where(degenerate, torch.zeros_like(centred), centred)
    return centred.reshape(rewards.shape).to(torch.float32)


def token_advantages(advantages: torch.Tensor, lengths: list[int] | torch.Tensor) -> torch.Tensor:
    """Broadcast one advantage per sequence onto its tokens, concatenated (the packed layout)."""
    lens = torch.as_tensor(lengths, dtype=torch.long)
    if lens.numel() != advantages.numel():
        raise ValueError(f"{advantages.numel()} advantages but {lens.numel()} sequence lengths")
    return torch.repeat_interleave(advantages.reshape(-1).to(torch.float32), lens)


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    flat = rewards.reshape(-1).to(torch.float64)
    if flat.numel() % group_size != 0:
        raise ValueError(
            f"{flat.numel()} rewards cannot be split into groups of {group_size} "
            f"({flat.numel()} % {group_size} = {flat.numel() % group_size})"
        )
    return flat.view(-1, group_size)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization"): each sample's
    baseline is the mean of the *other* samples of its group, ``A_i = r_i − (Σ_j r_j − r_i)/(n − 1)``, which
    equals ``n/(n − 1) · (r_i − mean)``. Needs ``group_size >= 2``; an all-equal group is exactly zero."""
    if group_size < 2:
        raise ValueError(f"RLOO needs group_size >= 2 (a leave-one-out baseline), got {group_size}")
    grouped = _grouped(rewards, group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    adv = grouped - others
    degenerate = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
    return torch.where(degenerate, torch.zeros_like(adv), adv).reshape(rewards.shape).to(torch.float32)


def batch_normalised(
    values: torch.Tensor, lengths: Sequence[int] | torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """``(v − mean) / (std + eps)`` over the whole batch; with ``lengths`` the moments are over response tokens
    (each sample counted once per token, as OpenRLHF whitens REINFORCE++'s per-token advantages). A batch with
    no spread gives exact zeros."""
    flat = values.reshape(-1).to(torch.float64)
    if lengths is None:
        weight = torch.ones_like(flat)
    else:
        weight = torch.as_tensor(lengths, dtype=torch.float64).reshape(-1)
        if weight.numel() != flat.numel():
            raise ValueError(f"{flat.numel()} values but {weight.numel()} lengths")
    total = weight.sum().clamp(min=1.0)
    mean = (flat * weight).sum() / total
    std = (((flat - mean) ** 2 * weight).sum() / total).sqrt()
    if bool((flat == flat[:1]).all()) or float(std) == 0.0:
        return torch.zeros_like(values, dtype=torch.float32)
    return ((flat - mean) / (std + eps)).reshape(values.shape).to(torch.float32)


def advantages(
    name: str,
    rewards: torch.Tensor,
    group_size: int,
    *,
    normalize_std: bool = True,
    group_std: GroupStd = "population",
    lengths: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """One advantage per sample of a batch laid out group after group, by the plan's estimator:

      grpo                    (r − group mean) / group std (``normalize_std``; DeepSeekMath, Shao et al. 2024);
                              ``group_std`` population (n) or sample (n − 1, verl's)
      dr_grpo                 r − group mean (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training")
      rloo                    r − mean of the group's other samples (`rloo_advantages`)
      reinforce_pp_batchnorm  r normalised over the batch: REINFORCE++ without its KL reward (β = 0)
      reinforce_pp_baseline   (r − group mean), then normalised over the batch (REINFORCE++-baseline, Hu et al. 2025)

    ``lengths`` (response tokens per sample) makes the batch moments token-weighted. reinforce_pp itself is per
    token and needs the reference policy's log-probs: `reinforce_pp_advantages`.
    """
    if name == "grpo":
        return group_advantages(rewards, group_size, scale_by_std=normalize_std, unbiased_std=group_std == "sample")
    if name == "dr_grpo":
        return group_advantages(rewards, group_size, scale_by_std=False)
    if name == "rloo":
        return rloo_advantages(rewards, group_size)
    if name == "reinforce_pp_batchnorm":
        _grouped(rewards, group_size)  # the layout check
        return batch_normalised(rewards, lengths)
    if name == "reinforce_pp_baseline":
        centred = group_advantages(rewards, group_size, scale_by_std=False)
        return batch_normalised(centred, lengths)
    if name == "reinforce_pp":
        raise ValueError("reinforce_pp's advantages are per token (a KL in the reward): use reinforce_pp_advantages")
    raise ValueError(f"unknown advantage estimator {name!r}; expected one of {', '.join(ESTIMATORS)}")


def compromised(failed: Sequence[bool], group_size: int) -> list[bool]:
    """Per sample, whether its group holds a sample whose reward failed (``failed``: per sample, laid out group after
    group). A failed reward has no value to learn from and leaves its group without a baseline, so the whole group
    carries no learning signal, as an all-equal group."""
    flags = [bool(f) for f in failed]
    groups = [any(flags[i : i + group_size]) for i in range(0, len(flags), group_size)]
    return [g for g in groups for _ in range(group_size)]


def plan_advantages(
    algo: Any,
    rewards: torch.Tensor,
    group_size: int,
    lengths: Sequence[int] | torch.Tensor,
    failed: Sequence[bool] | None = None,
) -> torch.Tensor:
    """`advantages` by the plan's algorithm section (``lengths``: response tokens per sample); zeros for
    reinforce_pp, whose per-token advantages `kl_reward_advantages` fills in once the batch is built. A group with a
    failed reward (``failed``, per sample) gets zeros and stays out of the batch moments: every other group's
    advantages are those of the batch without it."""
    if algo.name == "reinforce_pp":
        return torch.zeros(rewards.shape)
    std = getattr(algo, "group_std", "population")  # older plans: the population std
    flat = rewards.reshape(-1)
    keep = torch.tensor([not c for c in compromised(failed or [False] * flat.numel(), group_size)], dtype=torch.bool)
    out = torch.zeros(flat.shape, dtype=torch.float32)
    if keep.any():
        kept_lengths = [int(n) for n, k in zip(lengths, keep.tolist(), strict=True) if k]
        adv = advantages(
            algo.name, flat[keep], group_size, normalize_std=algo.normalize_std, group_std=std, lengths=kept_lengths
        )
        out[keep] = adv
    return out.reshape(rewards.shape)


def reinforce_pp_advantages(
    rewards: Sequence[float] | torch.Tensor, token_kl: Sequence[torch.Tensor], kl_coef: float, eps: float = 1e-6
) -> list[torch.Tensor]:
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262, eq. 8-10) from each sample's scalar reward and the KL of each of
    its response tokens, in order.

    The reward is per token: ``r_t = −β·KL_t``, plus the scalar reward at the last response token; the return
    ``G_t = Σ_{i≥t} r_i`` (γ = 1) is ``r − β·Σ_{i≥t} KL_i``. Returns are then normalised over every response token
    of the batch (mean and population std, + ``eps``; OpenRLHF whitens them the same way). Moments in float64; a
    batch with no spread gives exact zeros. Returns one float32 tensor per sample, aligned with ``token_kl``.
    """
    scores = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
    if scores.numel() != len(token_kl):
        raise ValueError(f"{scores.numel()} rewards but {len(token_kl)} samples of token KL")
    returns = []
    for score, kl in zip(scores, token_kl, strict=True):
        kl64 = kl.detach().reshape(-1).to(torch.float64)
        returns.append(score - kl_coef * torch.flip(torch.cumsum(torch.flip(kl64, (0,)), 0), (0,)))
    sizes = [len(g) for g in returns]
    flat = torch.cat(returns) if returns else torch.zeros(0, dtype=torch.float64)
    if flat.numel() == 0 or bool((flat == flat[:1]).all()):
        return [torch.zeros(n) for n in sizes]
    whitened = ((flat - flat.mean()) / (flat.std(unbiased=False) + eps)).to(torch.float32)
    return list(torch.split(whitened, sizes))


def reinforce_pp_rows(
    rewards: Sequence[float],
    samples: Sequence[Sequence[int]],
    masks: Sequence[Sequence[int]],
    behaviour: Sequence[Sequence[float]],
    reference: Sequence[Sequence[float]],
    kl_coef: float,
    estimator: KLKind = "k1",
    excluded: Sequence[bool] | None = None,
) -> list[list[float]]:
    """`reinforce_pp_advantages` laid out as training rows: sample ``i``'s response is the tokens where ``masks``
    is 1 in its rows ``samples[i]``, in order (one row for a single completion, one per model call or segment for an
    agent trajectory). ``KL_t`` is the ``estimator``'s estimate from the behaviour policy's and the reference's
    log-probs of the sampled token (k1: ``log π_behave − log π_ref``, the paper's). Returns one advantage per
    position of every row, 0 off the mask. Samples flagged in ``excluded`` (a group with a failed reward,
    `compromised`) get 0 on every token and stay out of the whitening."""
    if excluded is not None and any(excluded):
        kept = [i for i, e in enumerate(excluded) if not e]
        sub = reinforce_pp_rows(
            [rewards[i] for i in kept], [samples[i] for i in kept], masks, behaviour, reference, kl_coef, estimator
        )
        kept_rows = {r for i in kept for r in samples[i]}
        return [sub[r] if r in kept_rows else [0.0] * len(m) for r, m in enumerate(masks)]
    kls: list[torch.Tensor] = []
    for rows in samples:
        b = [lp for r in rows for lp, m in zip(behaviour[r], masks[r], strict=True) if m]
        ref = [lp for r in rows for lp, m in zip(reference[r], masks[r], strict=True) if m]
        kls.append(kl_penalty(torch.tensor(b, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64), estimator))
    per_sample = reinforce_pp_advantages(rewards, kls, kl_coef)
    out: list[list[float]] = [[0.0] * len(m) for m in masks]
    for rows, adv in zip(samples, per_sample, strict=True):
        values = iter(adv.tolist())
        for r in rows:
            out[r] = [next(values) if m else 0.0 for m in masks[r]]
    return out


def reward_kl(algo: Any) -> tuple[float, KLKind]:
    """The plan's REINFORCE++ reward KL (β, estimator); β 0 for every other estimator (and older plans)."""
    if algo.name != "reinforce_pp":
        return 0.0, "k1"
    return float(getattr(algo, "reward_kl_coef", None) or 0.0), getattr(algo, "reward_kl_estimator", None) or "k1"


def kl_reward_advantages(
    algo: Any,
    batch: dict[str, Any],
    rewards: Sequence[float],
    samples: Sequence[Sequence[int]],
    masks: Sequence[Sequence[int]],
    reference_logprobs: Callable[[dict[str, Any]], list[list[float]]],
    excluded: Sequence[bool] | None = None,
) -> list[list[float]]:
    """reinforce_pp's per-token advantages of a built batch (`reinforce_pp_rows` over ``batch``'s behaviour
    log-probs), scoring it under the reference policy only when β > 0; a plan that also has a KL loss
    (``kl_coef``) keeps the reference log-probs in ``batch`` so they are computed once. ``excluded``: per sample,
    a group with a failed reward (0 on its tokens).

    π_behave in KL_t is the engine's log-prob of each sampled token (``behaviour_logprobs``, the version that
    sampled it), not the actor's own as OpenRLHF scores it: that needs no trainer forward over the batch before the
    step. The price is a bias: each token's engine-trainer gap (the ``logprob_gap/mean`` metric: under 1e-5 in
    float32, 0.002-0.04 nats in bf16 after a fresh sync) enters KL_t, so a return carries up to β × the gaps summed
    over the rest of its response; with staleness the KL is the older sampling policy's. KL_t and the returns are
    float64 (`kl_penalty` keeps float64 inputs in float64)."""
    beta, estimator = reward_kl(algo)
    behaviour = batch["behaviour_logprobs"]
    reference = reference_logprobs(batch) if beta > 0 else behaviour
    if beta > 0 and algo.kl_coef > 0:
        batch["ref_logprobs"] = reference
    return reinforce_pp_rows(rewards, samples, masks, behaviour, reference, beta, estimator, excluded)
