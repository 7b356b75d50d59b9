"""The plan's roles: trainer, rollout engines and teachers, each with its devices, layout, memory and engine
arguments, and the colocated offload steps."""

from __future__ import annotations

from rlc.compiler import routing, search
from rlc.compiler.engine_config import engine_args, engine_env, trainer_env
from rlc.compiler.memory import MemoryBreakdown
from rlc.compiler.ray_placement import placement_ids
from rlc.compiler.resolve import Problem
from rlc.compiler.rounding import r3, significant
from rlc.schemas import layout as layout_lib
from rlc.schemas.arch import ModelArch
from rlc.schemas.plan import (
    ExpertLayers,
    LatentAttention,
    LinearAttentionLayers,
    Memory,
    ModelSettings,
    OffloadStep,
    Parallel,
    RayPlacement,
    Role,
    TeacherSettings,
)
from rlc.schemas.spec import ModelRef

#: AdamW's moment decay rates and epsilon: PyTorch's defaults, which verl's and AReaL's FSDP actors keep too.
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
#: How a rank's sequences are packed into micro-batches: first-fit decreasing, the fewest micro-batches under the
#: token budget (`runtime/packing.py`; "kk" balances them instead).
PACKING_ALGORITHM = "ffd"


def model_path(problem: Problem, ref: ModelRef, arch: ModelArch) -> tuple[str, bool]:
    """Local folder for a model; on cpu the tiny model is built under the run directory when none is given."""
    if ref.path:
        return ref.path, False
    if problem.target.kind == "cpu" and arch.family == "rlc":
        return f"{problem.spec.run_dir}/model", True
    hub = [a for a in arch.aliases if "/" in a]
    return (hub[0] if hub else arch.id), False


def model_settings(problem: Problem, ref: ModelRef, arch: ModelArch) -> ModelSettings:
    path, build = model_path(problem, ref, arch)
    return ModelSettings(
        id=arch.id,
        path=path,
        hf_architecture=arch.hf_architecture,
        params_b=significant(arch.total_params() / 1e9),
        vocab_size=arch.vocab_size,
        build_tiny=build,
        tiny_max_positions=arch.max_position_embeddings if build else None,
        linear_attention=linear_attention_layers(arch),
        experts=expert_layers(arch),
        latent_attention=latent_attention(arch),
        layers=arch.num_layers,
    )


def expert_layers(arch: ModelArch) -> ExpertLayers | None:
    """The plan's record of an MoE model's routed experts (None for dense models)."""
    if arch.moe is None:
        return None
    return ExpertLayers(
        layers=arch.num_layers - arch.moe.first_dense_layers,
        num_experts=arch.moe.num_experts,
        experts_per_token=arch.moe.experts_per_token,
        routing_id_bytes=routing.routing_id_bytes(arch.moe.num_experts),
    )


def latent_attention(arch: ModelArch) -> LatentAttention | None:
    """The plan's record of a multi-head latent attention model's heads (None for other attention)."""
    a = arch.attention
    if a.kind != "mla":
        return None
    nope, rope, value = a.qk_nope_head_dim or 0, a.qk_rope_head_dim or 0, a.v_head_dim or 0
    return LatentAttention(
        kv_lora_rank=a.kv_lora_rank or 1,
        q_lora_rank=a.q_lora_rank,
        qk_head_dim=nope + rope,
        qk_rope_head_dim=rope,
        v_head_dim=value,
    )


def linear_attention_layers(arch: ModelArch) -> LinearAttentionLayers | None:
    """The plan's record of a hybrid model's Gated-DeltaNet layers (None for models without them)."""
    a = arch.attention
    if a.kind != "linear-hybrid":
        return None
    return LinearAttentionLayers(
        layers=arch.num_linear_attention_layers(),
        full_attention_interval=a.full_attention_interval or 1,
        key_heads=a.linear_num_key_heads or 1,
        value_heads=a.linear_num_value_heads or 1,
    )


def memory_model(b: MemoryBreakdown, phase: str) -> Memory:
    items = {k: r3(v) for k, v in b.items.items()}
    return Memory(items=items, total_gib=r3(sum(items.values())), capacity_gib=r3(b.capacity_gib), phase=phase)


def offload_steps(problem: Problem, colocated: bool, best: search.Candidate, keeps_base: bool) -> list[OffloadStep]:
    """Colocated phase transitions; on cpu (no sleep mode) both phases stay resident.

    The engine's weights are discarded while the trainer works (vLLM sleep level 2; the in-place sync refills
    them), except where the engine serves LoRA adapters: an adapter sync never resends the base, so the base
    goes to host memory and back (level 1, priced by `cost.engine_offload_s`).
    """
    if not colocated or problem.target.kind == "cpu":
        return []
    wake, sleep = ("onload", "offload") if keeps_base else ("wake", "sleep")
    steps = [
        OffloadStep(phase="before_rollout", action="offload", what="params"),
        OffloadStep(phase="before_rollout", action="offload", what="grads"),
        OffloadStep(phase="before_rollout", action="offload", what="optimizer"),
        OffloadStep(phase="before_rollout", action=wake, what="rollout_weights"),
        OffloadStep(phase="before_rollout", action="wake", what="kv_cache"),
        OffloadStep(phase="before_train", action="sleep", what="kv_cache"),
        OffloadStep(phase="before_train", action=sleep, what="rollout_weights"),
        OffloadStep(phase="before_train", action="onload", what="params"),
    ]
    if not best.train.layout.offload_optimizer:
        steps.append(OffloadStep(phase="before_train", action="onload", what="optimizer"))
    return steps


def actor_role(problem: Problem, best: search.Candidate, placements: dict[str, RayPlacement]) -> Role:
    """The trainer role: its layout exactly as the trainer builds it, memory, time split and notes."""
    spec, tl, mem, t = problem.spec, best.train.layout, best.train.memory, best.train.time
    notes = [
        f"{tl.summary()}: fastest fitting trainer layout on {tl.world_size} devices",
        f"peak {mem.total_gib:.3g} of {mem.capacity_gib:.3g} GiB",
    ]
    if tl.offload_params or tl.offload_optimizer:
        notes.append(f"host memory for offloaded state: {mem.host_gib_per_node:.0f} GiB per node")
    algo = spec.algorithm
    if algo.minibatches > 1:
        proximal = ", after a forward pass for the proximal log-probs" if algo.decoupled_loss else ""
        notes.append(f"{algo.minibatches} optimizer steps per training step (algorithm.minibatches){proximal}")
    replay = routing.decide(problem)
    if replay is not None:
        notes.append(routing.replay_note(replay))
    return Role(
        name="actor",
        kind="train",
        devices=tl.world_size,
        placement=placement_ids(best.train_start, tl.world_size, problem.devices_per_node),
        parallel=Parallel(tp=tl.tp, pp=tl.pp, cp=tl.cp, ep=tl.ep, dp=tl.dp),
        layout=layout_lib.TrainLayout.model_validate(tl.model_dump()),
        ray=placements["actor"],
        backend=tl.backend,
        replicas=tl.dp,
        memory=memory_model(mem, "train"),
        env=trainer_env(problem, mem.total_gib, mem.capacity_gib),
        engine={
            "logprob_chunk_tokens": spec.train.logprob_chunk_tokens,
            "packing": spec.train.packing,
            "packing_algorithm": PACKING_ALGORITHM,
            "packed_attention": "varlen",
            "betas": list(ADAM_BETAS),
            "eps": ADAM_EPS,
            "etp": tl.etp,
            **(
                {"router_aux_loss_coef": spec.train.router_aux_loss_coef, "routing_replay": replay.replay}
                if replay is not None
                else {}
            ),
        },
        estimates={
            "train_s": r3(best.train.seconds),
            "compute_s": r3(t.compute_s),
            "pp_bubble": r3(t.bubble),
            "comm_s": r3(t.tp_s + t.cp_s + t.ep_s + t.dp_s),
            "offload_s": r3(t.offload_s),
        },
        notes=notes,
    )


def _engine_backend(problem: Problem) -> str:
    return "vllm-ascend" if problem.target.kind == "npu" else "vllm"


def rollout_role(
    problem: Problem,
    ctx: search.Context,
    best: search.Candidate,
    placements: dict[str, RayPlacement],
    model_path: str,
) -> Role:
    """The rollout engines: TP/EP, vLLM arguments verbatim, KV budget and throughput."""
    rl = best.rollout.layout
    lora_mode = search.lora_rollout_mode(problem)
    replay = routing.decide(problem)
    capture = replay.capture if replay is not None and replay.replay == "rollout" else None
    return Role(
        name="rollout",
        kind="rollout",
        devices=rl.devices,
        placement=placement_ids(best.rollout_start, rl.devices, problem.devices_per_node),
        parallel=Parallel(tp=rl.tp, ep=rl.ep, dp=rl.replicas),
        ray=placements["rollout"],
        backend=_engine_backend(problem),
        replicas=rl.replicas,
        memory=memory_model(best.rollout.memory, "rollout"),
        engine=engine_args(
            problem,
            model_path,
            rl,
            colocated=best.mode == "colocated",
            lora=lora_mode == "adapter",
            teacher=False,
            routing_capture=capture,
        ),
        env=engine_env(problem, rl, routing_capture=capture),
        estimates={
            "rollout_s": r3(best.step.rollout_s),
            "decode_step_s": r3(best.rollout.time.step_s),
            "concurrent_seqs": float(best.rollout.time.concurrency),
            "generated_tokens_per_s": r3(best.rollout.time.tokens_per_s),
            **_routing_estimates(problem, ctx, capture),
        },
        notes=[
            f"{rl.replicas} engine(s) of {rl.engine_devices} device(s), TP {rl.tp}"
            + (f", EP {rl.ep}" if rl.ep > 1 else ""),
            f"KV cache {best.rollout.memory.items.get('kv_cache', 0):.1f} GiB holds about {best.rollout.seqs} "
            f"sequences of mean length per scheduler; max_num_seqs {rl.max_num_seqs}",
            *_width_notes(problem, ctx, best),
            *_capture_notes(problem, ctx, capture),
        ],
        routing_capture=capture,
    )


def _routing_estimates(problem: Problem, ctx: search.Context, capture: str | None) -> dict[str, float]:
    """Bytes of routing a step records and carries to the trainer (mean lengths, and at most), where it is recorded."""
    if capture is None:
        return {}
    mean, most = routing.step_routing_bytes(problem.arch, ctx.work, problem.spec.rollout.max_total_len)
    return {"routing_bytes_per_step": float(mean), "routing_bytes_per_step_max": float(most)}


def _capture_notes(problem: Problem, ctx: search.Context, capture: str | None) -> list[str]:
    """Who records the engines' routing, what that asks of their arguments, and how much of it a step carries."""
    if capture is None:
        return []
    arch = problem.arch
    assert arch.moe is not None
    width = routing.routing_id_bytes(arch.moe.num_experts)
    mean, most = routing.step_routing_bytes(arch, ctx.work, problem.spec.rollout.max_total_len)
    who = (
        "rlc's capture in vLLM's worker records each token's experts; prefix caching is off "
        "(enable_prefix_caching: false), because a prompt served from the prefix cache runs no forward and has no "
        "recorded routing"
        if capture == "rlc"
        else "the engine's own capture records each token's experts (enable_return_routed_experts)"
        + (
            f"; needs vllm-ascend {routing.NPU_CAPTURE_SINCE} or later"
            if problem.target.kind == "npu"
            else "; vLLM requires prefix caching and Model Runner V2 for it"
        )
    )
    size = (
        f"routing per token: {arch.num_layers} layers x top-{arch.moe.experts_per_token} ids of {width} byte(s) = "
        f"{routing.routing_bytes_per_token(arch)} bytes; per step {routing.size_text(mean)} at mean lengths, at "
        f"most {routing.size_text(most)}"
    )
    return [f"routing capture: {who}", size]


def _width_notes(problem: Problem, ctx: search.Context, best: search.Candidate) -> list[str]:
    """Narrower engines on the rollout devices and why they lost (disaggregated, placement free)."""
    if best.mode != "disaggregated" or problem.spec.placement.rollout.tp is not None:
        return []
    sync = problem.spec.algorithm.max_staleness == 0
    return [f"narrower engines: {note}" for note in search.width_notes(ctx, best.rollout, best.rollout_start, sync)]


def teacher_roles(
    problem: Problem, best: search.Candidate, placements: dict[str, RayPlacement]
) -> tuple[list[Role], list[TeacherSettings]]:
    """One forward-only engine role per teacher, and the distillation settings that name them."""
    spec = problem.spec
    roles: list[Role] = []
    settings: list[TeacherSettings] = []
    for option, start in zip(best.teachers, best.teacher_starts, strict=True):
        teacher = next(t for t in (spec.distill.teachers if spec.distill else []) if t.name == option.name)
        t_model = model_settings(problem, teacher.model, problem.teacher_archs[option.name])
        layout = option.layout
        roles.append(
            Role(
                name=f"teacher-{option.name}",
                kind="teacher",
                devices=layout.devices,
                placement=placement_ids(start, layout.devices, problem.devices_per_node),
                parallel=Parallel(tp=layout.tp, dp=layout.replicas),
                ray=placements[f"teacher-{option.name}"],
                backend=_engine_backend(problem),
                replicas=layout.replicas,
                memory=memory_model(option.memory, "steady"),
                engine=engine_args(problem, t_model.path or "", layout, colocated=False, lora=False, teacher=True)
                | {"model": t_model.path},
                env=engine_env(problem, layout),
                estimates={"teacher_s": r3(option.seconds)},
                notes=[f"forward-only engines scoring student samples ({layout.replicas} x TP {layout.tp})"],
            )
        )
        settings.append(
            TeacherSettings(
                name=option.name,
                role=f"teacher-{option.name}",
                model=t_model,
                domain=teacher.domain,
                weight=teacher.weight,
            )
        )
    return roles, settings
