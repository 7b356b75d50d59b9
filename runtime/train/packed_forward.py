"""The trainer's forward on packed (THD) micro-batches: attention adapters and the chunked log-prob head.

A packed micro-batch is one row ``[1, L]`` of concatenated sequences whose positions restart per
sequence. Attention must not cross sequence boundaries, and transformers does not infer that from
restarted ``position_ids`` under sdpa/eager on CPU (measured: log-probs off by ~0.76). Two ways to
isolate the sequences, chosen by ``packed_attention``:

- ``"varlen"``: per-sequence causal attention driven by ``cu_seqlens``, the THD layout of varlen
  fused kernels. On NPU/CUDA transformers' ``flash_attention_2`` takes the ``cu_seq_lens_*`` and
  ``max_length_*`` kwargs directly; on CPU ``varlen_sdpa_attention`` (registered with transformers
  as ``rlc_varlen_sdpa``) runs one SDPA call over the sequences right-padded to the longest while that
  wastes little, else one per sequence length, so attention costs about Σ len² instead of L².
- ``"mask"``: an explicit ``[1, 1, L, L]`` block-diagonal causal mask under sdpa. Exact but O(L²) in
  memory and compute; kept as the CPU reference the varlen path is tested against.

The head never materialises ``[T, V]`` logits: ``chunked_logprobs_entropy`` walks the tokens in
``logprob_chunk_tokens`` chunks, which is what the planner's memory model assumes (chunk × V × 4 × 3).
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F

from ..algo.logprobs import chunked_logprobs_entropy
from ..packing import PackedBatch, pack_micro_batches
from ..platform import Platform

__all__ = [
    "LOGPROB_METHOD",
    "VARLEN_SDPA",
    "PackedAttention",
    "attn_implementation_for",
    "install_logprob_forward",
    "pack_rank_sequences",
    "packed_attention_inputs",
    "register_varlen_attention",
    "varlen_sdpa_attention",
]

PackedAttention = Literal["varlen", "mask"]
#: Causal attention over batched rows ``[n, H, L, D]`` (SDPA with the layer's scale, dropout and GQA settings).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
VARLEN_SDPA = "rlc_varlen_sdpa"
LOGPROB_METHOD = "rlc_token_logprobs"


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


def attn_implementation_for(
    platform: Platform, packing: bool, packed_attention: PackedAttention, cp: int = 1
) -> str | None:
    """The attention implementation to load the model with; None keeps transformers' default (sdpa).

    The choice is made at load time because transformers reads it from the config on every call. Context
    parallelism has its own (``context_parallel.CP_ATTENTION``), which runs Ulysses or ring per micro-batch.
    """
    if cp > 1:
        from .context_parallel import register_cp_attention

        if platform.name == "cpu":
            register_varlen_attention()  # Ulysses' full-row step on cpu
        return register_cp_attention()
    if not packing:
        return None
    if packed_attention == "mask":
        return "sdpa"
    if packed_attention != "varlen":
        raise ValueError(f"unknown packed_attention {packed_attention!r}; expected 'varlen' or 'mask'")
    if platform.name == "cpu":
        return register_varlen_attention()
    # transformers routes flash_attention_2 to torch_npu's varlen kernel on Ascend, flash-attn on CUDA.
    return "flash_attention_2"


def packed_attention_inputs(
    packed: PackedBatch, platform: Platform, device: torch.device, packed_attention: PackedAttention = "varlen"
) -> dict[str, Any]:
    """Keyword arguments for the model body that keep packed sequences from attending to each other.

    ``"mask"``: restarted ``position_ids``, the ``[1, 1, L, L]`` block-causal bool mask (CPU
    reference; O(L²)) and the boundaries as ``rlc_seq_bounds`` for linear-attention layers.
    ``"varlen"``: restarted ``position_ids`` and flash-attention-style ``cu_seq_lens_q/k`` + ``max_length_q/k``
    (int32 cumulative lengths with a leading 0), which transformers forwards to the attention function
    (``flash_attention_2`` on NPU/CUDA, ``varlen_sdpa_attention`` on CPU) and linear-attention layers read too.
    """
    position_ids = packed.position_ids.to(device)
    if packed_attention == "mask":
        if platform.name != "cpu":
            raise ValueError("the O(L²) block-causal mask is a CPU reference; use packed_attention='varlen' on devices")
        return {
            "position_ids": position_ids,
            "attention_mask": packed.attention_mask().to(device),
            # Linear-attention layers take the boundaries themselves (`linear_attention`); attention ignores them.
            "rlc_seq_bounds": packed.cu_seqlens.to(device),
        }
    cu = packed.cu_seqlens.to(device=device, dtype=torch.int32)
    return {
        "position_ids": position_ids,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": packed.max_seqlen,
        "max_length_k": packed.max_seqlen,
    }


def pack_rank_sequences(lengths: Sequence[int], budget: int, algorithm: str = "ffd") -> list[list[int]]:
    """Index bins of this rank's sequences under the micro-batch token budget.

    A sequence longer than the budget raises ``SequenceTooLongError`` naming it, its length and the
    budget (the compiler refuses such plans, so at run time it means the data outgrew the plan).
    """
    return pack_micro_batches(lengths, int(budget), algorithm=algorithm)  # type: ignore[arg-type]


def _token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    body_kwargs: dict[str, Any],
    temperature: float,
    chunk_tokens: int,
    labels: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Body → final hidden states → chunked log-probs and entropy of the next token.

    Without `labels`: fp32 ``[B, T]`` tensors aligned with ``input_ids`` (entry t is about token t given the
    tokens before it; entry 0 is 0; callers also zero each packed sequence's first entry). With `labels` (a
    context-parallel slice, whose next tokens lie partly on the next rank): one entry per position, the
    log-prob of ``labels`` there. `inputs_embeds`: the previous pipeline stage's hidden states, which the body
    continues from (the token ids then only name the labels).
    """
    if inputs_embeds is None:
        hidden = model.model(input_ids=input_ids, **body_kwargs).last_hidden_state
    else:
        hidden = model.model(inputs_embeds=inputs_embeds, **body_kwargs).last_hidden_state
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError("chunked log-probs assume a bias-free lm head")
    if labels is not None:
        return chunked_logprobs_entropy(hidden, head.weight, labels, temperature, chunk_tokens)
    logp, ent = chunked_logprobs_entropy(hidden[:, :-1], head.weight, input_ids[:, 1:], temperature, chunk_tokens)
    return F.pad(logp, (1, 0)), F.pad(ent, (1, 0))


def install_logprob_forward(model: torch.nn.Module) -> None:
    """Give ``model`` a ``rlc_token_logprobs(input_ids, body_kwargs, temperature, chunk_tokens)`` method.

    Under FSDP2 the method is registered as a forward method of the root unit, so the embedding /
    final norm / tied lm-head weights are all-gathered around it exactly as around ``forward``, and
    their gradients are reduce-scattered after backward. Without FSDP it is a plain method.
    """
    from torch.distributed.fsdp import register_fsdp_forward_method

    setattr(model, LOGPROB_METHOD, types.MethodType(_token_logprobs, model))
    register_fsdp_forward_method(model, LOGPROB_METHOD)
