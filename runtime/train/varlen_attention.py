"""Varlen causal attention on CPU: per-sequence attention over a packed (THD) row, driven by ``cu_seqlens``.

Registered with transformers as ``rlc_varlen_sdpa``, it runs one SDPA call over the sequences right-padded to the
longest while that wastes little, else one per sequence length, so attention costs about Σ len² instead of L².
The packed forward (`packed_forward`) and context parallelism's full-row step (`context_parallel`) both use it.

`attention_kernel_for` is the platform seam (`schemas.layout.PLATFORM_KERNELS`): this function on cpu, and on CUDA
where flash-attn does not import (torch's SDPA then runs its own fused kernels per sequence length); transformers'
``flash_attention_2`` on CUDA with flash-attn, and on Ascend, where transformers routes it to torch_npu's
``npu_fusion_attention`` in its TND varlen layout (no CUDA package involved).
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from rlc.schemas.layout import FLASH_ATTN_ATTENTION, NPU_FUSION_ATTENTION, VARLEN_SDPA_ATTENTION

__all__ = ["VARLEN_SDPA", "attention_kernel_for", "register_varlen_attention", "varlen_sdpa_attention"]

#: Causal attention over batched rows ``[n, H, L, D]`` (SDPA with the layer's scale, dropout and GQA settings).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
VARLEN_SDPA = "rlc_varlen_sdpa"


def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal SDPA per packed sequence: the varlen kernels' semantics on devices that lack them.

    ``query`` is ``[1, H, L, D]`` and ``key``/``value`` ``[1, Hkv, L, D]`` (grouped-query heads are
    expanded by SDPA); returns ``[1, L, H, D]`` as transformers' attention interface expects.
    """
    if cu_seq_lens_q is None:
        raise ValueError(f"{VARLEN_SDPA} attention needs cu_seq_lens_q: pass packed_attention_inputs(...) kwargs")
    if cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise ValueError(f"{VARLEN_SDPA} is for self-attention over packed sequences (cu_seq_lens_k != _q)")
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError(f"{VARLEN_SDPA} takes one packed row and no attention mask")
    if sliding_window is not None:
        raise NotImplementedError(f"{VARLEN_SDPA} does not implement sliding-window attention")
    bounds = [int(b) for b in cu_seq_lens_q.tolist()]
    gqa = key.shape[1] != query.shape[1]
    lengths = [end - start for start, end in itertools.pairwise(bounds)]
    width = max(lengths)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)

    if width <= PADDED_ATTENTION_MAX_WIDTH and len(lengths) * width**2 <= PADDED_ATTENTION_WASTE * sum(
        n * n for n in lengths
    ):
        return _padded_causal(query, key, value, bounds[:-1], lengths, width, attend), None
    return _grouped_causal(query, key, value, bounds[:-1], lengths, attend), None


#: The single padded call is taken for short sequences, where a call's fixed cost outweighs its arithmetic, while
#: its attention work (sequences × longest²) stays within PADDED_ATTENTION_WASTE of the sequences' own (Σ length²).
#: Measured on the quickstart's rows (128 sequences of 6-11 tokens, forward and backward): one padded call 6.0 ms
#: against 10.5 ms for one call per length, at 1.7x the attention work. Long sequences keep one call per length:
#: there the calls cost nothing next to the arithmetic, and the padded copies are memory the planner does not
#: price (the long-context example's trainer peaked 1.28x its estimate with them, measured).
PADDED_ATTENTION_MAX_WIDTH = 256
PADDED_ATTENTION_WASTE = 2.0


def _padded_causal(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    starts: Sequence[int],
    lengths: Sequence[int],
    width: int,
    attend: Attend,
) -> torch.Tensor:
    """Every sequence right-padded to ``width`` in one batched causal call; pad rows are dropped after.

    Causal attention never lets a real token see the pad tokens after it, so real rows are exact.
    """
    n = len(lengths)
    offsets = torch.arange(width)
    real = offsets[None, :] < torch.tensor(lengths)[:, None]
    first = torch.tensor(starts)[:, None]
    gather = torch.where(real, first + offsets[None, :], first).reshape(-1)

    def rows(t: torch.Tensor) -> torch.Tensor:  # [1, H, T, D] -> [n, H, width, D]
        return t[0].index_select(1, gather.to(t.device)).unflatten(1, (n, width)).transpose(0, 1)

    out = attend(rows(query), rows(key), rows(value))  # [n, H, width, D]
    out = out.transpose(1, 2).reshape(n * width, out.shape[1], out.shape[-1])
    keep = real.reshape(-1).nonzero().squeeze(1).to(out.device)
    return out.index_select(0, keep).unsqueeze(0)


def _grouped_causal(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    starts: Sequence[int],
    lengths: Sequence[int],
    attend: Attend,
) -> torch.Tensor:
    """One batched causal call per distinct sequence length (no padding at all); for widely spread lengths.

    Tokens are gathered per length and put back in packed order with the inverse permutation.
    """
    starts_by_length: dict[int, list[int]] = {}
    for start, length in zip(starts, lengths, strict=True):
        starts_by_length.setdefault(length, []).append(start)
    outs, order = [], []
    for length, same in starts_by_length.items():
        positions = (torch.tensor(same)[:, None] + torch.arange(length)[None, :]).reshape(-1)
        order.append(positions)
        n = len(same)

        def rows(
            t: torch.Tensor, positions: torch.Tensor = positions, n: int = n, length: int = length
        ) -> torch.Tensor:
            # [1, H, T, D] -> [n, H, length, D]
            return t[0].index_select(1, positions.to(t.device)).unflatten(1, (n, length)).transpose(0, 1)

        out = attend(rows(query), rows(key), rows(value))
        outs.append(out.transpose(1, 2).reshape(n * length, *out.shape[1:2], out.shape[-1]))  # [n·len, H, D]
    packed = torch.cat(outs) if len(outs) > 1 else outs[0]
    inverse = torch.argsort(torch.cat(order)).to(packed.device)
    return packed.index_select(0, inverse).unsqueeze(0)


def register_varlen_attention() -> str:
    """Register ``varlen_sdpa_attention`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    return VARLEN_SDPA


def attention_kernel_for(platform: str) -> tuple[str, str]:
    """(transformers attention implementation, kernel name) for packed rows on `platform`; registers rlc's varlen
    SDPA when that is the choice."""
    if platform == "npu":
        return "flash_attention_2", NPU_FUSION_ATTENTION
    if platform == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2", FLASH_ATTN_ATTENTION
    return register_varlen_attention(), VARLEN_SDPA_ATTENTION
