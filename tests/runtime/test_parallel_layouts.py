"""The trainer builds each parallel layout the planner can emit, and the numerics equal one plain rank.

Every layout runs in its own spawned gloo group on the tiny model: packed micro-batches of several
sequences, one of which crosses the context-parallel rank boundary, a second micro-batch, then one
decoupled-PPO step. Log-probs must match the single-rank trainer within 1e-5, gradients within 1e-4 and the
updated weights within 1e-5 (where the gradient is not numerically zero); the layout each rank reports (read
back from its model) must be the one asked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ranks import free_port, leave_together

from rlc.schemas.layout import TORCH_LINEAR_KERNELS

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow

LP_TOL, GRAD_TOL, WEIGHT_TOL = 1e-5, 1e-4, 1e-5
LR = 1e-3
BUDGET = 64
# Sequence lengths: the first bin packs 13 + 22 + 9 + 17 = 61 tokens (padded to 62 for cp 2: the 22-token
# sequence at positions 13-34 crosses the split at 31), the second 30 + 11.
LENGTHS = (13, 22, 9, 17, 30, 11)

LAYOUTS = {
    "dp2": {"world_size": 2},
    "cp2-ulysses": {"world_size": 2, "cp": 2},
    "cp2-ring": {"world_size": 2, "cp": 2, "cp_kind": "ring"},
    "tp2": {"world_size": 2, "tp": 2},
    "tp2-cp2-ring": {"world_size": 4, "tp": 2, "cp": 2, "cp_kind": "ring"},
    # 1F1B over two stages of one layer each: the tied embedding lives on both (its gradients summed).
    "pp2-dp2": {"world_size": 4, "pp": 2},
    "pp2-recompute": {"world_size": 2, "pp": 2, "recompute": "full"},
    "pp2-tp2": {"world_size": 4, "pp": 2, "tp": 2},
    "pp2-cp2-ring": {"world_size": 4, "pp": 2, "cp": 2, "cp_kind": "ring"},
    "cp2-recompute-offload": {
        "world_size": 2,
        "cp": 2,
        "recompute": "full",
        "offload_params": True,
        "offload_optimizer": True,
    },
}


def _batch() -> dict:
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, 32, (n,), generator=g).tolist() for n in LENGTHS]
    return {
        "input_ids": ids,
        "loss_mask": [[0] * 4 + [1] * (n - 4) for n in LENGTHS],
        "advantages": [float(x) for x in torch.randn(len(LENGTHS), generator=g)],
    }


def _random_lora_init() -> None:
    """Random A and B in this process's trainers: PEFT's default zero B would leave A's gradient zero and the adapter
    a no-op (the trainer seeds torch before PEFT injects the adapters, so every rank and layout draws the same)."""
    from rlc.runtime.train import lora as lora_lib

    plain = lora_lib.lora_config

    def random_init(settings: dict) -> object:
        config = plain(settings)
        config.init_lora_weights = False
        return config

    lora_lib.lora_config = random_init


def _rank_main(
    rank: int, world: int, port: int, model_dir: str, out: str, layout: dict, packing: bool, lora: dict | None = None
) -> None:
    torch.set_num_threads(1)
    from rlc.runtime.train import lora as lora_lib
    from rlc.runtime.train.group import split_batch
    from rlc.runtime.train.trainer import TrainerWorker
    from rlc.schemas.layout import TrainLayout

    if lora:
        _random_lora_init()
    lay = TrainLayout(**{"micro_batch_tokens": BUDGET, **layout})
    cfg = {"lr": LR, "logprob_chunk_tokens": 7, "packing": packing, "max_grad_norm": 1e9, "lora": lora}
    w = TrainerWorker(rank, world, "127.0.0.1", port, model_dir, "cpu", cfg, lay)
    share = split_batch(_batch(), lay.dp)[lay.coordinates(rank)["dp"]]
    lp = w.compute_logprobs(share)
    # A pipeline stage before the last computes no log-probs (empty rows); its loss inputs go unused.
    lp = [row or [0.0] * len(ids) for row, ids in zip(lp, share["input_ids"], strict=True)]
    extra: dict = {}
    if lora:  # the KL reference (adapters off, through every stage) and the adapter the engines load, before the step
        base = w.compute_logprobs(share, adapters=False)
        extra["base_lp"] = [row or [0.0] * len(ids) for row, ids in zip(base, share["input_ids"], strict=True)]
    # Behaviour log-probs a little off the proximal ones, so the importance weights are not all 1.
    beh = [
        [x + 0.01 * ((t * 7 + j) % 5 - 2) for j, (x, t) in enumerate(zip(r, s, strict=True))]
        for r, s in zip(lp, share["input_ids"], strict=True)
    ]
    stats = w.train_step({**share, "behaviour_logprobs": beh, "proximal_logprobs": lp}, {"clip": 0.2})
    grads = {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in w.model.named_parameters()
        if p.grad is not None
    }
    weights = w.full_state_dict()
    if lora:  # the trained adapter, as weight sync and checkpoints gather and write it
        extra["adapter"] = w.adapter_state_dict()
        written = w.save_adapter(f"{out}/adapter")
        extra["written"] = lora_lib.read_adapter(written)[0] if written else None
    # torch's canonical gather, which the trainer's own walk over its state dict must equal (names and values)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    canonical = get_model_state_dict(w.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    torch.save(
        {
            "lp": lp,
            "stats": stats,
            "grads": grads,
            "weights": weights,
            "canonical": canonical if rank == 0 else None,
            "built": w.built_layout(),
            **extra,
        },
        f"{out}/rank{rank}.pt",
    )
    leave_together(w)


def _run(model_dir: Path, out: Path, layout: dict, packing: bool = True, lora: dict | None = None) -> list[dict]:
    import torch.multiprocessing as mp

    world = layout["world_size"]
    out.mkdir(parents=True, exist_ok=True)
    args = (world, free_port(), str(model_dir), str(out), layout, packing, lora)
    mp.spawn(_rank_main, args=args, nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(tiny_model_dir, tmp_path_factory.mktemp("ref"), {"world_size": 1})[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_rank(name: str, reference: dict, tiny_model_dir: Path, tmp_path: Path) -> None:
    layout = LAYOUTS[name]
    _assert_matches(_run(tiny_model_dir, tmp_path, layout), reference, layout)


#: LoRA (rank 4, alpha 8: scaling 2, on every linear layer) split into pipeline stages, over tensor-parallel ranks
#: (base and lora_B column-wise with lora_A whole for q/k/v/gate/up; base and lora_A row-wise with lora_B whole for
#: o/down), and both, against one rank running the sequences unpacked.
LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}
LORA_LAYOUTS = {
    "one-rank-packed": {"world_size": 1},
    "pp2": {"world_size": 2, "pp": 2},
    "tp2": {"world_size": 2, "tp": 2},
    "pp2-tp2": {"world_size": 4, "pp": 2, "tp": 2},
}


@pytest.fixture(scope="module")
def lora_reference(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(tiny_model_dir, tmp_path_factory.mktemp("lora-ref"), {"world_size": 1}, packing=False, lora=LORA)[0]


@pytest.mark.parametrize("name", list(LORA_LAYOUTS))
def test_lora_layout_matches_one_unpacked_rank(
    name: str, lora_reference: dict, reference: dict, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Only the adapters train and their gradients, the log-probs with and without them, and the adapter written for
    the engines (every stage's layers, TP shards gathered) equal one rank's."""
    layout = LORA_LAYOUTS[name]
    _assert_lora_matches(_run(tiny_model_dir, tmp_path, layout, lora=LORA), lora_reference, reference, layout)


def _assert_lora_matches(ranks: list[dict], lora_reference: dict, reference: dict, layout: dict) -> None:
    """`_assert_matches` for a LoRA run, then: only the adapters have gradients, adapters off is the plain
    trainer's base model, and the adapter the engines load is every trained factor, gathered."""
    _assert_matches(ranks, lora_reference, layout)
    assert lora_reference["grads"] and all(".lora_" in k for k in lora_reference["grads"])
    # the factor each TP rank holds whole (lora_A beside a column-wise base, lora_B beside a row-wise one) gets the
    # same gradient on every TP rank, so its copies stay equal
    for r in ranks:
        peer = next(o for o in ranks if o["built"]["built"]["coords"]["pp"] == r["built"]["built"]["coords"]["pp"])
        assert all(torch.equal(g, peer["grads"][k]) for k, g in r["grads"].items())
    speakers = [r for r in ranks if r["built"]["built"]["coords"]["pp"] == layout.get("pp", 1) - 1]
    speakers = [
        r for r in speakers if (r["built"]["built"]["coords"]["cp"], r["built"]["built"]["coords"]["tp"]) == (0, 0)
    ]
    base = [row for r in speakers for row in r["base_lp"]]
    # adapters off is the base model, whose log-probs the plain trainer computes; the adapters do change them
    assert (
        max(abs(a - b) for x, y in zip(base, reference["lp"], strict=True) for a, b in zip(x, y, strict=True)) < LP_TOL
    )
    assert (
        max(abs(a - b) for x, y in zip(base, lora_reference["lp"], strict=True) for a, b in zip(x, y, strict=True))
        > 1e-2
    )
    base_ref = lora_reference["base_lp"]
    assert max(abs(a - b) for x, y in zip(base, base_ref, strict=True) for a, b in zip(x, y, strict=True)) < LP_TOL
    # the adapter is every layer's trained factors, exactly the gathered weights (which match one rank's, above)
    for key in ("adapter", "written"):
        got = ranks[0][key]
        assert list(got) == list(lora_reference[key]), key
        assert all(torch.equal(v, ranks[0]["weights"][k]) for k, v in got.items()), key
    assert all(r["adapter"] is None and r["written"] is None for r in ranks[1:])


#: Layouts the capability table accepts for a hybrid (Gated-DeltaNet) model, checked against one rank running the
#: sequences unpacked (padded rows through transformers' own forward): packing itself is under test here.
HYBRID_LAYOUTS = {
    "one-rank-packed": {"world_size": 1},
    "dp2": {"world_size": 2},
    "cp2-ulysses": {"world_size": 2, "cp": 2},
    "cp2-ulysses-recompute": {"world_size": 2, "cp": 2, "recompute": "full"},
}


@pytest.fixture(scope="module")
def hybrid_reference(tiny_hybrid_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(tiny_hybrid_model_dir, tmp_path_factory.mktemp("hybrid-ref"), {"world_size": 1}, packing=False)[0]


@pytest.mark.parametrize("name", list(HYBRID_LAYOUTS))
def test_hybrid_layout_matches_one_unpacked_rank(
    name: str, hybrid_reference: dict, tiny_hybrid_model_dir: Path, tmp_path: Path
) -> None:
    layout = HYBRID_LAYOUTS[name]
    ranks = _run(tiny_hybrid_model_dir, tmp_path, layout)
    _assert_matches(ranks, hybrid_reference, layout)
    built = ranks[0]["built"]["built"]["extra"]
    assert built["linear_attention_layers"] == 3
    assert built["linear_attention_kernels"] == TORCH_LINEAR_KERNELS


#: Expert-parallel layouts of the tiny Qwen3-MoE (8 experts, top-2, random routers that spread tokens over every
#: rank): plain FSDP2, EP 2 alone, EP 2 spanning both CP ranks, and EP 2 twice over four ranks (each expert held by
#: two ranks, which FSDP2 shards it over).
MOE_LAYOUTS = {
    "dp2": {"world_size": 2},
    "ep2": {"world_size": 2, "ep": 2},
    "ep2-cp2": {"world_size": 2, "ep": 2, "cp": 2},
    "ep2-dp4": {"world_size": 4, "ep": 2},
    # TP splits the attention; the experts stay whole (ETP 1) and are split over the TP ranks first (TP divides
    # EP), each TP rank serving its share and the outputs summed over TP; the rest of EP dispatches by all-to-all
    # within each TP column: over the TP pair alone, over TP and the two data-parallel ranks, over TP and CP.
    "ep2-tp2": {"world_size": 4, "ep": 2, "tp": 2},
    "ep4-tp2": {"world_size": 4, "ep": 4, "tp": 2},
    "ep4-tp2-cp2": {"world_size": 4, "ep": 4, "tp": 2, "cp": 2},
    "pp2-recompute": {"world_size": 2, "pp": 2, "recompute": "full"},
    "ep2-pp2": {"world_size": 4, "ep": 2, "pp": 2},
}


@pytest.fixture(scope="module")
def moe_reference(tiny_moe_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(tiny_moe_model_dir, tmp_path_factory.mktemp("moe-ref"), {"world_size": 1})[0]


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_moe_layout_matches_one_rank(name: str, moe_reference: dict, tiny_moe_model_dir: Path, tmp_path: Path) -> None:
    layout = MOE_LAYOUTS[name]
    ranks = _run(tiny_moe_model_dir, tmp_path, layout)
    _assert_matches(ranks, moe_reference, layout)
    # Each rank holds only its EP share of the experts, and the weights it gathers for export are whole.
    ep = layout.get("ep", 1)
    assert all(r["built"]["built"]["ep"] == ep for r in ranks)
    assert ranks[0]["weights"]["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 8


#: LoRA on mixture-of-experts models, against one rank running the sequences unpacked: on the tiny Qwen3-MoE
#: all-linear means the attention projections (the routers, fused experts and head are left out), on the tiny
#: DeepSeek-V3 also the dense first layer's MLP and the shared experts. Under plain data parallelism, EP 2, TP
#: beside EP, EP across both CP ranks and EP beside pipeline stages the experts and routers stay frozen and
#: adapter-free, and expert parallelism still finds them after PEFT wrapped the model. (model, layout)
MOE_LORA_LAYOUTS = {
    "one-rank-packed": ("moe", {"world_size": 1}),
    "dp2": ("moe", {"world_size": 2}),
    "ep2": ("moe", {"world_size": 2, "ep": 2}),
    "ep2-tp2": ("moe", {"world_size": 4, "ep": 2, "tp": 2}),
    "ep2-cp2": ("moe", {"world_size": 2, "ep": 2, "cp": 2}),
    "ep2-pp2": ("moe", {"world_size": 4, "ep": 2, "pp": 2}),
    "mla-ep2": ("mla", {"world_size": 2, "ep": 2}),
    "mla-tp2-ep2": ("mla", {"world_size": 2, "tp": 2, "ep": 2}),
}
MOE_LORA_ADAPTED = {
    "moe": {f"self_attn.{p}_proj" for p in "qkvo"},
    "mla": {f"self_attn.{p}" for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")}
    | {f"mlp.{p}_proj" for p in ("gate", "up", "down")}
    | {f"mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")},
}


@pytest.fixture(scope="module")
def moe_lora_reference(tiny_moe_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("moe-lora-ref")
    return _run(tiny_moe_model_dir, out, {"world_size": 1}, packing=False, lora=LORA)[0]


@pytest.fixture(scope="module")
def mla_lora_reference(tiny_mla_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("mla-lora-ref")
    return _run(tiny_mla_model_dir, out, {"world_size": 1}, packing=False, lora=LORA)[0]


@pytest.mark.parametrize("name", list(MOE_LORA_LAYOUTS))
def test_moe_lora_layout_matches_one_unpacked_rank(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    model, layout = MOE_LORA_LAYOUTS[name]
    lora_reference = request.getfixturevalue(f"{model}_lora_reference")
    ranks = _run(request.getfixturevalue(f"tiny_{model}_model_dir"), tmp_path, layout, lora=LORA)
    _assert_lora_matches(ranks, lora_reference, request.getfixturevalue(f"{model}_reference"), layout)
    adapted = {k.split(".lora_")[0].split(".", 3)[-1] for k in lora_reference["grads"]}
    assert adapted == MOE_LORA_ADAPTED[model], adapted
    for r in ranks:  # each adapter's gradient within 1e-4 of one rank's, relative to its size
        worst = max(
            (g - lora_reference["grads"][k]).norm() / lora_reference["grads"][k].norm() for k, g in r["grads"].items()
        )
        assert worst < GRAD_TOL, worst
    assert all(r["built"]["built"]["ep"] == layout.get("ep", 1) for r in ranks)
    experts = next(k for k in ranks[0]["weights"] if k.endswith("mlp.experts.gate_up_proj"))
    assert ranks[0]["weights"][experts].shape[0] == 8


#: MoE families with an always-on shared expert, under EP 2 across both CP ranks, against one rank running the
#: sequences unpacked (the Qwen3.5 MoE model is a Gated-DeltaNet hybrid, whose packing is under test too).
SHARED_MOE_FAMILIES = ("qwen2_moe", "qwen3_5_moe_text")


@pytest.mark.parametrize("family", SHARED_MOE_FAMILIES)
def test_shared_expert_moe_under_ep2_cp2_matches_one_unpacked_rank(
    family: str, tiny_shared_moe_model_dirs: dict, tmp_path: Path
) -> None:
    model_dir = tiny_shared_moe_model_dirs[family]
    reference = _run(model_dir, tmp_path / "ref", {"world_size": 1}, packing=False)[0]
    layout = {"world_size": 2, "ep": 2, "cp": 2}
    ranks = _run(model_dir, tmp_path / "ep", layout)
    _assert_matches(ranks, reference, layout)
    assert all(r["built"]["built"]["ep"] == 2 for r in ranks)


#: Layouts the capability table accepts for DeepSeek-V3 (latent attention, a dense first layer, grouped sigmoid
#: routing, a shared expert), against one rank running the sequences unpacked: packing is under test too.
MLA_LAYOUTS = {
    "one-rank-packed": {"world_size": 1},
    "dp2": {"world_size": 2},
    "ep2": {"world_size": 2, "ep": 2},
    "ep2-cp2": {"world_size": 2, "ep": 2, "cp": 2},
    "cp2-ring": {"world_size": 2, "cp": 2, "cp_kind": "ring"},
    "pp2-recompute": {"world_size": 2, "pp": 2, "recompute": "full"},
    # TP splits the up-projections by heads and the shared expert by width; the down-projections and their norms
    # stay whole on both TP ranks, the rotary key's gradient summed over them. With EP 2 the experts split over
    # the TP pair; with Ulysses CP 2 each rank attends with one of the four heads.
    "tp2": {"world_size": 2, "tp": 2},
    "tp2-ep2": {"world_size": 2, "tp": 2, "ep": 2},
    "tp2-cp2": {"world_size": 4, "tp": 2, "cp": 2},
}


@pytest.fixture(scope="module")
def mla_reference(tiny_mla_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(tiny_mla_model_dir, tmp_path_factory.mktemp("mla-ref"), {"world_size": 1}, packing=False)[0]


@pytest.mark.parametrize("name", list(MLA_LAYOUTS))
def test_latent_attention_layout_matches_one_unpacked_rank(
    name: str, mla_reference: dict, tiny_mla_model_dir: Path, tmp_path: Path
) -> None:
    layout = MLA_LAYOUTS[name]
    ranks = _run(tiny_mla_model_dir, tmp_path, layout)
    _assert_matches(ranks, mla_reference, layout)
    assert all(r["built"]["built"]["ep"] == layout.get("ep", 1) for r in ranks)
    assert ranks[0]["weights"]["model.layers.1.mlp.experts.gate_up_proj"].shape[0] == 8


def _assert_matches(ranks: list[dict], reference: dict, layout: dict) -> None:
    pp = layout.get("pp", 1)
    dp = layout["world_size"] // (layout.get("tp", 1) * layout.get("cp", 1) * pp)
    # One answering rank per data-parallel share (cp 0, tp 0, last stage), in share order, as TrainerGroup does.
    speakers = [
        r
        for r in ranks
        if (r["built"]["built"]["coords"]["cp"], r["built"]["built"]["coords"]["tp"]) == (0, 0)
        and r["built"]["built"]["coords"]["pp"] == pp - 1
    ]
    lp = [row for r in speakers for row in r["lp"]]
    assert len(speakers) == dp and len(lp) == len(LENGTHS)
    lp_diff = max(abs(a - b) for x, y in zip(lp, reference["lp"], strict=True) for a, b in zip(x, y, strict=True))
    assert lp_diff < LP_TOL, lp_diff
    for key in ("loss", "n_tokens", "grad_norm"):
        assert ranks[0]["stats"][key] == pytest.approx(reference["stats"][key], rel=1e-5), key
    for r in ranks:  # a pipeline stage holds its own layers' gradients (and the shared root weights')
        grad_diff = max((r["grads"][k] - reference["grads"][k]).abs().max().item() for k in r["grads"])
        assert grad_diff < GRAD_TOL, (r["built"]["built"]["rank"], grad_diff)
    assert set().union(*(r["grads"] for r in ranks)) == set(reference["grads"])
    # The step itself: AdamW's first update is lr·g/(|g| + eps), i.e. ±lr wherever |g| >> eps, so entries whose
    # gradient is numerically zero may flip sign between layouts (a difference of up to 2·lr there).
    for k, grad in reference["grads"].items():  # tied aliases (lm_head of a tied model) have no entry of their own
        diff = (ranks[0]["weights"][k] - reference["weights"][k]).abs()
        settled = grad.abs() > 1e-4
        worst = diff[settled].max().item() if settled.any() else 0.0
        at = int(diff.argmax())
        assert worst < WEIGHT_TOL, (k, worst, diff.max().item(), grad.flatten()[at].item())
        assert diff.max().item() <= 2 * LR + 1e-6, k
    canonical = ranks[0]["canonical"]  # under PP, torch's gather sees the first stage only
    assert list(ranks[0]["weights"]) == list(canonical) if pp == 1 else set(canonical) < set(ranks[0]["weights"])
    assert all(torch.equal(ranks[0]["weights"][k], v) for k, v in canonical.items())
    built = ranks[0]["built"]["built"]
    assert built["pp"] == pp
    assert built["mesh"] == {"dp": dp, "cp": layout.get("cp", 1), "tp": layout.get("tp", 1)}
    assert built["tp"] == layout.get("tp", 1) and built["shard_group"] == dp * layout.get("cp", 1)
    assert built["cp_kind"] == (layout.get("cp_kind", "ulysses") if layout.get("cp", 1) > 1 else None)
    assert built["recompute"] == layout.get("recompute", "none")
    assert built["offload_params"] == layout.get("offload_params", False)
    assert built["offload_optimizer"] == layout.get("offload_optimizer", False)
    assert built["compute_dtype"] == "float32"
    assert set(ranks[0]["built"]["memory"]["peak_gib"]) >= {"load", "logprobs", "train"}


def _resume_rank_main(
    rank: int, world: int, port: int, model_dir: str, out: str, reload: bool, layout: dict, lora: dict | None
) -> None:
    torch.set_num_threads(1)
    from rlc.runtime.train.trainer import TrainerWorker
    from rlc.schemas.layout import TrainLayout

    if lora:
        _random_lora_init()
    lay = TrainLayout(micro_batch_tokens=BUDGET, **layout)
    cfg = {"lr": LR, "logprob_chunk_tokens": 7, "lora": lora}
    w = TrainerWorker(rank, world, "127.0.0.1", port, model_dir, "cpu", cfg, lay)
    batch = _batch()
    stats = []
    for step in range(2):
        lp = [row or [0.0] * len(s) for row, s in zip(w.compute_logprobs(batch), batch["input_ids"], strict=True)]
        stats.append(w.train_step({**batch, "behaviour_logprobs": lp}, {"clip": 0.2}))
        if step == 0 and reload:
            w.save_checkpoint(f"{out}/ckpt")
            w.load_checkpoint(f"{out}/ckpt")
    torch.save({"stats": stats, "weights": w.full_state_dict()}, f"{out}/rank{rank}.pt")
    leave_together(w)


#: (model fixture, layout, lora): MoE stages, and LoRA stages over TP ranks (whose slices of the same adapters share
#: their stage's optimizer folder, the replicated factors too).
RESUMES = {
    "moe-pp2": ("tiny_moe_model_dir", {"world_size": 2, "pp": 2}, None),
    "lora-pp2-tp2": ("tiny_model_dir", {"world_size": 4, "pp": 2, "tp": 2}, LORA),
}


@pytest.mark.parametrize("name", list(RESUMES))
def test_pipeline_stages_resume_from_a_checkpoint_exactly(
    name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Each stage saves its own optimizer state: saving and loading between two steps changes nothing."""
    import torch.multiprocessing as mp

    fixture, layout, lora = RESUMES[name]
    model_dir = str(request.getfixturevalue(fixture))
    world = layout["world_size"]
    runs = {}
    for reload in (False, True):
        out = tmp_path / str(reload)
        out.mkdir()
        args = (world, free_port(), model_dir, str(out), reload, layout, lora)
        mp.spawn(_resume_rank_main, args=args, nprocs=world)
        runs[reload] = torch.load(out / "rank0.pt", weights_only=False)
    assert runs[True]["stats"][1]["loss"] == pytest.approx(runs[False]["stats"][1]["loss"], rel=1e-6)
    assert runs[True]["stats"][1]["grad_norm"] == pytest.approx(runs[False]["stats"][1]["grad_norm"], rel=1e-6)
    for key, value in runs[False]["weights"].items():
        assert torch.allclose(runs[True]["weights"][key], value, atol=1e-7), key


def _share_rank_main(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from rlc.runtime.train.weights_out import _share_from_rank0

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    weights = {"w": torch.arange(6.0), "b": torch.ones(2, 3, dtype=torch.bfloat16)} if rank == 0 else None
    meta = {"w": ((6,), "float32"), "b": ((2, 3), "bfloat16")}  # the trainer's merged stage metadata
    got = _share_from_rank0(weights, keep=rank != 1, rank=rank, meta=meta, device=torch.device("cpu"))
    torch.save(got, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_pipeline_weights_reach_every_rank_that_keeps_a_copy(tmp_path: Path) -> None:
    """Colocated runs write the weights on each node's leader: under PP rank 0 merges the stages and sends the whole
    to every other keeper (here rank 2), and a rank that keeps none gets nothing."""
    import torch.multiprocessing as mp

    mp.spawn(_share_rank_main, args=(3, free_port(), str(tmp_path)), nprocs=3)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(3)]
    assert got[1] is None
    assert all(torch.equal(g["w"], torch.arange(6.0)) for g in (got[0], got[2]))
    assert got[2]["b"].dtype == torch.bfloat16 and torch.equal(got[2]["b"], torch.ones(2, 3, dtype=torch.bfloat16))
