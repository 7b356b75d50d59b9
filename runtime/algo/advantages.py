"""Critic-free advantage estimators: each sample's reward judged against a baseline from its group or batch.

GRPO replaces a learned critic with the group itself: for the ``n`` samples drawn from one prompt,
advantage = (reward − group mean) / (group std + eps). A group whose rewards are all equal carries
no learning signal, so its advantages are exactly zero (not 0/eps noise). `advantages` dispatches on the
plan's estimator name (grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

Estimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
ESTIMATORS: tuple[str, ...] = Estimator.__args__  # type: ignore[attr-defined]


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
    up-weighting nearly-solved or nearly-hopeless prompts. Returns float32 of the same shape.
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
    return centred.reshape(rewards.shape)


def token_advantages(advantages: torch.Tensor, lengths: list[int] | torch.Tensor) -> torch.Tensor:
    """Broadcast one advantage per sequence onto its tokens, concatenated (the packed layout)."""
    lens = torch.as_tensor(lengths, dtype=torch.long)
    if lens.numel() != advantages.numel():
        raise ValueError(f"{advantages.numel()} advantages but {lens.numel()} sequence lengths")
    return torch.repeat_interleave(advantages.reshape(-1).to(torch.float32), lens)


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    flat = rewards.reshape(-1).to(torch.float32)
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
    return torch.where(degenerate, torch.zeros_like(adv), adv).reshape(rewards.shape)


def batch_normalised(
    values: torch.Tensor, lengths: Sequence[int] | torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """``(v − mean) / (std + eps)`` over the whole batch; with ``lengths`` the moments are over response tokens
    (each sample counted once per token, as OpenRLHF whitens REINFORCE++'s per-token advantages). A batch with
    no spread gives exact zeros."""
    flat = values.reshape(-1).to(torch.float32)
    if lengths is None:
        weight = torch.ones_like(flat)
    else:
        weight = torch.as_tensor(lengths, dtype=torch.float32).reshape(-1)
        if weight.numel() != flat.numel():
            raise ValueError(f"{flat.numel()} values but {weight.numel()} lengths")
    total = weight.sum().clamp(min=1.0)
    mean = (flat * weight).sum() / total
    std = (((flat - mean) ** 2 * weight).sum() / total).sqrt()
    if bool((flat == flat[:1]).all()) or float(std) == 0.0:
        return torch.zeros_like(values, dtype=torch.float32)
    return ((flat - mean) / (std + eps)).reshape(values.shape)


def advantages(
    name: str,
    rewards: torch.Tensor,
    group_size: int,
    *,
    normalize_std: bool = True,
    lengths: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """One advantage per sample of a batch laid out group after group, by the plan's estimator:

      grpo                   (r − group mean) / group std (``normalize_std``; DeepSeekMath, Shao et al. 2024)
      dr_grpo                r − group mean (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training")
      rloo                   r − mean of the group's other samples (`rloo_advantages`)
      reinforce_pp           r normalised over the batch (REINFORCE++, Hu et al. 2025, arXiv 2501.03262)
      reinforce_pp_baseline  (r − group mean), then normalised over the batch (REINFORCE++-baseline, ibid.)

    ``lengths`` (response tokens per sample) makes the REINFORCE++ batch moments token-weighted.
    """
    if name == "grpo":
        return group_advantages(rewards, group_size, scale_by_std=normalize_std)
    if name == "dr_grpo":
        return group_advantages(rewards, group_size, scale_by_std=False)
    if name == "rloo":
        return rloo_advantages(rewards, group_size)
    if name == "reinforce_pp":
        _grouped(rewards, group_size)  # the layout check
        return batch_normalised(rewards, lengths)
    if name == "reinforce_pp_baseline":
        centred = group_advantages(rewards, group_size, scale_by_std=False)
        return batch_normalised(centred, lengths)
    raise ValueError(f"unknown advantage estimator {name!r}; expected one of {', '.join(ESTIMATORS)}")
