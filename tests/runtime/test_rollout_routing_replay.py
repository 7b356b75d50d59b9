"""Rollout routing replay (R3) in the trainer and the router's load-balancing loss over the global batch.

The rollout engine's routing is the trainer's own choice on the tiny Qwen3-MoE with a third of the (token, layer)
pairs moved to other experts, as an engine that routes differently would. One-rank workers run in this process
over a one-rank gloo group; the reference for log-probs is transformers' model run one sequence at a time with its
routers forced to the engine's experts by a forward written here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_loss_split import pg  # noqa: F401  (the one-rank gloo group in-process workers join)

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.usefixtures("pg")

TOL = 1e-5  # fp32 cpu kernels on both sides (packed, padded and one sequence per forward)
LENGTHS = (13, 22, 9, 17, 30, 11)
MISSING = 255


def _worker(model_dir: Path, **cfg):  # type: ignore[no-untyped-def]
    from rlc.runtime.train.trainer import TrainerWorker

    base = {"lr": 1e-3, "logprob_chunk_tokens": 7, "micro_batch_tokens": 64, "max_grad_norm": 1e9}
    return TrainerWorker(0, 1, "127.0.0.1", 0, str(model_dir), "cpu", {**base, **cfg})


def _model(model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _batch(lengths: tuple[int, ...] = LENGTHS, seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, 32, (n,), generator=g).tolist() for n in lengths]
    return {
        "input_ids": ids,
        "loss_mask": [[0] * 4 + [1] * (n - 4) for n in lengths],
        "advantages": [float(x) for x in torch.randn(len(lengths), generator=g)],
    }


def _routers(model) -> list[tuple[int, torch.nn.Module]]:  # type: ignore[no-untyped-def]
    """(decoder layer, router) of every MoE layer."""
    from rlc.runtime.train.router import _LAYER, _named_routers

    return [(int(_LAYER.search(name).group(1)), m) for name, m in _named_routers(model)]  # type: ignore[union-attr]


@torch.no_grad()
def own_routing(model_dir: Path, seqs: list[list[int]]) -> list[np.ndarray]:
    """transformers' own experts for every token, one sequence per forward: ``[T, decoder layers, top_k]``, dense
    layers' columns not captured."""
    model = _model(model_dir)
    layers = model.config.num_hidden_layers
    seen: dict[int, torch.Tensor] = {}
    for col, router in _routers(model):
        router.register_forward_hook(lambda _m, _a, out, col=col: seen.__setitem__(col, out[2]))
    out = []
    for s in seqs:
        model(input_ids=torch.tensor([s]))
        k = next(iter(seen.values())).shape[-1]
        arr = np.full((len(s), layers, k), MISSING, dtype=np.uint8)
        for col, idx in seen.items():
            arr[:, col] = idx.numpy()
        out.append(arr)
    return out


def engine_routing(own: list[np.ndarray], experts: int = 8) -> tuple[list[np.ndarray], int]:
    """The engine's rows (one per token but the last) with every third (token, MoE layer) pair on other experts;
    and how many pairs were moved."""
    out, moved = [], 0
    for arr in own:
        rows = arr[:-1].copy()
        for t in range(rows.shape[0]):
            for col in range(rows.shape[1]):
                if rows[t, col, 0] != MISSING and (t * 7 + col) % 3 == 0:
                    rows[t, col] = (rows[t, col].astype(int) + 1) % experts
                    moved += 1
        out.append(rows)
    return out, moved


def _forced_forward(router: torch.nn.Module, forced: list[torch.Tensor]):  # type: ignore[no-untyped-def]
    """A Qwen3-MoE router forward that uses `forced[0]`'s experts where it holds them (-1: its own choice), with the
    gate weights of those experts' probabilities renormalised."""

    def forward(hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden = hidden.reshape(-1, router.weight.shape[-1])
        logits = torch.nn.functional.linear(hidden, router.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        own = torch.topk(probs, router.top_k, dim=-1).indices
        rows = forced[0]
        idx = torch.where(rows >= 0, rows, own)
        weights = probs.gather(-1, idx)
        return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), idx

    return forward


@torch.no_grad()
def forced_logprobs(model_dir: Path, seqs: list[list[int]], engine: list[np.ndarray | None]) -> list[list[float]]:
    """Log-probs of transformers' model whose routers use the engine's experts for each captured token."""
    model = _model(model_dir)
    slots: dict[int, list[torch.Tensor]] = {}
    for col, router in _routers(model):
        slots[col] = [torch.empty(0)]
        router.forward = _forced_forward(router, slots[col])
    out = []
    for s, rows in zip(seqs, engine, strict=True):
        for col, slot in slots.items():
            forced = torch.full((len(s), 2), -1, dtype=torch.long)
            if rows is not None:
                part = torch.from_numpy(rows[:, col].astype(np.int64))
                ok = (part != MISSING).all(-1)
                forced[: len(part)][ok] = part[ok]
            slot[0] = forced
        logits = model(input_ids=torch.tensor([s])).logits[0]
        lp = torch.log_softmax(logits[:-1].float(), -1).gather(-1, torch.tensor(s[1:]).unsqueeze(-1)).squeeze(-1)
        out.append([0.0, *lp.tolist()])
    return out


def _spy(worker) -> list[tuple[int, torch.Tensor, torch.Tensor]]:  # type: ignore[no-untyped-def]
    """Every (layer, own choice, experts used) the worker's routers return from now on."""
    calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    route = worker.routing.route

    def spy(layer: int, indices: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        used = route(layer, indices, probs)
        calls.append((layer, indices.clone(), used.clone()))
        return used

    worker.routing.route = spy
    return calls


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


@pytest.fixture(scope="module")
def scene(tiny_moe_model_dir: Path) -> dict:
    """The batch, the trainer's own experts and the engine's (a third of the pairs moved)."""
    batch = _batch()
    own = own_routing(tiny_moe_model_dir, batch["input_ids"])
    engine, moved = engine_routing(own)
    pairs = sum(r.shape[0] * r.shape[1] for r in engine)
    return {"batch": batch, "own": own, "engine": engine, "moved": moved, "pairs": pairs}


def _flat_engine(worker, batch: dict, engine: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The engine's experts and captured mask laid out as the worker's first micro-batch's routers see them."""
    micro = worker._micro_batches(batch["input_ids"])[0]
    mb = worker.batcher.build([batch["input_ids"][i] for i in micro])
    return mb.routed_experts([engine[i] for i in micro], 2, 2, 8)


@pytest.mark.parametrize("mode", ["off", "rollout"])
def test_rollout_replay_uses_the_engines_experts_and_off_only_measures(
    tiny_moe_model_dir: Path, scene: dict, mode: str
) -> None:
    """Without replay the trainer's routers keep their own experts and the step reports the agreement the moved
    pairs leave; with R3 every captured token uses exactly the engine's experts, in the proximal and the policy
    forward alike, and the log-probs are those of a model forced to them."""
    batch = {**scene["batch"], "routed_experts": scene["engine"]}
    worker = _worker(tiny_moe_model_dir, routing_replay=mode, micro_batch_tokens=128)
    calls = _spy(worker)
    lp = worker.compute_logprobs(batch)
    ids, captured = _flat_engine(worker, batch, scene["engine"])
    assert len(calls) == 2 and captured.any()
    for layer, own, used in calls:
        cap = captured[:, layer]
        if mode == "rollout":
            assert _same_sets(used[cap], ids[cap, layer]).all()
            assert torch.equal(used[~cap], own[~cap])  # uncaptured (each sequence's last token): its own
        else:
            assert torch.equal(used, own)
            assert not _same_sets(used[cap], ids[cap, layer]).all()
    expected = forced_logprobs(
        tiny_moe_model_dir, batch["input_ids"], scene["engine"] if mode == "rollout" else [None] * 6
    )
    for row, ref in zip(lp, expected, strict=True):
        assert np.allclose(row, ref, atol=TOL)
    calls.clear()
    stats = worker.train_step({**batch, "behaviour_logprobs": lp}, {"clip": 0.2})
    # The trainer's own choice before replay, against the engine's: every pair but the moved ones agree without
    # replay; with it, the second layer chooses on the hidden states the first layer's replay produced.
    same = [_same_sets(own[captured[:, layer]], ids[captured[:, layer], layer]) for layer, own, _ in calls]
    assert stats["moe/rollout_routing_agreement"] == pytest.approx(float(torch.cat(same).double().mean()), abs=1e-12)
    if mode == "off":
        assert stats["moe/rollout_routing_agreement"] == pytest.approx(1 - scene["moved"] / scene["pairs"], abs=1e-12)


def test_replay_survives_packing_and_padding(tiny_moe_model_dir: Path, scene: dict) -> None:
    """Packed rows of several sequences (three micro-batches) and padded batches replay the same experts: their
    log-probs equal one sequence per forward with the routers forced, and their steps give the same loss."""
    batch = {**scene["batch"], "routed_experts": scene["engine"]}
    expected = forced_logprobs(tiny_moe_model_dir, batch["input_ids"], scene["engine"])
    stats = []
    for packing in (True, False):
        worker = _worker(tiny_moe_model_dir, routing_replay="rollout", packing=packing, router_aux_loss_coef=0.1)
        assert len(worker._micro_batches(batch["input_ids"])) > 1
        lp = worker.compute_logprobs(batch)
        for row, ref in zip(lp, expected, strict=True):
            assert np.allclose(row, ref, atol=TOL)
        stats.append(worker.train_step({**batch, "behaviour_logprobs": lp}, {"clip": 0.2}))
    for key in ("loss", "grad_norm", "moe/aux_loss", "moe/rollout_routing_agreement"):
        assert stats[0][key] == pytest.approx(stats[1][key], rel=1e-5), key


def test_rows_not_captured_fall_back_to_the_trainers_own_routing(tiny_moe_model_dir: Path, scene: dict) -> None:
    """A (token, layer) entry marked 255, a sequence whose rows stop early and one without routing route with the
    trainer's own experts; the rest replay the engine's."""
    engine = [r.copy() for r in scene["engine"]]
    engine[0][2, 1] = MISSING  # one layer of one token
    engine[1][5] = MISSING  # every layer of one token
    engine[2] = engine[2][:3]  # rows stop after three tokens
    engine[3] = None  # type: ignore[call-overload]
    batch = {**scene["batch"], "routed_experts": engine}
    worker = _worker(tiny_moe_model_dir, routing_replay="rollout", micro_batch_tokens=128)
    calls = _spy(worker)
    lp = worker.compute_logprobs(batch)
    ids, captured = _flat_engine(worker, batch, engine)
    for layer, own, used in calls:
        cap = captured[:, layer]
        assert _same_sets(used[cap], ids[cap, layer]).all() and torch.equal(used[~cap], own[~cap])
    assert int(captured.sum()) == sum(r.shape[0] * 2 for r in scene["engine"]) - 1 - 2 - 2 * 5 - 2 * 16
    for row, ref in zip(lp, forced_logprobs(tiny_moe_model_dir, batch["input_ids"], engine), strict=True):
        assert np.allclose(row, ref, atol=TOL)


def test_the_setting_takes_older_plans_bools() -> None:
    """True is the trainer-side replay of the proximal experts, False is off; anything else is refused by name."""
    from rlc.runtime.train.router import Routing, replay_mode

    assert [replay_mode(v) for v in (True, False, None, "off", "proximal", "rollout")] == [
        "proximal",
        "off",
        "off",
        "off",
        "proximal",
        "rollout",
    ]
    assert Routing(8, 2, 0.0, True).mode == "proximal" and Routing(8, 2, 0.0, False).mode == "off"
    with pytest.raises(ValueError, match="routing_replay 'engine'; expected one of off, proximal, rollout"):
        replay_mode("engine")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda a: a[:, :1],
            r"sequence 0 has shape \[12, 1, 2\]; a sequence of 13 tokens on this model needs \[at most 12 rows, 2 ",
        ),
        (lambda a: a[:, :, :1], r"shape \[12, 2, 1\].*top-k 2\]"),
        (lambda a: np.concatenate([a, a[:1]]), r"shape \[13, 2, 2\]; a sequence of 13 tokens .*\[at most 12 rows"),
        (lambda a: np.where(a == a.flat[0], 9, a).astype(np.uint8), "sequence 0 names expert 9; the model has 8"),
    ],
)
def test_routing_the_model_cannot_have_is_refused(tiny_moe_model_dir: Path, scene: dict, change, message) -> None:  # type: ignore[no-untyped-def]
    """A layer count, top-k or row count that does not fit the model and sequence, or an expert it lacks: one line
    naming the shapes, before any forward."""
    engine = [change(scene["engine"][0]), *scene["engine"][1:]]
    worker = _worker(tiny_moe_model_dir, routing_replay="rollout")
    with pytest.raises(ValueError, match=message):
        worker.compute_logprobs({**scene["batch"], "routed_experts": engine})


def test_routers_read_their_decoder_layers_columns(tiny_mla_model_dir: Path) -> None:
    """Routers read the column of the decoder layer their name says: DeepSeek-V3's first layer is dense, so its two
    MoE routers read columns 1 and 2 of the three."""
    from rlc.runtime.train.router import install_routing

    routing = install_routing(_model(tiny_mla_model_dir), 0.0, "rollout", None)
    assert routing is not None and routing.decoder == [1, 2] and routing.columns == 3 and routing.top_k == 2


# ------------------------------------------------------------------ the load-balancing loss over the global batch


def test_one_micro_batch_loss_is_transformers_load_balancing_loss(tiny_moe_model_dir: Path) -> None:
    """One rank, one packed micro-batch: the loss is the coefficient times transformers' `load_balancing_loss_func`
    of each layer's router logits (f summing to top-k), averaged over the layers, over the tokens the loss counts
    (a sequence's last token left out, given to transformers as masked)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from rlc.runtime.platform import get_platform
    from rlc.runtime.train.micro_batches import MicroBatcher
    from rlc.runtime.train.router import RoutedTokens, install_routing

    seqs = _batch((13, 22, 9))["input_ids"]
    mb = MicroBatcher(get_platform("cpu"), torch.device("cpu"), 0, True, "mask").build(seqs)
    model = _model(tiny_moe_model_dir)
    logits: list[torch.Tensor] = []
    for _, router in _routers(model):
        router.register_forward_hook(lambda _m, _a, out: logits.append(out[0].detach()))
    routing = install_routing(model, 0.01, "off", None)
    assert routing is not None
    tokens = RoutedTokens(mb.routing_tokens())
    routing.start_minibatch(0, [tokens], [True])
    routing.begin((0, 0), record=False, tokens=tokens)
    model(input_ids=mb.input_ids)  # sequences see each other here: only the router logits are compared
    aux = routing.aux_loss()
    routing.end()
    mask = tokens.counted.view(1, -1).long()
    assert not bool(mask[0, len(seqs[0]) - 1]) and int(mask.sum()) == sum(map(len, seqs)) - 3
    per_layer = [float(load_balancing_loss_func((g,), 8, 2, mask)) for g in logits]
    assert aux is not None and float(aux.detach()) == pytest.approx(0.01 * sum(per_layer) / 2, abs=1e-6)
    assert routing.take_stats()["moe/aux_loss"] == pytest.approx(sum(per_layer) / 2, abs=1e-6)
    aux.backward()  # the router weights get the loss's gradient
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for _, r in _routers(model))


def _router_grads(worker) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    grads = {n: p.grad for n, p in worker.model.named_parameters() if p.grad is not None}
    return {n: (g.full_tensor() if hasattr(g, "full_tensor") else g).clone() for n, g in grads.items()}


@pytest.mark.parametrize("case", ["rollout", "proximal"])
def test_the_loss_over_several_micro_batches_has_the_whole_batchs_gradient(
    tiny_moe_model_dir: Path, scene: dict, case: str
) -> None:
    """The load-balancing loss alone (advantages 0): split into micro-batches its gradient is that of one
    micro-batch holding the whole minibatch, where f is known before the first backward: the engine's experts
    with R3 (every counted token captured), the proximal pass's with trainer-side replay (two minibatches)."""
    batch = {**scene["batch"], "advantages": [0.0] * len(LENGTHS)}
    if case == "rollout":
        batch["routed_experts"] = [r[:-1] for r in own_routing(tiny_moe_model_dir, batch["input_ids"])]
    results = []
    for budget in (128, 32):
        worker = _worker(
            tiny_moe_model_dir, lr=0.0, routing_replay=case, router_aux_loss_coef=0.5, micro_batch_tokens=budget
        )
        share = (
            batch if case == "rollout" else [{k: v[:3] for k, v in batch.items()}, {k: v[3:] for k, v in batch.items()}]
        )
        parts = [share] if case == "rollout" else share
        lp = [worker.compute_logprobs(p) for p in parts]
        train = [{**p, "behaviour_logprobs": x} for p, x in zip(parts, lp, strict=True)]
        counts = {len(worker._micro_batches(p["input_ids"])) for p in parts}
        stats = worker.train_step(train[0] if case == "rollout" else train, {"clip": 0.2})
        results.append((counts, stats, _router_grads(worker)))
    (one, whole, g_whole), (many, split, g_split) = results
    assert one == {1} and min(many) > 1
    assert split["moe/aux_loss"] == pytest.approx(whole["moe/aux_loss"], rel=1e-6)
    assert g_split.keys() == g_whole.keys() and any(g.abs().sum() > 0 for g in g_whole.values())
    for name, g in g_whole.items():
        assert torch.allclose(g_split[name], g, atol=1e-6, rtol=1e-4), name
