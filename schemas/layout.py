"""The trainer's parallel layout: one typed contract from the planner to the trainer that builds it.

The planner searches over `TrainLayout`s, prices them (memory, time), writes the winner into the plan, and the
trainer builds exactly that layout: a device mesh with these degrees, this precision, recompute and offload.
After start-up the trainer reports the layout it really built and the run stops if the two differ.

The shape follows torchtitan's ParallelDims: `world_size = dp · cp · tp · pp` with the mesh laid out
``(pp, dp, cp, tp)``, tp innermost (so tensor-parallel peers are neighbouring devices, inside one node).
FSDP2 shards parameters over the flattened ``dp × cp`` ranks (context-parallel ranks hold different tokens
of the same sequences, so their gradients are summed like data-parallel ones).

The divisibility and topology rules live here once: the spec rules (`compiler/rules.py`), the search and the
memory model call the same functions, so a layout the search proposes is one the rules accept.
`runtime_gaps` is the capability table: what the runtime can execute per backend and platform.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from rlc.schemas.arch import ModelArch

Backend = Literal["fsdp2", "megatron"]
CpKind = Literal["ulysses", "ring"]
Recompute = Literal["none", "selective", "full"]
DType = Literal["float32", "bfloat16"]
PlatformName = Literal["cpu", "cuda", "npu"]

#: Bytes per element of each dtype the layout can name.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2}

#: Mesh dimension names, outermost first; tensor parallelism is innermost (neighbouring devices).
MESH_DIMS: tuple[str, ...] = ("pp", "dp", "cp", "tp")


class Precision(BaseModel):
    """Which dtype each kind of training tensor is held in.

    FSDP2 keeps the sharded parameters in `param_dtype` (they are the optimizer's master weights, and AdamW's
    moments share their dtype), all-gathers them in `compute_dtype` for forward and backward (its
    MixedPrecisionPolicy), and reduce-scatters gradients in `reduce_dtype`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    param_dtype: DType = Field("float32", description="Sharded parameters, master weights and optimizer state.")
    compute_dtype: DType = Field("float32", description="All-gathered weights and activations in forward/backward.")
    reduce_dtype: DType = Field("float32", description="Gradient reduction across data/context-parallel ranks.")

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def reduce_bytes(self) -> int:
        return DTYPE_BYTES[self.reduce_dtype]

    def summary(self) -> str:
        """`bf16` when only the compute dtype differs from fp32 params, else every dtype."""
        short = {"float32": "fp32", "bfloat16": "bf16"}
        if self.param_dtype == self.reduce_dtype == "float32":
            return short[self.compute_dtype]
        return f"{short[self.param_dtype]}/{short[self.compute_dtype]}/{short[self.reduce_dtype]}"


FP32 = Precision()
BF16 = Precision(compute_dtype="bfloat16")


class TrainLayout(BaseModel):
    """A trainer layout: devices, parallel degrees, backend, precision, recompute, offload and token budget."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    world_size: int = Field(ge=1, description="Training devices (one process each).")
    backend: Backend = Field("fsdp2", description="fsdp2 (PyTorch FSDP2 + DTensor) or megatron.")
    tp: int = Field(1, ge=1, description="Tensor parallel degree (innermost mesh dimension, inside a node).")
    pp: int = Field(1, ge=1, description="Pipeline parallel degree.")
    cp: int = Field(1, ge=1, description="Context parallel degree: a micro-batch's tokens split over cp ranks.")
    cp_kind: CpKind = Field(
        "ulysses",
        description="ulysses: all-to-all of attention heads (needs heads divisible by tp·cp); ring: K/V blocks "
        "passed around the cp ranks with an online softmax (no head constraint).",
    )
    ep: int = Field(1, ge=1, description="Expert parallel degree (MoE).")
    recompute: Recompute = Field("none", description="Activation recomputation granularity.")
    offload_params: bool = Field(False, description="Parameters and gradients live in host memory (FSDP2 offload).")
    offload_optimizer: bool = Field(False, description="Optimizer state lives in host memory between steps.")
    micro_batch_tokens: int = Field(4096, ge=1, description="Tokens of one packed micro-batch, before the CP split.")
    precision: Precision = Field(default_factory=Precision, description="Dtypes of parameters, compute, reduction.")

    @model_validator(mode="after")
    def _consistent(self) -> TrainLayout:
        group = self.tp * self.pp * self.cp
        if self.world_size % group:
            raise ValueError(f"tp({self.tp})·pp({self.pp})·cp({self.cp})={group} does not divide {self.world_size}")
        return self

    @property
    def dp(self) -> int:
        """Data-parallel degree: world_size / (tp · pp · cp)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def shard_group(self) -> int:
        """Ranks FSDP2 shards parameters over: dp · cp (torchtitan's dp_shard_cp)."""
        return self.dp * self.cp

    @property
    def etp(self) -> int:
        """Expert tensor parallel: experts also split over TP when EP·TP fits in one stage's ranks.

        Megatron's default (ETP = TP) and MindSpeed's moe_tp_extend_ep both split each expert group over
        tp·ep ranks, which needs ep | cp·dp; otherwise verl/Megatron recipes set ETP = 1 and EP carves the
        tp·cp·dp ranks of a stage (e.g. Qwen3-235B TP2·CP8·EP16). The fsdp2 trainer never splits an expert over
        TP (ETP 1: `fsdp2_runs_ep`).
        """
        if self.backend == "fsdp2" or (self.ep > 1 and (self.cp * self.dp) % self.ep):
            return 1
        return self.tp

    @property
    def expert_shards(self) -> int:
        return self.ep * self.etp

    def mesh_shape(self) -> dict[str, int]:
        """Mesh dimensions, outermost first: {pp, dp, cp, tp}."""
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}

    def coordinates(self, rank: int) -> dict[str, int]:
        """A rank's position in the mesh (row-major over MESH_DIMS, tp fastest)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        out: dict[str, int] = {}
        rest = rank
        for name in reversed(MESH_DIMS):
            size = self.mesh_shape()[name]
            out[name] = rest % size
            rest //= size
        return {name: out[name] for name in MESH_DIMS}

    def summary(self) -> str:
        """Every choice that tells two trainer layouts apart: `fsdp2 tp2 pp1 cp2(ring) dp1 recompute=full ...`."""
        cp = f"cp{self.cp}" + (f"({self.cp_kind})" if self.cp > 1 and self.cp_kind != "ulysses" else "")
        text = f"{self.backend} tp{self.tp} pp{self.pp} {cp} dp{self.dp}"
        text += f" ep{self.ep}" if self.ep > 1 else ""
        text += f" recompute={self.recompute} mbt={self.micro_batch_tokens}"
        off = "+".join(n for n, on in (("params", self.offload_params), ("opt", self.offload_optimizer)) if on)
        text += f" offload={off}" if off else ""
        return text + (f" {self.precision.summary()}" if self.precision != FP32 else "")


# --------------------------------------------------------------------------------------------- rules


def tp_problem(arch: ModelArch, tp: int) -> str | None:
    """TP splits attention heads: it must divide them, and KV heads must split or replicate evenly."""
    heads, kv = arch.num_attention_heads, arch.num_kv_heads
    if heads % tp:
        return f"TP({tp}) does not divide {arch.id}'s {heads} attention heads"
    if kv % tp and tp % kv:
        return f"TP({tp}) and {kv} KV heads: neither divides the other, so KV heads cannot be split or replicated"
    return None


def cp_problem(arch: ModelArch, tp: int, cp: int, kind: CpKind) -> str | None:
    """Ulysses CP moves heads between ranks, so tp·cp must divide the heads; ring CP has no head constraint."""
    if cp == 1 or kind == "ring":
        return None
    heads = arch.num_attention_heads
    if heads % (tp * cp):
        return (
            f"TP({tp})·CP({cp})={tp * cp} does not divide {arch.id}'s {heads} attention heads "
            "(Ulysses context parallelism splits heads; ring context parallelism does not)"
        )
    return None


def split_layers(num_layers: int, stages: int) -> list[range]:
    """The decoder layers each pipeline stage holds: contiguous runs, as even as possible (earlier stages take the
    remainder, as Megatron's even split). The trainer (`runtime/train/pipeline`) and the dry run read it here."""
    if stages > num_layers:
        raise ValueError(f"{stages} pipeline stages for {num_layers} layers")
    base, extra = divmod(num_layers, stages)
    runs, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        runs.append(range(start, start + size))
        start += size
    return runs


def pp_problem(arch: ModelArch, pp: int) -> str | None:
    if pp > arch.num_layers:
        return f"PP({pp}) exceeds {arch.id}'s {arch.num_layers} layers"
    return None


def ep_problem(arch: ModelArch, ep: int) -> str | None:
    if ep == 1:
        return None
    if arch.moe is None:
        return f"EP({ep}) on dense model {arch.id}: expert parallelism needs a mixture-of-experts model"
    if arch.moe.num_experts % ep:
        return f"EP({ep}) does not divide {arch.id}'s {arch.moe.num_experts} experts"
    return None


def group_problem(world_size: int, tp: int, pp: int, cp: int) -> str | None:
    group = tp * pp * cp
    if world_size % group:
        return f"TP({tp})·PP({pp})·CP({cp})={group} does not divide {world_size} training devices"
    return None


def tp_topology_problem(tp: int, devices_per_node: int) -> str | None:
    if tp > devices_per_node:
        return f"TP({tp}) spans more than one node ({devices_per_node} devices per node)"
    return None


def default_cp_kind(arch: ModelArch, tp: int, cp: int) -> CpKind:
    """Ulysses where the heads allow it (fewer, larger collectives), else ring."""
    return "ulysses" if cp_problem(arch, tp, cp, "ulysses") is None else "ring"


def layout_problems(layout: TrainLayout, arch: ModelArch, devices_per_node: int) -> list[str]:
    """Every rule `layout` breaks for `arch` on nodes of `devices_per_node` devices (empty: valid)."""
    checks = (
        tp_problem(arch, layout.tp),
        cp_problem(arch, layout.tp, layout.cp, layout.cp_kind),
        pp_problem(arch, layout.pp),
        ep_problem(arch, layout.ep),
        tp_topology_problem(layout.tp, devices_per_node),
    )
    found = [c for c in checks if c]
    if layout.ep > 1 and (layout.tp * layout.cp * layout.dp) % layout.ep:
        found.append(f"EP({layout.ep}) does not divide the tp·cp·dp={layout.tp * layout.cp * layout.dp} ranks")
    return found


# --------------------------------------------------------------------------------------------- capabilities

#: What the FSDP2 runtime builds, per dimension. Anything else in a plan is a gap (`runtime_gaps`).
FSDP2_RECOMPUTE: tuple[str, ...] = ("none", "full")


def backend_recomputes(backend: str) -> tuple[str, ...]:
    """Recompute granularities a backend implements: FSDP2 checkpoints whole decoder layers (full) or none;
    Megatron also recomputes selectively (attention core only)."""
    return FSDP2_RECOMPUTE if backend == "fsdp2" else ("none", "selective", "full")


def fsdp2_runs_tp(tp: int, kv_heads: int, hybrid: bool = False) -> bool:
    """FSDP2's DTensor TP splits K/V projections by head (no KV-head replication; LoRA adapters split with the
    projection they wrap) and has no plan for Gated-DeltaNet layers, so it runs TP only where tp divides the KV
    heads, on models without linear attention (`hybrid`). Latent attention splits its up-projections by heads."""
    return tp == 1 or (kv_heads % tp == 0 and not hybrid)


def linear_heads(arch: ModelArch) -> tuple[int, int] | None:
    """(key heads, value heads) of a hybrid model's linear-attention layers; None for models without them."""
    a = arch.attention
    if a.kind != "linear-hybrid":
        return None
    return (a.linear_num_key_heads or 1, a.linear_num_value_heads or 1)


# The trainer's kernel seams, named per platform. The runtime picks from these names only (its kernels carry them:
# `runtime/train/linear_attention.kernels_for`, `varlen_attention.attention_kernel_for`,
# `expert_parallel.expert_kernel_for`) and the dry run prints the table, so what it says is what can run.
#: Gated-DeltaNet token mixers (the short causal conv and the chunked gated delta rule) over packed rows.
TORCH_LINEAR_KERNELS = "torch chunked delta rule and conv1d, split at cu_seqlens"
FLA_LINEAR_KERNELS = "flash-linear-attention (fla-core) Triton varlen chunk_gated_delta_rule and causal_conv1d"
FLA_ASCEND_LINEAR_KERNELS = (
    "flash-linear-attention (fla-core) Triton-Ascend varlen chunk_gated_delta_rule and causal_conv1d"
)
#: Causal attention over packed rows.
VARLEN_SDPA_ATTENTION = "rlc varlen SDPA (one causal SDPA call per sequence length)"
FLASH_ATTN_ATTENTION = "flash-attn varlen (transformers flash_attention_2)"
NPU_FUSION_ATTENTION = "torch_npu npu_fusion_attention TND varlen (transformers flash_attention_2)"
#: The routed experts' GEMMs on rows grouped by expert.
TORCH_EXPERT_KERNEL_NAME = "torch loop (one GEMM pair per local expert)"
GROUPED_MM_EXPERT_KERNEL = "torch grouped_mm (bfloat16; the loop for other dtypes)"
NPU_GROUPED_MATMUL_EXPERT_KERNEL = "torch_npu npu_grouped_matmul"

#: Kernel seams of the trainer, in the order the dry run names them.
KERNEL_SEAMS: tuple[str, ...] = ("gated_deltanet", "attention", "experts")


class KernelChoice(BaseModel):
    """What runs at one seam on one platform: `preferred` where its package imports, else `fallback` (None: the
    trainer refuses to start, naming the package)."""

    model_config = ConfigDict(frozen=True)

    preferred: str
    needs: str = ""
    fallback: str | None = None

    def names(self) -> tuple[str, ...]:
        """Every kernel name the runtime may report for this seam."""
        return (self.preferred,) if self.fallback is None else (self.preferred, self.fallback)

    def statement(self) -> str:
        """The dry run's words: the kernel, what it needs, and what runs without it."""
        if not self.needs:
            return self.preferred
        otherwise = f"else {self.fallback}" if self.fallback else "refused otherwise, naming the package"
        return f"{self.preferred} where {self.needs}; {otherwise}"


#: Per platform and seam, what the trainer runs. Nothing for one platform imports another's package: npu never
#: reaches causal-conv1d, flash-attn or fla's CUDA backends (`tests/runtime/test_kernel_seams.py` walks it).
PLATFORM_KERNELS: dict[str, dict[str, KernelChoice]] = {
    "cpu": {
        "gated_deltanet": KernelChoice(preferred=TORCH_LINEAR_KERNELS),
        "attention": KernelChoice(preferred=VARLEN_SDPA_ATTENTION),
        "experts": KernelChoice(preferred=TORCH_EXPERT_KERNEL_NAME),
    },
    "cuda": {
        "gated_deltanet": KernelChoice(preferred=FLA_LINEAR_KERNELS, needs="fla-core 0.6 imports (import fla)"),
        "attention": KernelChoice(
            preferred=FLASH_ATTN_ATTENTION, needs="flash-attn imports", fallback=VARLEN_SDPA_ATTENTION
        ),
        "experts": KernelChoice(
            preferred=GROUPED_MM_EXPERT_KERNEL,
            needs="torch has _grouped_mm, on an sm90+ GPU",
            fallback=TORCH_EXPERT_KERNEL_NAME,
        ),
    },
    "npu": {
        "gated_deltanet": KernelChoice(
            preferred=FLA_ASCEND_LINEAR_KERNELS,
            needs="fla-core 0.6 and triton-ascend import",
            fallback=TORCH_LINEAR_KERNELS,
        ),
        "attention": KernelChoice(preferred=NPU_FUSION_ATTENTION),
        "experts": KernelChoice(
            preferred=NPU_GROUPED_MATMUL_EXPERT_KERNEL,
            needs="torch_npu has npu_grouped_matmul",
            fallback=TORCH_EXPERT_KERNEL_NAME,
        ),
    },
}


def experts_over_tp(ep: int, tp: int) -> int:
    """How many TP ranks the fsdp2 trainer splits a MoE layer's experts over: all of them where TP divides EP (as
    Megatron's EP groups take the TP ranks at expert TP 1), else none (each TP rank then computes the experts of
    its column for the tokens TP peers share)."""
    return tp if tp > 1 and ep % tp == 0 else 1


def ep_column(ep: int, tp: int) -> int:
    """The EP ranks of one TP column (the all-to-all group that dispatches tokens): EP over the TP ranks that
    `experts_over_tp` takes."""
    return ep // experts_over_tp(ep, tp)


def fsdp2_runs_ep(ep: int, tp: int, cp: int, dp: int) -> bool:
    """FSDP2's expert parallelism (`runtime/train/expert_parallel`) splits the experts over the TP ranks where TP
    divides EP (`experts_over_tp`), then over `ep_column` neighbouring dp·cp ranks of each TP column: every CP
    rank of ep_column/cp data-parallel ranks. So it needs cp | ep_column and (ep_column/cp) | dp."""
    column = ep_column(ep, tp)
    return ep == 1 or column == 1 or (column % cp == 0 and dp % (column // cp) == 0)


def pipeline_gaps(layout: TrainLayout, hybrid: bool, colocated: bool) -> list[str]:
    """What the fsdp2 runtime's pipeline parallelism (`runtime/train/pipeline`, 1F1B) cannot build under `layout`:
    it splits the layers of a model without linear attention into stages (each stage with its layers' LoRA
    adapters, if any), composed with data, tensor, context and expert parallelism and recompute."""
    if layout.pp == 1 or not hybrid:
        return []
    return [f"pipeline parallelism (PP {layout.pp}) on the fsdp2 backend is not built with Gated-DeltaNet layers"]


def moe_gaps(layout: TrainLayout) -> list[str]:
    """What the fsdp2 runtime cannot build for a mixture-of-experts model under `layout`.

    It runs the experts with data, context and expert parallelism (`fsdp2_runs_ep`), EP taking the TP ranks where
    TP divides it. LoRA runs under all of them: its adapters sit on the attention, dense and shared-expert linears
    (`runtime/train/lora.moe_targets`), the routed experts and routers frozen without adapters.
    """
    gaps = []
    if not fsdp2_runs_ep(layout.ep, layout.tp, layout.cp, layout.dp):
        gaps.append(
            f"EP {layout.ep} with TP {layout.tp}, CP {layout.cp} and DP {layout.dp}: the fsdp2 backend splits the "
            "experts over the TP ranks when TP divides EP, then over every CP rank of data-parallel ranks, so CP "
            "must divide the rest of EP and its quotient must divide DP"
        )
    return gaps


def linear_attention_gaps(layout: TrainLayout, heads: tuple[int, int]) -> list[str]:
    """What the fsdp2 runtime cannot build for a hybrid model's Gated-DeltaNet layers under `layout`.

    Its packed forward (`runtime/train/linear_attention`) runs data parallelism and Ulysses context parallelism
    (all tokens of a share of the heads per rank: the convolution is per channel, the recurrence per head).
    Ring CP would pass the recurrent state from rank to rank, and TP would need the fused q/k/v projection split
    head by head; neither is built.
    """
    key, value = heads
    gaps = []
    if layout.tp > 1:
        gaps.append(
            f"tensor parallelism (TP {layout.tp}) over Gated-DeltaNet layers is not built on the fsdp2 backend: "
            "hybrid models train with data and Ulysses context parallelism"
        )
    if layout.cp > 1 and layout.cp_kind == "ring":
        gaps.append(
            f"ring context parallelism (CP {layout.cp}) over Gated-DeltaNet layers would pass the recurrent state "
            "between ranks, which is not built: use cp_kind ulysses"
        )
    elif layout.cp > 1 and (key % layout.cp or value % layout.cp):
        gaps.append(
            f"Ulysses CP {layout.cp} splits the Gated-DeltaNet heads over ranks: {key} key / {value} value heads do "
            "not divide"
        )
    return gaps


def latent_attention_gaps(layout: TrainLayout) -> list[str]:
    """What the fsdp2 runtime cannot build for a multi-head latent attention (DeepSeek-V3/R1) model under `layout`:
    nothing beyond what other models lack.

    Its packed forward runs transformers' MLA with query/key heads wider than value heads, under data, Ulysses
    and ring context (values zero-padded to the key width in the ring's blocks), expert and pipeline
    parallelism, and tensor parallelism: the up-projections split by heads, the down-projections and their norms
    whole on every TP rank, the shared rotary key's gradient summed over TP (`runtime/train/parallelize`).
    """
    del layout
    return []


def runtime_gaps(
    layout: TrainLayout,
    platform: PlatformName,
    *,
    lora: bool = False,
    kv_heads: int | None = None,
    linear_heads: tuple[int, int] | None = None,
    moe: bool = False,
    latent: bool = False,
    colocated: bool = False,
) -> list[str]:
    """What `rlc run` cannot execute about this layout on `platform`, one sentence each (empty: it runs).

    The capability table: FSDP2 runs data, tensor (DTensor, KV heads split not replicated) and
    context parallelism (Ulysses everywhere; ring on cpu), expert parallelism for MoE models (`moe_gaps`),
    pipeline parallelism (`pipeline_gaps`), full
    or no recompute, parameter and optimizer offload, fp32 or bf16 compute. The Megatron backend is planned (its
    memory and time models size very large runs) but not executed yet. `kv_heads` is checked when known;
    `linear_heads` (key, value) marks a hybrid model, whose Gated-DeltaNet layers add `linear_attention_gaps`;
    `moe` marks a mixture-of-experts model; `latent` a multi-head latent attention model (`latent_attention_gaps`);
    `colocated` a plan whose engines share the trainer's devices; `lora` a LoRA run (its adapters are split with the
    projections they wrap under TP and stay with their layers' pipeline stage; on MoE models they skip the
    routed experts and routers).
    """
    gaps: list[str] = []
    if layout.backend == "megatron":
        gaps.append(
            "the megatron backend is planned but not executed: rlc's trainer runs FSDP2 only "
            f"(this layout: {layout.summary()})"
        )
        return gaps
    gaps += pipeline_gaps(layout, linear_heads is not None, colocated)
    if moe:
        gaps += moe_gaps(layout)
    elif layout.ep > 1:
        gaps.append(f"expert parallelism (EP {layout.ep}) needs a mixture-of-experts model")
    if layout.tp > 1 and kv_heads is not None and kv_heads % layout.tp:
        gaps.append(
            f"TP {layout.tp} beyond the model's {kv_heads} KV heads needs KV-head replication, which the fsdp2 "
            "backend does not implement"
        )
    if layout.recompute not in FSDP2_RECOMPUTE:
        gaps.append(f"recompute={layout.recompute}: the fsdp2 backend recomputes whole layers (full) or nothing")
    if layout.cp > 1 and layout.cp_kind == "ring" and platform != "cpu":
        gaps.append(
            f"ring context parallelism on {platform}: rlc's ring attention is a plain-torch blockwise kernel "
            "(for cpu); accelerators need a fused kernel that returns its log-sum-exp, not wired yet"
        )
    if linear_heads is not None:
        gaps += linear_attention_gaps(layout, linear_heads)
    if latent:
        gaps += latent_attention_gaps(layout)
    return gaps
