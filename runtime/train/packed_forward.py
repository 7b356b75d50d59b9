"""The trainer's forward on packed (THD) micro-batches: attention adapters and the chunked log-prob head.

A packed micro-batch is one row ``[1, L]`` of concatenated sequences whose positions restart per
sequence. Attention must not cross sequence boundaries, and transformers does not infer that from
restarted ``position_ids`` under sdpa/eager on CPU (measured: log-probs off by ~0.76). Two ways to
isolate the sequences, chosen by ``packed_attention``:

- ``"varlen"``: per-sequence causal attention driven by ``cu_seqlens``, the THD layout of varlen
  fused kernels. On NPU/CUDA transformers' ``flash_attention_2`` takes the ``cu_seq_lens_*`` and
  ``max_length_*`` kwargs directly; on CPU `varlen_attention.varlen_sdpa_attention`.
- ``"mask"``: an explicit ``[1, 1, L, L]`` block-diagonal causal mask under sdpa. Exact but O(L²) in
  memory and compute; kept as the CPU reference the varlen path is tested against.

The head never materialises ``[T, V]`` logits: ``chunked_logprobs_entropy`` walks the tokens in
``logprob_chunk_tokens`` chunks, which is what the planner's memory model assumes (chunk × V × 4 × 3).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F

from ..algo.logprobs import chunked_logprobs_entropy
from ..packing import PackedBatch, pack_micro_batches
from ..platform import Platform
from .varlen_attention import VARLEN_SDPA, attention_kernel_for, register_varlen_attention, varlen_sdpa_attention

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
LOGPROB_METHOD = "rlc_token_logprobs"


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
    # rlc's varlen SDPA on cpu (and CUDA without flash-attn); flash_attention_2 (torch_npu's on Ascend) elsewhere.
    return attention_kernel_for(platform.name)[0]


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
