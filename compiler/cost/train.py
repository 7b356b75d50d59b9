"""Training time: FLOPs of a step, MFU, the pipeline bubble, data-parallel and expert-parallel communication, host
optimizer steps."""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil
from typing import Any

from rlc.compiler.cost.links import collective_s, ep_width_bandwidth, link_gbps, nodes_spanned
from rlc.compiler.cost.workload import Workload
from rlc.compiler.memory import ModelSizes, TrainLayout, dtype_bytes
from rlc.schemas.layout import experts_over_tp
from rlc.schemas.target import TargetProfile

__all__ = [
    "DP_OVERLAP",
    "HOST_ADAM_PARAMS_PER_S",
    "TrainTime",
    "expert_gemm_efficiency",
    "train_compute_s",
    "train_flops",
    "train_mfu",
    "train_time",
]

#: Share of data-parallel gradient/parameter traffic hidden behind compute (FSDP2 prefetch, Megatron
#: overlap_grad_reduce). Half is a conservative middle of what torchtitan and Megatron report.
DP_OVERLAP = 0.5
#: Parameters per second one host's CPU updates with AdamW when the optimizer step runs there (FSDP2
#: CPUOffloadPolicy). [estimate] a vectorised CPU Adam streams ~16 bytes of state per parameter, so a host with
#: ~50 GB/s of usable memory bandwidth updates a few billion per second (ZeRO-Offload, Ren et al. 2021, §4.2
#: reports its CPU-Adam several times faster than PyTorch's); the plain torch AdamW FSDP2 uses is slower.
HOST_ADAM_PARAMS_PER_S = 1e9


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
    """Training MFU for this model on this target: train_mfu, times `moe_train_ratio` for a mixture of experts and
    `linear_attention_train_ratio` for a Gated-DeltaNet hybrid.

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
    if sizes.arch.attention.kind == "linear-hybrid":
        mfu *= target.efficiency.linear_attention_train_ratio
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
    few tokens run below peak (`expert_gemm_efficiency`). Under FSDP2's TP, the weights it keeps whole
    (`memory.tp_whole_params`: latent attention's down-projections) are computed on every TP rank.
    """
    arch = sizes.arch
    fsdp = layout.backend == "fsdp2"
    b = layout.precision.compute_bytes if fsdp else dtype_bytes(target)
    compute = train_compute_s(sizes, layout, target, work)
    expert_share = (sizes.active_expert / sizes.active) if sizes.active else 0.0
    efficiency = expert_gemm_efficiency(sizes, layout, target)
    expert_s = compute * expert_share * (1 / efficiency - 1)
    if fsdp and layout.tp > 1 and experts_over_tp(layout.ep, layout.tp) == 1:
        # Where TP does not divide EP the fsdp2 trainer does not split the experts over TP: each TP rank computes
        # them for the tokens its column shares, so the expert FLOPs that `compute` divides over the TP ranks are
        # done tp times. (Where it does, each TP rank serves its share of the experts, and TP's all-reduce after the
        # FFN, which `_tp_s` counts for every layer, sums their outputs.)
        expert_s += compute * expert_share * (layout.tp - 1) / efficiency
    if fsdp and layout.tp > 1 and sizes.tp_whole and sizes.active:
        # What TP keeps whole (latent attention's down-projections, `memory.tp_whole_params`) each TP rank
        # computes for the tokens its TP group shares: done tp times, where `compute` divides it over them.
        compute += compute * sizes.tp_whole / sizes.active * (layout.tp - 1)
    per_step = work.micro_batches_per_step(layout.dp, layout.micro_batch_tokens)
    micro = work.minibatches * per_step
    bubble = (layout.pp - 1) / (per_step + layout.pp - 1)
    passes = 2.0 + (1.0 if layout.recompute == "full" else 0.0)
    pass_layers = passes * ceil(arch.num_layers / layout.pp)  # a pipeline stage's layers, per pass
    local = work.rank_tokens(layout.dp) / layout.cp
    traffic = _RankTraffic(arch, layout, target, local * b, pass_layers, micro, devices_per_node)
    tp_s, cp_s, ep_s = _tp_s(traffic), _cp_s(traffic), _ep_s(traffic)
    dp_s = _dp_s(sizes, layout, target, work, b, micro, compute, devices_per_node)
    offload_s = _offload_s(sizes, layout, target, work, b, micro, devices_per_node)
    return TrainTime(compute, bubble, tp_s, cp_s, ep_s, dp_s, offload_s, _overhead_s(layout, target, work), expert_s)


@dataclass(frozen=True)
class _RankTraffic:
    """What a rank's model-parallel collectives depend on: its activations' bytes (`local_bytes`: its tokens ×
    the compute dtype's bytes), the layers a pass crosses on its pipeline stage, and the micro-batches a step."""

    arch: Any
    layout: TrainLayout
    target: TargetProfile
    local_bytes: float
    pass_layers: float
    micro: int
    devices_per_node: int


def _tp_s(t: _RankTraffic) -> float:
    """Tensor parallelism: 4 all-reduces per layer per micro-batch (2 forward, 2 backward)."""
    layout = t.layout
    if layout.tp <= 1:
        return 0.0
    volume = 2 * (layout.tp - 1) / layout.tp * t.local_bytes * t.arch.hidden_size
    count = 2 * t.pass_layers
    return collective_s(t.target, count * volume, t.target.intra_node_bandwidth_gbps, count * t.micro)


def _cp_s(t: _RankTraffic) -> float:
    """Context parallelism: Ulysses' four all-to-alls of q, k, v, o per layer and pass, or ring's K/V blocks."""
    arch, layout = t.arch, t.layout
    if layout.cp <= 1:
        return 0.0
    link = link_gbps(t.target, layout.tp * layout.cp, t.devices_per_node)
    if layout.cp_kind == "ring":
        # Each rank passes its K/V block on cp − 1 times per layer (and dK/dV back in backward).
        volume = (layout.cp - 1) * t.local_bytes * 2 * arch.num_kv_heads * arch.head_dim / layout.tp
        count = (layout.cp - 1) * t.pass_layers
    else:
        width = (2 * arch.num_attention_heads + 2 * arch.num_kv_heads) * arch.head_dim
        volume = (layout.cp - 1) / layout.cp * t.local_bytes * width / layout.tp
        count = 4 * t.pass_layers
    cp_nodes = nodes_spanned(layout.tp * layout.cp, t.devices_per_node)
    return collective_s(t.target, t.pass_layers * volume, link, count * t.micro, cp_nodes)


def _ep_s(t: _RankTraffic) -> float:
    """Expert parallelism: dispatch and combine all-to-alls per MoE layer, forward and backward."""
    arch, layout = t.arch, t.layout
    if arch.moe is None or layout.ep <= 1:
        return 0.0
    moe_share = (arch.num_layers - arch.moe.first_dense_layers) / arch.num_layers
    volume = t.local_bytes * arch.moe.experts_per_token * arch.hidden_size * (layout.ep - 1) / layout.ep
    ep_nodes = nodes_spanned(layout.ep * layout.etp, t.devices_per_node)
    link = link_gbps(t.target, layout.ep * layout.etp, t.devices_per_node) * ep_width_bandwidth(ep_nodes)
    count = 2 * t.pass_layers * moe_share
    return collective_s(t.target, count * volume / layout.tp, link, count * t.micro, ep_nodes)


def _dp_s(
    sizes: ModelSizes,
    layout: TrainLayout,
    target: TargetProfile,
    work: Workload,
    b: float,
    micro: int,
    compute: float,
    devices_per_node: int,
) -> float:
    """Data parallelism: FSDP2's parameter gathers per micro-batch and gradient reduce-scatter per optimizer
    step, or Megatron's distributed optimizer once per step; half of it hides behind compute."""
    fsdp = layout.backend == "fsdp2"
    arch, steps = sizes.arch, work.minibatches
    group = _dp_group(layout)
    if group <= 1:
        return 0.0
    replica = sizes.total / (layout.tp * layout.pp)
    ring = (group - 1) / group
    if fsdp and arch.moe is not None and layout.ep > 1:
        # Each rank gathers only its 1/ep of the experts, over the group/ep ranks that hold the same ones.
        efsdp = max(1, group // layout.ep)
        experts = sizes.expert / layout.ep * (efsdp - 1) / efsdp / ring  # priced at the dp·cp ring below
        replica = ((sizes.total - sizes.expert) / layout.tp + experts) / layout.pp
    link = link_gbps(target, layout.world_size, devices_per_node)
    if fsdp:
        volume = (2 * micro * b + steps * layout.precision.reduce_bytes) * replica * ring
        count = 3 * micro * ceil(arch.num_layers / layout.pp)  # a pipeline stage gathers its own layers
    else:
        volume = steps * 2 * b * replica * ring
        count = 2 * steps
    dp_nodes = nodes_spanned(layout.world_size, devices_per_node)
    dp_s = max(0.0, collective_s(target, volume, link, count, dp_nodes) - DP_OVERLAP * compute)
    return max(dp_s, (1 - DP_OVERLAP) * collective_s(target, volume, link, count, dp_nodes))


def _offload_s(
    sizes: ModelSizes,
    layout: TrainLayout,
    target: TargetProfile,
    work: Workload,
    b: float,
    micro: int,
    devices_per_node: int,
) -> float:
    """Host offload: parameters over the host link per micro-batch, the optimizer's moments per update (or the
    host's own AdamW step)."""
    fsdp = layout.backend == "fsdp2"
    steps = work.minibatches
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
            group = _dp_group(layout)
            moments = 2 * layout.precision.param_bytes * shard if fsdp else 12 * shard / max(1, group)
            offload_s += steps * 2 * moments / host
    return offload_s


def _overhead_s(layout: TrainLayout, target: TargetProfile, work: Workload) -> float:
    """Fixed cost per pass over a micro-batch (launches, packing, Python): a forward+backward pass counts one, a
    forward-only pass a third, since a backward launches about two kernels per forward op (input and weight
    gradients, the 1:2 of their FLOPs; Narayanan et al. 2021 eq. 3); benchmarks/forward_pass_cost.py measures
    0.27-0.30 on the cpu target, where fixed costs dominate. Forward-only passes: the proximal pass over the same
    minibatches and, over the whole batch, a KL reference and extra ones; they are priced as compute and
    launches, without their parameter gathers and collectives (a lower bound)."""
    tokens_rank = work.rank_tokens(layout.dp)
    micro = work.minibatches * work.micro_batches_per_step(layout.dp, layout.micro_batch_tokens)
    whole = max(1, ceil(tokens_rank / layout.micro_batch_tokens))
    forward_only = micro * work.proximal_forwards + whole * ((1 if work.reference else 0) + work.extra_forwards)
    return (micro + forward_only / 3) * target.efficiency.micro_batch_overhead_s


def _dp_group(layout: TrainLayout) -> int:
    """Ranks that share one copy of the parameters' shards: FSDP2's shard group, or Megatron's data × context
    parallel ranks."""
    return layout.shard_group if layout.backend == "fsdp2" else layout.dp * layout.cp
