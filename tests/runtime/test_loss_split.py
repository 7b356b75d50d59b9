"""Loss aggregation is exact over any split of a minibatch: micro-batches of one rank, and two gloo ranks.

Each aggregation (and the sequence-level ratio and corrections, which need whole sequences) gives the same loss and
the same gradients whether the batch trains in one micro-batch or many, and on one rank or two; the loss also
equals its formula computed by hand from the same log-probs. Workers run in this process as a one-rank group (no
Ray); the two-rank check spawns processes and is slow.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ranks import free_port

from rlc.runtime.algo.policy import PolicyLoss

CAP = 2.0
POLICIES = {
    "token-mean": PolicyLoss(behave_imp_weight_cap=CAP),
    "seq-mean-token-sum": PolicyLoss(agg="seq-mean-token-sum", behave_imp_weight_cap=CAP),
    "seq-mean-token-mean": PolicyLoss(agg="seq-mean-token-mean", behave_imp_weight_cap=CAP),
    "seq-mean-token-sum-norm": PolicyLoss(agg="seq-mean-token-sum-norm", agg_norm_tokens=12, behave_imp_weight_cap=CAP),
    "gspo": PolicyLoss(ratio="sequence", clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean"),
    "token_truncate": PolicyLoss(behave_correction="token_truncate", behave_imp_weight_cap=CAP),
    "sequence_truncate": PolicyLoss(behave_correction="sequence_truncate", behave_imp_weight_cap=CAP),
    "sequence_mask": PolicyLoss(behave_correction="sequence_mask", behave_imp_weight_cap=CAP, agg="seq-mean-token-sum"),
}
BUDGETS = (16, 40, 4096)  # many micro-batches, a few, one


@pytest.fixture(scope="module")
def pg():
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


def _batch() -> dict:
    """Uneven lengths and response shares (one sequence with no response token), advantages of both signs."""
    g = torch.Generator().manual_seed(7)
    lengths = [16, 5, 12, 9, 3, 14, 7, 11]
    seqs = [torch.randint(3, 32, (n,), generator=g).tolist() for n in lengths]
    prompts = [4, 2, 3, 5, 3, 2, 6, 4]  # the fifth sequence is all prompt
    masks = [[0] * p + [1] * (n - p) for p, n in zip(prompts, lengths, strict=True)]
    adv = torch.randn(len(seqs), generator=g).tolist()
    return {"input_ids": seqs, "loss_mask": masks, "advantages": adv}


def _with_logprobs(batch: dict, lp: list[list[float]]) -> dict:
    """Proximal = the current policy (ratio 1); behaviour off by up to ±1.2 nats, so some weights pass the cap."""
    g = torch.Generator().manual_seed(11)
    behaviour = [[v + float(torch.empty(()).uniform_(-1.2, 1.2, generator=g)) for v in row] for row in lp]
    return {**batch, "behaviour_logprobs": behaviour, "proximal_logprobs": lp}


def _worker(model_dir: Path, budget: int, rank: int = 0, world: int = 1, port: int = 0):
    from rlc.runtime.train.trainer import TrainerWorker

    # Learning rate 0: the weights never move, so one worker per split serves every policy.
    cfg = {"lr": 0.0, "logprob_chunk_tokens": 7, "micro_batch_tokens": budget, "packing": True}
    return TrainerWorker(rank, world, "127.0.0.1" if world > 1 else None, port, str(model_dir), "cpu", cfg)


def _step(worker, batch: dict, policy: PolicyLoss) -> tuple[float, list[torch.Tensor]]:
    """The step's loss and its gradients (captured before the optimizer moves the weights)."""
    grads: list[torch.Tensor] = []
    step = worker.optimizer.step

    def capture() -> None:
        for p in worker.model.parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads.append(g.detach().clone())
        step()

    worker.optimizer.step = capture
    try:
        stats = worker.train_step(batch, {"policy": policy})
    finally:
        worker.optimizer.step = step
    return stats["loss"], grads


def _hand_loss(batch: dict, policy: PolicyLoss) -> float:
    """The loss by its formula at ratio 1 (proximal = current policy): Σ_i c_i Σ_t −A_i · w_t · keep_t."""
    import math

    counts = [sum(row[1:]) for row in batch["loss_mask"]]
    tokens, seqs = sum(counts), sum(1 for n in counts if n)
    total = 0.0
    for i, row in enumerate(batch["loss_mask"]):
        if not counts[i]:
            continue
        logw = [
            batch["proximal_logprobs"][i][t] - batch["behaviour_logprobs"][i][t] for t in range(1, len(row)) if row[t]
        ]
        c = {
            "token-mean": 1 / tokens,
            "seq-mean-token-sum": 1 / seqs,
            "seq-mean-token-mean": 1 / (seqs * counts[i]),
            "seq-mean-token-sum-norm": 1 / (seqs * (policy.agg_norm_tokens or 1)),
        }[policy.agg]
        if policy.behave_correction == "token_mask":
            ws = [math.exp(x) if math.exp(x) <= CAP else 0.0 for x in logw]
        elif policy.behave_correction == "token_truncate":
            ws = [min(math.exp(x), CAP) for x in logw]
        else:
            seq_w = math.exp(sum(logw))
            kept = seq_w <= CAP
            w = min(seq_w, CAP) if policy.behave_correction == "sequence_truncate" else (seq_w if kept else 0.0)
            ws = [w] * len(logw)
        if policy.ratio == "sequence":  # GSPO under the default token_mask correction with cap 5
            ws = [math.exp(x) if math.exp(x) <= 5.0 else 0.0 for x in logw]
        total += c * sum(-batch["advantages"][i] * w for w in ws)
    return total


@pytest.fixture(scope="module")
def workers(pg, tiny_model_dir: Path) -> dict:
    return {budget: _worker(tiny_model_dir, budget) for budget in BUDGETS}


@pytest.fixture(scope="module")
def prepared(workers: dict) -> dict:
    batch = _batch()
    return _with_logprobs(batch, workers[4096].compute_logprobs(batch))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_any_micro_batch_split_gives_the_same_loss_and_grads(name: str, prepared: dict, workers: dict) -> None:
    policy = POLICIES[name]
    results = [_step(workers[budget], prepared, policy) for budget in BUDGETS]
    (ref_loss, ref_grads), *others = results
    assert ref_loss == pytest.approx(_hand_loss(prepared, policy), rel=1e-5, abs=1e-7)
    assert any(g.abs().max() > 0 for g in ref_grads)
    for loss, grads in others:
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
        for got, want in zip(grads, ref_grads, strict=True):
            assert (got - want).abs().max().item() < 1e-6


def test_the_aggregations_differ(prepared: dict, workers: dict) -> None:
    """The invariance above is not the same number four times: each aggregation weighs the tokens differently."""
    losses = {name: _step(workers[4096], prepared, POLICIES[name])[0] for name in list(POLICIES)[:4]}
    assert len({round(v, 6) for v in losses.values()}) == 4, losses


# ------------------------------------------------------------------ two gloo ranks


def _rank_main(rank: int, port: int, model_dir: str, out_dir: str, batch: dict) -> None:
    torch.set_num_threads(1)
    from rlc.runtime.train.group import split_batch

    share = split_batch(batch, 2)[rank]
    w = _worker(Path(model_dir), 40, rank, 2, port)
    out = {name: _step(w, share, policy) for name, policy in POLICIES.items()}
    torch.save(out, f"{out_dir}/rank{rank}.pt")
    import torch.distributed as dist

    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_give_the_same_loss_and_grads(
    prepared: dict, workers: dict, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(free_port(), str(tiny_model_dir), str(tmp_path), prepared), nprocs=2, join=True)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    for name, policy in POLICIES.items():
        ref_loss, ref_grads = _step(workers[4096], prepared, policy)
        loss, grads = r0[name]
        assert len(grads) == len(ref_grads), (name, len(grads), len(ref_grads))
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7), name
        for got, want in zip(grads, ref_grads, strict=True):
            assert (got - want).abs().max().item() < 1e-6, name
