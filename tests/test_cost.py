"""Time model: roofline regimes, speculative decoding, pipeline bubble and step composition."""

from __future__ import annotations

from rlc.compiler import cost, memory
from rlc.compiler.memory import RolloutLayout, TrainLayout
from rlc.schemas.registry import load_arch, load_target

A2 = load_target("a2")
SIZES = memory.model_sizes(load_arch("qwen3-8b"))


def _work(**kw):  # type: ignore[no-untyped-def]
    base = dict(
        batch_prompts=64,
        group_size=8,
        max_prompt_len=1024,
        max_response_len=4096,
        staleness=2,
        decoupled=True,
        reference=False,
        lora=False,
    )
    base.update(kw)
    return cost.workload(**base)


def test_accepted_tokens_formula() -> None:
    assert cost.accepted_tokens_per_step(0, 0.7) == 1.0
    assert abs(cost.accepted_tokens_per_step(1, 0.7) - 1.7) < 1e-9
    assert abs(cost.accepted_tokens_per_step(3, 0.5) - 1.875) < 1e-9


def test_decode_is_bandwidth_bound_small_batch_compute_bound_large() -> None:
    layout = RolloutLayout(1, tp=1)
    one = cost.decode_step_s(SIZES, layout, A2, 1, 1024, 8)
    weights_s = SIZES.total * 2 / (A2.hbm_bandwidth_gbps * 1e9 * A2.efficiency.decode_bandwidth_efficiency)
    assert abs(one - weights_s) / weights_s < 0.3
    big = cost.decode_step_s(SIZES, layout, A2, 4096, 16, 8)
    assert big / 4096 < one  # batching amortises the weight reads
    assert big > one * 2  # but a huge batch turns compute-bound


def test_response_fraction_and_trained_tokens() -> None:
    w = _work()
    assert w.response_tokens == 4096 * cost.RESPONSE_FRACTION
    assert w.trained_tokens == 512 * (512 + 2048)


def test_pp_bubble_and_lora_flops() -> None:
    w = _work()
    t1 = cost.train_time(SIZES, TrainLayout(8, "megatron", pp=1, micro_batch_tokens=8192), A2, w, 8)
    t4 = cost.train_time(SIZES, TrainLayout(8, "megatron", pp=4, micro_batch_tokens=8192), A2, w, 8)
    assert t1.bubble == 0 and 0 < t4.bubble < 0.2
    assert cost.train_flops(SIZES, _work(lora=True), "none") < cost.train_flops(SIZES, w, "none")
    assert cost.train_flops(SIZES, w, "full") > cost.train_flops(SIZES, w, "none")


def test_step_composition() -> None:
    w = _work()
    r = cost.RolloutTime(sync_s=100, async_s=80, prefill_s=1, step_s=0.05, concurrency=64, tokens_per_s=1)
    dis = cost.step_time("disaggregated", w, r, 50, 0, 2, 0)
    assert dis.step_s == 82
    sync = cost.step_time("disaggregated", _work(staleness=0), r, 50, 0, 2, 0)
    assert sync.step_s == 152
    col = cost.step_time("colocated", w, r, 50, 0, 2, 3)
    assert col.step_s == 155 and col.switch_s == 3


def test_weight_sync_methods() -> None:
    inplace = cost.weight_sync_s(SIZES, A2, "inplace", cross_node=False)
    cross = cost.weight_sync_s(SIZES, A2, "broadcast", cross_node=True)
    disk = cost.weight_sync_s(SIZES, A2, "disk", cross_node=True)
    assert inplace < cross < disk
    assert cost.weight_sync_s(SIZES, A2, "broadcast", cross_node=True, adapter_params=10**6) < 0.01
