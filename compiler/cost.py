"""Time model: seconds per RL step for a layout, split into rollout, training, weight sync and switch.

The planner ranks layouts by trained tokens per second, so the model only has to order layouts correctly
and land in the right range; it is a roofline (max of bytes over bandwidth and FLOPs over peak, each scaled by
the target's measured efficiency) plus explicit communication terms. Every formula names its source; the
fixed assumptions (response length, overlap, latencies) are module constants with a stated reason.
Pure functions only.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil, log, log2

from rlc.compiler.memory import (
    ModelSizes,
    RolloutLayout,
    TrainLayout,
    dtype_bytes,
    kv_bytes_per_token_device,
    rollout_weights_bytes,
)
from rlc.schemas.arch import ModelArch
from rlc.schemas.target import TargetProfile

#: Mean response length as a fraction of max_response_len. RL responses are long-tailed: most finish well
#: before the cap while a few hit it (AReaL, StreamRL report means around half the cap on math tasks).
RESPONSE_FRACTION = 0.5
#: Mean model calls of an agent trajectory as a fraction of max_turns when the spec does not state
#: `expected_turns`: the cap is set for the longest episode, as the length caps are.
TURNS_FRACTION = 0.5
#: Mean prompt length as a fraction of max_prompt_len (the cap is set for the longest prompt).
PROMPT_FRACTION = 0.5
#: Latency of one small collective (ring start-up), seconds. HCCL small-message all-reduce on A2 measures in
#: the tens of microseconds (research notes §1.3: 18 GB/s bus bandwidth for a 2-NPU all-reduce); NCCL ~10 µs.
#: cpu: measured 0.72 ms, the median gloo all-reduce of 16 KB between two processes on a two-core machine.
COLLECTIVE_LATENCY_S = {"npu": 30e-6, "gpu": 10e-6, "cpu": 720e-6}
#: Latency one scale-out hop adds to a collective whose group spans nodes, seconds. NCCL's own cost model
#: (src/graph/tuning.cc, hwLat[NET][Tree][LL] = 5 µs) prices a tree all-reduce at
#: baseLat + 2 · (intra-node hops · intra latency + log2(nodes) · network latency): a group over n nodes pays
#: 2 · log2(n) network hops on top of its in-node latency. HCCL over RoCE has no published figure; the same RDMA
#: hop is assumed. cpu: 0 (the cpu target is one host).
NET_HOP_LATENCY_S = {"npu": 5e-6, "gpu": 5e-6, "cpu": 0.0}
#: Achieved all-to-all bandwidth of an expert-parallel group that spans n nodes, as a fraction of what a group
#: over two nodes achieves. Each rank's tokens split into smaller messages to more peers as the group widens,
#: so per-message costs and incast take a growing share: DeepEP's published low-latency kernels (deepseek-ai/DeepEP
#: README, H800 with one CX7 400 Gb/s InfiniBand NIC per GPU, 128 tokens, hidden 7168, top-8) reach per-rank RDMA
#: bandwidths, mean of dispatch and combine, of 68.5 GB/s at EP 16 (2 nodes), 50.5 at EP 32, 44.5 at EP 64, 39 at
#: EP 128 and 39.5 at EP 256: the ratios below. A group inside one node uses the intra-node link and no entry; a
#: group between two listed widths takes the wider one's entry, one wider than the table the last. HCCL's
#: all-to-all over RoCE has no published width series; the same shape is assumed.
EP_WIDTH_BANDWIDTH = {2: 1.0, 4: 0.74, 8: 0.65, 16: 0.57, 32: 0.58}
#: Fixed per-decode-step cost of the engine (scheduler, sampling, kernel launches in eager mode), seconds.
#: cpu: measured 4 ms (the quickstart engine generating 4 tokens for 8 sequences, less their sequence cost).
DECODE_STEP_OVERHEAD_S = {"npu": 4e-3, "gpu": 2e-3, "cpu": 4e-3}
#: Host time to launch one decoder layer's kernels in an eager engine (vLLM enforce_eager, no graph capture),
#: seconds, for a dense and for an MoE layer. Launches run ahead of the device on an asynchronous queue, so an
#: eager decode step takes max(device time, layers × launch time): small models at small batches are host-bound.
#: npu, MoE: 1.86 ms, the published eager − graph difference of vllm-ascend issue 7723 (Qwen3-Coder-480B-A35B
#: W8A8, 62 layers, one request: 171 ms eager vs 55.6 ms FULL_DECODE_ONLY TPOT). gpu, dense: 0.34 ms, the
#: published difference of vllm-omni issue 7960 (Qwen2.5-Omni-7B thinker on A800, 28 layers: ~22.5 ms eager vs
#: ~13 ms CUDA-graph TPOT). npu, dense: 1.11 ms, a floor from verl issue 6747 (Qwen2.5-0.5B GRPO on one 910B,
#: verl 0.7.1 with vllm-ascend in its default graph mode, 16 samples capped at 1,024 response tokens: 31.27 s
#: of generation, so at least 31.27 s / 1,024 = 30.5 ms per decode step; less DECODE_STEP_OVERHEAD_S over its
#: 24 layers). An eager engine launches at least what a piecewise graph engine launches, so its per-layer host
#: time is no lower. [estimate] gpu MoE scales by kernels per layer: a dense vLLM decoder layer launches ~12
#: (two norms, QKV, rotary, cache write, attention, O, gate-up, activation, down, two TP all-reduces), a
#: quantised MoE layer ~33 (router, top-k, token permutation, grouped GEMMs with their quantisation,
#: un-permutation, shared expert): 0.34 · 33/12. cpu: 0 (its engines always run eager and
#: DECODE_STEP_OVERHEAD_S / DECODE_SEQUENCE_OVERHEAD_S were measured that way).
EAGER_LAYER_LAUNCH_S = {
    "npu": {"dense": (31.27 / 1024 - DECODE_STEP_OVERHEAD_S["npu"]) / 24, "moe": 1.86e-3},
    "gpu": {"dense": 0.34e-3, "moe": 0.34e-3 * 33 / 12},
    "cpu": {"dense": 0.0, "moe": 0.0},
}
#: Host-side cost per sequence per decode step in the engine's own process (scheduling, sampler bookkeeping,
#: output processing), which tensor parallelism does not split. cpu: measured 0.23 ms with the quickstart
#: model (vLLM generate of 4 tokens for 8 vs 128 sequences, TP 1 and TP 2 alike). Accelerators: not measured
#: here; a dedicated host core makes it small next to the device's step, so it is left in their efficiencies.
DECODE_SEQUENCE_OVERHEAD_S = {"npu": 0.0, "gpu": 0.0, "cpu": 0.23e-3}
#: Host seconds one agent model call costs beyond the engine's decode work: the OpenAI-compatible endpoint in
#: the engine's actor (HTTP, rlc's session router, chat template, tokenization, detokenization, recording) and
#: the agent's `openai` client. Both run on Python event loops that take calls one at a time, so an engine
#: serving n calls in a turn round pays about n times this beside its decode steps (`agent_rollout_s`).
#: cpu: measured 8 ms, the central value of benchmarks/agent_call_cost.py over three runs on a two-core machine
#: (the slope over n of the wall time of n concurrent one-token chat calls on examples/cpu-agent.yaml's engine:
#: 7.2, 8.4 and 11.8 ms; about 4 ms of it the engine actor's CPU, 5 ms the clients'). [estimate] accelerators:
#: the same Python path on a server's faster host cores; not measured, `rlc calibrate` fits it from an agent run.
AGENT_CALL_OVERHEAD_S = {"npu": 2e-3, "gpu": 2e-3, "cpu": 8e-3}
#: Share of data-parallel gradient/parameter traffic hidden behind compute (FSDP2 prefetch, Megatron
#: overlap_grad_reduce). Half is a conservative middle of what torchtitan and Megatron report.
DP_OVERLAP = 0.5
#: Parameters per second one host's CPU updates with AdamW when the optimizer step runs there (FSDP2
#: CPUOffloadPolicy). [estimate] a vectorised CPU Adam streams ~16 bytes of state per parameter, so a host with
#: ~50 GB/s of usable memory bandwidth updates a few billion per second (ZeRO-Offload, Ren et al. 2021, §4.2
#: reports its CPU-Adam several times faster than PyTorch's); the plain torch AdamW FSDP2 uses is slower.
HOST_ADAM_PARAMS_PER_S = 1e9
#: Shared-filesystem bandwidth for disk weight sync, GB/s (one writer, readers in parallel).
DISK_GBPS = 2.0
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
#: Euler–Mascheroni constant, for the harmonic numbers in `expected_longest_response`.
EULER_GAMMA = 0.5772156649


def expected_longest_response(mean: float, cap: int, samples: int) -> float:
    """Expected length of the longest of `samples` responses: min(cap, mean · H_n), H_n = Σ_{k≤n} 1/k.

    A synchronous step waits for the slowest sample of the whole batch. Response lengths are modelled as
    exponential with the workload's mean (the maximum-entropy law for a known mean on [0, ∞), and right-skewed as
    RL lengths are: StreamRL, Zhong et al. 2025, §2.3; RLHFuse, Zhong et al. 2025, §2.2, both report the longest
    samples of a batch dominating generation time); the expected maximum of n i.i.d. exponentials is
    mean · H_n (Rényi's representation of exponential order statistics; David & Nagaraja, Order Statistics, 2003,
    §3.1), H_n ≈ ln n + γ + 1/(2n). The engine stops a sample at the cap, which bounds it: with a mean near half
    the cap any batch of 4 or more samples reaches the cap.
    """
    if samples <= 0 or mean <= 0:
        return float(min(cap, max(0.0, mean)))
    n = samples
    harmonic = sum(1.0 / k for k in range(1, n + 1)) if n <= 64 else log(n) + EULER_GAMMA + 1 / (2 * n)
    return min(float(cap), mean * harmonic)


@dataclass(frozen=True)
class AgentWork:
    """What an agentic rollout asks of an engine per trajectory, beside its tokens: several model calls, each
    after the environment answered the one before."""

    turns: float  # mean model calls per trajectory (the spec's expected_turns)
    turn_tokens: float  # mean tokens one call generates
    max_turn_tokens: int  # the most one call may generate (max_tokens_per_turn, within max_response_len)
    tool_s: float  # seconds the environment takes between two calls (the spec's assumed tool latency)


@dataclass(frozen=True)
class Workload:
    """What one RL step processes; derived from the spec once."""

    samples: int
    prompt_tokens: float
    response_tokens: float
    max_prompt: int
    max_response: int
    staleness: int
    decoupled: bool
    reference: bool
    lora: bool
    mtp_tokens: int = 0
    mtp_acceptance: float = 0.0
    mtp_draft_layers: int = 0
    group_size: int = 1
    #: Forward-only passes over the batch besides a KL reference's and the proximal one (`proximal_forwards`);
    #: comparisons with frameworks that make one where rlc makes none (verl's old_log_prob with a single
    #: mini-batch) set 1.
    extra_forwards: int = 0
    #: Optimizer steps per RL step (`algorithm.minibatches`): each takes its share of the micro-batches, its
    #: own pipeline fill and drain, gradient reduction and optimizer update.
    minibatches: int = 1
    #: Agentic rollouts (`rollout.agent`): each trajectory is several calls with tool time between them.
    agent: AgentWork | None = None
    #: Weight updates interrupt running samples (re-prefilled under the new weights) rather than wait for them
    #: (`plan.schedule.weight_update`).
    interrupt: bool = True
    #: Samples generated per trained sample: DAPO's dynamic sampling drops groups without signal and generates
    #: more (`Algorithm.expected_oversample`); 1 without it.
    oversample: float = 1.0

    @property
    def generated_samples(self) -> int:
        """Samples the engines generate per step (the trained ones and those dynamic sampling drops)."""
        return ceil(self.samples * self.oversample - 1e-9)

    @property
    def proximal_forwards(self) -> int:
        """Forward passes for the decoupled loss' proximal log-probs: none with one minibatch (the train
        forward's own), one over the batch with several (before the first update, AReaL's recompute_logprob)."""
        return 1 if self.decoupled and self.minibatches > 1 else 0

    @property
    def context_tokens(self) -> float:
        """Mean sequence length (prompt + response)."""
        return self.prompt_tokens + self.response_tokens

    @property
    def inflight_context(self) -> float:
        """Mean KV length of a sequence while it decodes: its prompt plus half its response.

        vLLM allocates KV blocks as a sequence grows (PagedAttention, Kwon et al. 2023), so a running
        sequence holds prompt + tokens generated so far, on average prompt + response / 2. This is both the
        KV a decode step reads per sequence and what each running sequence occupies, so the KV-limited
        concurrency is counted at this length too (not at the final length, which undercounts it by up to
        (prompt + response) / (prompt + response / 2), most for long responses and small tensor parallelism).
        """
        return self.prompt_tokens + self.response_tokens / 2

    @property
    def trained_tokens(self) -> float:
        """Tokens the trainer consumes per step: the ranking numerator."""
        return self.samples * self.context_tokens

    def rank_tokens(self, dp: int) -> float:
        """Tokens the busiest of `dp` data-parallel ranks trains: a sequence is never split across DP ranks
        (context parallelism splits it, inside a rank's group), so it takes ceil(samples / dp) mean-length
        sequences of each minibatch, and the ranks take every optimizer step together. Data parallelism wider
        than a minibatch's samples leaves ranks idle and gains nothing."""
        per_step = ceil(self.samples / self.minibatches)
        return self.minibatches * ceil(per_step / max(1, dp)) * self.context_tokens

    def micro_batches_per_step(self, dp: int, budget: int) -> int:
        """Micro-batches of at most `budget` tokens the busiest rank runs in each optimizer step."""
        return max(1, ceil(self.rank_tokens(dp) / self.minibatches / budget))


def workload(
    *,
    batch_prompts: int,
    group_size: int,
    max_prompt_len: int,
    max_response_len: int,
    staleness: int,
    decoupled: bool,
    reference: bool,
    lora: bool,
    mtp_tokens: int = 0,
    mtp_acceptance: float = 0.0,
    mtp_draft_layers: int = 0,
    minibatches: int = 1,
    agent: AgentWork | None = None,
    interrupt: bool = True,
    oversample: float = 1.0,
) -> Workload:
    """Build a Workload with the documented mean-length assumptions."""
    return Workload(
        samples=batch_prompts * group_size,
        group_size=group_size,
        prompt_tokens=max_prompt_len * PROMPT_FRACTION,
        response_tokens=max_response_len * RESPONSE_FRACTION,
        max_prompt=max_prompt_len,
        max_response=max_response_len,
        staleness=staleness,
        decoupled=decoupled,
        reference=reference,
        lora=lora,
        mtp_tokens=mtp_tokens,
        mtp_acceptance=mtp_acceptance,
        mtp_draft_layers=mtp_draft_layers,
        minibatches=minibatches,
        agent=agent,
        interrupt=interrupt,
        oversample=oversample,
    )


def agent_work(
    *, max_turns: int, expected_turns: float | None, max_tokens_per_turn: int, max_response_len: int, tool_s: float
) -> AgentWork:
    """An agent's per-trajectory work under the documented assumptions: `expected_turns` calls (unset: half of
    max_turns, at least one, as lengths default to half their caps), each generating RESPONSE_FRACTION of its
    token cap, but no more together than the trajectory's mean response (RESPONSE_FRACTION of max_response_len,
    which the trainer's workload counts): a long episode of many turns runs into its context budget."""
    turns = expected_turns if expected_turns is not None else max(1.0, max_turns * TURNS_FRACTION)
    cap = min(max_tokens_per_turn, max_response_len)
    per_turn = min(cap * RESPONSE_FRACTION, max_response_len * RESPONSE_FRACTION / turns)
    return AgentWork(float(turns), per_turn, cap, tool_s)


def accepted_tokens_per_step(k: int, a: float) -> float:
    """Expected tokens emitted per verification step with k draft tokens and per-token acceptance a.

    Leviathan et al. 2023 (speculative decoding, eq. 1): E = (1 − a^(k+1)) / (1 − a); 1 without drafting.
    """
    if k <= 0:
        return 1.0
    return (1 - a ** (k + 1)) / (1 - a)


def _collective_s(
    target: TargetProfile, num_bytes: float, bandwidth_gbps: float, count: float = 1.0, nodes: int = 1
) -> float:
    """α–β model: count × latency + bytes / (link bandwidth × collective efficiency). The latency of a group that
    spans `nodes` nodes grows by 2 · log2(nodes) scale-out hops (NET_HOP_LATENCY_S, NCCL's tree model)."""
    bw = bandwidth_gbps * 1e9 * target.efficiency.collective_efficiency
    alpha = COLLECTIVE_LATENCY_S[target.kind]
    if nodes > 1:
        alpha += 2 * log2(nodes) * NET_HOP_LATENCY_S[target.kind]
    return count * alpha + num_bytes / bw


def _nodes(group: int, devices_per_node: int) -> int:
    """Nodes a group of consecutive devices spans (groups are placed from node boundaries)."""
    return max(1, -(-group // max(1, devices_per_node)))


def ep_width_bandwidth(nodes: int) -> float:
    """Share of the scale-out all-to-all bandwidth an EP group over `nodes` nodes achieves (EP_WIDTH_BANDWIDTH,
    DeepEP's published width series); 1 for a group inside one node or over two."""
    if nodes <= 2:
        return 1.0
    wider = [k for k in sorted(EP_WIDTH_BANDWIDTH) if k >= nodes]
    return EP_WIDTH_BANDWIDTH[wider[0]] if wider else EP_WIDTH_BANDWIDTH[max(EP_WIDTH_BANDWIDTH)]


def _link_gbps(target: TargetProfile, group: int, devices_per_node: int) -> float:
    """Intra-node bandwidth when a group fits in one node, else the scale-out bandwidth."""
    return target.intra_node_bandwidth_gbps if group <= devices_per_node else target.inter_node_bandwidth_gbps


# --------------------------------------------------------------------------------------------- rollout


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
    nodes); a fixed engine overhead covers scheduling and launches.

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
        link = _link_gbps(target, layout.tp, devices_per_node)  # a pinned TP across nodes uses the scale-out link
        nodes = _nodes(layout.tp, devices_per_node)
        t += _collective_s(target, 2 * arch.num_layers * volume, link, 2 * arch.num_layers, nodes)
        logits = tokens_step * arch.vocab_size * b * (layout.tp - 1) / layout.tp
        t += _collective_s(target, logits, link, nodes=nodes)
    if arch.moe is not None and layout.ep > 1:
        moe_layers = arch.num_layers - arch.moe.first_dense_layers
        volume = tokens_step * arch.moe.experts_per_token * arch.hidden_size * b * (layout.ep - 1) / layout.ep
        ep_nodes = _nodes(layout.ep, devices_per_node)
        link = _link_gbps(target, layout.ep, devices_per_node) * ep_width_bandwidth(ep_nodes)
        t += _collective_s(target, 2 * moe_layers * volume, link, 2 * moe_layers, ep_nodes)
    if layout.eager:
        t = max(t, eager_launch_s(sizes, target))
    if layout.tp > 1:
        # A multi-worker engine hands every step to its workers and collects the result: two more exchanges.
        t += 2 * COLLECTIVE_LATENCY_S[target.kind]
    return t + decode_step_overhead_s(target) + engine_tokens * decode_sequence_overhead_s(target)


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


#: Host overheads a profile may leave unset, each with its default per target kind (the constants above).
KIND_DEFAULTS = {
    "decode_step_overhead_s": DECODE_STEP_OVERHEAD_S,
    "decode_sequence_overhead_s": DECODE_SEQUENCE_OVERHEAD_S,
    "agent_call_overhead_s": AGENT_CALL_OVERHEAD_S,
}


def efficiency(target: TargetProfile, name: str) -> float:
    """An efficiency as the cost model reads it: the profile's (e.g. `rlc calibrate`'s fit), else for a host
    overhead the profile leaves unset its kind's default (KIND_DEFAULTS)."""
    value = getattr(target.efficiency, name)
    return KIND_DEFAULTS[name][target.kind] if value is None else float(value)


def agent_call_overhead_s(target: TargetProfile) -> float:
    """Host seconds per agent model call."""
    return efficiency(target, "agent_call_overhead_s")


def decode_step_overhead_s(target: TargetProfile) -> float:
    """Host seconds per engine step."""
    return efficiency(target, "decode_step_overhead_s")


def decode_sequence_overhead_s(target: TargetProfile) -> float:
    """Host seconds per sequence per engine step."""
    return efficiency(target, "decode_sequence_overhead_s")


def eager_launch_s(sizes: ModelSizes, target: TargetProfile) -> float:
    """Host time to launch one eager decode step's kernels: Σ over layers of EAGER_LAYER_LAUNCH_S (dense layers
    and MoE layers at their own rates). The step takes at least this long however little the device does."""
    arch = sizes.arch
    rates = EAGER_LAYER_LAUNCH_S[target.kind]
    moe_layers = 0 if arch.moe is None else arch.num_layers - arch.moe.first_dense_layers
    return (arch.num_layers - moe_layers) * rates["dense"] + moe_layers * rates["moe"]


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
    k = work.mtp_tokens
    tau = accepted_tokens_per_step(k, work.mtp_acceptance)

    def step_at(c: int, context: float) -> float:
        return decode_step_s(sizes, layout, target, c, context, devices_per_node, k, work.mtp_draft_layers)

    step = step_at(c_sync, ctx)
    mean_steps = work.response_tokens / tau
    tail_c = max(1, int(c_sync * TAIL_CONCURRENCY_FRACTION))
    tail_step = step_at(tail_c, work.prompt_tokens + work.response_tokens)
    longest = expected_longest_response(work.response_tokens, work.max_response, generated)
    tail = max(0.0, longest - work.response_tokens) / tau * tail_step
    # Each attention rank prefills its own samples on its share of the engine's devices.
    rank_devices = layout.engine_devices / layout.attention_dp
    prefill_flops = 2 * sizes.active * per_rank * work.prompt_tokens
    prefill = prefill_flops / (rank_devices * target.bf16_tflops * 1e12 * target.efficiency.prefill_mfu)
    prefill += per_rank * decode_sequence_overhead_s(target)  # each sequence's prefill is one engine step
    if work.agent is not None:
        engine_share = ceil(work.samples / layout.replicas)
        busy, chain = agent_rollout_s(
            work.agent, per_rank, engine_share, work.samples, c_sync, step, tail_step, tau, target
        )
        sync_s = chain + prefill
        # Asynchronous: the controller keeps up to staleness + 1 batches of trajectories in flight (agent_plan sizes
        # the engines' in-flight work to it), so one batch's tool waits and tail overlap the next batches' calls; a
        # batch still needs its engine's own work. A trajectory waiting for its tool holds no decode slot, so of
        # the rank's (s + 1) × share trajectories only the share of their time spent decoding (`decoding_share`)
        # decodes at once: with slow tools the engine runs below c and its work takes longer.
        admitted = (work.staleness + 1) * per_rank * decoding_share(work.agent, step, tau)
        c_agent = max(1, min(c_sync, int(admitted)))
        if c_agent < c_sync:
            agent_step = step_at(c_agent, ctx)
            busy, _ = agent_rollout_s(
                work.agent, per_rank, engine_share, work.samples, c_agent, agent_step, tail_step, tau, target
            )
        async_s = max(busy + prefill, sync_s / (work.staleness + 1))
        agent_tokens = work.samples * work.agent.turns * work.agent.turn_tokens
        return RolloutTime(sync_s, async_s, prefill, step, c_sync, agent_tokens / async_s)
    sync = per_rank / c_sync * mean_steps * step + tail + prefill
    if work.staleness == 0:
        return RolloutTime(sync, sync, prefill, step, c_sync, generated * work.response_tokens / sync)
    async_step = step_at(c_async, ctx)
    if work.interrupt:
        update = interrupt_s(sizes, layout, target, c_async, ctx)
    else:
        drain_c = max(1, int(c_async * TAIL_CONCURRENCY_FRACTION))
        drain = expected_longest_response(work.response_tokens, work.max_response, c_async) - work.response_tokens
        update = max(0.0, drain) / tau * step_at(drain_c, work.prompt_tokens + work.response_tokens)
    stream = per_rank / c_async * mean_steps * async_step + update + prefill
    return RolloutTime(sync, stream, prefill, async_step, c_async, generated * work.response_tokens / stream)


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


# --------------------------------------------------------------------------------------------- training


@dataclass(frozen=True)
class TrainTime:
    """Training seconds per step and its parts."""

    compute_s: float
    bubble: float
    tp_s: float
    cp_s: float
    ep_s: float
    dp_s: float
    offload_s: float
    overhead_s: float = 0.0
    #: Expert GEMMs' time beyond their FLOPs at peak MFU, when too few tokens reach each expert to keep the
    #: device compute-bound (`expert_gemm_efficiency`).
    expert_s: float = 0.0

    @property
    def total_s(self) -> float:
        comm = self.tp_s + self.cp_s + self.ep_s + self.dp_s
        busy = self.compute_s + self.expert_s
        return busy / (1 - self.bubble) + comm + self.offload_s + self.overhead_s


def train_flops(sizes: ModelSizes, work: Workload, recompute: str) -> float:
    """FLOPs per step for the trainer (forward + backward + extra forwards).

    6·N_active·T for forward and backward (Kaplan et al. 2020; Narayanan et al. 2021 eq. 3) — 4·N·T with
    LoRA, whose frozen weights need no weight gradients — plus causal attention 3 · 2·n_q·d_h·ctx per token
    per full layer. Extra forwards of 2·N·T (+ attention): full recompute (one more forward), selective
    (about a tenth of one), a KL reference policy, the proximal pass of several minibatches
    (`Workload.proximal_forwards`; with one the train forward's own log-probs serve) and
    `Workload.extra_forwards`.
    """
    arch = sizes.arch
    tokens = work.trained_tokens
    attn_fwd = 2 * arch.num_attention_heads * arch.head_dim * sizes.full_attention_layers * work.context_tokens
    fwd = (2 * sizes.active + attn_fwd) * tokens
    flops = (2 if work.lora else 3) * fwd
    extra = {"full": 1.0, "selective": 0.1}.get(recompute, 0.0)
    extra += (1.0 if work.reference else 0.0) + work.proximal_forwards + work.extra_forwards
    return flops + extra * fwd


def train_mfu(sizes: ModelSizes, target: TargetProfile) -> float:
    """Training MFU for this model on this target: train_mfu, times `moe_train_ratio` for a mixture of experts.

    MoE layers add work a dense layer has not (router, top-k, permuting tokens to their experts and back) and
    run their expert GEMMs as grouped GEMMs of uneven, smaller shapes, so the same framework reaches a lower
    share of peak on them. Pre-training shows the mildest form: NeMo AutoModel's published DGX-H100 BF16 table
    measures 277 model TFLOP/s/GPU for Qwen3-MoE-30B-A3B (EP 8 inside one node, DeepEP) against 389 for dense
    Llama3-70B, a ratio of 0.71 (the Ascend profiles' `moe_train_ratio`). RL trains smaller packed micro-batches
    and adds log-prob passes: NeMo-RL v0.3's published per-phase timings put Qwen3-30B-A3B's training at 0.20 of
    the dense runs' MFU on the same GPUs (the GPU profiles' value, fitted by benchmarks/fit_gpu_efficiency.py).
    Wider EP groups pay their all-to-alls in `train_time`'s EP term, which is not folded in here.
    """
    mfu = target.efficiency.train_mfu
    if sizes.arch.moe is not None:
        mfu *= target.efficiency.moe_train_ratio
    return mfu


def train_compute_s(sizes: ModelSizes, layout: TrainLayout, target: TargetProfile, work: Workload) -> float:
    """Compute seconds of a training step on its busiest rank: train_flops / (devices · peak · `train_mfu`),
    times the data-parallel imbalance `rank_tokens(dp) · dp / trained_tokens` (1 when dp divides the samples;
    past one sample per rank, more ranks add nothing)."""
    flops = train_flops(sizes, work, layout.recompute)
    imbalance = work.rank_tokens(layout.dp) * layout.dp / work.trained_tokens if work.trained_tokens else 1.0
    return flops * imbalance / (layout.world_size * target.bf16_tflops * 1e12 * train_mfu(sizes, target))


def expert_gemm_efficiency(sizes: ModelSizes, layout: TrainLayout, target: TargetProfile) -> float:
    """Share of peak an expert GEMM reaches: min(1, intensity / ridge) (roofline, Williams et al. 2009).

    One local expert multiplies [m × h] by its [h × n] weight shard: 2·m·h·n FLOPs over 2·(m·h + h·n + m·n)
    bf16 bytes, so its intensity is m·h·n / (m·h + h·n + m·n) FLOP/byte, against the device's ridge point
    (peak FLOPs / HBM bandwidth). m, the rows an expert receives per micro-batch, is the local tokens × top-k
    × the EP ranks that send to it, over the experts: (mbt / cp) · k · ep / E; n is the expert's width over
    expert-TP, f_e / etp. Expert parallelism gathers ep ranks' tokens onto whole experts (large m and n), where
    expert TP cuts every expert into thin slices: why published MoE recipes run EP 8-64 with ETP 1.
    """
    moe = sizes.arch.moe
    if moe is None:
        return 1.0
    m = layout.micro_batch_tokens / layout.cp * moe.experts_per_token * layout.ep / moe.num_experts
    h, n = sizes.arch.hidden_size, moe.expert_intermediate_size / layout.etp
    intensity = m * h * n / (m * h + h * n + m * n)
    ridge = target.bf16_tflops * 1e12 / (target.hbm_bandwidth_gbps * 1e9)
    return min(1.0, intensity / ridge)


def train_time(
    sizes: ModelSizes, layout: TrainLayout, target: TargetProfile, work: Workload, devices_per_node: int
) -> TrainTime:
    """Seconds per training step for `layout`.

    Compute: train_flops / (devices · peak · train MFU). PP bubble (pp − 1)/(m + pp − 1) with m micro-batches
    per pipeline and optimizer step (Narayanan et al. 2021, 1F1B): each of `Workload.minibatches` steps fills
    and drains the pipeline again. TP: 4 all-reduces per layer per micro-batch (2 forward, 2 backward; Shoeybi
    et al. 2019), ring volume 2(t−1)/t · tokens · h · bytes. CP (Ulysses, Jacobs et al. 2023): 4 all-to-alls
    of q,k,v,o forward and backward, (c−1)/c of the local tokens' heads. EP: dispatch and combine all-to-alls
    per MoE layer, forward and backward (Lepikhin et al. 2020), at `ep_width_bandwidth` of the scale-out link
    for a group over several nodes. DP: FSDP2 all-gathers parameters for forward and backward of every
    micro-batch and reduce-scatters gradients once per optimizer step; Megatron's distributed optimizer
    reduce-scatters gradients and all-gathers parameters once per optimizer step; half of it hides behind
    compute. Offload: parameters cross the host link per micro-batch (forward, backward), also
    for a LoRA run's frozen base; offloaded optimizer moments are brought to the device for each update and back.
    CP ring (Liu et al. 2023): K/V blocks passed cp − 1 times per layer and pass. Expert GEMMs that see too
    few tokens run below peak (`expert_gemm_efficiency`).
    """
    arch = sizes.arch
    fsdp = layout.backend == "fsdp2"
    b = layout.precision.compute_bytes if fsdp else dtype_bytes(target)
    compute = train_compute_s(sizes, layout, target, work)
    expert_share = (sizes.active_expert / sizes.active) if sizes.active else 0.0
    efficiency = expert_gemm_efficiency(sizes, layout, target)
    expert_s = compute * expert_share * (1 / efficiency - 1)
    if fsdp and layout.tp > 1:
        # The fsdp2 trainer does not split experts over TP: each TP rank computes them for the tokens its column
        # shares, so the expert FLOPs that `compute` divides over the TP ranks are done tp times.
        expert_s += compute * expert_share * (layout.tp - 1) / efficiency
    tokens_rank = work.rank_tokens(layout.dp)
    steps = work.minibatches
    per_step = work.micro_batches_per_step(layout.dp, layout.micro_batch_tokens)
    micro = steps * per_step
    bubble = (layout.pp - 1) / (per_step + layout.pp - 1)
    passes = 2.0 + (1.0 if layout.recompute == "full" else 0.0)
    stage_layers = ceil(arch.num_layers / layout.pp)
    local = tokens_rank / layout.cp
    tp_s = cp_s = ep_s = 0.0
    if layout.tp > 1:
        volume = 2 * (layout.tp - 1) / layout.tp * local * arch.hidden_size * b
        count = 2 * passes * stage_layers
        tp_s = _collective_s(target, count * volume, target.intra_node_bandwidth_gbps, count * micro)
    if layout.cp > 1:
        link = _link_gbps(target, layout.tp * layout.cp, devices_per_node)
        if layout.cp_kind == "ring":
            # Each rank passes its K/V block on cp − 1 times per layer (and dK/dV back in backward).
            volume = (layout.cp - 1) * local * 2 * arch.num_kv_heads * arch.head_dim * b / layout.tp
            count = (layout.cp - 1) * passes * stage_layers
        else:
            width = (2 * arch.num_attention_heads + 2 * arch.num_kv_heads) * arch.head_dim
            volume = (layout.cp - 1) / layout.cp * local * width * b / layout.tp
            count = 4 * passes * stage_layers
        cp_nodes = _nodes(layout.tp * layout.cp, devices_per_node)
        cp_s = _collective_s(target, passes * stage_layers * volume, link, count * micro, cp_nodes)
    if arch.moe is not None and layout.ep > 1:
        moe_share = (arch.num_layers - arch.moe.first_dense_layers) / arch.num_layers
        volume = local * arch.moe.experts_per_token * arch.hidden_size * b * (layout.ep - 1) / layout.ep
        ep_nodes = _nodes(layout.ep * layout.etp, devices_per_node)
        link = _link_gbps(target, layout.ep * layout.etp, devices_per_node) * ep_width_bandwidth(ep_nodes)
        count = 2 * passes * stage_layers * moe_share
        ep_s = _collective_s(target, count * volume / layout.tp, link, count * micro, ep_nodes)
    dp_s = 0.0
    group = layout.shard_group if fsdp else layout.dp * layout.cp
    if group > 1:
        replica = sizes.total / (layout.tp * layout.pp)
        ring = (group - 1) / group
        if fsdp and arch.moe is not None and layout.ep > 1:
            # Each rank gathers only its 1/ep of the experts, over the group/ep ranks that hold the same ones.
            efsdp = max(1, group // layout.ep)
            experts = sizes.expert / layout.ep * (efsdp - 1) / efsdp / ring  # priced at the dp·cp ring below
            replica = ((sizes.total - sizes.expert) / layout.tp + experts) / layout.pp
        link = _link_gbps(target, layout.world_size, devices_per_node)
        if fsdp:
            volume = (2 * micro * b + steps * layout.precision.reduce_bytes) * replica * ring
            count = 3 * micro * stage_layers  # a pipeline stage gathers its own layers
        else:
            volume = steps * 2 * b * replica * ring
            count = 2 * steps
        dp_nodes = _nodes(layout.world_size, devices_per_node)
        dp_s = max(0.0, _collective_s(target, volume, link, count, dp_nodes) - DP_OVERLAP * compute)
        dp_s = max(dp_s, (1 - DP_OVERLAP) * _collective_s(target, volume, link, count, dp_nodes))
    offload_s = 0.0
    host = target.host_to_device_bandwidth_gbps * 1e9
    shard = sizes.total / layout.world_size if fsdp else sizes.total / (layout.tp * layout.pp)
    w_bytes = layout.precision.param_bytes if fsdp else b
    if layout.offload_params:
        # Parameters cross the host link for forward and backward of every micro-batch; gradients come back
        # once (a LoRA run's frozen base has none, but its weights still travel).
        grads = 0 if work.lora else steps * layout.precision.reduce_bytes
        offload_s += (2 * micro * w_bytes + grads) * shard / host
    if layout.offload_optimizer and not work.lora:
        if fsdp and layout.offload_params:
            # CPUOffloadPolicy runs AdamW on the host, whose cores update every local rank's shard.
            offload_s += steps * shard * min(devices_per_node, layout.world_size) / HOST_ADAM_PARAMS_PER_S
        else:
            # The moments come to the device for each update and go back: 2 × their bytes.
            moments = 2 * layout.precision.param_bytes * shard if fsdp else 12 * shard / max(1, group)
            offload_s += steps * 2 * moments / host
    # Fixed cost per pass over a micro-batch (launches, packing, Python): a forward+backward pass counts one, a
    # forward-only pass a third, since a backward launches about two kernels per forward op (input and weight
    # gradients, the 1:2 of their FLOPs; Narayanan et al. 2021 eq. 3); benchmarks/forward_pass_cost.py measures
    # 0.27-0.30 on the cpu target, where fixed costs dominate. Forward-only passes: the proximal pass
    # over the same minibatches and, over the whole batch, a KL reference and extra ones; they are priced as
    # compute and launches, without their parameter gathers and collectives (a lower bound).
    whole = max(1, ceil(tokens_rank / layout.micro_batch_tokens))
    forward_only = micro * work.proximal_forwards + whole * ((1 if work.reference else 0) + work.extra_forwards)
    launches = micro + forward_only / 3
    overhead = launches * target.efficiency.micro_batch_overhead_s
    return TrainTime(compute, bubble, tp_s, cp_s, ep_s, dp_s, offload_s, overhead, expert_s)


# --------------------------------------------------------------------------------------------- sync and step


def weight_sync_s(
    sizes: ModelSizes,
    target: TargetProfile,
    method: str,
    *,
    cross_node: bool,
    adapter_params: int = 0,
    engine_share: float = 1.0,
) -> float:
    """Seconds to move new weights from the trainer to the engines.

    Volume: the full model in compute dtype (total params × bytes), or only the LoRA adapters when the
    engine serves them. broadcast: one pipelined broadcast from trainer rank 0 (bytes / link bw; across
    nodes the scale-out link bounds it) after gathering the shards on that rank (same volume, intra-node).
    inplace (colocated): the gathered weights go through host shared memory, because the trainer rank
    and the engine worker of one device cannot both be ranks of one NCCL group: each node's leader rank
    gathers the full weights (over the scale-out link when the trainer spans nodes) and copies them to its
    host (bytes / host↔device bandwidth); that node's engine workers then copy back, in parallel, only the
    shard each one serves (`engine_share` × bytes each: vLLM's weight loaders narrow every checkpoint tensor
    to the rank's TP slice and skip experts outside its EP rank before the device copy).
    disk: safetensors written once and read in parallel at DISK_GBPS.

    `engine_share` is the share of the full weights one engine device holds (`memory.rollout_weights_bytes`
    over the full bytes; 1 for a TP 1 engine). The engine's reload (`weight_reload_gbps`) is per device too:
    each worker copies and repacks its own shard, all workers at once.
    """
    b = dtype_bytes(target)
    volume = (adapter_params or sizes.total) * b
    # Every path ends with the engine taking the weights in (vLLM reload_weights: copies into its parameters
    # and, on cpu and NPUs, repacking for its kernels), at the target's measured or estimated rate.
    # A LoRA adapter is small and whole on every engine device.
    shard = volume if adapter_params else volume * min(1.0, max(0.0, engine_share))
    reload = shard / (target.efficiency.weight_reload_gbps * 1e9) + target.efficiency.weight_sync_overhead_s
    if method == "disk":
        return 2 * volume / (DISK_GBPS * 1e9) + reload
    intra = _collective_s(target, volume, target.intra_node_bandwidth_gbps)
    link = target.inter_node_bandwidth_gbps if cross_node else target.intra_node_bandwidth_gbps
    if method == "inplace":
        gather = _collective_s(target, volume, link)
        return gather + (volume + shard) / (target.host_to_device_bandwidth_gbps * 1e9) + reload
    return intra + _collective_s(target, volume, link) + reload


def engine_weight_share(sizes: ModelSizes, layout: RolloutLayout) -> float:
    """Share of the full weights one device of an engine with `layout` holds (dense parts over TP, routed
    experts over EP or TP): what each engine worker copies in and repacks when new weights arrive."""
    full = sizes.dense + sizes.embedding + sizes.head + sizes.expert
    return rollout_weights_bytes(sizes, layout.tp, layout.ep, 1) / full if full else 1.0


def switch_s(target: TargetProfile, train_state_gib: float) -> float:
    """Colocated phase switch per step: training state to host before rollout and back before training.

    2 × state bytes / host↔device bandwidth (the engine's weights are discarded at sleep level 2 and
    refilled by the in-place sync, its KV cache is dropped and re-allocated, both cheap). 0 on cpu, where
    nothing moves.
    """
    if target.kind == "cpu":
        return 0.0
    return 2 * train_state_gib * 1024**3 / (target.host_to_device_bandwidth_gbps * 1e9)


def engine_offload_s(sizes: ModelSizes, target: TargetProfile, engine_share: float) -> float:
    """An adapter-serving colocated engine's base weights to host and back each step (vLLM sleep level 1: an
    adapter sync never resends the base, so it cannot be discarded as at level 2):
    2 × its device's share of the weights / host↔device bandwidth, every device at once. 0 on cpu."""
    if target.kind == "cpu":
        return 0.0
    return 2 * sizes.total * dtype_bytes(target) * engine_share / (target.host_to_device_bandwidth_gbps * 1e9)


def teacher_time_s(sizes: ModelSizes, devices: int, target: TargetProfile, work: Workload, share: float) -> float:
    """Forward-only teacher scoring: 2 · active params · (share of samples · mean length) / (devices · peak · MFU)."""
    flops = 2 * sizes.active * work.samples * share * work.context_tokens
    return flops / (devices * target.bf16_tflops * 1e12 * target.efficiency.prefill_mfu)


@dataclass(frozen=True)
class StepTime:
    """One RL step's estimate and its split."""

    step_s: float
    rollout_s: float
    train_s: float
    teacher_s: float
    sync_s: float
    switch_s: float
    tokens_per_s: float
    overhead_s: float = 0.0


def step_time(
    mode: str,
    work: Workload,
    rollout: RolloutTime,
    train_s: float,
    teacher_s: float,
    sync_s: float,
    switch: float,
    overhead_s: float = 0.0,
) -> StepTime:
    """Combine the phases.

    Disaggregated with staleness > 0 (AReaL-style asynchrony): rollout runs while the trainer works, so
    step ≈ max(rollout, teachers, train) + sync, the rollout streamed without a tail (`rollout_time`).
    Staleness 0 serialises them: rollout (waiting for the batch's long tail) + teachers + train + sync.
    Colocated: rollout + teachers + train + sync + switch. Every step also pays
    the target's fixed `step_overhead_s` (controller bookkeeping, rewards, Python).
    """
    if mode == "disaggregated" and work.staleness > 0:
        r = rollout.async_s
        step = max(r, teacher_s, train_s) + sync_s
    else:
        r = rollout.sync_s
        step = r + teacher_s + train_s + sync_s + (switch if mode == "colocated" else 0.0)
    step += overhead_s
    if mode != "colocated":
        switch = 0.0
    return StepTime(step, r, train_s, teacher_s, sync_s, switch, work.trained_tokens / step, overhead_s)
