"""Bin packing under a token budget, DP equalisation, the packed layout, and packed-forward parity."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from rlc.runtime.packing import (  # noqa: E402
    PackedBatch,
    SequenceTooLongError,
    block_causal_mask,
    equalize_micro_batches,
    ffd_pack,
    kk_pack,
    pack_micro_batches,
    pack_sequences,
    split_bins_to_count,
)

torch.set_num_threads(2)

lengths_and_budget = st.integers(1, 64).flatmap(
    lambda budget: st.tuples(st.lists(st.integers(1, budget), min_size=0, max_size=40), st.just(budget))
)


def _assert_valid(bins: list[list[int]], lengths: list[int], budget: int) -> None:
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths))), "every sequence exactly once"
    for b in bins:
        assert b, "no empty bins"
        assert sum(lengths[i] for i in b) <= budget


@settings(max_examples=150, deadline=None)
@given(lengths_and_budget)
def test_ffd_and_kk_respect_budget(case: tuple[list[int], int]) -> None:
    lengths, budget = case
    ffd = ffd_pack(lengths, budget)
    kk = kk_pack(lengths, budget)
    _assert_valid(ffd, lengths, budget)
    _assert_valid(kk, lengths, budget)
    lower = -(-sum(lengths) // budget)
    assert len(ffd) >= lower and len(kk) >= lower
    # First fit opens a bin only when the item fits nowhere, so any two bins hold > budget tokens.
    assert len(ffd) <= max(1, 2 * sum(lengths) // budget + 1)


def test_bin_counts_ffd_vs_kk() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 400, (256,), generator=g).tolist()
    budget = 1024
    ffd, kk = ffd_pack(lengths, budget), kk_pack(lengths, budget)
    lower = -(-sum(lengths) // budget)
    assert lower <= len(ffd) <= lower + 2
    assert lower <= len(kk) <= lower + 2

    def spread(bins: list[list[int]]) -> int:
        loads = [sum(lengths[i] for i in b) for b in bins]
        return max(loads) - min(loads)

    # KK balances loads: its heaviest and lightest micro-batches are much closer than FFD's.
    assert spread(kk) < spread(ffd)


def test_kk_min_bins_and_dispatch() -> None:
    lengths = [5, 5, 5, 5, 4, 4]
    assert len(kk_pack(lengths, 100, min_bins=3)) == 3
    assert len(pack_micro_batches(lengths, 100, "ffd", min_bins=3)) == 3
    with pytest.raises(ValueError, match="unknown packing algorithm"):
        pack_micro_batches(lengths, 100, "best")  # type: ignore[arg-type]


def test_too_long_sequence_error() -> None:
    for fn in (ffd_pack, kk_pack):
        with pytest.raises(SequenceTooLongError) as exc:
            fn([10, 300, 20], 256)
        assert exc.value.index == 1 and exc.value.length == 300 and exc.value.budget == 256
        assert "300 tokens" in str(exc.value) and "256" in str(exc.value)


def test_split_bins_to_count() -> None:
    lengths = [8, 1, 1, 6]
    bins = split_bins_to_count([[0, 1, 2, 3]], 3, lengths)
    _assert_valid(bins, lengths, 16)
    assert len(bins) == 3
    with pytest.raises(ValueError, match="cannot make 5 micro-batches from 4"):
        split_bins_to_count([[0, 1, 2, 3]], 5, lengths)


@settings(max_examples=80, deadline=None)
@given(lengths_and_budget, st.integers(1, 8))
def test_equalize_gives_every_rank_the_same_count(case: tuple[list[int], int], dp: int) -> None:
    lengths, budget = case
    bins = ffd_pack(lengths, budget)
    if len(lengths) < dp:
        with pytest.raises(ValueError, match="data-parallel"):
            equalize_micro_batches(bins, dp, lengths)
        return
    try:
        ranks = equalize_micro_batches(bins, dp, lengths)
    except ValueError as exc:  # only when no split can reach a multiple of dp
        assert "multiple" in str(exc)
        assert len(bins) > (len(lengths) // dp) * dp  # more bins than the largest multiple of dp it could split to
        return
    assert len(ranks) == dp
    assert len({len(r) for r in ranks}) == 1
    _assert_valid([b for r in ranks for b in r], lengths, budget)


def test_equalize_balances_tokens() -> None:
    lengths = [100, 90, 80, 70, 10, 10, 10, 10]
    bins = [[i] for i in range(8)]
    ranks = equalize_micro_batches(bins, 2, lengths)
    loads = [sum(lengths[i] for b in r for i in b) for r in ranks]
    assert [len(r) for r in ranks] == [4, 4]
    assert abs(loads[0] - loads[1]) <= 20


def test_pack_layout_and_roundtrip() -> None:
    seqs = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])]
    batch = pack_sequences(seqs)
    assert isinstance(batch, PackedBatch)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 6] and batch.cu_seqlens.dtype == torch.int32
    assert batch.max_seqlen == 3 and batch.num_tokens == 6
    for got, want in zip(batch.unpack(batch.input_ids), seqs, strict=True):
        assert torch.equal(got, want)
    # Per-token float fields and [L, V]-shaped outputs round-trip too.
    values = [torch.randn(n, 4) for n in (3, 1, 2)]
    packed = batch.pack(values)
    assert packed.shape == (1, 6, 4)
    for got, want in zip(batch.unpack(packed), values, strict=True):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="tokens"):
        batch.unpack(torch.zeros(5))
    with pytest.raises(ValueError, match="empty"):
        pack_sequences([[1], []])


def test_block_causal_mask() -> None:
    mask = block_causal_mask(torch.tensor([0, 2, 3, 5], dtype=torch.int32))
    assert mask.shape == (1, 1, 5, 5) and mask.dtype == torch.bool
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 0, 1, 0],
            [0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0, 0], expected)


# --- packed forward parity on the tiny model --------------------------------------------------


def _token_logprobs(model, ids: torch.Tensor, **kw) -> torch.Tensor:
    """Log-prob of each next token, [L-1], from one forward over ids [1, L]."""
    logits = model(input_ids=ids, **kw).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)


def _packed_logprobs(model, batch: PackedBatch) -> list[torch.Tensor]:
    logits = model(
        input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=batch.attention_mask()
    ).logits.float()
    logp = torch.log_softmax(logits[0], -1)
    out = []
    for seq_logp, seq_ids in zip(batch.unpack(logp), batch.unpack(batch.input_ids), strict=True):
        out.append(seq_logp[:-1].gather(-1, seq_ids[1:, None]).squeeze(-1))
    return out


@torch.no_grad()
def test_packed_forward_matches_separate_forwards(tiny_model) -> None:
    g = torch.Generator().manual_seed(0)
    budget = 96
    lengths = [1, 17, 5, 33, 2, 9, 40, 12, 26]
    seqs = [torch.randint(3, 19, (n,), generator=g) for n in lengths]
    seqs.append(torch.randint(3, 19, (budget,), generator=g))  # fills a micro-batch exactly
    bins = kk_pack([len(s) for s in seqs], budget)
    assert any(sum(len(seqs[i]) for i in b) == budget for b in bins)
    max_diff = 0.0
    for b in bins:
        batch = pack_sequences([seqs[i] for i in b])
        assert batch.num_tokens <= budget
        packed = _packed_logprobs(tiny_model, batch)
        for i, got in zip(b, packed, strict=True):
            want = _token_logprobs(tiny_model, seqs[i][None])
            assert got.shape == want.shape
            if want.numel():
                max_diff = max(max_diff, float((got - want).abs().max()))
    assert max_diff < 1e-4, max_diff


@torch.no_grad()
def test_perturbing_one_packed_sequence_changes_no_other(tiny_model) -> None:
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 19, (n,), generator=g) for n in (6, 1, 11, 8)]
    base = _packed_logprobs(tiny_model, pack_sequences(seqs))
    changed = [s.clone() for s in seqs]
    changed[2][3] = 3 if int(changed[2][3]) != 3 else 4
    after = _packed_logprobs(tiny_model, pack_sequences(changed))
    for j in (0, 1, 3):
        assert torch.equal(base[j], after[j])
    assert not torch.equal(base[2], after[2])


@settings(max_examples=80, deadline=None)
@given(lengths_and_budget, st.one_of(st.none(), st.integers(1, 6)))
def test_padded_micro_batches_keep_the_token_budget(case: tuple[list[int], int], cap: int | None) -> None:
    """Padded micro-batches (train.packing: false) obey the plan's budget counted with their padding."""
    from rlc.runtime.packing import padded_micro_batches

    lengths, budget = case
    bins = padded_micro_batches(lengths, budget, cap)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert b and len(b) * max(lengths[i] for i in b) <= budget
        assert cap is None or len(b) <= cap
    # Greedy over ascending lengths: no bin could have taken the next one's shortest sequence.
    for this, after in itertools.pairwise(bins):
        longest = max(lengths[i] for i in after[:1] + this)
        assert (cap is not None and len(this) >= cap) or (len(this) + 1) * longest > budget


def test_padded_micro_batches_refuse_a_sequence_over_the_budget() -> None:
    from rlc.runtime.packing import SequenceTooLongError, padded_micro_batches

    with pytest.raises(SequenceTooLongError, match="sequence 1 has 9 tokens"):
        padded_micro_batches([3, 9], 8)
