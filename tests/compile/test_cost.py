"""Time model: roofline regimes, speculative decoding, pipeline bubble and step composition."""

from __future__ import annotations

import dataclasses

import pytest

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
    t1 = cost.train_time(SIZES, TrainLayout(world_size=8, backend="megatron", pp=1, micro_batch_tokens=8192), A2, w, 8)
    t4 = cost.train_time(SIZES, TrainLayout(world_size=8, backend="megatron", pp=4, micro_batch_tokens=8192), A2, w, 8)
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


def test_engine_feed_is_what_the_plan_tells_the_controller() -> None:
    """The cost model's per-engine concurrency is the feed the plan prescribes and the controller obeys: one
    group per request, streamed, up to twice max_num_seqs sequences held per engine."""
    import inspect

    from rlc.runtime.workflows import generate

    source = inspect.getsource(generate)
    assert "self.chunk_prompts = sched.rollout_chunk_prompts" in source
    assert "self.chunks_per_engine = sched.rollout_chunks_per_engine" in source
    assert cost.STREAM_REQUEST_PROMPTS == 1
    assert cost.engine_inflight_requests(1024, 8) == 256
    assert cost.engine_inflight_requests(90, 8) == 23
    assert cost.engine_inflight_requests(1, 16) == 1


def test_concurrency_is_an_engines_share_capped_by_its_slots() -> None:
    """A synchronous step admits the batch at once: one TP 8 engine holds the whole batch in flight and eight
    TP 1 engines an eighth each; vLLM's max_num_seqs caps either."""
    work = _work(max_response_len=8192, max_prompt_len=2048, staleness=0)
    wide = cost.rollout_time(SIZES, RolloutLayout(8, tp=8), A2, work, 8, 1024)
    narrow = cost.rollout_time(SIZES, RolloutLayout(8, tp=1), A2, work, 8, 90)
    capped = cost.rollout_time(SIZES, RolloutLayout(8, tp=8), A2, work, 8, 256)
    assert wide.concurrency == 512
    assert narrow.concurrency == 64 and 8 * narrow.concurrency == wide.concurrency
    assert capped.concurrency == 256


def test_continuous_batching_refills_slots() -> None:
    """64 samples per engine on 54 slots take 64/54 mean-length passes; whole waves would make them cost as
    much as 108 samples (two waves either way)."""
    layout = RolloutLayout(8, tp=1)
    few = _work(max_response_len=8192, max_prompt_len=2048, batch_prompts=64)
    many = _work(max_response_len=8192, max_prompt_len=2048, batch_prompts=108)
    t_few = cost.rollout_time(SIZES, layout, A2, few, 8, 54)
    t_many = cost.rollout_time(SIZES, layout, A2, many, 8, 54)
    assert t_few.concurrency == t_many.concurrency == 54
    one_pass = few.response_tokens * t_few.step_s
    gap = (t_many.sync_s - t_many.prefill_s) - (t_few.sync_s - t_few.prefill_s)
    assert abs(gap - (108 - 64) / 54 * one_pass) / one_pass < 0.01


def test_inflight_context_is_prompt_plus_half_response() -> None:
    work = _work(max_prompt_len=2048, max_response_len=8192)
    assert work.inflight_context == 1024 + 2048
    assert work.inflight_context < work.context_tokens


def test_sampler_and_logit_gather_are_not_split_by_tp() -> None:
    """At a fixed batch, TP 8 shrinks the weight reads 8x but not the sampler's pass over the logits."""
    batch = 256
    t8 = cost.decode_step_s(SIZES, RolloutLayout(8, tp=8), A2, batch, 16, 8)
    hbm = A2.hbm_bandwidth_gbps * 1e9 * A2.efficiency.decode_bandwidth_efficiency
    sampler = batch * SIZES.arch.vocab_size * 4 * cost.SAMPLER_PASSES / hbm
    weights = (SIZES.dense + SIZES.embedding + SIZES.head) / 8 * 2 / hbm
    assert t8 > weights + sampler


def test_data_parallelism_past_one_sample_per_rank_gains_nothing() -> None:
    """A sequence is not split across DP ranks: 512 samples on 1024 ranks take as long as on 512, and 512 on
    384 ranks as long as on 256 (two each on the busiest)."""
    w = _work()  # 64 prompts × 8 = 512 samples

    def compute(world: int) -> float:
        return cost.train_compute_s(SIZES, TrainLayout(world_size=world, micro_batch_tokens=8192), A2, w)

    assert compute(1024) == pytest.approx(compute(512))
    assert compute(384) == pytest.approx(compute(256))
    assert compute(256) == pytest.approx(2 * compute(512))
    assert w.rank_tokens(1024) == w.context_tokens


def test_rollout_past_one_sample_per_rank_gains_nothing() -> None:
    """Prefill is a rank's own prompts, not the pool's share of all of them: more engines than samples idle."""
    w = _work(batch_prompts=4, group_size=2)  # 8 samples
    times = [cost.rollout_time(SIZES, RolloutLayout(n, tp=1), A2, w, 8, 64) for n in (8, 16, 64)]
    assert times[0].sync_s == pytest.approx(times[1].sync_s) == pytest.approx(times[2].sync_s)
    assert times[0].prefill_s == pytest.approx(times[2].prefill_s)


def test_streamed_rollout_has_no_tail_and_pays_its_updates() -> None:
    """Under a staleness bound the controller streams groups, so the engines run up to (s + 1) batches at once and
    a step's slowest samples finish beside the next batches: no long tail, only mean-length passes, plus what
    each weight update costs the running sequences (prefilled again when interrupting, drained when waiting)."""
    base = dataclasses.replace(_work(max_response_len=2048, max_prompt_len=2048, batch_prompts=32), response_tokens=200)
    sync_work = dataclasses.replace(base, staleness=0)
    layout = RolloutLayout(8, tp=1)
    sync = cost.rollout_time(SIZES, layout, A2, sync_work, 8, 1024)
    assert sync.async_s == pytest.approx(sync.sync_s)
    work = dataclasses.replace(base, staleness=2)
    stream = cost.rollout_time(SIZES, layout, A2, work, 8, 1024)
    per_rank = work.samples // 8
    assert stream.concurrency == 3 * per_rank
    passes = per_rank / stream.concurrency * work.response_tokens * stream.step_s + stream.prefill_s
    update = cost.interrupt_s(SIZES, layout, A2, stream.concurrency, work.inflight_context)
    assert stream.async_s == pytest.approx(passes + update)
    assert stream.async_s < sync.sync_s
    waiting = cost.rollout_time(SIZES, layout, A2, dataclasses.replace(work, interrupt=False), 8, 1024)
    assert waiting.async_s > passes


def test_minibatches_pay_their_own_pipeline_fills_updates_and_proximal_pass() -> None:
    """Four optimizer steps per batch: the pipeline fills and drains four times over a quarter of the
    micro-batches each (Megatron's gradient reduce-scatter and parameter all-gather, and offloaded moments,
    four times), and the decoupled loss adds one forward pass for the proximal log-probs; without the decoupled
    loss there is no proximal pass."""
    layout = TrainLayout(world_size=16, backend="megatron", pp=4, micro_batch_tokens=8192, offload_optimizer=True)
    one, four = _work(), _work(minibatches=4)
    t1, t4 = (cost.train_time(SIZES, layout, A2, w, 8) for w in (one, four))
    micro = max(1, -(-one.rank_tokens(layout.dp) // layout.micro_batch_tokens))
    assert t1.bubble == pytest.approx(3 / (micro + 3))
    assert t4.bubble == pytest.approx(3 / (-(-micro // 4) + 3))
    assert t4.dp_s > t1.dp_s and t4.offload_s == pytest.approx(4 * t1.offload_s)
    fwd = cost.train_flops(SIZES, one, "none") / 3
    assert cost.train_flops(SIZES, four, "none") == pytest.approx(4 * fwd)
    assert four.proximal_forwards == 1 and _work(minibatches=4, decoupled=False).proximal_forwards == 0
    assert cost.train_flops(SIZES, _work(minibatches=4, decoupled=False), "none") == pytest.approx(3 * fwd)
    assert t4.total_s > t1.total_s


def test_a_minibatch_is_shared_by_the_data_parallel_ranks() -> None:
    """512 samples in 4 minibatches of 128: 256 ranks take one sample of each (4 in all), and 512 ranks gain
    nothing over 128, since each optimizer step has only 128 samples to spread."""
    w = _work(minibatches=4)
    assert w.rank_tokens(256) == pytest.approx(4 * w.context_tokens)
    assert w.rank_tokens(512) == w.rank_tokens(128) == pytest.approx(4 * w.context_tokens)
    assert _work().rank_tokens(512) == pytest.approx(w.context_tokens)


def test_hybrid_training_runs_at_the_targets_linear_attention_share_of_train_mfu() -> None:
    """On cpu the Gated-DeltaNet layers run torch's kernels: a hybrid trains at 0.15 of the dense efficiency
    (fitted on examples/cpu-hybrid-mtp.yaml); accelerator profiles assume fla's kernels keep the dense one."""
    cpu, a3 = load_target("cpu"), load_target("a3")
    hybrid, dense = memory.model_sizes(load_arch("rlc-tiny-hybrid-mtp")), memory.model_sizes(load_arch("rlc-tiny"))
    assert cost.train_mfu(hybrid, cpu) == pytest.approx(0.15 * cost.train_mfu(dense, cpu))
    assert cost.train_mfu(memory.model_sizes(load_arch("qwen3.6-27b")), a3) == a3.efficiency.train_mfu


def test_tensor_parallel_ranks_each_compute_the_latent_down_projections() -> None:
    """DeepSeek-V3 on FSDP2 with TP 4: every TP rank computes the down-projections TP keeps whole, so their share
    of the FLOPs is done 4 times; a dense model's compute does not change with TP."""
    ds, w = memory.model_sizes(load_arch("deepseek-v3")), _work()
    flat = cost.train_compute_s(ds, TrainLayout(world_size=256, tp=4, ep=64), A2, w)
    tp4 = cost.train_time(ds, TrainLayout(world_size=256, tp=4, ep=64), A2, w, 8)
    assert tp4.compute_s == pytest.approx(flat * (1 + 3 * ds.tp_whole / ds.active))
    assert 0.01 < ds.tp_whole / ds.active < 0.05  # about 2.5% of DeepSeek-V3's active parameters
    one = cost.train_time(ds, TrainLayout(world_size=256, ep=64), A2, w, 8)
    assert one.compute_s == pytest.approx(flat)
    dense = cost.train_time(SIZES, TrainLayout(world_size=8, tp=4), A2, w, 8)
    assert dense.compute_s == pytest.approx(cost.train_compute_s(SIZES, TrainLayout(world_size=8, tp=4), A2, w))
