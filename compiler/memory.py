"""Per-device memory model: what each role holds on one device, item by item, in GiB.

The planner must never emit a plan that runs out of memory, so every role's peak is summed from named
items (weights, gradients, optimizer states, activations, logits, KV cache, workspaces, reserve) and compared
with the device's usable memory. Each function states its formula and source; the numbers are estimates with
the target's `reserve_gib` as the margin for what they leave out (communication buffers, fragmentation).
Pure functions only: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from math import ceil

from rlc.schemas.arch import ModelArch
from rlc.schemas.layout import TrainLayout
from rlc.schemas.target import TargetProfile

GIB = 1024**3

#: Share of host RAM the planner lets offloaded states take (the rest is for the OS, Ray, data, pinned buffers).
HOST_MEMORY_FRACTION = 0.8

#: Runtime/graph workspace of a vLLM engine outside the profiled activations (ACL graph / CUDA graph pools,
#: sampler state), GiB. vllm-ascend and vLLM capture graphs after the profile run has sized the KV cache, so
#: the pool lands outside gpu_memory_utilization's budget (the OOM reports in deployments.yaml are of that
#: kind); ~0.5 GiB is what their logs report for decode-only graphs at the default capture sizes. 0 on cpu.
ENGINE_GRAPH_GIB = 0.5

#: Logits copies kept per token while computing log-probs with a backward pass: fp32 logits, the softmax
#: (log-softmax) output, and the gradient w.r.t. the logits.
LOGIT_COPIES = 3

#: How far above an even share of an MoE layer's routed rows the busiest expert-parallel rank receives. GShard
#: (Lepikhin et al. 2020) and Switch (Fedus et al. 2021) size expert buffers at capacity factors 1.0-2.0; rlc's
#: dispatch drops no tokens, so its buffers follow the router: 1.5 prices a router that a load-balancing loss
#: keeps near even.
EP_IMBALANCE = 1.5

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
    #: Elements HF (transformers) decoder layers keep per token for backward: what the FSDP2 trainer stores.
    act_hf: float = 0.0
    #: Layers with full attention (a KV cache); hybrid models' linear layers excluded. Counted once here
    #: because the search asks for it per candidate layout.
    full_attention_layers: int = 0
    #: Decoder-layer parameters (every layer) the fsdp2 trainer's TP keeps whole on each TP rank, beyond the norms
    #: the model counts as split: latent attention's down-projections and latent norms (`tp_whole_params`).
    tp_whole: int = 0

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
        act_hf=hf_activation_elements_per_token_layer(arch),
        full_attention_layers=arch.num_full_attention_layers(),
        tp_whole=arch.num_layers * tp_whole_params(arch),
    )


def tp_whole_params(arch: ModelArch) -> int:
    """Parameters of one decoder layer that the fsdp2 trainer's tensor parallelism keeps whole on every TP rank
    (and computes on each): latent attention's down-projections h·r_q + h·(r_kv + rope) and the latents' norms
    r_q + r_kv, whose outputs every head shares (`runtime/train/parallelize`); 0 for other attention."""
    a, h = arch.attention, arch.hidden_size
    if a.kind != "mla":
        return 0
    q = (h + 1) * a.q_lora_rank if a.q_lora_rank else 0
    r_kv = a.kv_lora_rank or 0
    return q + h * (r_kv + (a.qk_rope_head_dim or 0)) + r_kv


def lora_params(arch: ModelArch, rank: int, targets: str | list[str]) -> int:
    """Trainable LoRA parameters: Σ over adapted linears of r·(d_in + d_out) (Hu et al. 2021, eq. 3).

    `all-linear` adapts q/k/v/o and gate/up/down of every layer; for MoE models the routed experts are left
    out (PEFT's all-linear skips fused expert weights) and the shared experts' / dense layers' FFN counts.
    MLA and linear-attention layers are approximated by their q/k/v/o-equivalent widths.
    """
    f = arch.intermediate_size
    if arch.moe is not None:
        f = arch.moe.num_shared_experts * (
            arch.moe.shared_expert_intermediate_size or arch.moe.expert_intermediate_size
        )
    names = targets if targets == "all-linear" else tuple(targets)
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return _lora_params(arch.hidden_size, q, kv, f, arch.num_layers, rank, names)


@lru_cache(maxsize=256)
def _lora_params(h: int, q: int, kv: int, f: int, layers: int, rank: int, targets: str | tuple[str, ...]) -> int:
    """`lora_params` of the widths that decide it (the search asks thousands of times for one model)."""
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
    return per_layer * layers


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


def fsdp2_gathered_layer(sizes: ModelSizes, layout: TrainLayout) -> float:
    """Parameters of the largest decoder layer as FSDP2 all-gathers it on one device: its dense part over TP, and
    under expert parallelism only the rank's 1/ep of the routed experts (they are gathered over the efsdp ranks).
    What TP keeps whole (`tp_whole_params`) is gathered whole."""
    whole = sizes.tp_whole / sizes.layers
    if sizes.arch.moe is None or layout.ep == 1:
        return (sizes.max_layer - whole) / layout.tp + whole
    experts = sizes.expert / max(1, sizes.layers - sizes.arch.moe.first_dense_layers)
    return (sizes.max_layer - experts - whole) / layout.tp + whole + experts / layout.ep


def train_param_shard(sizes: ModelSizes, layout: TrainLayout) -> tuple[float, float]:
    """Parameters on the most loaded device, split as (dense incl. embeddings, routed experts).

    FSDP2 (ZeRO-3, Rajbhandari et al. 2020; rlc's trainer): decoder-layer weights are split by TP (colwise
    q/k/v/gate/up, rowwise o/down) and every parameter is sharded over the dp·cp ranks, so a device holds
    (layers/t + embedding + head)/(dp·cp); embeddings and norms are not tensor-parallel there (norms are counted
    split, they are small), nor latent attention's down-projections (`tp_whole_params`, counted whole).
    Megatron (Narayanan et al. 2021; megatron/training/theoretical_memory_usage.py): a stage holds
    ceil(L/p) layers; dense parts split by t, routed experts by ep·etp; the first stage adds the embedding and
    the last the LM head (both when p == 1), vocab-parallel over t.
    """
    if layout.backend == "fsdp2":  # a pipeline stage holds its 1/pp of the layers and every root weight
        layers = sizes.total - sizes.embedding - sizes.head
        split = ((layers - sizes.tp_whole) / layout.tp + sizes.tp_whole) / layout.pp
        return (split + sizes.embedding + sizes.head) / layout.shard_group, 0.0
    per_layer = 1 / sizes.layers
    stage_layers = ceil(sizes.layers / layout.pp)
    vocab = sizes.embedding + sizes.head if layout.pp == 1 else max(sizes.embedding, sizes.head or sizes.embedding)
    dense = (sizes.dense * per_layer * stage_layers + vocab) / layout.tp
    expert = sizes.expert * per_layer * stage_layers / layout.expert_shards
    return dense, expert


def hf_activation_elements_per_token_layer(arch: ModelArch) -> float:
    """Activation elements a transformers decoder layer keeps per token for backward (the FSDP2 trainer's).

    `activation_elements_per_token_layer` counts what fused kernels keep (Megatron). The HF modules keep more,
    each op saving its own inputs. Counted from Qwen3/Llama's modeling code, per token:
      norms: input, normalised value and output of both RMSNorms: 6h;
      q and k: the projection's output, then (with QK-norm) the norm's normalised value and output, the
        rotate_half copy and the rotary output: 5·(n_q + n_kv)·d_h with QK-norm, 3·(n_q + n_kv)·d_h without;
      v: n_kv·d_h; the attention output and the copy reshaped for o_proj: 2·n_q·d_h;
      SwiGLU: gate, up, act(gate) and act(gate)·up: 4f.
    Linear-attention layers of hybrid models keep the fused-kernel count. Measured on the cpu target (2-layer
    hidden-128 model, fp32, 6K-12K-token micro-batches, tests/runtime/test_layout_memory.py): 2,918 elements per
    token per layer against 3,072 counted here.
    """
    if arch.attention.kind == "mla":
        return activation_elements_per_token_layer(arch, "none")
    h, d, f = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_attention_heads * d, arch.num_kv_heads * d
    q_width = q * (2 if arch.attention.output_gate else 1)
    full = (5 if arch.attention.qk_norm else 3) * (q_width + kv) + kv + 2 * q
    share = arch.num_full_attention_layers() / arch.num_layers
    attn = share * full + (1 - share) * _linear_attention_elements(arch)
    if arch.moe is not None:  # routed experts are Megatron's; keep the fused count for the FFN there
        return 6 * h + attn + activation_elements_per_token_layer(arch, "none") - 4 * h - _fused_attention(arch)
    return 6 * h + attn + 4 * f


def replicated_activation_elements(arch: ModelArch, recompute: str) -> float:
    """The part of a layer's stored activations that tensor parallelism without sequence parallelism does not
    split: the RMSNorms' inputs, normalised values and outputs and the two all-reduced projection outputs (8h;
    4h under selective recompute, which drops the norms' values), or the layer input under full recompute
    (h). FSDP2's DTensor TP in rlc splits only the attention heads and the FFN width, so latent attention's
    latents (r_q + r_kv + rope, as `_fused_attention` counts them) stay whole too; Megatron with sequence
    parallelism splits everything."""
    h = arch.hidden_size
    if recompute == "full":
        return float(h)
    a = arch.attention
    latents = (a.q_lora_rank or 0) + (a.kv_lora_rank or 0) + (a.qk_rope_head_dim or 0) if a.kind == "mla" else 0
    return {"none": 8.0 * h, "selective": 4.0 * h}[recompute] + latents


def _linear_attention_elements(arch: ModelArch) -> float:
    """Fused-kernel activations of one linear-attention layer per token (hybrid models), 0 otherwise."""
    a = arch.attention
    if a.kind != "linear-hybrid":
        return 0.0
    nk, nv = a.linear_num_key_heads or 0, a.linear_num_value_heads or 0
    dk, dv = a.linear_key_head_dim or 0, a.linear_value_head_dim or 0
    return float(2 * (2 * nk * dk + nv * dv) + 2 * nv * dv)


def _fused_attention(arch: ModelArch) -> float:
    """The attention part of `activation_elements_per_token_layer`: q/k/v and the output (MLA's latents), the
    full-attention share of a hybrid model's layers and the linear share."""
    a = arch.attention
    if a.kind == "mla":
        qk = (a.qk_nope_head_dim or 0) + (a.qk_rope_head_dim or 0)
        return float(
            (a.q_lora_rank or 0)
            + (a.kv_lora_rank or 0)
            + (a.qk_rope_head_dim or 0)
            + 2 * arch.num_attention_heads * qk
            + 2 * arch.num_attention_heads * (a.v_head_dim or 0)
        )
    full = (arch.num_attention_heads * (3 if a.output_gate else 2) + 2 * arch.num_kv_heads) * arch.head_dim
    if a.kind != "linear-hybrid":
        return float(full)
    share = arch.num_full_attention_layers() / arch.num_layers
    return share * full + (1 - share) * _linear_attention_elements(arch)


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
    attn = _fused_attention(arch)
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
    sync_group: bool = False,
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
    Activations, per device, in the compute dtype, for tokens = micro_batch_tokens / cp. Megatron:
    `activation_elements_per_token_layer` (fused kernels, Korthikanti et al.) × tokens × ceil(L/p) layers × p
    in-flight micro-batches on the first 1F1B stage, all divided by t (sequence parallel); full recompute adds
    one layer's complete set for the layer being recomputed. FSDP2: `hf_activation_elements_per_token_layer`
    (what transformers' modules keep) × tokens × L, plus 2h of hidden-state gradients in backward; its tensor
    parallelism splits heads and FFN width only, so the norms' and the all-reduced outputs' share
    (`replicated_activation_elements`) stays whole; full recompute keeps h per layer and rebuilds one.
    Logits: log-probs are computed in chunks of `logprob_chunk_tokens`, so chunk × V × 4 bytes × 3 (fp32
    logits, log-softmax, gradient) — never tokens × V; Megatron's vocab-parallel head divides V by t.
    Offload: FSDP2 parameter offload (CPUOffloadPolicy) keeps parameters, gradients and the optimizer step on
    the host; optimizer offload keeps AdamW's moments on the host and streams one FSDP unit's moments to the
    device for its update; host need is checked per node.
    `resident_gib`: memory another role keeps on the same device during this phase (colocated).
    `sync_group`: rank 0 also holds the weight-sync broadcast group's buffers (the target's sync_group_gib).
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
        items["gather"] = gib((2 * fsdp2_gathered_layer(sizes, layout) + sizes.embedding + sizes.head) * cb)
    if lora:
        adapters = lora_params(sizes.arch, lora_rank or 0, lora_targets)
        split = layout.world_size if fsdp else layout.tp * layout.pp
        items["lora"] = gib(adapters / split * (w_bytes + g_bytes + o_bytes))
    if reference and not lora:
        items["reference"] = gib(shard * w_bytes)
    tokens = ceil(layout.micro_batch_tokens / layout.cp)
    arch = sizes.arch

    stage_layers = ceil(arch.num_layers / layout.pp)
    if fsdp:
        # HF layers: every layer's stored set; backward frees each saved tensor as it makes the gradient that
        # replaces it, so on top only the incoming and outgoing hidden-state gradients (2h) are live (measured
        # on the cpu target). Full recompute keeps each layer's input and rebuilds one layer at a time.
        kept = replicated_activation_elements(arch, "none")
        layer = kept + (sizes.act_hf - kept) / layout.tp
        backward = 2 * arch.hidden_size
        stored = arch.hidden_size if layout.recompute == "full" else layer
        # A pipeline stage keeps its layers' activations for up to pp micro-batches in flight (1F1B, first stage).
        kept_layers = stage_layers * layout.pp if layout.pp > 1 else arch.num_layers
        act = stored * tokens * kept_layers + (layer if layout.recompute == "full" else 0.0) * tokens
        act += backward * tokens
    else:
        act = sizes.act[layout.recompute] / layout.tp * tokens * stage_layers * layout.pp
        if layout.recompute == "full":
            act += sizes.act["none"] / layout.tp * tokens
    if lora:
        act += 2 * (lora_rank or 0) * len(LORA_MODULES) * tokens * stage_layers * layout.pp / layout.tp
    items["activations"] = gib(act * cb)
    if fsdp and arch.moe is not None and layout.ep > 1:
        # One MoE layer's dispatch in flight: the rows sent (tokens · k · h) and the busiest rank's rows received.
        rows = tokens * arch.moe.experts_per_token * arch.hidden_size
        items["ep_buffers"] = gib(rows * (1 + EP_IMBALANCE) * cb)
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
    allocated = sum(items.values())
    if target.allocator_overhead:
        items["margin"] = target.allocator_overhead * allocated
    if resident_gib:
        items["other_roles"] = resident_gib
    if sync_group and target.sync_group_gib:
        items["sync_group"] = target.sync_group_gib
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
    #: The engines run without graph capture (vLLM enforce_eager): host-launched kernels every decode step.
    eager: bool = False

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

    def cores_per_node(self, dpn: int) -> int:
        """Engine cores per node of an engine whose attention data parallelism spans whole nodes (vLLM runs such an
        engine as a front end plus, on each node, that node's cores, each driving its TP devices); 0 for any other
        engine (within one node, or TP across nodes)."""
        if self.engine_devices <= dpn or self.attention_dp == 1 or dpn % self.tp or self.engine_devices % dpn:
            return 0
        return dpn // self.tp

    def summary(self) -> str:
        """Engines, their TP (and EP) and vLLM's memory share: `4x vllm tp2 mem=0.90`."""
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        eager = " eager" if self.eager else ""
        return f"{self.replicas}x vllm tp{self.tp}{ep} mem={self.memory_fraction:.2f}{eager}"


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
    workspace = engine_workspace_bytes(arch, layout.tp, layout.max_num_batched_tokens, seqs_for_sampler, b)
    items["workspace"] = gib(workspace)
    owned = layout.memory_fraction * target.usable_hbm_gib
    kv = owned - sum(items.values())
    items["kv_cache"] = max(kv, 0.0)
    items.update(engine_outside_items(sizes, layout.tp, target, max_model_len))
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


def engine_outside_items(sizes: ModelSizes, tp: int, target: TargetProfile, max_model_len: int) -> dict[str, float]:
    """What a vLLM engine device needs beside its gpu_memory_utilization share, GiB.

    graph: the graph pool captured after the KV cache is sized (ENGINE_GRAPH_GIB). prefill: the longest
    prefill's transient, one full `max_model_len` sequence's K/V on this device gathered for the attention of
    its last chunk (kv bytes per token · max_model_len). [UNCERTAIN] a stated model, calibrated on vllm-ascend
    issue 3357 (Qwen3-235B TP16, 98K max_model_len: OOM at 0.95 on a ~90K-token prompt, where this transient is
    4.4 GiB and 0.95 leaves 0.05 GiB beside the reserve); 0 on cpu, where the budget is a convention.
    """
    if target.kind == "cpu":
        return {}
    b = dtype_bytes(target)
    prefill = gib(kv_bytes_per_token_device(sizes.arch, tp, b) * max_model_len)
    return {"graph": ENGINE_GRAPH_GIB, "prefill": prefill}


def max_memory_fraction(target: TargetProfile, outside_gib: float = 0.0) -> float:
    """Largest vLLM share that leaves the reserve (and anything else outside vLLM) free."""
    return (target.usable_hbm_gib - target.reserve_gib - outside_gib) / target.usable_hbm_gib
