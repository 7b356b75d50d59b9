"""Context parallelism for packed micro-batches: each of the cp ranks holds a contiguous slice of the row.

A packed micro-batch (``[1, L]``, several sequences, positions restarting per sequence) is padded to a
multiple of cp with one extra pad segment and cut into cp equal slices; rank r embeds and runs the layers on
slice r only, so activations per rank fall by cp. Attention is the only operation that mixes tokens, and the
registered attention function (``rlc_context_parallel``, selected at model load) does it one of two ways:

- **Ulysses** (Jacobs et al. 2023, DeepSpeed-Ulysses): an all-to-all turns "all heads, my tokens" into "my
  heads, all tokens", ordinary varlen attention runs over the whole row with the global ``cu_seqlens``, and a
  second all-to-all turns it back. Needs the (local) heads divisible by cp; KV heads are repeated when fewer.
- **Ring** (Liu et al. 2023, ring attention): the K/V slices travel around the cp ranks; each rank attends
  its queries to every block with an online softmax (running max / log-sum-exp), masking keys that are in the
  future or in another packed sequence. Backward sends K/V around again with their gradient accumulators.
  Blocks entirely in a rank's future are skipped but still passed on, so every rank runs the same
  communication in forward and backward. Plain torch (for cpu); accelerators would use a fused kernel that
  returns its log-sum-exp, which is not wired (`schemas/layout.runtime_gaps`).

Both are autograd-correct: Ulysses through torch.distributed.nn's differentiable all-to-all, ring through a
custom autograd function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..packing import PackedBatch, pack_sequences
from .varlen_attention import varlen_sdpa_attention

__all__ = [
    "CP_ATTENTION",
    "CpShard",
    "all_to_all_autograd",
    "context_parallel_attention",
    "cp_micro_batch",
    "register_cp_attention",
]

CP_ATTENTION = "rlc_context_parallel"
#: Query rows per block product in ring attention: bounds the [heads, rows, block] score matrix.
RING_QUERY_ROWS = 1024


@dataclass(frozen=True)
class CpShard:
    """This rank's slice of one packed micro-batch; travels to the attention function as ``rlc_cp``."""

    group: Any  # the cp process group
    rank: int  # position in the cp group
    size: int  # cp degree
    kind: str  # "ulysses" or "ring"
    cu_seqlens: torch.Tensor  # int32 boundaries of the whole padded row (pad segment included)
    max_seqlen: int
    chunk: int  # tokens per rank
    inner: str  # attention for Ulysses' full-row step: transformers implementation name

    @property
    def start(self) -> int:
        return self.rank * self.chunk

    @property
    def end(self) -> int:
        return self.start + self.chunk

    def doc_ids(self, device: torch.device) -> torch.Tensor:
        """Which packed segment each position of the whole row belongs to."""
        cu = self.cu_seqlens.to(device=device, dtype=torch.long)
        return torch.repeat_interleave(torch.arange(cu.numel() - 1, device=device), cu[1:] - cu[:-1])


def cp_micro_batch(seqs: list[list[int]], pad_id: int, size: int) -> tuple[PackedBatch, int]:
    """Pack `seqs` and append a pad segment so the row splits into `size` equal slices.

    Returns the packed batch (pad segment included as its last sequence when one was needed) and the number
    of pad tokens appended (0 when the row already divides).
    """
    total = sum(len(s) for s in seqs)
    pad = (-total) % size
    packed = pack_sequences([*seqs, [pad_id] * pad] if pad else seqs)
    return packed, pad


def _global_rank(group: Any, rank: int) -> int:
    return dist.get_global_rank(group, rank)


# --------------------------------------------------------------------------------------------- Ulysses


def all_to_all_autograd(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Differentiable all-to-all over dim 0 (chunk i goes to rank i, chunk i of the result came from rank i)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), None, None, group))


def _seq_to_heads(x: torch.Tensor, size: int, group: Any) -> torch.Tensor:
    """``[1, H, c, D]`` (all heads, my tokens) → ``[1, H/size, size·c, D]`` (my heads, every token)."""
    _, heads, chunk, dim = x.shape
    parts = x.reshape(size, heads // size, chunk, dim)
    got = all_to_all_autograd(parts, group)  # [size (source rank = token slice), H/size, c, D]
    return got.permute(1, 0, 2, 3).reshape(1, heads // size, size * chunk, dim)


def _heads_to_seq(x: torch.Tensor, size: int, group: Any) -> torch.Tensor:
    """``[1, size·c, H/size, D]`` (transformers' output layout, my heads) → ``[1, c, H, D]`` (my tokens)."""
    _, total, local_heads, dim = x.shape
    chunk = total // size
    parts = x.reshape(size, chunk, local_heads, dim)  # slice i of the tokens goes to rank i
    got = all_to_all_autograd(parts, group)  # [size (source rank = head group), c, H/size, D]
    return got.permute(1, 0, 2, 3).reshape(1, chunk, size * local_heads, dim)


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x


def _inner_attention(name: str) -> Callable[..., tuple[torch.Tensor, Any]]:
    if name == "flash_attention_2":
        from transformers import AttentionInterface

        return AttentionInterface._global_mapping["flash_attention_2"]
    return varlen_sdpa_attention


def _ulysses(
    module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: CpShard, scaling: float | None
) -> torch.Tensor:
    heads = q.shape[1]
    if heads % shard.size:
        raise ValueError(f"Ulysses context parallelism: {heads} local heads do not split over cp {shard.size}")
    if k.shape[1] % shard.size:  # fewer KV heads than cp ranks: give every rank the KV heads its queries use
        k, v = _repeat_kv(k, heads), _repeat_kv(v, heads)
    qf, kf, vf = (_seq_to_heads(t, shard.size, shard.group) for t in (q, k, v))
    cu = shard.cu_seqlens.to(device=q.device, dtype=torch.int32)
    out, _ = _inner_attention(shard.inner)(
        module,
        qf,
        kf,
        vf,
        None,
        scaling=scaling,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=shard.max_seqlen,
        max_length_k=shard.max_seqlen,
    )
    return _heads_to_seq(out, shard.size, shard.group)


# --------------------------------------------------------------------------------------------- ring


def _block_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """[rows, keys] True where the query may attend the key: same packed sequence, key not after the query."""
    return (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)) & (doc[q_pos].unsqueeze(1) == doc[k_pos].unsqueeze(0))


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [H, r, D] to one K/V block [H, c, D]: output and log-sum-exp per row (-inf if none)."""
    scores = torch.einsum("hrd,hcd->hrc", q, k) * scale
    scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return torch.einsum("hrc,hcd->hrd", probs, v), lse


def _exchange(tensor: torch.Tensor, shard: CpShard) -> tuple[torch.Tensor, list[Any]]:
    """Start sending `tensor` to the next rank of the ring and receiving the previous rank's into a new buffer."""
    nxt = _global_rank(shard.group, (shard.rank + 1) % shard.size)
    prev = _global_rank(shard.group, (shard.rank - 1) % shard.size)
    buf = torch.empty_like(tensor)
    return buf, [dist.isend(tensor.contiguous(), nxt, group=shard.group), dist.irecv(buf, prev, group=shard.group)]


def _finish(works: list[Any]) -> None:
    for work in works:
        work.wait()


class _RingAttention(torch.autograd.Function):
    """Causal, packed-sequence-aware ring attention over the cp group (fp32 maths)."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, doc, scale, shard):  # type: ignore[override]
        heads, rows, dim = q.shape
        out = torch.zeros(heads, rows, dim, dtype=torch.float32, device=q.device)
        lse = torch.full((heads, rows), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).float()
        qf = q.float()
        for step in range(shard.size):
            src = (shard.rank - step) % shard.size
            works: list[Any] = []
            if step < shard.size - 1:
                incoming, works = _exchange(kv, shard)
            if src <= shard.rank:  # a block wholly in the future is skipped, but still passed on
                k_pos = torch.arange(src * shard.chunk, (src + 1) * shard.chunk, device=q.device)
                for r0 in range(0, rows, RING_QUERY_ROWS):
                    sl = slice(r0, min(rows, r0 + RING_QUERY_ROWS))
                    mask = _block_mask(q_pos[sl], k_pos, doc)
                    b_out, b_lse = _block_forward(qf[:, sl], kv[0], kv[1], mask, scale)
                    new = torch.logaddexp(lse[:, sl], b_lse)
                    keep = torch.where(torch.isinf(new), 0.0, torch.exp(lse[:, sl] - new))
                    add = torch.where(torch.isinf(new), 0.0, torch.exp(b_lse - new))
                    out[:, sl] = out[:, sl] * keep.unsqueeze(-1) + b_out * add.unsqueeze(-1)
                    lse[:, sl] = new
            _finish(works)
            if works:
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse, q_pos, doc)
        ctx.scale, ctx.shard = scale, shard
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse, q_pos, doc = ctx.saved_tensors
        scale, shard = ctx.scale, ctx.shard
        rows = q.shape[1]
        qf, go = q.float(), grad_out.float()
        delta = (go * out).sum(-1)  # [H, rows]: rowsum(dO ∘ O)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v]).float()
        dkv = torch.zeros_like(kv)  # gradient of the block we hold; it travels with the block
        for step in range(shard.size):
            src = (shard.rank - step) % shard.size
            if src <= shard.rank:
                k_pos = torch.arange(src * shard.chunk, (src + 1) * shard.chunk, device=q.device)
                for r0 in range(0, rows, RING_QUERY_ROWS):
                    sl = slice(r0, min(rows, r0 + RING_QUERY_ROWS))
                    mask = _block_mask(q_pos[sl], k_pos, doc).unsqueeze(0)
                    scores = torch.einsum("hrd,hcd->hrc", qf[:, sl], kv[0]) * scale
                    probs = torch.where(mask, torch.exp(scores - lse[:, sl].unsqueeze(-1)), 0.0)
                    dkv[1] += torch.einsum("hrc,hrd->hcd", probs, go[:, sl])
                    dp = torch.einsum("hrd,hcd->hrc", go[:, sl], kv[1])
                    ds = probs * (dp - delta[:, sl].unsqueeze(-1))
                    dq[:, sl] += torch.einsum("hrc,hcd->hrd", ds, kv[0]) * scale
                    dkv[0] += torch.einsum("hrc,hrd->hcd", ds, qf[:, sl]) * scale
            # Pass the block and its gradient on; after the last step one more hop brings each rank its own.
            payload = torch.cat([kv, dkv]) if step < shard.size - 1 else dkv
            incoming, works = _exchange(payload, shard) if shard.size > 1 else (payload, [])
            _finish(works)
            if step < shard.size - 1:
                kv, dkv = incoming[:2], incoming[2:]
            else:
                dkv = incoming
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: CpShard, scaling: float | None) -> torch.Tensor:
    """Ring attention of this rank's slice. K and V travel as one block, so values narrower than the keys (latent
    attention's) are zero-padded to the key width and the output cropped back: the padded columns stay zero (and
    wider values pad the queries and keys, which leaves every score as it was)."""
    heads, width = q.shape[1], v.shape[-1]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    k, v = _repeat_kv(k, heads), _repeat_kv(v, heads)
    both = max(width, k.shape[-1])
    q, k, v = (F.pad(t, (0, both - t.shape[-1])) if t.shape[-1] != both else t for t in (q, k, v))
    q_pos = torch.arange(shard.start, shard.end, device=q.device)
    out = _RingAttention.apply(q[0], k[0], v[0], q_pos, shard.doc_ids(q.device), float(scale), shard)
    return out[..., :width].unsqueeze(0).transpose(1, 2).contiguous()  # [1, c, H, Dv]


# --------------------------------------------------------------------------------------------- entry point


def context_parallel_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    rlc_cp: CpShard | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: ``query`` ``[1, H, c, D]`` of this rank's slice → ``[1, c, H, D]``."""
    if rlc_cp is None:
        raise ValueError(f"{CP_ATTENTION} attention needs the rlc_cp slice: run the model through the trainer")
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError(f"{CP_ATTENTION} takes one packed row and no attention mask")
    if sliding_window is not None:
        raise NotImplementedError(f"{CP_ATTENTION} does not implement sliding-window attention")
    if dropout:
        raise NotImplementedError(f"{CP_ATTENTION} does not implement attention dropout")
    if rlc_cp.kind == "ulysses":
        return _ulysses(module, query, key, value, rlc_cp, scaling), None
    if rlc_cp.kind == "ring":
        return _ring(query, key, value, rlc_cp, scaling), None
    raise ValueError(f"unknown context-parallel kind {rlc_cp.kind!r}")


def register_cp_attention() -> str:
    """Register ``context_parallel_attention`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, context_parallel_attention)
    return CP_ATTENTION


def pad_targets(t: torch.Tensor, pad: int) -> torch.Tensor:
    """Extend a per-token ``[1, L]`` row by `pad` zeros (the pad segment's targets)."""
    return F.pad(t, (0, pad)) if pad else t
