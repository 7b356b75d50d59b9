"""Build the plan's trainer layout on a loaded HF model: device mesh, tensor parallelism, recompute, FSDP2.

The order is torchtitan's: tensor parallelism first (DTensor, per decoder layer), then activation
checkpointing, then FSDP2 over the flattened dp·cp ranks with the layout's mixed precision and offload
policies. The model arrives on the host, and its parameters reach the device shard by shard: DTensor's
`distribute_tensor` (TP) and the EP split place local shards on the mesh's device, and `fully_shard` moves each
unit's parameters and buffers there as it shards them, so the device never holds more than one unit unsharded
(moving the whole model first would need it all on one device, which large MoE models do not fit).
`describe_built` reads the result back from the objects themselves (mesh shape, parameter placements and
dtypes, FSDP policies, checkpointing flags), so `layout.json` records what was built, not what was asked for,
and `rlc run` can compare the two.

Tensor parallelism on Qwen-style layers: q/k/v and gate/up are split column-wise (by heads / FFN width),
o and down row-wise, so each layer does one all-reduce after attention and one after the FFN; embeddings,
norms and the LM head stay whole (sharded by FSDP only). Qwen3's per-head q/k RMSNorm then sees only local
heads, so the gradients of its (shared) weights are partial per TP rank and are summed over the TP group
after backward (`sum_partial_grads`). A LoRA-wrapped projection is split through its parts (`_lora_tp_plan`):
lora_B with a column-wise base, lora_A with a row-wise one (one more, rank-sized, all-reduce), the other factor
whole. A whole module feeding a column-wise one gets its full gradient on every TP rank: the column-wise input
is replicated, so its backward all-reduces the input gradient.

Multi-head latent attention (DeepSeek-V2/V3) makes every head's query, key and value from latents all heads
share: the up-projections (``q_b_proj``, or ``q_proj`` without a query latent, and ``kv_b_proj``) are split
column-wise by heads and ``o_proj`` row-wise, while the down-projections (``q_a_proj``, ``kv_a_proj_with_mqa``)
and the latents' norms stay whole, computed alike on every TP rank. The rotary part of the key is the one latent
that reaches the heads without a column-wise projection (every head adds the same rotary key), so its gradient is
summed over TP where the down-projection makes it (`CopyToTP`). DeepSeek's shared expert is split like a dense
MLP.

Expert parallelism (`expert_parallel`) splits the dp·cp ranks into EP groups of `ep` neighbours (torchtitan's
layout: EP spans data-parallel ranks and every context-parallel rank of them) and the ``efsdp`` ranks that hold
the same experts; each MoE layer's experts are their own FSDP unit over the efsdp ranks. With TP the experts are
split over the TP ranks first where TP divides EP (`schemas/layout.experts_over_tp`), else each TP rank computes
them whole. Under pipeline parallelism (`pipeline`) the stages are the outermost mesh dimension and each stage
shards only its own layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rlc.schemas.layout import TrainLayout, ep_column, experts_over_tp, fsdp2_runs_ep

from ..platform import Platform
from .expert_parallel import CopyToTP, expert_modules, install_expert_parallel
from .linear_attention import linear_attention_modules

__all__ = [
    "TrainerMesh",
    "apply_layout",
    "attention_layers",
    "build_mesh",
    "decoder_layers",
    "describe_built",
    "sum_partial_grads",
]

#: Column-wise (output-split) and row-wise (input-split) projections of a Qwen/Llama decoder layer, and of a
#: DeepSeek one: latent attention's up-projections (by heads) and the shared expert (by width).
COLWISE = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.q_b_proj",
    "self_attn.kv_b_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.shared_experts.gate_proj",
    "mlp.shared_experts.up_proj",
)
ROWWISE = ("self_attn.o_proj", "mlp.down_proj", "mlp.shared_experts.down_proj")
#: Latent attention's kv down-projection: its output ends in the rotary key every head shares.
LATENT_KV_DOWN = "self_attn.kv_a_proj_with_mqa"
#: Per-head norms whose weights are shared by all heads: partial gradients under tensor parallelism.
PER_HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")


@dataclass
class TrainerMesh:
    """The device mesh of one trainer rank and the process groups the trainer talks over."""

    layout: TrainLayout
    world: Any  # DeviceMesh with dims (dp, cp, tp), or (efsdp, edp, cp, tp) under expert parallelism
    shard: Any  # DeviceMesh FSDP2 shards over: dp·cp flattened
    coords: dict[str, int]
    ep: Any = None  # the mesh the experts are split over, when ep > 1: edp·cp flattened, and tp where it takes TP
    ep_dispatch: Any = None  # the all-to-all mesh of a TP column (edp·cp flattened; None: no dispatch, TP alone)
    expert_shard: Any = None  # the ranks holding the same experts, which FSDP2 shards them over
    pp: Any = None  # the pipeline stages of this rank's data-parallel share, when pp > 1

    @property
    def tp_group(self) -> Any:
        return self.world.get_group("tp")

    @property
    def cp_group(self) -> Any:
        return self.world.get_group("cp")

    @property
    def shard_group(self) -> Any:
        return self.shard.get_group()

    @property
    def tp_mesh(self) -> Any:
        return self.world["tp"]


def build_mesh(layout: TrainLayout, platform: Platform, rank: int) -> TrainerMesh:
    """The (dp, cp, tp) mesh over every trainer rank, tp innermost, and the flattened dp·cp shard mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.get_world_size() != layout.world_size:
        raise RuntimeError(f"the trainer group has {dist.get_world_size()} ranks, the layout {layout.world_size}")
    # Pipeline stages are the outermost dimension (a stage's data-parallel ranks are neighbours); without PP the
    # mesh keeps its three (or four) dimensions.
    pp: tuple[int, ...] = (layout.pp,) if layout.pp > 1 else ()
    pp_name: tuple[str, ...] = ("pp",) if layout.pp > 1 else ()
    if layout.ep == 1:
        world = init_device_mesh(
            platform.device_type, (*pp, layout.dp, layout.cp, layout.tp), mesh_dim_names=(*pp_name, "dp", "cp", "tp")
        )
        shard = world["dp", "cp"]._flatten("dp_cp")
        stages = world["pp"] if pp else None
        return TrainerMesh(layout, world, shard, layout.coordinates(rank), pp=stages)
    if not fsdp2_runs_ep(layout.ep, layout.tp, layout.cp, layout.dp):
        raise ValueError(f"expert parallel {layout.ep} is not one the fsdp2 trainer builds ({layout.summary()})")
    # The experts split over the TP ranks where TP divides EP, then over a TP column's EP group: every CP rank of
    # edp neighbouring data-parallel ranks (`schemas.layout.fsdp2_runs_ep`).
    over_tp, column = experts_over_tp(layout.ep, layout.tp), ep_column(layout.ep, layout.tp)
    edp = column // layout.cp if column > 1 else 1
    world = init_device_mesh(
        platform.device_type,
        (*pp, layout.dp // edp, edp, layout.cp, layout.tp),
        mesh_dim_names=(*pp_name, "efsdp", "edp", "cp", "tp"),
    )
    world["efsdp", "edp"]._flatten("dp")
    shard = world["efsdp", "edp", "cp"]._flatten("dp_cp")
    if over_tp > 1:
        # With the TP ranks the expert split is (edp, cp, tp), tp fastest; the all-to-all stays in a TP column.
        ep = world["edp", "cp", "tp"]._flatten("ep")
        dispatch = world["edp", "cp"]._flatten("ep_column") if column > 1 else None
        # Ranks holding the same experts: efsdp, and with no column (EP = TP) every CP rank too, which is dp·cp.
        expert_shard = shard if column == 1 else world["efsdp"]
    else:
        ep = dispatch = world["edp", "cp"]._flatten("ep")
        expert_shard = world["efsdp"]
    stages = world["pp"] if pp else None
    return TrainerMesh(
        layout,
        world,
        shard,
        layout.coordinates(rank),
        ep=ep,
        ep_dispatch=dispatch,
        expert_shard=expert_shard,
        pp=stages,
    )


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find decoder layers on {type(model).__name__}")
    return list(layers)


def attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Decoder layers whose token mixer is softmax attention (``self_attn``): every layer of a dense model, the
    full-attention layers of a hybrid one (its Gated-DeltaNet layers hold ``linear_attn``)."""
    return [layer for layer in decoder_layers(model) if hasattr(layer, "self_attn")]


def _has(layer: torch.nn.Module, name: str) -> bool:
    """Whether `layer` has submodule `name` (an MoE layer's MLP is its experts and router, not gate/up/down)."""
    try:
        layer.get_submodule(name)
    except AttributeError:
        return False
    return True


def _apply_tensor_parallel(model: torch.nn.Module, mesh: TrainerMesh) -> set[str]:
    """Split every decoder layer's projections over the TP mesh; returns the per-head norm weights' names."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cfg = model.config
    tp = mesh.layout.tp
    kv = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    if cfg.num_attention_heads % tp or kv % tp:
        raise ValueError(
            f"tensor parallel {tp} needs the {cfg.num_attention_heads} attention heads and {kv} KV heads divisible"
        )
    if any(hasattr(layer, "linear_attn") for layer in decoder_layers(model)):
        raise NotImplementedError("tensor parallelism over Gated-DeltaNet layers is not built on the fsdp2 backend")
    for layer in decoder_layers(model):
        if not any(True for _ in layer.parameters()):  # a layer another pipeline stage holds
            continue
        plan: dict[str, Any] = {name: ColwiseParallel() for name in COLWISE if _has(layer, name)}
        plan.update({name: RowwiseParallel() for name in ROWWISE if _has(layer, name)})
        parallelize_module(layer, mesh.tp_mesh, _lora_tp_plan(layer, plan))
        if _has(layer, LATENT_KV_DOWN):
            rope = int(cfg.qk_rope_head_dim)
            layer.get_submodule(LATENT_KV_DOWN).register_forward_hook(_sum_rotary_key_grad(rope, mesh.tp_group))
    return {
        name
        for name, p in model.named_parameters()
        if p.requires_grad and any(f"{norm}." in name for norm in PER_HEAD_NORMS)
    }


def _sum_rotary_key_grad(rope: int, group: Any) -> Any:
    """A forward hook for latent attention's kv down-projection under TP: its output's last `rope` features, the
    rotary key, feed only this rank's heads, so their gradient is summed over the TP group; the latent before them
    reaches ``kv_b_proj``, whose column-wise input already sums its gradient."""

    def hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        latent, key = output.split([output.shape[-1] - rope, rope], dim=-1)
        return torch.cat([latent, CopyToTP.apply(key, group)], dim=-1)

    return hook


def _lora_tp_plan(layer: torch.nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """`plan` with each LoRA-wrapped projection's entry split over its parts (a PEFT ``LoraLayer`` is no Linear).

    ``y = W x + s · B (A x)``. Column-wise W: B column-wise too, so both terms come out split alike, and A whole
    (its input is the replicated x, and B's input gradient is all-reduced before it reaches A, so A's gradient is
    whole and equal on every TP rank). Row-wise W: A row-wise over the split input with its rank-r output
    all-reduced, then B whole; W's own all-reduce makes the sum whole. With LoRA dropout, TP peers draw the same
    masks (every rank seeds torch alike and draws alike), so the whole factor's copies stay equal.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out: dict[str, Any] = {}
    for name, style in plan.items():
        module = layer.get_submodule(name)
        if not (hasattr(module, "base_layer") and hasattr(module, "lora_A")):
            out[name] = style
            continue
        out[f"{name}.base_layer"] = style
        split = "lora_B" if isinstance(style, ColwiseParallel) else "lora_A"
        for adapter in getattr(module, split):
            out[f"{name}.{split}.{adapter}"] = ColwiseParallel() if split == "lora_B" else RowwiseParallel()
    return out


def mesh_device(mesh: Any) -> torch.device:
    """The device this rank's part of `mesh` lives on (as FSDP2 and DTensor place it): the current one of the
    mesh's device type."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def apply_layout(model: torch.nn.Module, mesh: TrainerMesh, platform: Platform) -> list[torch.nn.Parameter]:
    """TP, recompute and FSDP2 per the layout, in place, on a model still on the host (each shard moves to the
    device as it is made). Returns parameters whose grads are partial per TP rank.

    One FSDP unit per decoder layer overlaps each layer's all-gather with the previous compute; the root unit
    holds embeddings, final norm and (tied) LM head.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    layout = mesh.layout
    partial = _apply_tensor_parallel(model, mesh) if layout.tp > 1 else set()
    experts = set()
    if layout.ep > 1:
        tp_group = mesh.tp_group if experts_over_tp(layout.ep, layout.tp) > 1 else None
        installed = install_expert_parallel(model, mesh.ep, mesh_device(mesh.ep), mesh.ep_dispatch, tp_group)
        experts = {id(m) for m in installed}
    if layout.recompute == "full":
        # Whole decoder layers are recomputed in backward (non-reentrant checkpointing works under FSDP2).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif layout.recompute != "none":
        raise ValueError(f"recompute={layout.recompute} is not implemented on the fsdp2 backend")
    precision = layout.precision
    mp = MixedPrecisionPolicy(
        param_dtype=getattr(torch, precision.compute_dtype), reduce_dtype=getattr(torch, precision.reduce_dtype)
    )
    # pin_memory needs an accelerator; on cpu the host *is* the device.
    offload = CPUOffloadPolicy(pin_memory=platform.name != "cpu") if layout.offload_params else OffloadPolicy()
    for layer in decoder_layers(model):
        if not any(True for _ in layer.parameters()):  # a layer another pipeline stage holds
            continue
        for module in layer.modules():
            if id(module) in experts:
                # Reduced over the efsdp ranks only, its gradient already summed over the EP group's tokens: the
                # dp·cp divisor makes it the same global mean as every other weight's (see expert_parallel). Over
                # several ranks a divisor other than their count is a pre-multiplied sum, which gloo lacks: sum,
                # then divide (one rank divides its own copy either way).
                fully_shard(module, mesh=mesh.expert_shard, mp_policy=mp, offload_policy=offload)
                module.set_gradient_divide_factor(float(layout.shard_group))
                module.set_force_sum_reduction_for_comms(mesh.expert_shard.size() > 1)
        fully_shard(layer, mesh=mesh.shard, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh.shard, mp_policy=mp, offload_policy=offload)
    # FSDP2 replaced the parameters with sharded ones: look the partial ones up again by name.
    return [p for name, p in model.named_parameters() if name in partial]


def sum_partial_grads(params: list[torch.nn.Parameter], mesh: TrainerMesh) -> None:
    """Sum the per-head norms' gradient shards over the TP group (each TP rank saw only its heads)."""
    if mesh.layout.tp == 1:
        return
    for p in params:
        if p.grad is None:
            continue
        local = p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
        dist.all_reduce(local, group=mesh.tp_group)


@dataclass
class BuiltLayout:
    """What one rank really built, read back from its model and mesh (`layout.json`)."""

    rank: int
    coords: dict[str, int]
    mesh: dict[str, int]
    tp: int
    shard_group: int
    cp: int
    cp_kind: str | None
    param_dtype: str
    compute_dtype: str
    reduce_dtype: str
    recompute: str
    offload_params: bool
    offload_optimizer: bool
    attention: str
    ep: int
    pp: int
    extra: dict[str, Any] = field(default_factory=dict)


def _expert_shards(model: torch.nn.Module) -> int:
    """How many ranks the first MoE layer's experts are split over (1: a dense model, or experts not split)."""
    experts = expert_modules(model)
    if not experts:
        return 1
    weight = experts[0].gate_up_proj
    names = list(getattr(getattr(weight, "device_mesh", None), "mesh_dim_names", None) or ())
    return int(weight.device_mesh.size(names.index("ep"))) if "ep" in names else 1


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else "float32"


def describe_built(
    model: torch.nn.Module,
    mesh: TrainerMesh,
    rank: int,
    cp_kind: str | None,
    offload_optimizer: bool,
    compute_dtype_seen: torch.dtype | None,
) -> BuiltLayout:
    """Read the layout back from the objects: mesh, a projection's placements, FSDP policies, checkpointing.

    `compute_dtype_seen` is the dtype a decoder layer's weight had during a forward (the all-gathered copy);
    None means no forward has run yet, and the FSDP policy's dtype is reported instead. `offload_optimizer`:
    whether the optimizer keeps its moments in host memory between steps.
    """
    layer = attention_layers(model)[0]
    linear = linear_attention_modules(model)
    # a latent-attention layer with a query latent projects its heads in q_b_proj (its q_proj is None)
    query = (
        "self_attn.q_proj"
        if isinstance(getattr(layer.self_attn, "q_proj", None), torch.nn.Module)
        else "self_attn.q_b_proj"
    )
    weight = layer.get_submodule(query).weight
    placements = getattr(weight, "placements", ())
    weight_mesh = getattr(weight, "device_mesh", None)
    names = list(getattr(weight_mesh, "mesh_dim_names", None) or ())
    tp = weight_mesh.size(names.index("tp")) if "tp" in names else 1
    shard = weight_mesh.size(names.index("dp_cp")) if "dp_cp" in names else (weight_mesh.size() if weight_mesh else 1)
    group = model._get_fsdp_state()._fsdp_param_group  # the root FSDP unit's policies
    mp, offload = group.mp_policy, group.offload_policy
    from torch.distributed.fsdp import CPUOffloadPolicy

    world = mesh.world
    return BuiltLayout(
        rank=rank,
        coords=dict(mesh.coords),
        mesh={n: int(world[n].size()) for n in ("dp", "cp", "tp")},
        pp=int(mesh.pp.size()) if mesh.pp is not None else 1,
        tp=int(tp),
        shard_group=int(shard),
        cp=int(world["cp"].size()),
        ep=_expert_shards(model),
        cp_kind=cp_kind,
        param_dtype=_dtype_name(weight.dtype),
        compute_dtype=_dtype_name(compute_dtype_seen or mp.param_dtype or weight.dtype),
        reduce_dtype=_dtype_name(mp.reduce_dtype or weight.dtype),
        recompute="full" if getattr(layer, "gradient_checkpointing", False) else "none",
        offload_params=isinstance(offload, CPUOffloadPolicy),
        # Moments follow parameters that FSDP2 keeps on the host; otherwise the optimizer keeps them there.
        offload_optimizer=offload_optimizer or isinstance(offload, CPUOffloadPolicy),
        attention=str(model.config._attn_implementation),
        extra={
            "q_proj_placements": [str(p) for p in placements],
            "linear_attention_layers": len(linear),
            "linear_attention_kernels": linear[0]._rlc_kernels.name if linear else None,
        },
    )
