"""MoE routers in RL (`runtime/train/router.py`): rlc's router forward is transformers' outside the trainer's passes,
its load-balancing loss is Switch Transformer's as transformers computes it, and routing replay makes the policy
forward use the experts the proximal pass chose (the rollout engine's: `test_rollout_routing_replay.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


def _model(model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _ids() -> torch.Tensor:
    return torch.randint(3, 32, (1, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "qwen3_5_moe_text", "deepseek_v3"])
def test_outside_the_trainers_passes_routing_is_transformers_own(
    family: str, tiny_moe_model_dir: Path, tiny_shared_moe_model_dirs: dict, tiny_mla_model_dir: Path
) -> None:
    """Same logits with rlc's routers as with transformers' own, for every MoE family the runtime accepts (their
    router classes renormalise the top-k weights by a config flag, or always; DeepSeek-V3's scores with a sigmoid,
    biases its choice and limits it to the best expert groups)."""
    from rlc.runtime.train.router import install_routing

    dirs = {"qwen3_moe": tiny_moe_model_dir, "deepseek_v3": tiny_mla_model_dir, **tiny_shared_moe_model_dirs}
    model_dir = dirs[family]
    ids = _ids()
    with torch.no_grad():
        before = _model(model_dir)(input_ids=ids).logits
        model = _model(model_dir)
        routing = install_routing(model, 0.0, replay=True, group=None)
        assert routing is not None and routing.layers in (2, 4)
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)


def test_a_router_rlc_does_not_reproduce_is_refused(tiny_mla_model_dir: Path) -> None:
    """Qwen's softmax routing given DeepSeek's router would route other experts with other weights: refused by name
    when installed, never run."""
    from rlc.runtime.train import router as router_lib

    model = _model(tiny_mla_model_dir)
    gate = router_lib.router_modules(model)[0]
    original = gate.forward
    routing = router_lib.Routing(8, 2, 0.0, replay=False)
    gate._rlc_routing, gate._rlc_layer, gate._rlc_renormalise = routing, 0, True
    gate.forward = router_lib._router_forward.__get__(gate)
    with pytest.raises(RuntimeError, match="DeepseekV3TopkRouter"):
        router_lib._check_same_routing(gate, original)


def test_load_balancing_loss_is_switch_transformers_as_transformers_computes_it(tiny_moe_model_dir: Path) -> None:
    """A forward with gradients outside the trainer's minibatches is its own batch: rlc's per-layer term E·Σ f_i·P_i
    (f the tokens per expert over the tokens, summing to top-k) is transformers' `load_balancing_loss_func` of that
    layer, and the loss is the coefficient times its mean over the layers."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from rlc.runtime.train.router import install_routing

    model = _model(tiny_moe_model_dir)
    logits: list[torch.Tensor] = []
    for router in [m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]:
        router.register_forward_hook(lambda _m, _a, out: logits.append(out[0].detach()))
    routing = install_routing(model, 0.01, replay=False, group=None)
    assert routing is not None
    routing.begin(("step", 0), record=False)
    model(input_ids=_ids())
    aux = routing.aux_loss()
    routing.end()
    expected = sum(float(load_balancing_loss_func((g,), 8, 2)) for g in logits) / len(logits)
    stats = routing.take_stats()
    assert stats["moe/aux_loss"] == pytest.approx(expected, rel=1e-6)
    assert aux is not None and float(aux.detach()) == pytest.approx(0.01 * expected, rel=1e-6)
    aux.backward()  # the router weights get the loss's gradient
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routing_routers(model))
    assert stats["moe/expert_load_max"] >= 1.0


def routing_routers(model):  # type: ignore[no-untyped-def]
    from rlc.runtime.train.router import router_modules

    return router_modules(model)


@pytest.mark.parametrize("replay", [False, True])
def test_replay_gives_the_policy_forward_the_proximal_experts(tiny_moe_model_dir: Path, replay: bool) -> None:
    """The proximal pass records each layer's experts; after the router moved, the policy forward of the same
    micro-batch measures how many tokens changed experts and, with replay, uses the recorded ones."""
    from rlc.runtime.train.router import install_routing

    model = _model(tiny_moe_model_dir)
    routing = install_routing(model, 0.0, replay=replay, group=None)
    assert routing is not None
    used: dict[tuple, torch.Tensor] = {}
    route = routing.route

    def spy(layer: int, indices: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        out = route(layer, indices, probs)
        used[(routing._record, layer)] = out.clone()
        return out

    routing.route = spy  # type: ignore[method-assign]
    ids = _ids()
    with torch.no_grad():
        routing.begin((0, 0), record=True)
        model(input_ids=ids)
        routing.end()
        for router in routing_routers(model):  # an optimizer step that moves the router
            router.weight.add_(torch.randn_like(router.weight) * 0.5)
        routing.begin((0, 0), record=False)
        model(input_ids=ids)
        routing.end()
    stats = routing.take_stats()
    assert stats["moe/routing_changed"] > 0.1
    for layer in range(2):
        same = torch.equal(used[(False, layer)].sort(-1).values, used[(True, layer)].sort(-1).values)
        assert same == replay


def test_the_trainer_reports_routing_drift_and_load_with_two_minibatches(tiny_moe_model_dir: Path) -> None:
    """A one-rank trainer step of two minibatches: the proximal pass records, the second minibatch's policy forward
    (after the first update) is compared with it, and the step reports the drift, the load and the aux loss."""
    from rlc.runtime.train.trainer import TrainerWorker

    cfg = {"lr": 5e-2, "router_aux_loss_coef": 0.01, "routing_replay": True, "max_grad_norm": 1e9}
    worker = TrainerWorker(0, 1, None, 0, str(tiny_moe_model_dir), "cpu", cfg)
    try:
        g = torch.Generator().manual_seed(1)
        ids = [torch.randint(3, 32, (n,), generator=g).tolist() for n in (20, 30, 25, 15)]
        batch = {
            "input_ids": ids,
            "loss_mask": [[0] * 4 + [1] * (len(s) - 4) for s in ids],
            "advantages": [1.0, -1.0, 0.5, -0.5],
        }
        batch["behaviour_logprobs"] = worker.compute_logprobs(batch)
        halves = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
        result = worker.train_step(halves, {"clip": 0.2})
    finally:
        worker.shutdown()
    # lr 5e-2 moves the router: about 40% of the second minibatch's tokens would take other experts.
    assert 0.05 < result["moe/routing_changed"] <= 1.0
    assert result["moe/expert_load_max"] >= 1.0 and result["moe/aux_loss"] > 0


def test_recomputed_layers_repeat_the_load_balancing_loss(tiny_moe_model_dir: Path) -> None:
    """Full recompute with the load-balancing loss on: the recomputed router repeats the first run's routing and its
    loss's autograd ops, so the step equals the one without recompute."""
    from rlc.runtime.train.trainer import TrainerWorker
    from rlc.schemas.layout import TrainLayout

    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(3, 32, (n,), generator=g).tolist() for n in (20, 30, 25)]
    batch = {"input_ids": ids, "loss_mask": [[0] * 4 + [1] * (len(s) - 4) for s in ids], "advantages": [1.0, -1.0, 0.5]}
    results = []
    for recompute in ("none", "full"):
        cfg = {"lr": 1e-2, "router_aux_loss_coef": 0.5, "max_grad_norm": 1e9}
        layout = TrainLayout(world_size=1, recompute=recompute)
        worker = TrainerWorker(0, 1, None, 0, str(tiny_moe_model_dir), "cpu", cfg, layout)
        try:
            lp = worker.compute_logprobs(batch)
            results.append(worker.train_step({**batch, "behaviour_logprobs": lp}, {"clip": 0.2}))
        finally:
            worker.shutdown()
    assert results[1]["loss"] == pytest.approx(results[0]["loss"], rel=1e-6)
    assert results[1]["grad_norm"] == pytest.approx(results[0]["grad_norm"], rel=1e-5)
    assert results[1]["moe/aux_loss"] == pytest.approx(results[0]["moe/aux_loss"], rel=1e-6)
