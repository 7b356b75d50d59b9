"""Sequence packing: bin-pack variable-length sequences into micro-batches under a token budget.

Padding wastes compute in proportion to length variance, which is large for RL rollouts. Instead
the trainer concatenates several sequences into one row (``[1, L]``) with ``position_ids``
restarting per sequence and ``cu_seqlens`` marking the boundaries (the THD layout that varlen
attention kernels take on NPU/GPU). On CPU, transformers does not isolate packed sequences from
positions alone, so ``block_causal_mask`` builds the explicit block-diagonal causal mask.

Pure torch: no transformers import here.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

__all__ = [
    "PackedBatch",
    "SequenceTooLongError",
    "block_causal_mask",
    "equalize_micro_batches",
    "ffd_pack",
    "kk_pack",
    "pack_micro_batches",
    "pack_sequences",
    "split_bins_to_count",
]

Bins = list[list[int]]


class SequenceTooLongError(ValueError):
    """A single sequence does not fit the micro-batch token budget, so no packing can place it."""

    def __init__(self, index: int, length: int, budget: int) -> None:
        self.index, self.length, self.budget = index, length, budget
        super().__init__(
            f"sequence {index} has {length} tokens but the micro-batch token budget is {budget}; "
            f"raise the budget to at least {length} (prompt + max new tokens) or shorten the sequence"
        )


def _check(lengths: Sequence[int], budget: int) -> None:
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"sequence {i} has negative length {n}")
        if n > budget:
            raise SequenceTooLongError(i, n, budget)


def ffd_pack(lengths: Sequence[int], budget: int) -> Bins:
    """First-fit-decreasing: longest first, each into the first bin with room. Returns index bins.

    Fast and uses at most 11/9·OPT + 1 bins; bins come out unbalanced (early ones full).
    """
    _check(lengths, budget)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: Bins = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def _kk_partition(lengths: Sequence[int], k: int) -> Bins:
    """Karmarkar–Karp largest-differencing into exactly ``k`` (possibly empty) balanced subsets."""
    # Each heap entry is a k-way partial partition: subsets sorted by load, descending.
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for tie, i in enumerate(range(len(lengths))):
        parts = [(lengths[i], [i])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-lengths[i], tie, parts))
    tie = len(lengths)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # Merge the heaviest subset of one with the lightest of the other to cancel differences.
        merged = [(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    if not heap:
        return [[] for _ in range(k)]
    return [sorted(items) for _, items in heap[0][2]]


def kk_pack(lengths: Sequence[int], budget: int, min_bins: int = 1) -> Bins:
    """Karmarkar–Karp multiway partitioning into the fewest balanced bins that respect ``budget``.

    Starts from the lower bound ``ceil(sum / budget)`` (and ``min_bins``) and adds a bin until every
    subset fits; balanced loads make micro-batch times even, which matters when ranks wait on each
    other. Terminates because with one bin per sequence every bin fits. Empty bins are dropped.
    """
    _check(lengths, budget)
    n = len(lengths)
    if n == 0:
        return []
    k = max(min_bins, math.ceil(sum(lengths) / budget), 1)
    k = min(k, n)
    while True:
        bins = _kk_partition(lengths, k)
        if all(sum(lengths[i] for i in b) <= budget for b in bins):
            return [b for b in bins if b]
        k += 1


def pack_micro_batches(
    lengths: Sequence[int],
    budget: int,
    algorithm: Literal["ffd", "kk"] = "ffd",
    min_bins: int = 1,
) -> Bins:
    """Pack sequence ``lengths`` into index bins of at most ``budget`` tokens (``ffd`` or ``kk``)."""
    if algorithm == "ffd":
        bins = ffd_pack(lengths, budget)
        return split_bins_to_count(bins, min(min_bins, len(lengths)), lengths) if min_bins > 1 else bins
    if algorithm == "kk":
        return kk_pack(lengths, budget, min_bins=min_bins)
    raise ValueError(f"unknown packing algorithm {algorithm!r}; expected 'ffd' or 'kk'")


def padded_micro_batches(lengths: Sequence[int], budget: int, max_sequences: int | None = None) -> Bins:
    """Index bins for padded (unpacked) micro-batches: each holds as many sequences as fit ``budget`` once
    padded to its longest (count × longest ≤ budget), shortest first so that neighbours pad little; at most
    ``max_sequences`` each when given. The plan's token budget bounds padded micro-batches as it bounds packed
    ones, so the memory the planner sized is what a forward takes."""
    _check(lengths, budget)
    bins: Bins = []
    current: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (lengths[j], j)):
        longest = lengths[i]  # ascending order: the newest sequence is the longest so far
        full = max_sequences is not None and len(current) >= max_sequences
        if current and (full or longest * (len(current) + 1) > budget):
            bins.append(current)
            current = []
        current.append(i)
    if current:
        bins.append(current)
    return bins


def _load(b: list[int], lengths: Sequence[int] | None) -> int:
    return sum(lengths[i] for i in b) if lengths is not None else len(b)


def split_bins_to_count(bins: Bins, count: int, lengths: Sequence[int] | None = None) -> Bins:
    """Split the heaviest multi-sequence bins in two until there are ``count`` bins.

    Splitting never breaks the budget (halves are smaller). Raises ``ValueError`` when there are
    fewer sequences than ``count``; there is then nothing left to split.
    """
    out = [list(b) for b in bins if b]
    n_seqs = sum(len(b) for b in out)
    if count > n_seqs:
        raise ValueError(f"cannot make {count} micro-batches from {n_seqs} sequences")
    while len(out) < count:
        idx = max(
            (j for j, b in enumerate(out) if len(b) > 1),
            key=lambda j: (_load(out[j], lengths), len(out[j])),
        )
        b = sorted(out.pop(idx), key=lambda i: -(lengths[i] if lengths is not None else 1))
        halves: Bins = [[], []]
        loads = [0, 0]
        for i in b:  # greedy balance; the first two items seed the two halves
            j = 0 if (loads[0], len(halves[0])) <= (loads[1], len(halves[1])) else 1
            halves[j].append(i)
            loads[j] += lengths[i] if lengths is not None else 1
        out.extend(sorted(h) for h in halves)
    return out


def equalize_micro_batches(bins: Bins, dp: int, lengths: Sequence[int] | None = None) -> list[Bins]:
    """Deal ``bins`` to ``dp`` data-parallel ranks so every rank runs the same micro-batch count.

    FSDP ranks all-gather parameters in every forward, so a rank with fewer micro-batches would
    hang the others. Bins are first split until their count is a positive multiple of ``dp``, then
    dealt heaviest-first to the lightest rank that still has a free slot (token-balanced when
    ``lengths`` is given, sequence-count-balanced otherwise). Returns one list of bins per rank.
    """
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    nonempty = [b for b in bins if b]
    n_seqs = sum(len(b) for b in nonempty)
    if n_seqs < dp:
        raise ValueError(f"{n_seqs} sequences cannot give each of {dp} data-parallel ranks a micro-batch")
    count = max(len(nonempty), dp)
    count = math.ceil(count / dp) * dp
    if count > n_seqs:
        count = (n_seqs // dp) * dp
    if count < len(nonempty):  # merging could break the budget, so fail clearly instead
        raise ValueError(
            f"{len(nonempty)} micro-batches holding {n_seqs} sequences cannot be split into a multiple "
            f"of dp={dp}; use a batch size that is a multiple of dp or a larger token budget"
        )
    split = split_bins_to_count(nonempty, count, lengths)
    per_rank = count // dp
    ranks: list[Bins] = [[] for _ in range(dp)]
    loads = [0] * dp
    for b in sorted(split, key=lambda b: (-_load(b, lengths), b)):
        r = min((r for r in range(dp) if len(ranks[r]) < per_rank), key=lambda r: (loads[r], r))
        ranks[r].append(b)
        loads[r] += _load(b, lengths)
    return ranks


def block_causal_mask(cu_seqlens: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``[1, 1, L, L]`` bool mask, True where query i may attend key j: same sequence and j ≤ i.

    O(L²) memory: meant for CPU and tests; NPUs take ``cu_seqlens`` in varlen fused attention.
    """
    cu = torch.as_tensor(cu_seqlens, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    total = int(cu[-1])
    seq_id = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    pos = torch.arange(total)
    same = seq_id.unsqueeze(0) == seq_id.unsqueeze(1)
    causal = pos.unsqueeze(0) <= pos.unsqueeze(1)
    return (same & causal).view(1, 1, total, total)


@dataclass
class PackedBatch:
    """Several sequences concatenated into one row, with the boundaries needed to undo it."""

    input_ids: torch.Tensor  # [1, L] long
    position_ids: torch.Tensor  # [1, L] long, restarting at 0 per sequence
    cu_seqlens: torch.Tensor  # [n + 1] int32, leading 0
    max_seqlen: int
    lengths: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def attention_mask(self) -> torch.Tensor:
        """The block-diagonal causal mask for this batch (see ``block_causal_mask``)."""
        return block_causal_mask(self.cu_seqlens)

    def pack(self, per_sequence: Sequence[torch.Tensor]) -> torch.Tensor:
        """Concatenate per-sequence per-token tensors (advantages, masks…) into the packed ``[1, L, …]``."""
        if [int(t.shape[0]) for t in per_sequence] != self.lengths:
            raise ValueError(f"lengths {[int(t.shape[0]) for t in per_sequence]} do not match packed {self.lengths}")
        return torch.cat(list(per_sequence), dim=0).unsqueeze(0)

    def unpack(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """Split a packed ``[1, L, …]`` or ``[L, …]`` tensor back into per-sequence tensors."""
        flat = packed
        if packed.dim() >= 2 and packed.shape[0] == 1 and packed.shape[1] == self.num_tokens:
            flat = packed[0]
        if flat.shape[0] != self.num_tokens:
            raise ValueError(f"packed tensor has {flat.shape[0]} tokens, batch has {self.num_tokens}")
        return list(torch.split(flat, self.lengths, dim=0))


def pack_sequences(sequences: Sequence[torch.Tensor | Sequence[int]]) -> PackedBatch:
    """Concatenate token-id sequences into a ``PackedBatch`` (empty sequences are rejected).

    Lists become one tensor from one flat list, and so do the positions: a tensor per sequence cost more than the
    packing itself on many short sequences (the quickstart's 128 per micro-batch).
    """
    if not sequences:
        raise ValueError("cannot pack zero sequences")
    if any(isinstance(s, torch.Tensor) for s in sequences):
        seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
        lengths = [int(s.numel()) for s in seqs]
        input_ids = torch.cat(seqs)
    else:
        lengths = [len(s) for s in sequences]
        input_ids = torch.tensor(list(itertools.chain.from_iterable(sequences)), dtype=torch.long)
    if min(lengths) == 0:
        raise ValueError(f"sequence {lengths.index(0)} is empty; every packed sequence needs a token")
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), dim=0)
    position_ids = torch.tensor(list(itertools.chain.from_iterable(map(range, lengths))), dtype=torch.long)
    return PackedBatch(
        input_ids=input_ids.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        cu_seqlens=cu,
        max_seqlen=max(lengths),
        lengths=lengths,
    )
