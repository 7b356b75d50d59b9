"""A train step whose loss or gradient norm is not finite skips its optimizer step: the weights and AdamW's state stay
bit-identical to the last good step, and the step's statistics say how many updates were skipped and why.

Injected as a user or an engine would: NaN advantages, NaN behaviour log-probs, an infinite KL reference, an
infinite gradient; and, with two minibatches, a NaN in the second only (the first already stepped on finite values)
or in the first only (the second still takes its step).
Workers run in this process as a one-rank FSDP2 group over gloo; the two-rank check, where only one rank's share
is non-finite, spawns processes and is slow.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from ranks import free_port, leave_together

from rlc.runtime.nonfinite import quantity

CFG = {"lr": 1e-2, "logprob_chunk_tokens": 7, "micro_batch_tokens": 64, "packing": True}
POLICY = {"clip": 0.2}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def worker(tiny_model_dir: Path, request: pytest.FixtureRequest):
    """A one-rank worker computing in float32, or in bfloat16 over float32 master weights (the dtype users run)."""
    from rlc.runtime.train.trainer import TrainerWorker, default_layout
    from rlc.schemas.layout import Precision

    layout = default_layout(1, CFG).model_copy(update={"precision": Precision(compute_dtype=request.param)})
    w = TrainerWorker(0, 1, None, 0, str(tiny_model_dir), "cpu", CFG, layout)  # a group of one: no rendezvous
    w.train_step(_batch(w), POLICY)  # a good step first: AdamW holds moments and a step count
    yield w
    w.shutdown()


def _batch(w, n: int = 2) -> dict:
    """`n` sequences with their behaviour log-probs from the worker itself (on policy)."""
    seqs = [[1, 5, 6, 7, 8, 9], [1, 4, 3, 6, 2], [1, 7, 7, 2, 9, 4, 3], [1, 3, 8, 5]][:n]
    masks = [[0, 0, 0] + [1] * (len(s) - 3) for s in seqs]
    batch = {"input_ids": seqs, "loss_mask": masks, "advantages": [1.0, -1.0, 0.5, -0.5][:n]}
    return {**batch, "behaviour_logprobs": w.compute_logprobs(batch)}


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _state(w) -> dict[str, torch.Tensor]:
    """Every master weight and every AdamW state tensor (moments and step counts), copied. The root FSDP unit stays
    unsharded after a forward, holding its compute-dtype copy: resharding first reads the master weights."""
    for module in w.model.modules():
        if hasattr(module, "reshard"):
            module.reshard()
    out = {f"param/{name}": _local(p) for name, p in w.model.named_parameters()}
    for k, opt in enumerate(w.optimizer.optimizers):
        for i, state in enumerate(opt.state.values()):
            out.update({f"opt{k}/{i}/{key}": _local(v) for key, v in state.items() if torch.is_tensor(v)})
    return out


def _assert_identical(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"{len(changed)} tensors changed, e.g. {changed[:3]}"


def _assert_skipped(stats: dict, what: str, skipped: int = 1) -> None:
    assert stats["skipped_steps"] == skipped
    assert quantity(stats["nonfinite"]) == what


def _assert_trains_on(w) -> None:
    """The worker still steps on a good batch after a skip: no NaN gradient was left behind."""
    before = _state(w)
    stats = w.train_step(_batch(w), POLICY)
    assert stats["skipped_steps"] == 0 and stats["nonfinite"] == 0 and math.isfinite(stats["grad_norm"])
    after = _state(w)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("param/"))


def test_nan_advantages_skip_the_update(worker) -> None:
    batch = _batch(worker)
    before = _state(worker)
    stats = worker.train_step({**batch, "advantages": [float("nan"), 1.0]}, POLICY)
    _assert_skipped(stats, "loss")
    assert math.isnan(stats["loss"])  # reported as it was
    _assert_identical(before, _state(worker))
    _assert_trains_on(worker)


def test_nan_behaviour_logprobs_skip_the_update(worker) -> None:
    batch = _batch(worker)
    behaviour = [list(row) for row in batch["behaviour_logprobs"]]
    behaviour[1][4] = float("nan")
    before = _state(worker)
    stats = worker.train_step({**batch, "behaviour_logprobs": behaviour}, {"policy": _against_behaviour()})
    _assert_skipped(stats, "loss")
    _assert_identical(before, _state(worker))


def _against_behaviour():
    """Plain PPO, whose ratio is to the behaviour policy. (The decoupled loss gives a non-finite behaviour weight 0,
    so there a NaN behaviour log-prob drops its token: the engine's log-probs are checked before any batch.)"""
    from rlc.runtime.algo.policy import PolicyLoss

    return PolicyLoss(decoupled=False)


def test_an_infinite_loss_with_finite_gradients_skips_the_update(worker) -> None:
    """k1's gradient does not depend on the reference, so an infinite reference leaves every gradient finite."""
    batch = _batch(worker)
    ref = [[0.0] + [float("-inf")] * (len(s) - 1) for s in batch["input_ids"]]
    before = _state(worker)
    stats = worker.train_step({**batch, "ref_logprobs": ref}, {**POLICY, "kl_coef": 0.1, "kl_estimator": "k1"})
    _assert_skipped(stats, "loss")
    assert math.isinf(stats["loss"]) and math.isfinite(stats["grad_norm"])
    _assert_identical(before, _state(worker))


def test_an_infinite_gradient_skips_the_update(worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gradient turned infinite after backward (as an overflowing bf16 reduction would): the loss is finite, the
    norm is not, and clipping must not pass it to AdamW."""
    from rlc.runtime.train import trainer as trainer_module

    summed = trainer_module.sum_partial_grads

    def poisoned(partial, mesh) -> None:
        summed(partial, mesh)
        grad = next(p for p in worker.model.parameters() if p.grad is not None).grad
        (grad._local_tensor if hasattr(grad, "_local_tensor") else grad).view(-1)[0] = float("inf")

    monkeypatch.setattr(trainer_module, "sum_partial_grads", poisoned)
    before = _state(worker)
    stats = worker.train_step(_batch(worker), POLICY)
    _assert_skipped(stats, "grad_norm")
    assert math.isfinite(stats["loss"]) and math.isinf(stats["grad_norm"])
    _assert_identical(before, _state(worker))
    monkeypatch.undo()
    _assert_trains_on(worker)


def test_only_the_failing_minibatch_skips(worker) -> None:
    """Two minibatches, NaN only in the second: the first updates, the second does not (AdamW counts one step)."""
    batch = _batch(worker, 4)
    first = {k: v[:2] for k, v in batch.items()}
    second = {k: v[2:] for k, v in batch.items()}
    second["advantages"] = [float("nan"), 1.0]
    steps = [_local(s["step"]) for opt in worker.optimizer.optimizers for s in opt.state.values()]
    before = _state(worker)
    stats = worker.train_step([first, second], POLICY)
    _assert_skipped(stats, "loss")
    assert stats["optimizer_steps"] == 2
    after_steps = [_local(s["step"]) for opt in worker.optimizer.optimizers for s in opt.state.values()]
    assert all(int(b) + 1 == int(a) for b, a in zip(steps, after_steps, strict=True))
    after = _state(worker)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("param/"))


def _restore(w, saved: dict[str, torch.Tensor]) -> None:
    """Puts back every parameter and AdamW state tensor `_state` copied."""
    now = {f"param/{name}": p for name, p in w.model.named_parameters()}
    for k, opt in enumerate(w.optimizer.optimizers):
        for i, state in enumerate(opt.state.values()):
            now.update({f"opt{k}/{i}/{key}": v for key, v in state.items() if torch.is_tensor(v)})
    with torch.no_grad():
        for key, t in now.items():
            (t.to_local() if hasattr(t, "to_local") else t).copy_(saved[key])


def test_a_nan_in_the_first_minibatch_leaves_the_second_its_step(worker) -> None:
    """NaN only in the first of two minibatches: the second takes its optimizer step (AdamW counts one step) and the
    weights move exactly as that minibatch alone moves them; one update skipped, not two."""
    batch = _batch(worker, 4)
    batch["proximal_logprobs"] = batch["behaviour_logprobs"]  # both minibatches' pre-step log-probs, given
    first = {k: v[:2] for k, v in batch.items()}
    second = {k: v[2:] for k, v in batch.items()}
    first["advantages"] = [float("nan"), 1.0]
    before = _state(worker)
    stats = worker.train_step([first, second], POLICY)
    _assert_skipped(stats, "loss")
    after = _state(worker)
    steps = [k for k in before if k.endswith("/step")]
    assert steps and all(int(after[k]) == int(before[k]) + 1 for k in steps)
    _restore(worker, before)
    worker.train_step([second], POLICY)  # the second minibatch's step alone, from the same weights and moments
    alone = _state(worker)
    _assert_identical(alone, after)


# ---------------------------------------------------------------- two ranks: one rank's loss stops both

#: Two-rank layouts, and the ranks whose loss is infinite: one data-parallel rank's share; a pipeline's last stage,
#: the only one that computes the loss (its gradients reach the first stage finite).
TWO_RANKS = {"dp2": ({"world_size": 2}, {1}), "pp2": ({"world_size": 2, "pp": 2}, {0, 1})}


def _rank_main(rank: int, port: int, model_dir: str, out: str, name: str) -> None:
    torch.set_num_threads(1)
    from rlc.runtime.train.group import split_batch
    from rlc.runtime.train.trainer import TrainerWorker
    from rlc.schemas.layout import TrainLayout

    layout, injected = TWO_RANKS[name]
    lay = TrainLayout(micro_batch_tokens=CFG["micro_batch_tokens"], **layout)
    w = TrainerWorker(rank, 2, "127.0.0.1", port, model_dir, "cpu", CFG, lay)
    batch = _batch(w, 4)  # a pipeline stage before the last scores nothing (empty rows), and computes no loss
    rows = zip(batch["behaviour_logprobs"], batch["input_ids"], strict=True)
    batch["behaviour_logprobs"] = [r or [0.0] * len(s) for r, s in rows]
    share = split_batch(batch, lay.dp)[lay.coordinates(rank)["dp"]]
    w.train_step(share, POLICY)
    state = _state(w)  # this rank's shard of every parameter and of AdamW's state
    inf = float("-inf") if rank in injected else 0.0  # k1's gradient does not depend on the reference: all finite
    ref = [[0.0] + [inf] * (len(s) - 1) for s in share["input_ids"]]
    stats = w.train_step({**share, "ref_logprobs": ref}, {**POLICY, "kl_coef": 0.1, "kl_estimator": "k1"})
    after = _state(w)
    same = all(torch.equal(v, after[k]) for k, v in state.items())
    torch.save({"stats": stats, "same": same}, f"{out}/rank{rank}.pt")
    leave_together(w)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_one_ranks_nonfinite_loss_skips_the_update_on_every_rank(
    name: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(free_port(), str(tiny_model_dir), str(tmp_path), name), nprocs=2, join=True)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        _assert_skipped(result["stats"], "loss")
        assert result["same"], f"rank {rank} changed its shard of the weights or of AdamW's state"


def test_clipping_leaves_a_nonfinite_norm_to_the_caller() -> None:
    """NaN compares False with the bound and max_norm/inf zeroes finite gradients: neither may happen silently."""
    from rlc.runtime.train.optimizer import clip_grad_norm

    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    params[0].grad = torch.tensor([3.0, 4.0, 0.0])
    for bad in (float("inf"), float("nan")):
        params[1].grad = torch.tensor([bad, 1.0, 1.0])
        norm = clip_grad_norm(params, max_norm=1.0)
        assert not math.isfinite(norm)
        assert torch.equal(params[0].grad, torch.tensor([3.0, 4.0, 0.0]))  # not scaled by max_norm / norm
    params[1].grad = torch.zeros(3)
    assert clip_grad_norm(params, max_norm=1.0) == pytest.approx(5.0)
    assert torch.allclose(params[0].grad, torch.tensor([0.6, 0.8, 0.0]), atol=1e-6)
