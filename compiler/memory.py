"""Per-device memory model: what each role holds on one device, item by item, in GiB.

The planner must never emit a plan that runs out of memory, so every role's peak is summed from named
items (weights, gradients, optimizer states, activations, logits, KV cache, workspaces, reserve) and compared
with the device's usable memory. Each function states its formula and source; the numbers are estimates with
the target's `reserve_gib` as the margin for what they leave out (communication buffers, fragmentation).
Pure functions only: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import ceil

from rlc.schemas.arch import ModelArch
from rlc.schemas.layout import TrainLayout
from rlc.schemas.target import TargetProfile

GIB = 1024**3

#: Share of host RAM the planner lets offloaded states take (the rest is for the OS, Ray, data, pinned buffers).
HOST_MEMORY_FRACTION = 0.8

#: Runtime/graph workspace of a vLLM engine outside the profiled activations (ACL graph / CUDA graph pools,
#: sampler state), GiB. vllm-ascend and vLLM capture graphs after the profile run; ~0.5 GiB is what their
#: logs report for decode-only graphs at the default capture sizes. 0 on cpu (no graphs).
ENGINE_GRAPH_GIB = 0.5

#: Logits copies kept per token while computing log-probs with a backward pass: fp32 logits, the softmax
#: (log-softmax) output, and the gradient w.r.t. the logits.
LOGIT_COPIES = 3

#: Linear layers PEFT's `all-linear` targets in one decoder layer, with their (d_in, d_out) computed below.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Megatron spellings of the same modules (MindSpeed-RL's lora_target_modules).
LORA_ALIASES = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}


def gib(num_bytes: float) -> float:
    """Bytes to GiB."""
    return num_bytes / GIB


def dtype_bytes(target: TargetProfile) -> int:
    """Bytes per parameter/activation element: bf16 (2) on accelerators, fp32 (4) on the cpu target.

    vLLM's CPU build dies with SIGILL on bf16 kernels here (DESIGN.md, measured), so the cpu target runs
    trainer and engines in float32.
    """
    return 4 if target.kind == "cpu" else 2


# --------------------------------------------------------------------------------------------- model sizes


@dataclass(frozen=True)
class ModelSizes:
    """Parameter counts split the way parallelism splits them, computed once per architecture.

    `dense` is everything in decoder layers that TP splits (attention, dense FFN, shared experts, router,
    norms); `expert` is the routed experts, which EP splits; `embedding` and `head` sit on the first and last
    pipeline stage (head is 0 when tied).
    """

    arch: ModelArch
    total: int
    active: int
    dense: int
    expert: int
    active_expert: int
    embedding: int
    head: int
    max_layer: int
    mtp: int
    act: dict[str, float]
    #: Layers with full attention (a KV cache); hybrid models' linear layers excluded. Counted once here
    #: because the search asks for it per candidate layout.
    full_attention_layers: int = 0

    @property
    def layers(self) -> int:
        return self.arch.num_layers


def model_sizes(arch: ModelArch) -> ModelSizes:
    """Split `arch`'s parameters into dense, routed-expert, embedding and head parts.

    Routed experts per MoE layer: E·3·h·f_e (SwiGLU); active: k·3·h·f_e. Everything else in the layers is
    dense. Counts come from ModelArch's formulas (HF config shapes), so they sum to total_params().
    """
    h, v = arch.hidden_size, arch.vocab_size
    layers = sum(arch.layer_param_count(i) for i in range(arch.num_layers))
    expert = active_expert = 0
    if arch.moe is not None:
        per = 3 * h * arch.moe.expert_intermediate_size
        moe_layers = sum(1 for i in range(arch.num_layers) if arch.layer_is_moe(i))
        expert = moe_layers * arch.moe.num_experts * per
        active_expert = moe_layers * arch.moe.experts_per_token * per
    head = 0 if arch.tie_word_embeddings else v * h
    return ModelSizes(
        arch=arch,
        total=arch.total_params(),
        active=arch.active_params(),
        dense=layers - expert,
        expert=expert,
        active_expert=active_expert,
        embedding=v * h + h,
        head=head,
        max_layer=arch.max_layer_params(),
        mtp=arch.mtp_params(),
        act={rc: activation_elements_per_token_layer(arch, rc) for rc in ("none", "selective", "full")},
        full_attention_layers=arch.num_full_attention_layers(),
    )


def lora_params(arch: ModelArch, rank: int, targets: str | list[str]) -> int:
    """Trainable LoRA parameters: Σ over adapted linears of r·(d_in + d_out) (Hu et al. 2021, eq. 3).

    `all-linear` adapts q/k/v/o and gate/up/down of every layer; for MoE models the routed experts are left
    out (PEFT's all-linear skips fused expert weights) and the shared experts' / dense layers' FFN counts.
    MLA and linear-attention layers are approximated by their q/k/v/o-equivalent widths.
    """
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_kv_heads * d
    f = arch.intermediate_size
    if arch.moe is not None:
        f = arch.moe.num_shared_experts * (
            arch.moe.shared_expert_intermediate_size or arch.moe.expert_intermediate_size
        )
    shapes = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, f),
        "up_proj": (h, f),
        "down_proj": (f, h),
    }
    if targets == "all-linear":
        names: set[str] = set(LORA_MODULES)
    else:
        names = set()
        for name in targets:
            names.update(LORA_ALIASES.get(name, (name,)))
    per_layer = sum(rank * (shapes[n][0] + shapes[n][1]) for n in names if n in shapes and shapes[n][1])
    return per_layer * arch.num_layers


# --------------------------------------------------------------------------------------------- breakdowns


@dataclass(frozen=True)
class MemoryBreakdown:
    """One role's per-device peak, by item, against what the device offers."""

    role: str
    phase: str
    items: dict[str, float]
    capacity_gib: float
    host_gib_per_node: float = 0.0
    host_capacity_gib: float = 0.0
    problems: tuple[str, ...] = field(default_factory=tuple)

    @property
    def total_gib(self) -> float:
        return sum(self.items.values())

    @property
    def fits(self) -> bool:
        return self.total_gib <= self.capacity_gib + 1e-9 and not self.problems

    def describe(self) -> str:
        """`weights 2.1, grads 2.1, ...` with zero items left out."""
        return ", ".join(f"{k} {v:.1f}" for k, v in self.items.items() if v >= 0.05)

    def verdict(self) -> str:
        """Why it does not fit, in numbers: `train 71.3 > 60.9 GiB` or the first problem."""
        if self.total_gib > self.capacity_gib + 1e-9:
            return f"{self.role} {self.total_gib:.1f} > {self.capacity_gib:.1f} GiB"
        return self.problems[0] if self.problems else "fits"


# --------------------------------------------------------------------------------------------- training


def train_param_shard(sizes: ModelSizes, layout: TrainLayout) -> tuple[float, float]:
    """Parameters on the most loaded device, split as (dense incl. embeddings, routed experts).

    FSDP2 (ZeRO-3, Rajbhandari et al. 2020; rlc's trainer): decoder-layer weights are split by TP (colwise
    q/k/v/gate/up, rowwise o/down) and every parameter is sharded over the dp·cp ranks, so a device holds
    (layers/t + embedding + head)/(dp·cp); embeddings and norms are not tensor-parallel there.
    Megatron (Narayanan et al. 2021; megatron/training/theoretical_memory_usage.py): a stage holds
    ceil(L/p) layers; dense parts split by t, routed experts by ep·etp; the first stage adds the embedding and
    the last the LM head (both when p == 1), vocab-parallel over t.
    """
    if layout.backend == "fsdp2":
        layers = sizes.total - sizes.embedding - sizes.head
        return (layers / layout.tp + sizes.embedding + sizes.head) / layout.shard_group, 0.0
    per_layer = 1 / sizes.layers
    stage_layers = ceil(sizes.layers / layout.pp)
    vocab = sizes.embedding + sizes.head if layout.pp == 1 else max(sizes.embedding, sizes.head or sizes.embedding)
    dense = (sizes.dense * per_layer * stage_layers + vocab) / layout.tp
    expert = sizes.expert * per_layer * stage_layers / layout.expert_shards
    return dense, expert


def replicated_activation_elements(arch: ModelArch, recompute: str) -> float:
    """The part of `activation_elements_per_token_layer` that tensor parallelism without sequence parallelism
    does not split: the norms' inputs and outputs (4h; 2h under selective recompute, which drops the norm
    outputs), or the layer input under full recompute (h). FSDP2's DTensor TP in rlc splits only the
    attention heads and the FFN width; Megatron with sequence parallelism splits everything."""
    h = arch.hidden_size
    return {"none": 4.0 * h, "selective": 2.0 * h, "full": float(h)}[recompute]


def activation_elements_per_token_layer(arch: ModelArch, recompute: str) -> float:
    """Activation elements stored for backward per token per layer (average layer).

    Adapted from Korthikanti et al. 2022 (arXiv 2205.05198, Table 2: sbh(34 + 5as/h) bytes per layer for
    GPT with dropout). For Qwen-style layers (RMSNorm, GQA, SwiGLU, no dropout) with fused/flash attention,
    which never stores the a·s² score matrix (the 5as/h term, as with selective recompute there), a layer
    keeps: 2 norm inputs + 2 norm outputs (4h), q/k/v ((n_q + 2·n_kv)·d_h), the attention output (n_q·d_h),
    and SwiGLU's gate, up and activation (3f). MoE layers keep, per routed copy (top-k), the permuted input
    and output (2h) and the expert's 3·f_e, plus shared experts and the fp32 router logits.
      none:      all of the above;
      selective: recompute the norms' outputs and the SwiGLU activation (drop 2h + one f);
      full:      keep only the layer input (h); one layer's full set is added once by the caller.
    """
    h = arch.hidden_size
    if recompute == "full":
        return float(h)
    a = arch.attention
    if a.kind == "mla":
        qk = (a.qk_nope_head_dim or 0) + (a.qk_rope_head_dim or 0)
        attn = (
            (a.q_lora_rank or 0)
            + (a.kv_lora_rank or 0)
            + (a.qk_rope_head_dim or 0)
            + 2 * arch.num_attention_heads * qk
            + 2 * arch.num_attention_heads * (a.v_head_dim or 0)
        )
    else:
        full = (arch.num_attention_heads * (3 if a.output_gate else 2) + 2 * arch.num_kv_heads) * arch.head_dim
        if a.kind == "linear-hybrid":
            nk, nv = a.linear_num_key_heads or 0, a.linear_num_value_heads or 0
            dk, dv = a.linear_key_head_dim or 0, a.linear_value_head_dim or 0
            linear = 2 * (2 * nk * dk + nv * dv) + 2 * nv * dv
            share = arch.num_full_attention_layers() / arch.num_layers
            attn = share * full + (1 - share) * linear
        else:
            attn = full
    moe_layers = sum(1 for i in range(arch.num_layers) if arch.layer_is_moe(i))
    moe_share = moe_layers / arch.num_layers
    dense_ffn, dense_act = 3 * arch.intermediate_size, arch.intermediate_size
    moe_ffn = moe_act = 0.0
    if arch.moe is not None:
        m = arch.moe
        fs = m.num_shared_experts * (m.shared_expert_intermediate_size or m.expert_intermediate_size)
        moe_ffn = m.experts_per_token * (2 * h + 3 * m.expert_intermediate_size) + 3 * fs + 2 * m.num_experts
        moe_act = m.experts_per_token * m.expert_intermediate_size + fs
    ffn = moe_share * moe_ffn + (1 - moe_share) * dense_ffn
    act = moe_share * moe_act + (1 - moe_share) * dense_act
    stored = 4 * h + attn + ffn
    if recompute == "selective":
        stored -= 2 * h + act
    return stored


def train_memory(
    sizes: ModelSizes,
    layout: TrainLayout,
    target: TargetProfile,
    *,
    logprob_chunk_tokens: int,
    lora_rank: int | None = None,
    lora_targets: str | list[str] = "all-linear",
    reference: bool = False,
    devices_per_node: int | None = None,
    resident_gib: float = 0.0,
) -> MemoryBreakdown:
    """The trainer's per-device peak during the training phase.

    Model states (ZeRO accounting, Rajbhandari et al. 2020). FSDP2 as rlc's trainer runs it: the sharded
    parameters are the master weights in the layout's param dtype (4 bytes for fp32), gradients are
    reduce-scattered in its reduce dtype (4), AdamW keeps two moments in the param dtype (8): 16 bytes per
    parameter over the dp·cp shard, the same total as mixed-precision ZeRO's 2 + 2 + 12. FSDP2 all-gathers
    up to two decoder layers (current + prefetched) and the root unit (embeddings, tied or separate head)
    in the compute dtype. Megatron with the distributed optimizer keeps bf16 weights (2) and fp32 main grads
    (4) per TP/PP/EP shard and the 12-byte optimizer sharded over its data-parallel ranks (DP·CP for dense,
    the expert-DP tp·cp·dp/(ep·etp) for experts); on the cpu target 4 + 4 + 8.
    LoRA: the frozen base keeps only weights; the adapters carry weights, grads and optimizer (same
    sharding). A KL reference without LoRA is one more frozen weight copy.
    Activations: `activation_elements_per_token_layer` × compute bytes × tokens per device (micro_batch_tokens/cp)
    × ceil(L/p) layers × p in-flight micro-batches on the first 1F1B stage. Megatron (sequence parallel)
    divides all of it by t; FSDP2's tensor parallelism splits heads and FFN width only, so the norms' share
    (`replicated_activation_elements`) stays whole. Full recompute adds one layer's complete set for the layer
    being recomputed.
    Logits: log-probs are computed in chunks of `logprob_chunk_tokens`, so chunk × V × 4 bytes × 3 (fp32
    logits, log-softmax, gradient) — never tokens × V; Megatron's vocab-parallel head divides V by t.
    Offload: FSDP2 parameter offload (CPUOffloadPolicy) keeps parameters, gradients and the optimizer step on
    the host; optimizer offload keeps AdamW's moments on the host and streams one FSDP unit's moments to the
    device for its update; host need is checked per node.
    `resident_gib`: memory another role keeps on the same device during this phase (colocated).
    """
    fsdp = layout.backend == "fsdp2"
    dense, expert = train_param_shard(sizes, layout)
    shard = dense + expert
    items: dict[str, float] = {}
    lora = lora_rank is not None
    if fsdp:
        p = layout.precision
        w_bytes, g_bytes, o_bytes, cb = p.param_bytes, p.reduce_bytes, 2 * p.param_bytes, p.compute_bytes
        opt_shard = shard
    else:
        b = dtype_bytes(target)
        w_bytes, g_bytes, o_bytes, cb = b, 4, 8 if target.kind == "cpu" else 12, b
        edp = max(1, layout.tp * layout.cp * layout.dp // layout.expert_shards)
        opt_shard = dense / (layout.dp * layout.cp) + expert / edp
    items["weights"] = gib(shard * w_bytes)
    items["grads"] = 0.0 if lora else gib(shard * g_bytes)
    items["optimizer"] = 0.0 if lora else gib(opt_shard * o_bytes)
    if fsdp and (layout.shard_group > 1 or cb != w_bytes):
        items["gather"] = gib((2 * sizes.max_layer / layout.tp + sizes.embedding + sizes.head) * cb)
    if lora:
        adapters = lora_params(sizes.arch, lora_rank or 0, lora_targets)
        split = layout.world_size if fsdp else layout.tp * layout.pp
        items["lora"] = gib(adapters / split * (w_bytes + g_bytes + o_bytes))
    if reference and not lora:
        items["reference"] = gib(shard * w_bytes)
    tokens = ceil(layout.micro_batch_tokens / layout.cp)
    arch = sizes.arch

    def per_token(recompute: str) -> float:
        total = sizes.act[recompute]
        if not fsdp:
            return total / layout.tp
        kept = replicated_activation_elements(arch, recompute)
        return kept + (total - kept) / layout.tp

    stage_layers = ceil(arch.num_layers / layout.pp)
    act = per_token(layout.recompute) * tokens * stage_layers * layout.pp
    if layout.recompute == "full":
        act += per_token("none") * tokens
    if lora:
        act += 2 * (lora_rank or 0) * len(LORA_MODULES) * tokens * stage_layers * layout.pp / layout.tp
    items["activations"] = gib(act * cb)
    chunk = min(logprob_chunk_tokens, tokens)
    items["logits"] = gib(chunk * arch.vocab_size / (1 if fsdp else layout.tp) * 4 * LOGIT_COPIES)
    host_per_device = 0.0
    if layout.offload_params:
        moved = ("weights", "grads", "optimizer") if fsdp else ("weights", "grads")
        host_per_device += sum(items[k] for k in moved)
        items.update({k: 0.0 for k in moved})
    if layout.offload_optimizer and items["optimizer"]:
        host_per_device += items["optimizer"]
        # One FSDP unit's moments at a time come to the device for its update.
        unit = max(sizes.max_layer / layout.tp, sizes.embedding + sizes.head) / layout.shard_group
        items["optimizer"] = gib(unit * o_bytes) if fsdp else 0.0
    if resident_gib:
        items["other_roles"] = resident_gib
    items["reserve"] = target.reserve_gib
    per_node = min(devices_per_node or target.devices_per_node, layout.world_size)
    host_cap = target.host_memory_gib * HOST_MEMORY_FRACTION
    host = host_per_device * per_node
    problems = ()
    if host > host_cap:
        problems = (f"offloaded train state {host:.0f} GiB per node > {host_cap:.0f} GiB of host memory",)
    return MemoryBreakdown("train", "train", items, target.usable_hbm_gib, host, host_cap, problems)


def train_state_gib(breakdown: MemoryBreakdown) -> float:
    """Weights, grads, optimizer, LoRA and reference on device: what a colocated switch moves to host."""
    return sum(breakdown.items.get(k, 0.0) for k in ("weights", "grads", "optimizer", "lora", "reference"))


# --------------------------------------------------------------------------------------------- rollout


@dataclass(frozen=True)
class RolloutLayout:
    """vLLM engines for one role: devices, TP per engine, expert parallel and the memory budget."""

    devices: int
    tp: int = 1
    ep: int = 1
    memory_fraction: float = 0.9
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 8192

    @property
    def engine_devices(self) -> int:
        """Devices per vLLM engine: TP, or the EP group (= TP × attention-DP) for MoE expert parallel."""
        return max(self.tp, self.ep)

    @property
    def replicas(self) -> int:
        return max(1, self.devices // self.engine_devices)

    @property
    def attention_dp(self) -> int:
        """Attention data-parallel ranks inside one EP engine (vLLM: EP = TP × DP)."""
        return self.engine_devices // self.tp

    def summary(self) -> str:
        """Engines, their TP (and EP) and vLLM's memory share: `4x vllm tp2 mem=0.90`."""
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        return f"{self.replicas}x vllm tp{self.tp}{ep} mem={self.memory_fraction:.2f}"


def kv_bytes_per_token_device(arch: ModelArch, tp: int, b: int, mtp: bool = False) -> float:
    """KV-cache bytes per token on one device of a TP group (vLLM).

    GQA: 2·L_full·n_kv·d_h·bytes split over t, but each rank keeps at least one KV head: heads per rank =
    ceil(n_kv / t) (vLLM replicates KV heads when t > n_kv). MLA caches one latent per token, replicated on
    every TP rank ((kv_lora_rank + rope)·L·bytes). MTP layers add their own KV.
    """
    total = arch.kv_bytes_per_token(b, include_mtp=mtp)
    if arch.attention.kind == "mla":
        return float(total)
    return total / arch.num_kv_heads * ceil(arch.num_kv_heads / tp)


def linear_state_bytes_device(arch: ModelArch, tp: int, b: int) -> float:
    """Per-sequence linear-attention state on one device (hybrid models), split over TP heads."""
    return arch.linear_state_bytes_per_sequence(b, 4) / tp


def rollout_weights_bytes(sizes: ModelSizes, tp: int, ep: int, b: int) -> float:
    """Engine weights per device: dense parts and vocab over TP, routed experts over EP (or TP when EP=1)."""
    dense = sizes.dense + sizes.embedding + sizes.head
    return (dense / tp + sizes.expert / (ep if ep > 1 else tp)) * b


def engine_workspace_bytes(arch: ModelArch, tp: int, tokens: int, seqs: int, b: int) -> float:
    """Activation peak of vLLM's profile run at `tokens` batched tokens, plus sampler logits.

    vLLM sizes the KV cache as fraction × HBM − weights − this peak (vllm-ascend tutorials: "available
    kv_cache = gpu_memory_utilization × HBM − peak HBM of a profile run with max_num_batched_tokens"). The
    forward keeps the residual, a norm output and the widest intermediate (q/k/v or gate+up over t) alive:
    tokens × (2h + max(qkv, 2f)/t) × bytes; the sampler holds fp32 logits for `seqs` rows (two copies).
    """
    h = arch.hidden_size
    f = arch.intermediate_size
    if arch.moe is not None:
        f = max(arch.moe.expert_intermediate_size * arch.moe.experts_per_token, f if arch.moe.first_dense_layers else 0)
    qkv = (arch.num_attention_heads + 2 * arch.num_kv_heads) * arch.head_dim
    widest = max(qkv, 2 * f) / tp
    return tokens * (2 * h + widest) * b + seqs * arch.vocab_size * 4 * 2


def rollout_memory(
    sizes: ModelSizes,
    layout: RolloutLayout,
    target: TargetProfile,
    *,
    max_model_len: int,
    mtp: bool = False,
    lora_rank: int | None = None,
    lora_targets: str | list[str] = "all-linear",
    resident_gib: float = 0.0,
    role: str = "rollout",
    prompt_logprobs: bool = False,
    planned_context: float | None = None,
) -> tuple[MemoryBreakdown, int]:
    """A vLLM engine device's memory and the sequences it can hold at `max_model_len`.

    vLLM owns `memory_fraction` × device memory: weights (bf16 / t; experts / ep), the MTP drafter's layer,
    LoRA slots, the profiled activation workspace and graph pool, and the KV cache filling the rest (vLLM
    docs, gpu_memory_utilization). Outside it sit the reserve and, for forward-only teachers that return
    prompt log-probs, the fp32 [batched tokens × V] log-softmax (two copies) that vLLM's profile run does not
    exercise (the MOPD recipe keeps teacher utilisation at 0.5 because of this transient).
    Returns the breakdown and the concurrent sequences per attention rank at `planned_context` (default
    `max_model_len`): floor(KV / (KV bytes per token · context + linear state)). vLLM allocates KV blocks as
    sequences grow, so concurrency follows the mean length; the check that matters for start-up is that one
    full `max_model_len` sequence fits (vLLM refuses to start otherwise), which is a problem when it fails.
    """
    b = dtype_bytes(target)
    arch = sizes.arch
    items: dict[str, float] = {"weights": gib(rollout_weights_bytes(sizes, layout.tp, layout.ep, b))}
    if mtp:
        items["mtp"] = gib(sizes.mtp * b / layout.tp)
    if lora_rank:
        adapters = lora_params(arch, lora_rank, lora_targets)
        slots = adapters * b / layout.tp
        punica = layout.max_num_batched_tokens * lora_rank * len(LORA_MODULES) * b
        items["lora"] = gib(slots + punica)
    seqs_for_sampler = layout.max_num_seqs or 256
    graph = 0.0 if target.kind == "cpu" else ENGINE_GRAPH_GIB
    items["workspace"] = (
        gib(engine_workspace_bytes(arch, layout.tp, layout.max_num_batched_tokens, seqs_for_sampler, b)) + graph
    )
    owned = layout.memory_fraction * target.usable_hbm_gib
    kv = owned - sum(items.values())
    items["kv_cache"] = max(kv, 0.0)
    if prompt_logprobs:
        items["logprob_logits"] = gib(layout.max_num_batched_tokens * arch.vocab_size * 4 * 2)
    if resident_gib:
        items["other_roles"] = resident_gib
    items["reserve"] = target.reserve_gib
    per_token = kv_bytes_per_token_device(arch, layout.tp, b, mtp)
    state = linear_state_bytes_device(arch, layout.tp, b)
    per_seq = per_token * max_model_len + state
    full = int(max(kv, 0.0) * GIB // per_seq) if per_seq else 0
    planned = per_token * (planned_context or max_model_len) + state
    seqs = int(max(kv, 0.0) * GIB // planned) if planned else 0
    problems: tuple[str, ...] = ()
    if kv <= 0:
        problems = (
            f"{role} weights and workspace {owned - kv:.1f} GiB exceed its share "
            f"{layout.memory_fraction:.2f} × {target.usable_hbm_gib:.1f} = {owned:.1f} GiB",
        )
    elif full < 1:
        problems = (
            f"{role} KV cache {kv:.1f} GiB cannot hold one {max_model_len}-token sequence ({gib(per_seq):.1f} GiB)",
        )
    breakdown = MemoryBreakdown(role, "rollout", items, target.usable_hbm_gib, problems=problems)
    return breakdown, seqs


def max_memory_fraction(target: TargetProfile, outside_gib: float = 0.0) -> float:
    """Largest vLLM share that leaves the reserve (and anything else outside vLLM) free."""
    return (target.usable_hbm_gib - target.reserve_gib - outside_gib) / target.usable_hbm_gib
