"""Torch dtypes named as the weight-sync announcements name them (``"bfloat16"``), shared by every weight path."""

from __future__ import annotations

import torch

__all__ = ["dtype_from_str"]


def dtype_from_str(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` → ``torch.bfloat16``."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype
