"""GRPO advantages: each sample's reward judged against the other samples of its prompt group.

GRPO replaces a learned critic with the group itself: for the ``n`` samples drawn from one prompt,
advantage = (reward − group mean) / (group std + eps). A group whose rewards are all equal carries
no learning signal, so its advantages are exactly zero (not 0/eps noise).
"""

from __future__ import annotations

import torch


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
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    flat = rewards.reshape(-1).to(torch.float32)
    if flat.numel() % group_size != 0:
        raise ValueError(
            f"{flat.numel()} rewards cannot be split into groups of {group_size} "
            f"({flat.numel()} % {group_size} = {flat.numel() % group_size})"
        )
    grouped = flat.view(-1, group_size)
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
