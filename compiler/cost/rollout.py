"""Rollout time: the decode-step roofline, the streamed feed (engines held full, no long tail), interrupts and agent
episodes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import ceil

from rlc.compiler.cost.links import COLLECTIVE_LATENCY_S, collective_s, ep_width_bandwidth, link_gbps, nodes_spanned
from rlc.compiler.cost.overheads import (
    HOST_OVERLAPS_DEVICE,
    agent_call_overhead_s,
    decode_sequence_overhead_s,
    decode_step_overhead_s,
    eager_launch_s,
)
from rlc.compiler.cost.workload import AgentWork, Workload, accepted_tokens_per_step, expected_longest_response
from rlc.compiler.memory import ModelSizes, RolloutLayout, dtype_bytes, kv_bytes_per_token_device
from rlc.schemas.arch import ModelArch
from rlc.schemas.target import TargetProfile

__all__ = [
    "SAMPLER_PASSES",
    "STREAM_OVERFILL",
    "STREAM_REQUEST_PROMPTS",
    "TAIL_CONCURRENCY_FRACTION",
    "RolloutTime",
    "agent_rollout_s",
    "decode_attention_flops",
    "decode_step_s",
    "decoding_share",
    "engine_inflight_requests",
    "interrupt_s",
    "rollout_time",
]

#: Passes over the fp32 [tokens × vocab] logits per decode step in vLLM's sampler: write the upcast logits,
#: log-softmax read + write (RL asks for the sampled tokens' log-probs), read for sampling. vLLM gathers the
#: vocab-parallel logits and every TP rank runs the sampler on the whole batch (V1 model runner), so this work
#: is per engine, not split by TP.
SAMPLER_PASSES = 4
#: How the controller feeds engines (plan.schedule.rollout_chunk_prompts / rollout_chunks_per_engine, which the
#: planner sets from `STREAM_REQUEST_PROMPTS` and `engine_inflight_requests` and the controller obeys): one prompt's
#: group per generate request, streamed: the engine (vLLM's async engine) runs every request it holds at once, and
#: the controller admits the next group as soon as one finishes, within the staleness bound. Each engine holds up
#: to `STREAM_OVERFILL` × max_num_seqs sequences, so the scheduler's waiting queue refills the slot of every sample
#: that ends before its group does, without a round trip to the controller.
STREAM_REQUEST_PROMPTS = 1


STREAM_OVERFILL = 2
#: Concurrency left in the long tail of a synchronous rollout, as a fraction of the full batch: the last
#: sequences to finish decode almost alone (bandwidth-bound steps at tiny batch).
TAIL_CONCURRENCY_FRACTION = 0.125


@dataclass(frozen=True)
class RolloutTime:
    """Rollout seconds per step: synchronous (the batch waits for its longest sequence) and asynchronous (streamed
    under the staleness bound, no tail); the decode step and concurrency of the one the plan runs."""

    sync_s: float
    async_s: float
    prefill_s: float
    step_s: float
    concurrency: int
    tokens_per_s: float
    #: One trajectory's sequential critical path (agent turns, their tool waits and the batch's tail, prefill
    #: included): what staleness can spread over s + 1 steps but not hide (`step.step_time`); 0 for single-turn.
    chain_s: float = 0.0


def decode_step_s(
    sizes: ModelSizes,
    layout: RolloutLayout,
    target: TargetProfile,
    batch: int,
    context: float,
    devices_per_node: int,
    draft_tokens: int = 0,
    draft_layers: int = 0,
) -> float:
    """Time of one decode step for `batch` sequences per attention rank at mean `context`.

    Roofline (Williams et al. 2009; the standard LLM-inference analysis): max(bytes read / (HBM bw ·
    decode efficiency), FLOPs / (peak · prefill MFU)). Bytes = weights on the device (for MoE only the experts
    the step's tokens touch: E_local·(1 − (1 − k/E)^tokens)) + the KV of every sequence; FLOPs = 2 · active
    params per token / t, plus attention 4·n_q·d_h·context per full layer. Verification of k draft tokens
    multiplies the FLOPs by k + 1; an MTP drafter reads its layer k more times. TP adds two all-reduces per
    layer, EP two all-to-alls per MoE layer (at `ep_width_bandwidth` of the link when the group spans several
    nodes); a fixed engine overhead covers scheduling and launches, and the engine's host work per sequence
    (`decode_sequence_overhead_s` × the attention rank's tokens: each rank runs its own scheduler) runs
    beside the device's step on accelerators (max of the two) and after it on cpu.

    What TP does not split is charged per engine: the vocab-parallel logits are all-gathered
    ((t−1)/t · tokens · V · bytes) and every rank samples the whole batch (SAMPLER_PASSES over fp32 logits).
    Small next to the weights at TP 1, they are what a wide engine pays for batching every sequence at once.
    An eager engine (`layout.eager`) takes at least `eager_launch_s`, its host's kernel launches.
    """
    arch = sizes.arch
    b = dtype_bytes(target)
    tokens_step = batch * (draft_tokens + 1)
    engine_tokens = tokens_step * layout.attention_dp
    dense_bytes = (sizes.dense + sizes.embedding + sizes.head) / layout.tp * b
    expert_bytes = 0.0
    if arch.moe is not None:
        shards = layout.ep if layout.ep > 1 else layout.tp
        touched = 1 - (1 - arch.moe.experts_per_token / arch.moe.num_experts) ** engine_tokens
        expert_bytes = sizes.expert / shards * b * touched
    kv = kv_bytes_per_token_device(arch, layout.tp, b) * context * batch
    draft = draft_tokens * draft_layers * (sizes.max_layer / layout.tp) * b
    read = dense_bytes + expert_bytes + kv + draft
    active_dense = sizes.active - sizes.active_expert
    flops = 2 * active_dense / layout.tp * tokens_step
    flops += 2 * sizes.active_expert * engine_tokens / layout.engine_devices
    full_layers = sizes.full_attention_layers
    flops += decode_attention_flops(arch) * full_layers * context * tokens_step / layout.tp
    hbm = target.hbm_bandwidth_gbps * 1e9 * target.efficiency.decode_bandwidth_efficiency
    t = max(read / hbm, flops / (target.bf16_tflops * 1e12 * target.efficiency.prefill_mfu))
    t += tokens_step * arch.vocab_size * 4 * SAMPLER_PASSES / hbm
    if layout.tp > 1:
        volume = tokens_step * arch.hidden_size * b * 2 * (layout.tp - 1) / layout.tp
        link = link_gbps(target, layout.tp, devices_per_node)  # a pinned TP across nodes uses the scale-out link
        nodes = nodes_spanned(layout.tp, devices_per_node)
        t += collective_s(target, 2 * arch.num_layers * volume, link, 2 * arch.num_layers, nodes)
        logits = tokens_step * arch.vocab_size * b * (layout.tp - 1) / layout.tp
        t += collective_s(target, logits, link, nodes=nodes)
    if arch.moe is not None and layout.ep > 1:
        moe_layers = arch.num_layers - arch.moe.first_dense_layers
        volume = tokens_step * arch.moe.experts_per_token * arch.hidden_size * b * (layout.ep - 1) / layout.ep
        ep_nodes = nodes_spanned(layout.ep, devices_per_node)
        link = link_gbps(target, layout.ep, devices_per_node) * ep_width_bandwidth(ep_nodes)
        t += collective_s(target, 2 * moe_layers * volume, link, 2 * moe_layers, ep_nodes)
    if layout.eager:
        t = max(t, eager_launch_s(sizes, target))
    if layout.tp > 1:
        # A multi-worker engine hands every step to its workers and collects the result: two more exchanges.
        t += 2 * COLLECTIVE_LATENCY_S[target.kind]
    host = tokens_step * decode_sequence_overhead_s(target)  # each attention-DP rank schedules its own batch
    # Per-sequence host work beside the device's step (accelerators) or after it (cpu): HOST_OVERLAPS_DEVICE.
    t = max(t, host) if HOST_OVERLAPS_DEVICE[target.kind] else t + host
    return t + decode_step_overhead_s(target)


def decode_attention_flops(arch: ModelArch) -> float:
    """Attention FLOPs of one decode token per cached token per layer.

    Multi-head attention: QKᵀ and PV, 2 · 2 · n_q · d_h. MLA decodes in its absorbed form (DeepSeek-V2 report
    §2.1.2: W_UK folds into the query and W_UV into the output, so attention runs over the cached latent; vLLM's
    MLA backends and FlashMLA decode this way): every head scores against the kv_lora_rank + rope latent and
    sums kv_lora_rank-wide values, 2 · n_q · (2 · kv_lora_rank + d_rope), 2.8x the MHA figure for DeepSeek-V3.
    """
    a = arch.attention
    if a.kind == "mla" and a.kv_lora_rank and a.qk_rope_head_dim:
        return 2 * arch.num_attention_heads * (2 * a.kv_lora_rank + a.qk_rope_head_dim)
    return 4 * arch.num_attention_heads * arch.head_dim


def engine_inflight_requests(max_num_seqs: int, group_size: int, attention_dp: int = 1) -> int:
    """Generate requests (one prompt's group each) the controller keeps in flight on one engine: enough for
    STREAM_OVERFILL × max_num_seqs sequences on each of its attention-DP ranks (each runs its own scheduler with
    max_num_seqs slots); the staleness bound may admit fewer."""
    seqs = STREAM_OVERFILL * max(1, max_num_seqs) * max(1, attention_dp)
    return max(1, -(-seqs // max(1, group_size)))


def interrupt_s(sizes: ModelSizes, layout: RolloutLayout, target: TargetProfile, c: int, context: float) -> float:
    """Seconds one interrupting weight update costs a rollout rank: its c running sequences are prefilled again
    under the new weights, 2 · active params · c · context FLOPs on the rank's devices at prefill MFU (Kaplan et
    al. 2020 forward FLOPs), one engine step per sequence besides."""
    devices = layout.engine_devices / layout.attention_dp
    flops = 2 * sizes.active * c * context
    return flops / (
        devices * target.bf16_tflops * 1e12 * target.efficiency.prefill_mfu
    ) + c * decode_sequence_overhead_s(target)


def rollout_time(
    sizes: ModelSizes,
    layout: RolloutLayout,
    target: TargetProfile,
    work: Workload,
    devices_per_node: int,
    max_seqs: int,
) -> RolloutTime:
    """Seconds to generate one step's samples on this rollout pool.

    Samples spread evenly over the pool's attention ranks (replicas × attention-DP). The controller streams one
    group per request and keeps each engine holding up to `engine_inflight_requests` of them, so a rank runs c
    sequences at once, each holding on average `inflight_context` tokens of KV:
      synchronous (staleness 0; colocated): the batch is admitted at once, c = min(max_num_seqs, the rank's
        samples). Continuous batching refills a slot as soon as a sequence finishes, so the rank's samples take
        samples / c mean-length passes (fractional: 64 samples on 54 slots cost 1.19 passes, not 2 whole waves),
        then the batch's long tail (its expected longest response, `expected_longest_response`, less the mean)
        decodes at 1/8 concurrency.
      asynchronous (staleness s > 0): the bound admits up to s + 1 batches ahead, c = min(max_num_seqs,
        (s + 1) × the rank's samples), and there is no tail: a step's slowest samples finish while the next
        batches decode beside them (AReaL, Fu et al. 2025, §4). Each weight update lands with c sequences
        running: interrupting prefills them again under the new weights (`interrupt_s`); waiting drains them
        first, the tail of the longest of c running samples (their remaining lengths are exponential with the
        same mean: memoryless).
    Prefill: 2 · active params · a rank's prompt tokens / (its devices · peak · prefill MFU) (Kaplan et al. 2020
    forward FLOPs), plus one engine step per sequence. With dynamic sampling the engines generate
    `generated_samples` (the trained ones times the expected over-sampling) for each step.
    """
    ranks = layout.replicas * layout.attention_dp
    generated = work.generated_samples
    per_rank = ceil(generated / ranks)
    requests = engine_inflight_requests(max_seqs, work.group_size, layout.attention_dp)
    fed = ceil(requests * work.group_size / layout.attention_dp)
    c_sync = max(1, min(max_seqs, per_rank, fed))
    c_async = max(1, min(max_seqs, (work.staleness + 1) * per_rank, fed))
    ctx = work.inflight_context
    tau = accepted_tokens_per_step(work.mtp_tokens, work.mtp_acceptance)

    def step_at(c: int, context: float) -> float:
        return decode_step_s(
            sizes, layout, target, c, context, devices_per_node, work.mtp_tokens, work.mtp_draft_layers
        )

    step = step_at(c_sync, ctx)
    tail_step = step_at(max(1, int(c_sync * TAIL_CONCURRENCY_FRACTION)), work.prompt_tokens + work.response_tokens)
    prefill = _prefill_s(sizes, layout, target, work, per_rank)
    if work.agent is not None:
        return _agent_time(work, layout, target, per_rank, c_sync, step, tail_step, tau, prefill, step_at)
    longest = expected_longest_response(work.response_tokens, work.max_response, generated)
    tail = max(0.0, longest - work.response_tokens) / tau * tail_step
    mean_steps = work.response_tokens / tau
    sync = per_rank / c_sync * mean_steps * step + tail + prefill
    if work.staleness == 0:
        return RolloutTime(sync, sync, prefill, step, c_sync, generated * work.response_tokens / sync)
    async_step = step_at(c_async, ctx)
    update = _update_s(sizes, layout, target, work, c_async, tau, step_at)
    stream = per_rank / c_async * mean_steps * async_step + update + prefill
    return RolloutTime(sync, stream, prefill, async_step, c_async, generated * work.response_tokens / stream)


def _prefill_s(sizes: ModelSizes, layout: RolloutLayout, target: TargetProfile, work: Workload, per_rank: int) -> float:
    """Each attention rank prefills its own samples on its share of the engine's devices, one engine step per
    sequence besides."""
    rank_devices = layout.engine_devices / layout.attention_dp
    prefill_flops = 2 * sizes.active * per_rank * work.prompt_tokens
    prefill = prefill_flops / (rank_devices * target.bf16_tflops * 1e12 * target.efficiency.prefill_mfu)
    return prefill + per_rank * decode_sequence_overhead_s(target)


def _update_s(
    sizes: ModelSizes,
    layout: RolloutLayout,
    target: TargetProfile,
    work: Workload,
    c_async: int,
    tau: float,
    step_at: Callable[[int, float], float],
) -> float:
    """What a weight update costs the stream: prefilling the c running sequences again (interrupt), or draining
    them first (wait)."""
    if work.interrupt:
        return interrupt_s(sizes, layout, target, c_async, work.inflight_context)
    drain_c = max(1, int(c_async * TAIL_CONCURRENCY_FRACTION))
    drain = expected_longest_response(work.response_tokens, work.max_response, c_async) - work.response_tokens
    return max(0.0, drain) / tau * step_at(drain_c, work.prompt_tokens + work.response_tokens)


def _agent_time(
    work: Workload,
    layout: RolloutLayout,
    target: TargetProfile,
    per_rank: int,
    c_sync: int,
    step: float,
    tail_step: float,
    tau: float,
    prefill: float,
    step_at: Callable[[int, float], float],
) -> RolloutTime:
    """Agent episodes. Asynchronous: the controller keeps up to staleness + 1 batches of trajectories in flight
    (agent_plan sizes the engines' in-flight work to it), so one batch's tool waits and tail overlap the next
    batches' calls; a batch still needs its engine's own work. A trajectory waiting for its tool holds no decode
    slot, so of the rank's (s + 1) × share trajectories only the share of their time spent decoding
    (`decoding_share`) decodes at once: with slow tools the engine runs below c and its work takes longer."""
    agent = work.agent
    assert agent is not None
    engine_share = ceil(work.samples / layout.replicas)
    busy, chain = agent_rollout_s(agent, per_rank, engine_share, work.samples, c_sync, step, tail_step, tau, target)
    sync_s = chain + prefill
    admitted = (work.staleness + 1) * per_rank * decoding_share(agent, step, tau)
    c_agent = max(1, min(c_sync, int(admitted)))
    if c_agent < c_sync:
        agent_step = step_at(c_agent, work.inflight_context)
        busy, _ = agent_rollout_s(
            agent, per_rank, engine_share, work.samples, c_agent, agent_step, tail_step, tau, target
        )
    async_s = max(busy + prefill, sync_s / (work.staleness + 1))
    agent_tokens = work.samples * agent.turns * agent.turn_tokens
    return RolloutTime(sync_s, async_s, prefill, step, c_sync, agent_tokens / async_s, chain_s=sync_s)


def decoding_share(agent: AgentWork, step: float, tau: float) -> float:
    """The share of a trajectory's time spent decoding: its turns' decode time over that plus the tool waits
    between them (turns − 1 of them); the rest it holds no decode slot."""
    decode = agent.turns * agent.turn_tokens / tau * step
    tools = max(0.0, agent.turns - 1) * agent.tool_s
    return decode / (decode + tools) if decode + tools > 0 else 1.0


def agent_rollout_s(
    agent: AgentWork,
    rank_share: int,
    engine_share: int,
    samples: int,
    c: int,
    step: float,
    tail_step: float,
    tau: float,
    target: TargetProfile,
) -> tuple[float, float]:
    """Seconds of an engine's work for its share of a step's agent trajectories, and of the batch's critical path
    (a synchronous step's rollout), prefill of the prompts aside.

    At staleness 0 the controller starts a batch's trajectories together, and they take `turns` rounds:
      decode  every trajectory's call: rank_share / c passes of a mean turn at concurrency c, and from the second
              call on its prefill of what came since (one engine step per sequence, `decode_sequence_overhead_s`;
              the first call's is the prompts' prefill);
      host    engine_share × `agent_call_overhead_s`: each call's endpoint and client work, one call at a time;
      tools   `tool_s` between two calls (turns − 1 of them): the environments answer every trajectory at once.
    Then the batch waits for its slowest trajectory, decoding at tail concurrency. One turn's expected excess of
    the slowest of the batch's trajectories over the mean is e1 (`expected_longest_response`, capped at the turn's
    limit); a trajectory sums `turns` of them, and the excess of a maximum grows with the spread of what is
    maximised, which for a sum of T independent turns is √T times one turn's: √T · e1 (exact at T = 1; a
    heuristic beyond, at most T · e1, every turn at its cap). A tool call that overlaps other trajectories'
    decoding (shares wider than c) is not credited: such a share is priced a little high.
    The engine's own work is the decode and host parts without the tool waits and the tail.
    """
    waves = rank_share / c
    per_call = waves * agent.turn_tokens / tau * step + engine_share * agent_call_overhead_s(target)
    later = max(0.0, agent.turns - 1)  # calls after the first, whose prefill the prompts' prefill does not cover
    busy = agent.turns * per_call + later * rank_share * decode_sequence_overhead_s(target)
    excess = expected_longest_response(agent.turn_tokens, agent.max_turn_tokens, samples) - agent.turn_tokens
    tail = agent.turns**0.5 * max(0.0, excess) / tau * tail_step
    return busy, busy + later * agent.tool_s + tail
