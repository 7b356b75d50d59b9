"""Rollout routing replay (R3) under context and pipeline parallelism, against one rank running the sequences
unpacked: the engine's routing (a third of the (token, layer) pairs on other experts than the trainer's own) reaches
every CP slice and every pipeline stage in the micro-batch's layout, so log-probs, the step's loss, its
load-balancing loss (over the global batch), the agreement metric and the gradients are the one rank's.

Each layout runs in its own spawned gloo group on the tiny Qwen3-MoE: packed micro-batches of several sequences,
one of which crosses the CP rank boundary (the row padded for the split), a second micro-batch, then one step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ranks import free_port, leave_together
from test_rollout_routing_replay import engine_routing, own_routing

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow

LP_TOL, GRAD_TOL = 1e-5, 1e-4
BUDGET = 64
# The first bin packs 13 + 22 + 9 + 17 = 61 tokens (padded to 62 for cp 2: the 22-token sequence crosses the
# split at 31), the second 30 + 11.
LENGTHS = (13, 22, 9, 17, 30, 11)

LAYOUTS = {
    "cp2": {"world_size": 2, "cp": 2},
    # one MoE layer per stage; the second stage's router reads the routing's second column; recompute repeats it
    "pp2-recompute": {"world_size": 2, "pp": 2, "recompute": "full"},
}
CFG = {
    "lr": 1e-3,
    "logprob_chunk_tokens": 7,
    "max_grad_norm": 1e9,
    "routing_replay": "rollout",
    "router_aux_loss_coef": 0.1,
}


def _rank_main(rank: int, world: int, port: int, model_dir: str, out: str, layout: dict, batch: dict) -> None:
    torch.set_num_threads(1)
    from rlc.runtime.train.trainer import TrainerWorker
    from rlc.schemas.layout import TrainLayout

    lay = TrainLayout(**{"micro_batch_tokens": BUDGET, **layout})
    w = TrainerWorker(rank, world, "127.0.0.1", port, model_dir, "cpu", {**CFG, "packing": world > 1}, lay)
    lp = w.compute_logprobs(batch)
    lp = [row or [0.0] * len(ids) for row, ids in zip(lp, batch["input_ids"], strict=True)]  # an earlier stage's
    beh = [[x + 0.01 * ((j * 7) % 5 - 2) for j, x in enumerate(r)] for r in lp]
    stats = w.train_step({**batch, "behaviour_logprobs": beh, "proximal_logprobs": lp}, {"clip": 0.2})
    grads = {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in w.model.named_parameters()
        if p.grad is not None
    }
    last = w.pipeline is None or w.pipeline.last
    torch.save({"lp": lp if last else None, "stats": stats, "grads": grads}, f"{out}/rank{rank}.pt")
    leave_together(w)


def _run(model_dir: Path, out: Path, layout: dict, batch: dict) -> list[dict]:
    import torch.multiprocessing as mp

    world = layout["world_size"]
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(_rank_main, args=(world, free_port(), str(model_dir), str(out), layout, batch), nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def batch(tiny_moe_model_dir: Path) -> dict:
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, 32, (n,), generator=g).tolist() for n in LENGTHS]
    engine, moved = engine_routing(own_routing(tiny_moe_model_dir, ids))
    assert moved > 0
    return {
        "input_ids": ids,
        "loss_mask": [[0] * 4 + [1] * (n - 4) for n in LENGTHS],
        "advantages": [float(x) for x in torch.randn(len(LENGTHS), generator=g)],
        "routed_experts": engine,
    }


@pytest.fixture(scope="module")
def reference(tiny_moe_model_dir: Path, batch: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One rank, the sequences unpacked (padded micro-batches)."""
    return _run(tiny_moe_model_dir, tmp_path_factory.mktemp("r3-ref"), {"world_size": 1}, batch)[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_replay_under_cp_and_pp_matches_one_unpacked_rank(
    name: str, reference: dict, batch: dict, tiny_moe_model_dir: Path, tmp_path: Path
) -> None:
    ranks = _run(tiny_moe_model_dir, tmp_path, LAYOUTS[name], batch)
    lp = next(r["lp"] for r in ranks if r["lp"] is not None)  # CP: every rank gathers the whole row
    diff = max(abs(a - b) for x, y in zip(lp, reference["lp"], strict=True) for a, b in zip(x, y, strict=True))
    assert diff < LP_TOL, diff
    stats, ref = ranks[0]["stats"], reference["stats"]
    assert 0 < ref["moe/rollout_routing_agreement"] < 0.9 and ref["moe/aux_loss"] > 0
    for key in ("loss", "grad_norm", "moe/aux_loss", "moe/rollout_routing_agreement", "moe/expert_load_max"):
        assert stats[key] == pytest.approx(ref[key], rel=1e-5), key
    for r in ranks:  # a pipeline stage holds its own layers' gradients (and the shared root weights')
        worst = max((r["grads"][k] - reference["grads"][k]).abs().max().item() for k in r["grads"])
        assert worst < GRAD_TOL, worst
    assert set().union(*(r["grads"] for r in ranks)) == set(reference["grads"])
