"""Packed (THD) micro-batches in the trainer: same numbers as padding, no leaks across sequences.

Workers run in this process as a one-rank FSDP2 group over gloo (no Ray), so each check takes well
under a second; the two-rank check with uneven micro-batch counts spawns processes and is slow.
The padded path is the reference: it runs each sequence in its own row, so it cannot leak.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from ranks import free_port, leave_together

TOL = 1e-5  # fp32 CPU kernels on both sides; measured differences are ~1e-6 (different matmul shapes)
# Weights after one AdamW step: its first update is about lr·sign(g), so gradients within TOL of
# zero can move a weight by a good part of lr (1e-3). Gradients themselves are compared at TOL.
WEIGHT_TOL = 1e-4
BUDGET = 64  # micro-batch token budget of the packed workers
#: Each rank of the spawned two-rank groups: packed, the same learning rate and log-prob chunks as `_worker`.
RANK_CFG = {"lr": 1e-3, "logprob_chunk_tokens": 7, "micro_batch_tokens": BUDGET, "packing": True}


@pytest.fixture(scope="module")
def pg():
    """A one-rank gloo group in this process, which every in-process TrainerWorker joins."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    port = free_port()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield port
    if started:
        dist.destroy_process_group()


def _worker(model_dir: Path, port: int, **cfg):
    from rlc.runtime.train.trainer import TrainerWorker

    base = {"lr": 1e-3, "logprob_chunk_tokens": 7, "micro_batch_tokens": BUDGET, "micro_batch_size": 3}
    return TrainerWorker(0, 1, "127.0.0.1", port, str(model_dir), "cpu", {**base, **cfg})


@pytest.fixture(scope="module")
def workers(pg, tiny_model_dir: Path) -> dict:
    """Padded, packed-varlen and packed-mask workers on the same weights (never trained here)."""
    return {
        "padded": _worker(tiny_model_dir, pg, packing=False),
        "varlen": _worker(tiny_model_dir, pg, packing=True, packed_attention="varlen"),
        "mask": _worker(tiny_model_dir, pg, packing=True, packed_attention="mask"),
    }


def _batch(seed: int = 0) -> dict:
    """Random lengths with the edge cases: a one-token sequence, a one-token response, a full bin."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 5, BUDGET, *torch.randint(2, 40, (9,), generator=g).tolist()]
    seqs = [torch.randint(3, 32, (n,), generator=g).tolist() for n in lengths]
    masks = [[0] * min(4, n - 1) + [1] * (n - min(4, n - 1)) for n in lengths]  # len 5: 4 prompt + 1 response
    adv = torch.randn(len(seqs), generator=g).tolist()
    return {"input_ids": seqs, "loss_mask": masks, "advantages": adv}


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max((torch.tensor(x) - torch.tensor(y)).abs().max().item() for x, y in zip(a, b, strict=True))


def test_packed_logprobs_match_padded(workers) -> None:
    batch = _batch()
    ref = workers["padded"].compute_logprobs(batch)
    bins = workers["varlen"]._micro_batches(batch["input_ids"])
    assert [2] in bins  # the BUDGET-token sequence fills a micro-batch alone
    assert sum(len(b) for b in bins) == len(batch["input_ids"]) and len(bins) < len(batch["input_ids"])
    for kind in ("varlen", "mask"):
        got = workers[kind].compute_logprobs(batch)
        assert all(row[0] == 0.0 for row in got) and got[0] == [0.0]
        assert _max_diff(got, ref) < TOL, kind


def test_no_attention_leak_across_packed_sequences(workers) -> None:
    batch = _batch(1)
    victim = 4
    changed = {**batch, "input_ids": [list(s) for s in batch["input_ids"]]}
    changed["input_ids"][victim] = [3 + (t - 2) % 29 for t in changed["input_ids"][victim]]
    for kind in ("varlen", "mask"):
        w = workers[kind]
        assert any(victim in b and len(b) > 1 for b in w._micro_batches(batch["input_ids"]))
        before, after = w.compute_logprobs(batch), w.compute_logprobs(changed)
        others = [i for i in range(len(before)) if i != victim]
        assert _max_diff([before[i] for i in others], [after[i] for i in others]) < 1e-6, kind
        assert _max_diff([before[victim]], [after[victim]]) > 1e-2  # the perturbation itself is visible


def test_restarted_positions_alone_do_leak(tiny_model) -> None:
    """The control for the test above: without the mask / varlen kernel, sdpa mixes the sequences."""
    from rlc.runtime.packing import pack_sequences

    a, b = [5, 6, 7, 8, 9], [10, 11, 12, 13]
    with torch.no_grad():
        alone = tiny_model(input_ids=torch.tensor([b])).logits[0]
        p = pack_sequences([a, b])
        packed = tiny_model(input_ids=p.input_ids, position_ids=p.position_ids).logits[0, len(a) :]
        masked = tiny_model(
            input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=p.attention_mask()
        ).logits[0, len(a) :]
    assert (packed - alone).abs().max().item() > 1e-3
    assert (masked - alone).abs().max().item() < TOL


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["varlen", "mask"])
def test_packed_train_step_equals_padded(pg, tiny_model_dir, kind) -> None:
    batch = _batch(2)
    padded = _worker(tiny_model_dir, pg, packing=False)
    packed = _worker(tiny_model_dir, pg, packing=True, packed_attention=kind)
    lp = padded.compute_logprobs(batch)
    ref = [[v - 0.01 * (i % 3) for i, v in enumerate(row)] for row in lp]  # a non-zero KL to the reference
    b = {**batch, "behaviour_logprobs": lp, "proximal_logprobs": lp, "ref_logprobs": ref}
    cfg = {"clip": 0.2, "kl_coef": 0.1, "entropy_coef": 0.01}
    a, p = padded.train_step(b, cfg), packed.train_step(b, cfg)
    for key in ("loss", "entropy", "kl_ref", "grad_norm", "n_tokens"):
        assert p[key] == pytest.approx(a[key], abs=TOL), key
    grads_a = {n: q.grad.full_tensor() for n, q in padded.model.named_parameters()}
    grads_p = {n: q.grad.full_tensor() for n, q in packed.model.named_parameters()}
    assert grads_a.keys() == grads_p.keys()
    assert max((grads_a[n] - grads_p[n]).abs().max().item() for n in grads_a) < TOL
    sd_a, sd_p = padded.model.state_dict(), packed.model.state_dict()
    assert max((sd_a[n].full_tensor() - sd_p[n].full_tensor()).abs().max().item() for n in sd_a) < WEIGHT_TOL


def test_too_long_sequence_is_refused(workers) -> None:
    from rlc.runtime.packing import SequenceTooLongError

    batch = {"input_ids": [[3] * 10, [4] * (BUDGET + 1)]}
    with pytest.raises(SequenceTooLongError, match=rf"sequence 1 has {BUDGET + 1} tokens .* budget is {BUDGET}"):
        workers["varlen"].compute_logprobs(batch)


def test_attention_adapters() -> None:
    from rlc.runtime.packing import pack_sequences
    from rlc.runtime.platform import get_platform
    from rlc.runtime.train.packed_forward import VARLEN_SDPA, attn_implementation_for, packed_attention_inputs

    cpu, npu = get_platform("cpu"), get_platform("npu")
    p = pack_sequences([[1, 2, 3], [4], [5, 6]])
    mask = packed_attention_inputs(p, cpu, torch.device("cpu"), "mask")
    assert mask["attention_mask"].shape == (1, 1, 6, 6) and mask["attention_mask"].dtype == torch.bool
    assert mask["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1]]
    var = packed_attention_inputs(p, npu, torch.device("cpu"), "varlen")
    assert var["cu_seq_lens_q"].tolist() == [0, 3, 4, 6] and var["cu_seq_lens_q"].dtype == torch.int32
    assert var["max_length_q"] == var["max_length_k"] == 3 and "attention_mask" not in var
    with pytest.raises(ValueError, match="CPU reference"):
        packed_attention_inputs(p, npu, torch.device("cpu"), "mask")
    assert attn_implementation_for(cpu, True, "varlen") == VARLEN_SDPA
    assert attn_implementation_for(npu, True, "varlen") == "flash_attention_2"
    assert attn_implementation_for(cpu, True, "mask") == "sdpa"
    assert attn_implementation_for(npu, False, "varlen") is None


@pytest.mark.parametrize(
    ("bounds", "padded"),
    [
        ([0, 1, 7, 20, 21], False),  # lengths 1, 6, 13, 1: padding would triple the work, one call per length
        ([0, 5, 11, 17, 21], True),  # lengths 5, 6, 6, 4: one call over the sequences padded to 6
        ([0, 300, 599], False),  # long sequences: calls cost nothing next to the arithmetic, no padded copies
    ],
)
def test_varlen_sdpa_equals_block_causal_mask(bounds: list[int], padded: bool) -> None:
    """Both cpu varlen paths give the block-causal reference's outputs and gradients."""
    from rlc.runtime.packing import block_causal_mask
    from rlc.runtime.train import varlen_attention as va

    cu = torch.tensor(bounds, dtype=torch.int32)
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    takes_padded = max(lengths) <= va.PADDED_ATTENTION_MAX_WIDTH and len(lengths) * max(
        lengths
    ) ** 2 <= va.PADDED_ATTENTION_WASTE * sum(n * n for n in lengths)
    assert takes_padded == padded
    g = torch.Generator().manual_seed(0)
    total = bounds[-1]
    inputs = [torch.randn(1, h, total, 8, generator=g, requires_grad=True) for h in (4, 2, 2)]
    out, _ = va.varlen_sdpa_attention(torch.nn.Identity(), *inputs, None, scaling=0.3, cu_seq_lens_q=cu)
    weights = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * weights).sum(), inputs)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *inputs, attn_mask=block_causal_mask(cu), scale=0.3, enable_gqa=True
    ).transpose(1, 2)
    ref_grads = torch.autograd.grad((ref * weights).sum(), inputs)
    assert out.shape == (1, total, 4, 8)
    assert (out - ref).abs().max().item() < 1e-6
    for got, want in zip(grads, ref_grads, strict=True):
        assert (got - want).abs().max().item() < 1e-5


# ------------------------------------------------------------------ two ranks, uneven micro-batch counts


def _rank_main(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    from rlc.runtime.train.group import split_batch
    from rlc.runtime.train.trainer import TrainerWorker

    w = TrainerWorker(rank, 2, "127.0.0.1", port, model_dir, "cpu", RANK_CFG)
    share = split_batch(_two_rank_batch(), 2)[rank]
    lp = w.compute_logprobs(share)
    stats = w.train_step({**share, "behaviour_logprobs": lp, "proximal_logprobs": lp}, {"clip": 0.2})
    sd = w.full_state_dict()
    torch.save(
        {"lp": lp, "stats": stats, "bins": len(w._micro_batches(share["input_ids"])), "sd": sd},
        f"{out_dir}/rank{rank}.pt",
    )
    leave_together(w)


def _two_rank_batch() -> dict:
    """Rank 0 gets three full-ish sequences (3 bins), rank 1 three short ones (1 bin + 2 dummies)."""
    b = _batch(3)
    lengths = [BUDGET - 4, BUDGET - 10, BUDGET - 20, 6, 9, 12]
    g = torch.Generator().manual_seed(3)
    b["input_ids"] = [torch.randint(3, 32, (n,), generator=g).tolist() for n in lengths]
    b["loss_mask"] = [[0] * 3 + [1] * (n - 3) for n in lengths]
    b["advantages"] = b["advantages"][: len(lengths)]
    return b


@pytest.mark.slow
def test_two_ranks_with_uneven_micro_batch_counts(pg, tiny_model_dir, tmp_path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(free_port(), str(tiny_model_dir), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["bins"] == r1["bins"] == 3  # rank 1 ran dummy micro-batches to keep FSDP in step
    batch = _two_rank_batch()
    one = _worker(tiny_model_dir, pg, packing=False)
    lp = one.compute_logprobs(batch)
    assert _max_diff(r0["lp"] + r1["lp"], lp) < TOL
    ref = one.train_step({**batch, "behaviour_logprobs": lp, "proximal_logprobs": lp}, {"clip": 0.2})
    for key in ("loss", "grad_norm", "n_tokens"):
        assert r0["stats"][key] == pytest.approx(ref[key], abs=TOL), key
    sd = {k: v.full_tensor() for k, v in one.model.state_dict().items()}
    assert max((r0["sd"][k] - sd[k]).abs().max().item() for k in sd) < WEIGHT_TOL


def test_the_train_forward_is_the_proximal_policy(pg, tiny_model_dir) -> None:
    """One optimizer step per batch: a train step without proximal log-probs (its own forward's) takes the
    same step as one given a separate proximal pass, and reports the engine-trainer gap on sampled tokens."""
    batch = _batch(3)
    given = _worker(tiny_model_dir, pg, packing=True, packed_attention="varlen")
    own = _worker(tiny_model_dir, pg, packing=True, packed_attention="varlen")
    lp = given.compute_logprobs(batch)
    behaviour = [[v - 0.05 * (i % 2) for i, v in enumerate(row)] for row in lp]  # an off-policy engine
    cfg = {"clip": 0.2, "decoupled": True}
    a = given.train_step({**batch, "behaviour_logprobs": behaviour, "proximal_logprobs": lp}, cfg)
    b = own.train_step({**batch, "behaviour_logprobs": behaviour}, cfg)
    for key in ("loss", "grad_norm", "behave_imp_weight_mean", "behave_imp_weight_max", "clip_fraction"):
        assert b[key] == pytest.approx(a[key], abs=TOL), key
    sd_a, sd_b = given.model.state_dict(), own.model.state_dict()
    assert max((sd_a[n].full_tensor() - sd_b[n].full_tensor()).abs().max().item() for n in sd_a) < WEIGHT_TOL
    masked = [
        abs(lp[r][j] - behaviour[r][j]) for r, m in enumerate(batch["loss_mask"]) for j in range(1, len(m)) if m[j]
    ]
    assert b["behaviour_gap_max"] == pytest.approx(max(masked), abs=TOL)
    assert b["behaviour_gap"] == pytest.approx(sum(masked) / len(masked), abs=TOL)


def test_the_plans_kl_estimator_is_the_one_trained_with(pg, tiny_model_dir) -> None:
    """`algorithm.kl_estimator` reaches the loss: each of k1, k2, k3 gives its own formula's mean."""
    import math

    worker = _worker(tiny_model_dir, pg, packing=True, packed_attention="varlen", lr=0.0)  # weights never move
    batch = _batch(3)
    lp = worker.compute_logprobs(batch)
    ref = [[v - 0.01 * (i % 3) for i, v in enumerate(row)] for row in lp]  # log π − log π_ref = 0.01 · (i % 3)
    b = {**batch, "behaviour_logprobs": lp, "proximal_logprobs": lp, "ref_logprobs": ref}
    formulas = {"k1": lambda x: x, "k2": lambda x: 0.5 * x * x, "k3": lambda x: math.exp(-x) - 1 + x}
    for kind, f in formulas.items():
        got = worker.train_step(b, {"clip": 0.2, "kl_coef": 0.1, "kl_estimator": kind})["kl_ref"]
        # Position 0 has no log-prob (nothing predicts it), so the trainer never counts it.
        values = [f(0.01 * (i % 3)) for mask in batch["loss_mask"] for i, m in enumerate(mask) if m and i > 0]
        assert got == pytest.approx(sum(values) / len(values), rel=1e-4), kind


def test_minibatches_are_optimizer_steps_clipped_against_the_step_start(pg, tiny_model_dir) -> None:
    """`algorithm.minibatches: 2` takes the same two optimizer steps as two one-minibatch steps given the
    proximal log-probs of the weights before the first: the proximal pass runs before any update."""
    from rlc.runtime.train.group import split_batch

    batch = _batch(4)
    split = _worker(tiny_model_dir, pg, packing=True, packed_attention="varlen")
    by_hand = _worker(tiny_model_dir, pg, packing=True, packed_attention="varlen")
    lp = by_hand.compute_logprobs(batch)
    behaviour = [[v - 0.05 * (i % 2) for i, v in enumerate(row)] for row in lp]
    cfg = {"clip": 0.2, "decoupled": True}
    first, second = split_batch({**batch, "behaviour_logprobs": behaviour}, 2)
    got = split.train_step([first, second], cfg)
    a = by_hand.train_step({**first, "proximal_logprobs": lp[: len(first["input_ids"])]}, cfg)
    b = by_hand.train_step({**second, "proximal_logprobs": lp[len(first["input_ids"]) :]}, cfg)
    sd_a, sd_b = split.model.state_dict(), by_hand.model.state_dict()
    assert max((sd_a[n].full_tensor() - sd_b[n].full_tensor()).abs().max().item() for n in sd_a) < WEIGHT_TOL
    assert got["optimizer_steps"] == 2
    # Norms near 16 carry fp32 rounding of about 1e-6 of their size (the proximal pass and compute_logprobs sum
    # in their own orders): compared relatively, not to TOL.
    assert got["grad_norm"] == pytest.approx((a["grad_norm"] + b["grad_norm"]) / 2, rel=1e-5)
    assert got["loss"] == pytest.approx((a["loss"] + b["loss"]) / 2, abs=TOL)
    assert got["n_tokens"] == a["n_tokens"] + b["n_tokens"]
    # The second minibatch trains after the first update, so the policy has moved from the proximal one there;
    # within one minibatch it has not.
    assert a["approx_kl"] == pytest.approx(0.0, abs=1e-9)
    assert b["approx_kl"] > 1e-6
    assert got["approx_kl"] == pytest.approx(
        (a["approx_kl"] * a["n_tokens"] + b["approx_kl"] * b["n_tokens"]) / got["n_tokens"], rel=1e-3
    )


def _three_sequences() -> dict:
    """Three sequences for two ranks and two minibatches: the first minibatch (one sequence) leaves rank 0 empty."""
    b = _batch(5)
    return {k: v[1:4] for k, v in b.items()}


def _rank_minibatches(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    from rlc.runtime.train.group import minibatch_shares
    from rlc.runtime.train.trainer import TrainerWorker

    w = TrainerWorker(rank, 2, "127.0.0.1", port, model_dir, "cpu", RANK_CFG)
    batch = _three_sequences()
    batch["behaviour_logprobs"] = torch.load(f"{out_dir}/behaviour.pt")
    shares = minibatch_shares(batch, 2, 2)[rank]
    assert [len(s["input_ids"]) for s in shares] == ([0, 1] if rank == 0 else [1, 1])
    stats = w.train_step(shares, {"clip": 0.2})
    torch.save({"stats": stats, "sd": w.full_state_dict()}, f"{out_dir}/rank{rank}.pt")
    leave_together(w)


@pytest.mark.slow
def test_two_ranks_take_minibatch_steps_together_with_an_empty_share(pg, tiny_model_dir, tmp_path) -> None:
    """Two data-parallel ranks, two minibatches of three sequences: rank 0 has nothing in the first and runs a dummy
    micro-batch, and the group takes the same two optimizer steps as one rank with the whole batch."""
    import torch.multiprocessing as mp

    from rlc.runtime.train.group import minibatch_shares

    one = _worker(tiny_model_dir, pg, packing=True, packed_attention="varlen")
    batch = _three_sequences()
    lp = one.compute_logprobs(batch)
    behaviour = [[v - 0.05 * (i % 2) for i, v in enumerate(row)] for row in lp]
    torch.save(behaviour, tmp_path / "behaviour.pt")
    mp.spawn(_rank_minibatches, args=(free_port(), str(tiny_model_dir), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    (shares,) = minibatch_shares({**batch, "behaviour_logprobs": behaviour}, 2, 1)
    ref = one.train_step(shares, {"clip": 0.2})
    for key in ("loss", "grad_norm", "n_tokens", "approx_kl", "behaviour_gap", "behaviour_gap_max"):
        assert r0["stats"][key] == pytest.approx(ref[key], abs=TOL) == r1["stats"][key], key
    masked = [
        abs(lp[r][j] - behaviour[r][j]) for r, m in enumerate(batch["loss_mask"]) for j in range(1, len(m)) if m[j]
    ]
    assert ref["behaviour_gap"] == pytest.approx(sum(masked) / len(masked), abs=TOL)  # over every minibatch
    sd = {k: v.full_tensor() for k, v in one.model.state_dict().items()}
    assert max((r0["sd"][k] - sd[k]).abs().max().item() for k in sd) < WEIGHT_TOL
