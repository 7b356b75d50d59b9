"""Build the Plan: run the search, then write every decision down explicitly for the runtime.

The runtime reads nothing but the plan, so device ids, engine arguments, budgets and the schedule are all
fixed here, deterministically (sorted, rounded), and an infeasible spec becomes an RLC301 diagnostic with
the memory breakdown and concrete fixes instead of a plan that would run out of memory.
"""

from __future__ import annotations

import hashlib
import json

import rlc
from rlc.compiler import cost, memory, search
from rlc.compiler.diagnostics import Diagnostic
from rlc.compiler.load import LineMap
from rlc.compiler.memory import MemoryBreakdown, RolloutLayout
from rlc.compiler.resolve import Problem
from rlc.schemas import layout as layout_lib
from rlc.schemas.arch import ModelArch
from rlc.schemas.plan import (
    AlgorithmSettings,
    Candidate,
    Cluster,
    DataSettings,
    DistillSettings,
    Estimates,
    LoraSettings,
    Memory,
    ModelSettings,
    NodeDevices,
    OffloadStep,
    Parallel,
    Plan,
    RayPlacement,
    Role,
    Sampling,
    Schedule,
    TeacherSettings,
)
from rlc.schemas.spec import ModelRef

WORKER_EXTENSION = "rlc.runtime.rollout.weight_sync.WeightSyncExtension"
PLATFORM_OF_KIND = {"npu": "npu", "gpu": "cuda", "cpu": "cpu"}
MAX_RUNNERS_UP = 5
#: Context past which a pinned vLLM share above the planner's own cap draws a warning (long prefills).
LONG_CONTEXT = 32768


def r3(value: float) -> float:
    """Round for byte-stable plans."""
    return round(float(value), 3)


def significant(value: float, digits: int = 4) -> float:
    """Round to `digits` significant digits: 0.0001357 stays non-zero where 3 decimals would print 0.0."""
    return float(f"{float(value):.{digits}g}")


def spec_hash(problem: Problem) -> str:
    """sha256 of the canonical JSON of the resolved spec (sorted keys, no whitespace)."""
    text = json.dumps(problem.spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def speculative_method(arch: ModelArch, method: str) -> str:
    """vLLM speculative method name for a model family's MTP layers (or ngram)."""
    if method == "ngram" or arch.mtp_layers == 0:
        return "ngram"
    return {"deepseek-v3": "deepseek_mtp", "qwen3-next": "qwen3_next_mtp", "qwen3.5": "qwen3_5_mtp"}.get(
        arch.family, "mtp"
    )


def speculative_config(problem: Problem) -> dict | None:
    mtp = problem.spec.rollout.mtp
    if mtp is None:
        return None
    method = speculative_method(problem.arch, mtp.method)
    config: dict = {"method": method, "num_speculative_tokens": mtp.num_speculative_tokens}
    if method == "ngram":
        config["prompt_lookup_max"] = max(4, mtp.ngram_min)
        config["prompt_lookup_min"] = mtp.ngram_min
    return config


def model_path(problem: Problem, ref: ModelRef, arch: ModelArch) -> tuple[str, bool]:
    """Local folder for a model; on cpu the tiny model is built under the run directory when none is given."""
    if ref.path:
        return ref.path, False
    if problem.target.kind == "cpu" and arch.id == "rlc-tiny":
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
    )


def placement_ids(start: int, count: int, dpn: int) -> list[NodeDevices]:
    """Global device range [start, start+count) as local ids per node."""
    by_node: dict[int, list[int]] = {}
    for g in range(start, start + count):
        by_node.setdefault(g // dpn, []).append(g % dpn)
    return [NodeDevices(node=n, local_ids=ids) for n, ids in sorted(by_node.items())]


def memory_model(b: MemoryBreakdown, phase: str) -> Memory:
    items = {k: r3(v) for k, v in b.items.items()}
    return Memory(items=items, total_gib=r3(sum(items.values())), capacity_gib=r3(b.capacity_gib), phase=phase)


def engine_args(
    problem: Problem, path: str, layout: RolloutLayout, *, colocated: bool, lora: bool, teacher: bool
) -> dict:
    """vLLM engine arguments, verbatim."""
    spec, target = problem.spec, problem.target
    arch = problem.arch
    args: dict = {
        "model": path,
        "dtype": "float32" if target.kind == "cpu" else "bfloat16",
        "tensor_parallel_size": layout.tp,
        "enable_expert_parallel": layout.ep > 1,
        "data_parallel_size": layout.attention_dp,
        "max_model_len": spec.rollout.max_total_len,
        "gpu_memory_utilization": r3(layout.memory_fraction),
        "max_num_seqs": layout.max_num_seqs,
        "max_num_batched_tokens": layout.max_num_batched_tokens,
        "enable_prefix_caching": arch.attention.kind != "linear-hybrid",
        "seed": spec.algorithm.seed,
        "max_logprobs": 1,
    }
    if colocated and target.kind != "cpu":
        args["enable_sleep_mode"] = True
    if not teacher:
        spec_cfg = speculative_config(problem)
        if spec_cfg is not None:
            args["speculative_config"] = spec_cfg
        if lora and spec.lora is not None:
            args["enable_lora"] = True
            args["max_lora_rank"] = spec.lora.rank
        args["worker_extension_cls"] = WORKER_EXTENSION
    return args


def _fixes(problem: Problem, role: str, b: MemoryBreakdown, ctx: search.Context) -> list[str]:
    """Concrete changes that would make `role` fit, most effective first."""
    spec = problem.spec
    fixes: list[str] = []
    nodes = _nodes_that_fit(ctx, role)
    if nodes:
        fixes.append(f"cluster.nodes >= {nodes}")
    if role == "train":
        pin = spec.placement.train
        acts = b.items.get("activations", 0.0) + b.items.get("logits", 0.0)
        if spec.lora is None and problem.target.kind != "cpu":
            fixes.append("lora")
        if acts > 0.2 * b.total_gib and not pin.cp and spec.rollout.max_total_len >= 8192:
            fixes.append("train.cp=2")
        if not (spec.train.offload.params and spec.train.offload.optimizer) and not pin.offload:
            fixes.append("train.offload")
        if acts > 0.2 * b.total_gib and spec.train.recompute not in ("full", "auto"):
            fixes.append("train.recompute: full")
        if acts > 0.3 * b.total_gib:
            fixes.append("a shorter rollout.max_response_len")
    else:
        fixes.append(
            f"a larger placement.{role.split('-')[0]}.tp"
            if not role.startswith("teacher")
            else f"placement.teachers.{role.removeprefix('teacher-')}.tp"
        )
        if b.items.get("kv_cache", 1.0) <= 0.0 or "sequence" in b.verdict():
            fixes.append("a shorter rollout.max_response_len")
        if spec.mode != "disaggregated":
            fixes.append("mode: disaggregated")
        if role.startswith("teacher"):
            fixes.append("more cluster.nodes (a larger teacher pool)")
    return fixes


def _nodes_that_fit(ctx: search.Context, role: str) -> int | None:
    """Smallest node count (up to 64× the current) at which the role alone fits on every device."""
    if role != "train" or ctx.spec.placement.train.devices:
        return None
    dpn = ctx.devices_per_node
    for factor in (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
        nodes = ctx.nodes * factor
        n = nodes * dpn
        if search.train_search(ctx, n).options:
            for lower in range(ctx.nodes + 1, nodes):
                if search.train_search(ctx, lower * dpn).options:
                    return lower
            return nodes
    return None


def infeasible(
    problem: Problem, result: search.SearchResult, ctx: search.Context, lines: LineMap, file: str
) -> list[Diagnostic]:
    """RLC301 per role that cannot fit: the closest breakdown, the capacity, and what to change."""
    found: list[Diagnostic] = []
    target = problem.target
    for role, rs in sorted(result.failures.items()):
        b = rs.closest
        if b is None:
            message = f"{role} cannot be placed: {rs.reason or 'no layout satisfies the pins and topology'}"
            fixes = ["check placement pins", "cluster.nodes"]
        else:
            over_host = b.problems and b.total_gib <= b.capacity_gib
            if over_host:
                message = f"{role}: {b.problems[0]}"
            else:
                message = (
                    f"{role} needs {b.total_gib:.1f} GiB per device ({b.describe()}) but {target.id} devices "
                    f"have {target.usable_hbm_gib:.1f} GiB usable"
                )
                layout = rs.closest_layout
                if layout is not None and hasattr(layout, "summary"):
                    message += f" (closest layout: {layout.summary()})"
            fixes = _fixes(problem, role.split("-")[0] if role.startswith("rollout") else role, b, ctx)
        pinned = (role == "train" and problem.spec.placement.train.model_fields_set) or (
            role == "rollout" and problem.spec.placement.rollout.model_fields_set
        )
        path = f"placement.{role}" if pinned else ("cluster.nodes" if role == "train" else role)
        found.append(
            Diagnostic("RLC301", message, path, "error", "try " + ", ".join(fixes), lines.line_for(path), file)
        )
    if not found:
        found.append(
            Diagnostic(
                "RLC301",
                "no layout fits this cluster",
                "cluster.nodes",
                "error",
                "add nodes or relax placement pins",
                lines.line_for("cluster.nodes"),
                file,
            )
        )
    return found


def _warnings(problem: Problem, lines: LineMap, file: str) -> list[Diagnostic]:
    out: list[Diagnostic] = []
    pin = problem.spec.placement.rollout
    if (
        pin.memory_fraction
        and pin.memory_fraction > search.MAX_AUTO_FRACTION
        and (problem.spec.rollout.max_total_len > LONG_CONTEXT)
    ):
        out.append(
            Diagnostic(
                "RLC302",
                f"rollout memory_fraction {pin.memory_fraction:g} with {problem.spec.rollout.max_total_len}-token "
                "contexts: long prefills need transient memory outside vLLM's budget and have run out of memory "
                "at 0.95 (vllm-ascend issue 3357)",
                "placement.rollout.memory_fraction",
                "warning",
                f"use <= {search.MAX_AUTO_FRACTION}",
                lines.line_for("placement.rollout.memory_fraction"),
                file,
            )
        )
    return out


def build_plan(
    problem: Problem, lines: LineMap | None = None, file: str = "", *, exhaustive: bool = False
) -> tuple[Plan | None, list[Diagnostic]]:
    """Search the layouts for `problem` and assemble the Plan, or say why nothing fits (RLC301)."""
    lines = lines or LineMap()
    ctx = search.make_context(problem, exhaustive)
    result = search.search_context(ctx)
    diags = _warnings(problem, lines, file)
    if result.best is None:
        return None, diags + infeasible(problem, result, ctx, lines, file)
    platform = PLATFORM_OF_KIND[problem.target.kind]
    for gap in layout_lib.runtime_gaps(result.best.train.layout, platform):
        diags.append(
            Diagnostic(
                "RLC303",
                f"`rlc run` cannot execute this plan yet: {gap}",
                "train",
                "warning",
                "the plan is written for review and launch files; pin train.backend: fsdp2 (dense models) for a "
                "layout the runtime executes",
                lines.line_for("train"),
                file,
            )
        )
    return assemble(problem, ctx, result, diags), diags


def ray_placements(problem: Problem, best: search.Candidate) -> dict[str, RayPlacement]:
    """Each role's placement group, bundles and per-actor resource shares, by role name.

    Disaggregated: one group per role; a trainer device is one bundle, an engine (or teacher engine) one bundle
    of its TP/EP devices. Colocated: one group of device bundles shared by every role; each role's actor takes
    an equal share of a device (the trainer's share is halved again when a separate KL reference rank sits
    beside it), and engine i is anchored on the bundle of its first device.
    """
    res = problem.target.ray_resource
    colocated = best.mode == "colocated"
    tl, rl = best.train.layout, best.rollout.layout
    reference = problem.spec.algorithm.kl_coef > 0 and problem.spec.lora is None
    engines = [("rollout", rl)] + [(f"teacher-{t.name}", t.layout) for t in best.teachers]
    out: dict[str, RayPlacement] = {}
    if colocated:
        bundles = [{res: 1.0}] * tl.world_size
        share = r4(1.0 / len(["actor", *engines]))
        trainer = r4(share / 2) if reference else share
        out["actor"] = RayPlacement(
            placement_group="rlc-colocated",
            bundles=bundles,
            bundle_indices=list(range(tl.world_size)),
            actor_resources={res: trainer},
            reference_resources={res: trainer} if reference else None,
        )
        for name, lay in engines:
            out[name] = RayPlacement(
                placement_group="rlc-colocated",
                bundles=bundles,
                bundle_indices=[i * lay.engine_devices for i in range(lay.replicas)],
                actor_resources={res: share},
            )
        return out
    out["actor"] = RayPlacement(
        placement_group="rlc-actor",
        bundles=[{res: 1.0}] * tl.world_size,
        bundle_indices=list(range(tl.world_size)),
        actor_resources={res: 0.5 if reference else 1.0},
        reference_resources={res: 0.5} if reference else None,
    )
    for name, lay in engines:
        width = float(lay.engine_devices)
        out[name] = RayPlacement(
            placement_group=f"rlc-{name}",
            bundles=[{res: width}] * lay.replicas,
            bundle_indices=list(range(lay.replicas)),
            actor_resources={res: width},
        )
    return out


def r4(value: float) -> float:
    """Ray resource shares are kept to four decimals (Ray's own granularity)."""
    return float(int(value * 10_000) / 10_000)


def _offload_steps(problem: Problem, colocated: bool, best: search.Candidate) -> list[OffloadStep]:
    """Colocated phase transitions; on cpu (no sleep mode) both phases stay resident."""
    if not colocated or problem.target.kind == "cpu":
        return []
    steps = [
        OffloadStep(phase="before_rollout", action="offload", what="params"),
        OffloadStep(phase="before_rollout", action="offload", what="grads"),
        OffloadStep(phase="before_rollout", action="offload", what="optimizer"),
        OffloadStep(phase="before_rollout", action="wake", what="rollout_weights"),
        OffloadStep(phase="before_rollout", action="wake", what="kv_cache"),
        OffloadStep(phase="before_train", action="sleep", what="kv_cache"),
        OffloadStep(phase="before_train", action="sleep", what="rollout_weights"),
        OffloadStep(phase="before_train", action="onload", what="params"),
    ]
    if not best.train.layout.offload_optimizer:
        steps.append(OffloadStep(phase="before_train", action="onload", what="optimizer"))
    return steps


def assemble(problem: Problem, ctx: search.Context, result: search.SearchResult, diags: list[Diagnostic]) -> Plan:
    """Turn the winning candidate into the explicit Plan."""
    spec, target, arch = problem.spec, problem.target, problem.arch
    best = result.best
    assert best is not None
    dpn = problem.devices_per_node
    colocated = best.mode == "colocated"
    model = model_settings(problem, spec.model, arch)
    tl, rl = best.train.layout, best.rollout.layout
    lora_mode = search.lora_rollout_mode(problem)
    roles: list[Role] = []
    placements = ray_placements(problem, best)
    train_notes = [
        f"{tl.summary()}: fastest fitting trainer layout on {tl.world_size} devices",
        f"peak {best.train.memory.total_gib:.1f} of {best.train.memory.capacity_gib:.1f} GiB",
    ]
    if tl.offload_params or tl.offload_optimizer:
        train_notes.append(f"host memory for offloaded state: {best.train.memory.host_gib_per_node:.0f} GiB per node")
    roles.append(
        Role(
            name="actor",
            kind="train",
            devices=tl.world_size,
            placement=placement_ids(best.train_start, tl.world_size, dpn),
            parallel=Parallel(tp=tl.tp, pp=tl.pp, cp=tl.cp, ep=tl.ep, dp=tl.dp),
            layout=layout_lib.TrainLayout.model_validate(tl.model_dump()),
            ray=placements["actor"],
            backend=tl.backend,
            replicas=tl.dp,
            memory=memory_model(best.train.memory, "train"),
            engine={
                "logprob_chunk_tokens": spec.train.logprob_chunk_tokens,
                "packing": spec.train.packing,
                "packed_attention": "varlen",
                "etp": tl.etp,
            },
            estimates={
                "train_s": r3(best.train.seconds),
                "compute_s": r3(best.train.time.compute_s),
                "pp_bubble": r3(best.train.time.bubble),
                "comm_s": r3(best.train.time.tp_s + best.train.time.cp_s + best.train.time.ep_s + best.train.time.dp_s),
                "offload_s": r3(best.train.time.offload_s),
            },
            notes=train_notes,
        )
    )
    backend = "vllm-ascend" if target.kind == "npu" else "vllm"
    roles.append(
        Role(
            name="rollout",
            kind="rollout",
            devices=rl.devices,
            placement=placement_ids(best.rollout_start, rl.devices, dpn),
            parallel=Parallel(tp=rl.tp, ep=rl.ep, dp=rl.replicas),
            ray=placements["rollout"],
            backend=backend,
            replicas=rl.replicas,
            memory=memory_model(best.rollout.memory, "rollout"),
            engine=engine_args(
                problem, model.path or "", rl, colocated=colocated, lora=lora_mode == "adapter", teacher=False
            ),
            estimates={
                "rollout_s": r3(best.step.rollout_s),
                "decode_step_s": r3(best.rollout.time.step_s),
                "concurrent_seqs": float(best.rollout.time.concurrency),
                "generated_tokens_per_s": r3(best.rollout.time.tokens_per_s),
            },
            notes=[
                f"{rl.replicas} engine(s) of {rl.engine_devices} device(s), TP {rl.tp}"
                + (f", EP {rl.ep}" if rl.ep > 1 else ""),
                f"KV cache {best.rollout.memory.items.get('kv_cache', 0):.1f} GiB holds about {best.rollout.seqs} "
                f"sequences of mean length per scheduler; max_num_seqs {rl.max_num_seqs}",
            ],
        )
    )
    teacher_settings: list[TeacherSettings] = []
    for option, start in zip(best.teachers, best.teacher_starts, strict=True):
        teacher = next(t for t in (spec.distill.teachers if spec.distill else []) if t.name == option.name)
        t_arch = problem.teacher_archs[option.name]
        t_model = model_settings(problem, teacher.model, t_arch)
        layout = option.layout
        roles.append(
            Role(
                name=f"teacher-{option.name}",
                kind="teacher",
                devices=layout.devices,
                placement=placement_ids(start, layout.devices, dpn),
                parallel=Parallel(tp=layout.tp, dp=layout.replicas),
                ray=placements[f"teacher-{option.name}"],
                backend=backend,
                replicas=layout.replicas,
                memory=memory_model(option.memory, "steady"),
                engine=engine_args(problem, t_model.path or "", layout, colocated=False, lora=False, teacher=True)
                | {"model": t_model.path},
                estimates={"teacher_s": r3(option.seconds)},
                notes=[f"forward-only engines scoring student samples ({layout.replicas} x TP {layout.tp})"],
            )
        )
        teacher_settings.append(
            TeacherSettings(
                name=option.name,
                role=f"teacher-{option.name}",
                model=t_model,
                domain=teacher.domain,
                weight=teacher.weight,
            )
        )
    sync = search._sync_method(ctx, best.mode)
    schedule = Schedule(
        mode=best.mode,
        steps=spec.algorithm.steps,
        batch_prompts=spec.algorithm.batch_prompts,
        group_size=spec.algorithm.group_size,
        batch_samples=spec.algorithm.batch_prompts * spec.algorithm.group_size,
        micro_batch_tokens=tl.micro_batch_tokens,
        logprob_chunk_tokens=spec.train.logprob_chunk_tokens,
        packing=spec.train.packing,
        max_staleness=0 if colocated else spec.algorithm.max_staleness,
        rollout_chunk_prompts=cost.rollout_chunk_prompts(spec.algorithm.batch_prompts, rl.replicas),
        rollout_chunks_per_engine=cost.ENGINE_CHUNKS,
        weight_sync=sync,  # type: ignore[arg-type]
        offload=_offload_steps(problem, colocated, best),
        checkpoint_every=spec.output.checkpoint_every,
        keep_checkpoints=spec.output.keep_checkpoints,
    )
    algo = spec.algorithm
    step = best.step
    runners: list[Candidate] = []
    listed = {best.summary}
    for other in result.ranked[1:]:
        if len(runners) >= MAX_RUNNERS_UP:
            break
        if other.summary in listed:
            continue  # the same layout reached twice (e.g. from two splits) is listed once
        listed.add(other.summary)
        runners.append(
            Candidate(
                summary=other.summary,
                tokens_per_s=r3(other.step.tokens_per_s),
                step_time_s=r3(other.step.step_s),
                verdict=search.runner_up_verdict(best, other),
            )
        )
    for role, rs in sorted(result.failures.items()):
        if len(runners) >= MAX_RUNNERS_UP or rs.closest is None:
            continue
        runners.append(
            Candidate(
                summary=f"{role} ({getattr(rs.closest_layout, 'summary', lambda: '?')()})",
                tokens_per_s=0.0,
                step_time_s=0.0,
                verdict=f"does not fit: {rs.closest.verdict()}",
            )
        )
    return Plan(
        rlc_version=rlc.__version__,
        name=spec.name,
        spec_hash=spec_hash(problem),
        target=target.id,
        target_kind=target.kind,
        platform=PLATFORM_OF_KIND[target.kind],  # type: ignore[arg-type]
        cluster=Cluster(
            nodes=spec.cluster.nodes,
            devices_per_node=dpn,
            total_devices=problem.total_devices,
            ray_resource=target.ray_resource,
        ),
        model=model,
        roles=roles,
        schedule=schedule,
        algorithm=AlgorithmSettings(
            name=algo.name,
            decoupled_loss=algo.decoupled_loss,
            clip=algo.clip,
            behave_imp_weight_cap=algo.behave_imp_weight_cap,
            kl_coef=algo.kl_coef,
            kl_estimator=algo.kl_estimator,
            normalize_std=algo.normalize_std,
            lr=algo.lr,
            weight_decay=algo.weight_decay,
            grad_clip=algo.grad_clip,
            seed=algo.seed,
        ),
        sampling=Sampling(
            max_prompt_len=spec.rollout.max_prompt_len,
            max_response_len=spec.rollout.max_response_len,
            temperature=spec.rollout.temperature,
            top_p=spec.rollout.top_p,
            speculative=speculative_config(problem),
        ),
        data=DataSettings(
            train=spec.data.train,
            builtin=spec.data.is_builtin,
            prompt_key=spec.data.prompt_key,
            answer_key=spec.data.answer_key,
            domain_key=spec.data.domain_key,
            digits=spec.data.digits,
            reward=spec.reward.fn,
        ),
        lora=LoraSettings(
            rank=spec.lora.rank,
            alpha=spec.lora.alpha,
            dropout=spec.lora.dropout,
            target_modules=spec.lora.target_modules,
            rollout=lora_mode,  # type: ignore[arg-type]
        )
        if spec.lora
        else None,
        distill=DistillSettings(
            routing=spec.distill.routing,
            loss=spec.distill.loss,
            coef=spec.distill.coef,
            teachers=teacher_settings,
        )
        if spec.distill
        else None,
        run_dir=spec.run_dir,
        loggers=list(spec.output.loggers),
        env=dict(sorted(target.env.items())),
        estimates=Estimates(
            step_time_s=r3(step.step_s),
            rollout_s=r3(step.rollout_s),
            train_s=r3(step.train_s),
            weight_sync_s=r3(step.sync_s),
            switch_s=r3(step.switch_s),
            tokens_per_s=r3(step.tokens_per_s),
        ),
        runners_up=runners,
        warnings=[d.message for d in diags if d.severity == "warning"],
        runtime_gaps=layout_lib.runtime_gaps(tl, PLATFORM_OF_KIND[target.kind]),  # type: ignore[arg-type]
    )


__all__ = ["build_plan", "memory", "spec_hash"]
