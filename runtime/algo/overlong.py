"""DAPO's overlong handling (Yu et al. 2025, arXiv 2503.14476 §3.4): shaping and filtering of long responses.

A response cut off at the length limit gets a reward for an answer it never finished, which teaches noise. DAPO
softens the cliff with a length penalty over the last ``buffer_len`` tokens before the limit (eq. 13) and can mask
the loss of truncated responses altogether (overlong filtering). Pure Python: the workflow calls it per sample.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["is_truncated", "overlong_penalty"]


def overlong_penalty(length: int, max_len: int, buffer_len: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment, added to the reward of a response of ``length`` tokens:

        0                                           if length <= max_len − buffer_len
        penalty · ((max_len − buffer_len) − length) / buffer_len   if max_len − buffer_len < length <= max_len
        −penalty                                    if length > max_len

    ``buffer_len`` 0 punishes nothing.
    """
    if buffer_len <= 0:
        return 0.0
    if buffer_len >= max_len:
        raise ValueError(f"buffer_len {buffer_len} must be below max_len {max_len}")
    start = max_len - buffer_len
    if length <= start:
        return 0.0
    if length > max_len:
        return -penalty
    return penalty * (start - length) / buffer_len


def is_truncated(output_ids: Sequence[int], max_len: int, eos_ids: Sequence[int]) -> bool:
    """Whether generation stopped at the length limit rather than at an end-of-sequence token."""
    return len(output_ids) >= max_len and not (output_ids and output_ids[-1] in eos_ids)
