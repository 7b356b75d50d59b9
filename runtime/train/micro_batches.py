"""Micro-batches: the model inputs of one forward and the per-token rows aligned with its predictions.

Three shapes, one interface:
- packed (the plans' default): one ``[1, L]`` row of several sequences with per-sequence boundaries;
- padded: ``[B, W]`` right-padded sequences with an attention mask;
- packed under context parallelism: the row padded to a multiple of cp and this rank's slice of it
  (``context_parallel``), whose predictions are for the tokens one to the right of its positions.

Per-token rows (advantages, behaviour log-probs, masks...) are aligned with ``input_ids``: entry t is about
token t. `MicroBatch.local(rows)` turns them into the tensor the loss needs next to the model's log-probs:
the whole row, or under CP the slice of tokens this rank predicts. The MoE routers see the tokens of the
model input itself, flattened (the row, the padded ``[B, W]`` batch row by row, or this rank's CP slice,
unshifted): `MicroBatch.routing_tokens` and `MicroBatch.routed_experts` lay out what they need in that order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..packing import PackedBatch, pack_sequences
from ..platform import Platform
from .context_parallel import CpShard, cp_micro_batch
from .packed_forward import packed_attention_inputs
from .varlen_attention import attention_kernel_for

__all__ = ["MicroBatch", "MicroBatcher"]


@dataclass
class MicroBatch:
    """One forward's sequences, the model inputs built from them, and how its predictions line up."""

    seqs: list[list[int]]
    input_ids: torch.Tensor  # model input: [1, L] packed, [B, W] padded, [1, c] a CP slice
    body_kwargs: dict[str, Any]  # attention inputs for the model body
    packed: PackedBatch | None  # None on the padded path; under CP the padded row (pad segment last)
    device: torch.device
    cp: CpShard | None = None
    pad: int = 0  # pad tokens appended for the CP split
    labels: torch.Tensor | None = None  # CP: the next token of each of this slice's positions

    def _row(self, rows: Sequence[Sequence[float]]) -> torch.Tensor:
        """Per-sequence rows in the micro-batch's layout (missing entries are 0, as when padding).

        One tensor from one flat list: a tensor per sequence costs more than the training step's arithmetic
        on a small model.
        """
        width = max(len(s) for s in self.seqs)
        flat: list[float] = []
        for r, s in zip(rows, self.seqs, strict=True):
            n = width if self.packed is None else len(s)
            if len(r) > len(s):
                raise ValueError(f"a row of {len(r)} entries for a sequence of {len(s)} tokens")
            flat.extend(r)
            flat.extend([0.0] * (n - len(r)))
        if self.packed is None:
            return torch.tensor(flat, dtype=torch.float32).view(len(self.seqs), width)
        flat.extend([0.0] * self.pad)
        return torch.tensor(flat, dtype=torch.float32).unsqueeze(0)

    def local(self, rows: Sequence[Sequence[float]]) -> torch.Tensor:
        """Rows as the tensor aligned with this rank's log-probs (the slice it predicts under CP)."""
        row = self._row(rows)
        if self.cp is not None:
            row = F.pad(row, (0, 1))[:, self.cp.start + 1 : self.cp.end + 1]
        return row.to(self.device)

    def _token_slots(self) -> tuple[list[int], int]:
        """Where each sequence starts among the tokens the model input flattens to, and their number before any
        CP slicing (packed: the sequences back to back, then the CP pad; padded: one row of the widest each)."""
        if self.packed is None:
            width = max(len(s) for s in self.seqs)
            return [i * width for i in range(len(self.seqs))], width * len(self.seqs)
        starts, at = [], 0
        for s in self.seqs:
            starts.append(at)
            at += len(s)
        return starts, at + self.pad

    def _local_tokens(self, values: np.ndarray) -> torch.Tensor:
        """Host tensor of per-token `values` (the whole flattened input), this rank's CP slice of them."""
        if self.cp is not None:
            values = values[self.cp.start : self.cp.end]
        return torch.from_numpy(np.ascontiguousarray(values))

    def routing_tokens(self) -> torch.Tensor:
        """Which tokens of the model input (flattened, this rank's CP slice) the MoE routing statistics and the
        load-balancing loss count, on the host: not padding, and not a sequence's last token (nothing reads its
        output, and no rollout engine routed it)."""
        starts, total = self._token_slots()
        mask = np.zeros(total, dtype=bool)
        for start, s in zip(starts, self.seqs, strict=True):
            mask[start : start + len(s) - 1] = True
        return self._local_tokens(mask)

    def routed_experts(
        self, arrays: Sequence[Any], layers: int, top_k: int, num_experts: int, names: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rollout engine's experts for the tokens of the model input (flattened, this rank's CP slice), on the
        host: (ids ``[n, layers, top_k]`` long, captured ``[n, layers]`` bool).

        `arrays` holds one entry per sequence: None, or its ``routed_experts`` (row t: the experts each decoder
        layer chose for the token at position t, at most one row per token but the last, which no engine feeds;
        fewer rows leave the rest to the trainer). A (token, layer) entry holding the "not captured" mark (255
        below 255 experts, else 65535), a pad token and a missing row are not captured. A shape or expert id the
        model cannot have is refused, naming the sequence by `names` (its index in the batch)."""
        missing = 255 if num_experts < 255 else 65535
        starts, total = self._token_slots()
        ids = np.zeros((total, layers, top_k), dtype=np.int64)
        captured = np.zeros((total, layers), dtype=bool)
        for j, (start, s, arr) in enumerate(zip(starts, self.seqs, arrays, strict=True)):
            i = names[j] if names is not None else j
            if arr is None:
                continue
            arr = np.asarray(arr)
            if arr.size == 0:
                continue
            if arr.ndim != 3 or arr.shape[1:] != (layers, top_k) or arr.shape[0] > len(s) - 1:
                raise ValueError(
                    f"routed_experts of sequence {i} has shape {list(arr.shape)}; a sequence of {len(s)} tokens "
                    f"on this model needs [at most {len(s) - 1} rows, {layers} decoder layers, top-k {top_k}]"
                )
            rows = arr.astype(np.int64)
            known = rows != missing
            bad = known & ((rows < 0) | (rows >= num_experts))
            if bad.any():
                raise ValueError(
                    f"routed_experts of sequence {i} names expert {int(rows[bad][0])}; the model has {num_experts}"
                )
            ok = known.all(-1)
            ids[start : start + len(rows)] = np.where(ok[..., None], rows, 0)
            captured[start : start + len(rows)] = ok
        return self._local_tokens(ids), self._local_tokens(captured)

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per-sequence rows back out of a whole-row tensor (``gather_logprobs`` under CP), each as long as its
        sequence."""
        if self.packed is None:
            return [values[i, : len(s)] for i, s in enumerate(self.seqs)]
        parts = self.packed.unpack(values)
        return parts[: len(self.seqs)]

    def gather_logprobs(self, local: torch.Tensor) -> torch.Tensor:
        """The whole row's log-probs aligned with its tokens, from this rank's slice (identity without CP).

        Under CP every rank predicts the tokens right of its slice's positions; gathering the slices gives
        predictions for tokens 1..L, and token 0 has none (0). A sequence's first token was "predicted" from
        the previous sequence: zeroed here, as on the packed path.
        """
        if self.cp is None:
            return local
        parts = [torch.empty_like(local) for _ in range(self.cp.size)]
        dist.all_gather(parts, local.contiguous(), group=self.cp.group)
        row = F.pad(torch.cat(parts, dim=1), (1, 0))[:, : self.packed.num_tokens]  # type: ignore[union-attr]
        starts = self.packed.cu_seqlens[:-1].to(device=row.device, dtype=torch.long)  # type: ignore[union-attr]
        return row.index_fill(1, starts, 0.0)


class MicroBatcher:
    """Builds micro-batches for one trainer rank: packed, padded, or this rank's slice of a CP row."""

    def __init__(
        self,
        platform: Platform,
        device: torch.device,
        pad_id: int,
        packing: bool,
        packed_attention: str,
        cp_group: Any = None,
        cp_rank: int = 0,
        cp_size: int = 1,
        cp_kind: str = "ulysses",
    ) -> None:
        self.platform, self.device, self.pad_id = platform, device, pad_id
        self.packing, self.packed_attention = packing, packed_attention
        self.cp_group, self.cp_rank, self.cp_size, self.cp_kind = cp_group, cp_rank, cp_size, cp_kind
        if cp_size > 1 and not packing:
            raise ValueError("context parallelism splits packed micro-batches; the plan must enable packing")

    def build(self, seqs: Sequence[Sequence[int]]) -> MicroBatch:
        seqs = [list(s) for s in seqs]
        if self.cp_size > 1:
            return self._cp(seqs)
        if self.packing:
            packed = pack_sequences(seqs)
            kwargs = packed_attention_inputs(packed, self.platform, self.device, self.packed_attention)
            return MicroBatch(seqs, packed.input_ids.to(self.device), kwargs, packed, self.device)
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
            attn[i, : len(s)] = 1
        return MicroBatch(seqs, ids.to(self.device), {"attention_mask": attn.to(self.device)}, None, self.device)

    def _cp(self, seqs: list[list[int]]) -> MicroBatch:
        packed, pad = cp_micro_batch(seqs, self.pad_id, self.cp_size)
        chunk = packed.num_tokens // self.cp_size
        shard = CpShard(
            group=self.cp_group,
            rank=self.cp_rank,
            size=self.cp_size,
            kind=self.cp_kind,
            cu_seqlens=packed.cu_seqlens,
            max_seqlen=packed.max_seqlen,
            chunk=chunk,
            inner=attention_kernel_for(self.platform.name)[0],
        )
        sl = slice(shard.start, shard.end)
        labels = F.pad(packed.input_ids, (0, 1), value=self.pad_id)[:, shard.start + 1 : shard.end + 1]
        kwargs = {"position_ids": packed.position_ids[:, sl].to(self.device), "rlc_cp": shard}
        return MicroBatch(
            seqs,
            packed.input_ids[:, sl].to(self.device),
            kwargs,
            packed,
            self.device,
            shard,
            pad,
            labels.to(self.device),
        )
