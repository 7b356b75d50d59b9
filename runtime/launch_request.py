"""What `rlc run` will ask Ray for, read off the plan: placement groups, actors, trainer mesh, engines, sync path.

`rlc run --dry-run` prints this and exits (the request torchx's dryrun returns); a real run builds its actors
from the same object, so what the dry run shows is what starts. Nothing here is derived from anything but
the plan: the resource name, bundles and per-actor shares, the layout and engine arguments are all in it.
Pure Python (no ray, torch or vllm import).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rlc.schemas.cluster_nodes import node_resource
from rlc.schemas.layout import (
    PLATFORM_KERNELS,
    TrainLayout,
    ep_column,
    runtime_gaps,
    split_layers,
)
from rlc.schemas.plan import WEIGHT_SYNC_EXECUTABLE, ExpertLayers, Plan, Role
from rlc.schemas.platforms import PLATFORM_FACTS

__all__ = [
    "ActorRequest",
    "CoreHost",
    "LaunchRequest",
    "PlacementGroupRequest",
    "engine_workers",
    "launch_request",
    "render_request",
]

#: The env var that restricts a process's visible devices, per platform (as runtime.platform.PLATFORMS, which
#: imports torch; tests/plan/test_device_binding.py checks that the two agree).


@dataclass(frozen=True)
class PlacementGroupRequest:
    name: str
    strategy: str
    bundles: list[dict[str, float]]


def _device_env(platform: str, devices: tuple[int, ...]) -> dict[str, str]:
    name = PLATFORM_FACTS[platform].visible_devices_env
    if not devices or name is None:
        return {}
    return {name: ",".join(map(str, devices)), f"RAY_EXPERIMENTAL_NOSET_{name}": "1"}


@dataclass(frozen=True)
class CoreHost:
    """One further node of an engine whose attention data parallelism spans nodes: the actor there drives that
    node's engine cores, data-parallel ranks [start_rank, start_rank + cores), which join the engine's front end."""

    bundle_index: int
    devices: tuple[int, ...]
    node: int
    start_rank: int
    cores: int


@dataclass(frozen=True)
class ActorRequest:
    """One Ray actor: which role it serves, where it sits and what it takes."""

    name: str
    role: str
    kind: str  # trainer, reference, rollout, teacher, environment
    placement_group: str
    bundle_index: int
    resources: dict[str, float]
    detail: dict[str, Any] = field(default_factory=dict)
    #: The plan's device ids (one node's numbering) that this actor binds; empty on cpu and for environments.
    devices: tuple[int, ...] = ()
    #: The plan node this actor runs on (its bundle's node; environments: -1, anywhere).
    node: int = 0
    #: An engine across nodes: the bundles of its vLLM workers (one device each) and what each takes; its actor
    #: drives no device and its placement group is captured, so vLLM's Ray executor starts the workers there.
    worker_bundles: tuple[int, ...] = ()
    worker_resources: dict[str, float] = field(default_factory=dict)
    #: An engine whose attention DP spans nodes: the core hosts on its other nodes (this actor is its front end,
    #: with the first node's cores); each host takes `resources` of its bundle, like this actor.
    core_hosts: tuple[CoreHost, ...] = ()

    def device_env(self, platform: str) -> dict[str, str]:
        """The env that binds this actor to its planned devices: the visible-devices mask, and Ray's opt-out
        from rewriting it with the ids Ray assigned instead (a colocated engine spans several bundles' devices
        while holding a share of one, so Ray's ids cannot say which devices it drives)."""
        return _device_env(platform, self.devices)

    def core_host_starts(self, platform: str, env: dict[str, str]) -> list[dict[str, Any]]:
        """What the engine's front end needs to start each of its core hosts (`RolloutEngine.core_hosts`): the
        bundle, what the host takes of it, its env (`env` and the host's device binding), and its cores' ranks."""
        return [
            {
                "bundle_index": h.bundle_index,
                "resources": dict(self.resources),
                "env": {**env, **_device_env(platform, h.devices)},
                "start_rank": h.start_rank,
                "cores": h.cores,
            }
            for h in self.core_hosts
        ]

    def worker_env(self) -> dict[str, str]:
        """The env that puts an engine's vLLM Ray workers on its planned bundles, each taking its planned share
        (vLLM reads both when it starts its Ray executor); empty for an engine that drives its own devices."""
        if not self.worker_bundles:
            return {}
        (share,) = self.worker_resources.values()
        return {
            "VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, self.worker_bundles)),
            "VLLM_RAY_PER_WORKER_GPUS": repr(float(share)),
        }


@dataclass(frozen=True)
class LaunchRequest:
    plan: str
    platform: str
    ray_resource: str
    devices: int
    placement_groups: list[PlacementGroupRequest]
    actors: list[ActorRequest]
    engines: dict[str, dict[str, Any]]
    weight_sync: dict[str, Any]
    refusals: list[str]
    #: Optimizer steps each training step takes (the plan's `algorithm.minibatches`).
    optimizer_steps: int = 1
    #: How the trainer builds a hybrid model's linear-attention layers (None: every layer is attention).
    token_mixers: str | None = None
    #: What runs at each of the trainer's kernel seams this model has (`schemas.layout.PLATFORM_KERNELS`).
    trainer_kernels: dict[str, str] = field(default_factory=dict)
    pipeline: str | None = None
    #: How the controller feeds the rollout engines and what a weight update does to samples in flight.
    rollout_feed: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def trainer_ranks(self) -> list[ActorRequest]:
        return [a for a in self.actors if a.kind == "trainer"]


def _placement(role: Role) -> Any:
    if role.ray is None:
        raise ValueError(f"role {role.name} has no Ray placement; recompile the plan with this rlc")
    return role.ray


def bundle_nodes(role: Role) -> list[int]:
    """The plan node of each bundle of the role's placement group: bundles split the role's devices (node by node,
    in order) into equal consecutive slices, and a bundle sits on the node of its slice's first device."""
    ray = _placement(role)
    flat = [p.node for p in role.placement for _ in p.local_ids] or [0]
    width = max(1, len(flat) // max(1, len(ray.bundles)))
    return [flat[min(b * width, len(flat) - 1)] for b in range(len(ray.bundles))]


def _pinned(plan: Plan, role: Role) -> list[dict[str, float]]:
    """The role's bundles; on several nodes, each also asks for one unit of its node's resource (which
    `launch.sh` declares per node), so Ray puts it where the plan says rather than where it likes."""
    bundles = [dict(b) for b in _placement(role).bundles]
    if plan.cluster.nodes > 1:
        for bundle, node in zip(bundles, bundle_nodes(role), strict=True):
            bundle[node_resource(node)] = 1.0
    return bundles


def _groups(plan: Plan) -> list[PlacementGroupRequest]:
    out: dict[str, PlacementGroupRequest] = {}
    owners: dict[str, Role] = {}
    for role in plan.roles:
        ray = _placement(role)
        if not ray.bundles:  # nothing to reserve (environment workers of an agent with its own sandbox)
            continue
        # Roles sharing a group (colocated) read its nodes off its first role, the one that defines it.
        owner = owners.setdefault(ray.placement_group, role)
        bundles = _pinned(plan, owner) if owner is role else out[ray.placement_group].bundles
        if owner is not role and [dict(b) for b in ray.bundles] != [dict(b) for b in owner.ray.bundles]:  # type: ignore[union-attr]
            raise ValueError(f"roles disagree about placement group {ray.placement_group}'s bundles")
        group = PlacementGroupRequest(ray.placement_group, ray.strategy, bundles)
        held = out.setdefault(ray.placement_group, group)
        if held != group:
            raise ValueError(f"roles disagree about placement group {ray.placement_group}'s bundles")
    return list(out.values())


def engine_workers(role: Role) -> int:
    """The vLLM workers of one of the role's engines, each a rank of the broadcast group: TP workers of each of its
    data-parallel engine cores (attention DP, for expert parallelism beyond TP)."""
    return int(role.engine["tensor_parallel_size"]) * int(role.engine.get("data_parallel_size", 1))


def weight_sync_path(plan: Plan) -> dict[str, Any]:
    """How new weights reach the engines, as the plan fixes it."""
    rollout = plan.roles_of("rollout")[0]
    backend = PLATFORM_FACTS[plan.platform].dist_backend
    if plan.lora is not None and plan.lora.rollout == "adapter":
        return {
            "method": "adapter",
            "how": "trainer rank 0 writes each LoRA adapter version under RUN/sync/adapter-v<version>; engines "
            "serve it as a new LoRA request",
        }
    method = plan.schedule.weight_sync
    if method == "broadcast":
        workers = engine_workers(rollout)
        world = 1 + rollout.replicas * workers
        dp = rollout.engine.get("data_parallel_size", 1)
        shape = f"TP {rollout.parallel.tp}" + (f" × attention DP {dp}" if dp > 1 else "")
        senders = plan.schedule.weight_sync_senders
        how = (
            f"trainer rank 0 gathers the weights and broadcasts them over a {backend} group of {world} "
            f"ranks (itself + {rollout.replicas} engine(s) × {shape})"
        )
        if senders > 1:
            how = (
                f"trainer ranks 0-{senders - 1} each send their share of the buckets over a {backend} group of "
                f"their own with every engine worker ({rollout.replicas} engine(s) × {shape})"
            )
        if plan.schedule.weight_sync_slicing == "tp":
            how += "; each engine worker receives only its tensor-parallel shard of the weights rlc slices"
        return {"method": "broadcast", "how": how, "group_size": world, "backend": backend}
    if method == "disk":
        return {
            "method": "disk",
            "how": "trainer rank 0 writes safetensors to RUN/sync/latest; every engine reloads from there "
            "(the run directory must be on a filesystem every node sees)",
        }
    if method == "shared_memory":
        return {
            "method": "shared_memory",
            "how": "each node's first trainer rank writes the gathered weights into one shared-memory segment in its "
            "node's /dev/shm, rewritten in place every sync; the engines on that node map it and copy from it",
        }
    return {
        "method": "inplace",
        "how": "each node's first trainer rank writes the gathered weights as safetensors into its node's "
        "/dev/shm; the engines on that node reload from it (host memory, never the broadcast group)",
    }


def weight_sync_refusals(plan: Plan) -> list[str]:
    """What of the plan's weight sync the runtime cannot run (`WEIGHT_SYNC_EXECUTABLE`); the compiler picks only
    what it runs, so these catch plans edited by hand or compiled by another rlc."""
    s = plan.schedule
    out: list[str] = []
    fix = "recompile the plan with this rlc, which picks a path it runs"
    if s.weight_sync not in WEIGHT_SYNC_EXECUTABLE:
        out.append(f"weight sync {s.weight_sync}: this runtime does not execute it; {fix}")
    if s.weight_sync == "shared_memory" and (plan.platform != "cpu" or s.mode != "colocated"):
        out.append(f"weight sync shared_memory runs colocated on cpu only, not {s.mode} on {plan.platform}; {fix}")
    trainer = plan.roles_of("train")[0].devices if plan.roles_of("train") else 1
    if s.weight_sync_senders > 1:
        if s.weight_sync != "broadcast" or "senders" not in WEIGHT_SYNC_EXECUTABLE:
            out.append(f"weight sync with {s.weight_sync_senders} senders: this runtime sends from one; {fix}")
        elif s.weight_sync_senders > trainer:
            out.append(f"weight sync with {s.weight_sync_senders} senders but {trainer} trainer ranks; {fix}")
    if s.weight_sync_slicing == "tp" and (s.weight_sync != "broadcast" or "tp_slicing" not in WEIGHT_SYNC_EXECUTABLE):
        out.append(f"weight sync slicing tp with {s.weight_sync}: this runtime sends whole tensors; {fix}")
    return out


def _device_slices(plan: Plan, role: Role, actors: int, refusals: list[str]) -> list[tuple[int, ...]]:
    """The planned devices of each of a role's `actors`, in order: consecutive equal slices of the role's
    placement (node by node, the plan's device ids). On cpu, or where a slice would span nodes (one process
    cannot bind another node's devices; refused), no binding."""
    if plan.platform == "cpu" or actors == 0:
        return [()] * actors
    flat = [(p.node, i) for p in role.placement for i in p.local_ids]
    width = len(flat) // actors
    if width == 0 or width * actors != len(flat):
        refusals.append(f"role {role.name}: {len(flat)} planned devices do not divide among its {actors} actors")
        return [()] * actors
    slices = [flat[k * width : (k + 1) * width] for k in range(actors)]
    spanning = [k for k, part in enumerate(slices) if len({node for node, _ in part}) > 1]
    if spanning:
        refusals.append(
            f"role {role.name}: actor {spanning[0]} drives devices on several nodes; binding one actor to "
            "devices of more than one node is not implemented"
        )
        return [()] * actors
    return [tuple(i for _, i in part) for part in slices]


def launch_request(plan: Plan) -> LaunchRequest:
    """Everything `rlc run` starts, from the plan alone; ValueError for a plan (edited by hand) that lacks what
    every run needs."""
    for kind in ("train", "rollout"):
        if len(plan.roles_of(kind)) != 1:
            found = ", ".join(r.name for r in plan.roles_of(kind)) or "none"
            raise ValueError(f"a plan has exactly one {kind} role; this one has {found}: recompile it")
    actors: list[ActorRequest] = []
    refusals = list(plan.runtime_gaps)
    group_nodes: dict[str, list[int]] = {}
    for role in plan.roles:
        if _placement(role).bundles:
            group_nodes.setdefault(_placement(role).placement_group, bundle_nodes(role))

    def node_of(group: str, bundle: int) -> int:
        nodes = group_nodes.get(group, [])
        return nodes[bundle] if 0 <= bundle < len(nodes) else -1

    for role in plan.roles:
        ray = _placement(role)
        if role.kind == "train":
            layout = role.layout
            assert layout is not None
            devices = _device_slices(plan, role, len(ray.bundle_indices), refusals)
            for rank, bundle in enumerate(ray.bundle_indices):
                actors.append(
                    ActorRequest(
                        f"rlc-{role.name}-rank{rank}",
                        role.name,
                        "trainer",
                        ray.placement_group,
                        bundle,
                        dict(ray.actor_resources),
                        {"rank": rank, "mesh": layout.coordinates(rank), "layout": layout.summary()},
                        devices[rank],
                        node_of(ray.placement_group, bundle),
                    )
                )
                if ray.reference_resources is not None:
                    actors.append(
                        ActorRequest(
                            f"rlc-reference-rank{rank}",
                            role.name,
                            "reference",
                            ray.placement_group,
                            bundle,
                            dict(ray.reference_resources),
                            {"rank": rank, "mesh": layout.coordinates(rank), "forward_only": True},
                            devices[rank],
                            node_of(ray.placement_group, bundle),
                        )
                    )
        elif role.kind == "environments":
            for index in range(role.replicas):
                bundle = ray.bundle_indices[index] if ray.bundles else -1
                actors.append(
                    ActorRequest(
                        f"rlc-{role.name}-{index}",
                        role.name,
                        "environment",
                        ray.placement_group,
                        bundle,
                        dict(ray.actor_resources),
                        {"agent": plan.agent.run if plan.agent else ""},
                        node=node_of(ray.placement_group, bundle),
                    )
                )
        else:
            kind = "rollout" if role.kind == "rollout" else "teacher"
            # An engine across nodes binds no device itself: its vLLM workers take their bundles' devices.
            across = ray.engine_workers
            hosts = ray.engine_hosts or [[] for _ in ray.bundle_indices]
            per_engine = 1 + len(hosts[0])
            devices = (
                [()] * len(ray.bundle_indices)
                if across
                else _device_slices(plan, role, len(ray.bundle_indices) * per_engine, refusals)
            )
            cores = int(role.engine.get("data_parallel_size_local") or 0)
            if ray.engine_hosts and cores * per_engine != int(role.engine.get("data_parallel_size") or 1):
                refusals.append(
                    f"role {role.name}: its engines span {per_engine} nodes of {cores} engine core(s) each, which is "
                    f"not their data_parallel_size {role.engine.get('data_parallel_size')}: recompile the plan"
                )
            for index, bundle in enumerate(ray.bundle_indices):
                core_hosts = tuple(
                    CoreHost(b, devices[index * per_engine + k], node_of(ray.placement_group, b), k * cores, cores)
                    for k, b in enumerate(hosts[index], start=1)
                )
                actors.append(
                    ActorRequest(
                        f"rlc-{role.name}-{index}",
                        role.name,
                        kind,
                        ray.placement_group,
                        bundle,
                        dict(ray.actor_resources),
                        {"worker_nodes": sorted({node_of(ray.placement_group, b) for b in across[index]})}
                        if across
                        else {},
                        devices[index * per_engine],
                        node_of(ray.placement_group, bundle),
                        tuple(across[index]) if across else (),
                        dict(ray.worker_resources) if across else {},
                        core_hosts,
                    )
                )
    linear = plan.model.linear_attention
    hybrid_heads = (linear.key_heads, linear.value_heads) if linear else None
    for role in plan.roles_of("train"):
        assert role.layout is not None
        refusals += [
            g
            for g in runtime_gaps(
                role.layout,
                plan.platform,
                lora=plan.lora is not None,
                linear_heads=hybrid_heads,
                moe=plan.model.experts is not None,
                latent=plan.model.latent_attention is not None,
                colocated=plan.schedule.mode == "colocated",
            )
            if g not in refusals
        ]
    refusals += [g for g in weight_sync_refusals(plan) if g not in refusals]
    return LaunchRequest(
        plan=plan.name,
        platform=plan.platform,
        ray_resource=plan.cluster.ray_resource,
        devices=plan.cluster.total_devices,
        placement_groups=_groups(plan),
        actors=actors,
        engines={r.name: dict(r.engine) for r in plan.roles if r.kind in ("rollout", "teacher")},
        weight_sync=weight_sync_path(plan),
        refusals=refusals,
        optimizer_steps=plan.algorithm.minibatches,
        token_mixers=_token_mixers(plan),
        trainer_kernels=_trainer_kernels(plan),
        pipeline=_pipeline_line(plan),
        rollout_feed=_feed_line(plan),
    )


def _feed_line(plan: Plan) -> str:
    """The dry run's statement of the streaming feed (`runtime/workflows/generate`) and the weight-update mode."""
    sched = plan.schedule
    if plan.agent is not None:
        feed = f"agent episodes, up to {plan.agent.inflight_per_engine} per engine"
    else:
        feed = (
            f"{sched.rollout_chunk_prompts} prompt(s) x {sched.group_size} samples per request, up to "
            f"{sched.rollout_chunks_per_engine} requests per engine at once"
        )
    if sched.max_staleness == 0:
        return f"{feed}, synchronous: weight updates land between batches"
    update = (
        "freeze running samples, load, continue them under the new weights"
        if sched.weight_update == "interrupt"
        else "let running samples finish, then load"
    )
    return f"{feed}, up to {sched.max_staleness} versions ahead; weight updates {sched.weight_update}: {update}"


def _pipeline_line(plan: Plan) -> str | None:
    """The dry run's statement of the trainer's pipeline stages (`runtime/train/pipeline`), when it has any."""
    train = plan.roles_of("train")[0].layout
    assert train is not None
    if train.pp == 1:
        return None
    layers = plan.model.layers
    if layers is None:
        return f"{train.pp} stages, 1F1B"
    runs = ", ".join(f"{r.start}-{r.stop - 1}" for r in split_layers(layers, train.pp))
    return f"{train.pp} stages holding decoder layers {runs}, 1F1B; hidden states pass between stages"


def _token_mixers(plan: Plan) -> str | None:
    """The dry run's statement of a hybrid, MoE or latent-attention model's layers as the trainer will build them."""
    linear = plan.model.linear_attention
    train = plan.roles_of("train")[0].layout
    assert train is not None
    latent = plan.model.latent_attention
    if latent is not None:
        split = f", Ulysses CP {train.cp} splits its heads" if train.cp > 1 and train.cp_kind == "ulysses" else ""
        attention = (
            f"latent attention (MLA): q/k heads of {latent.qk_head_dim} (rotary {latent.qk_rope_head_dim}), v heads "
            f"of {latent.v_head_dim}, kv latent {latent.kv_lora_rank}, packed by cu_seqlens{split}; "
        )
        return attention + (_experts_line(plan.model.experts, train) if plan.model.experts else "dense MLP")
    if plan.model.experts is not None:
        return _experts_line(plan.model.experts, train)
    if linear is None:
        return None
    full = linear.layers // max(linear.full_attention_interval - 1, 1)
    split = (
        f"; Ulysses CP {train.cp} gives each rank {linear.key_heads // train.cp} key / "
        f"{linear.value_heads // train.cp} value linear heads over the whole row"
        if train.cp > 1
        else ""
    )
    return (
        f"hybrid: {linear.layers} Gated-DeltaNet + {full} attention layers; packed sequence boundaries reach "
        f"attention, the causal conv and the delta rule{split}"
    )


#: The dry run's names of the kernel seams.
SEAM_LABELS = {"attention": "attention", "gated_deltanet": "Gated-DeltaNet", "experts": "experts"}


def _trainer_kernels(plan: Plan) -> dict[str, str]:
    """The kernel each of the model's trainer seams runs on this platform: packed attention when the plan packs, the
    Gated-DeltaNet token mixers of a hybrid, the experts' GEMMs of a MoE model (a dense model says it has none)."""
    seams = PLATFORM_KERNELS[plan.platform]
    found = {}
    if plan.schedule.packing:
        found["attention"] = seams["attention"].statement()
    if plan.model.linear_attention is not None:
        found["gated_deltanet"] = seams["gated_deltanet"].statement()
    found["experts"] = seams["experts"].statement() if plan.model.experts is not None else "none (dense MLP)"
    return found


def _experts_line(experts: ExpertLayers, train: TrainLayout) -> str:
    text = (
        f"mixture of experts: {experts.layers} MoE layers of {experts.num_experts} experts, top-"
        f"{experts.experts_per_token}; "
    )
    staged = f"each of the {train.pp} pipeline stages computes its layers' experts; " if train.pp > 1 else ""
    if train.ep == 1:
        return text + staged + "every rank of a stage computes every expert (sharded by FSDP2 like any weight)"
    held = experts.num_experts // train.ep
    return (
        text + staged + f"EP {train.ep}: each rank holds {held} experts (FSDP2 shards them over "
        f"{max(1, train.shard_group // ep_column(train.ep, train.tp))} rank(s)), tokens reach them by all-to-all"
    )


def _resources(res: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(res.items()))


def render_request(req: LaunchRequest) -> str:
    """The dry run's text: what would start, in the order it starts."""
    lines = [f"rlc run --dry-run: plan {req.plan} on {req.platform} ({req.devices} `{req.ray_resource}` devices)"]
    lines.append("placement groups:")
    for g in req.placement_groups:
        counts: dict[str, int] = {}
        for b in g.bundles:
            counts[_resources(b)] = counts.get(_resources(b), 0) + 1
        shape = ", ".join(f"{n} × {{{k}}}" for k, n in counts.items())
        lines.append(f"  {g.name} ({g.strategy}): {len(g.bundles)} bundle(s): {shape}")
    lines.append("actors:")
    for a in req.actors:
        extra = ""
        if a.kind in ("trainer", "reference"):
            mesh = " ".join(f"{k}{v}" for k, v in a.detail["mesh"].items())
            extra = f"  mesh [{mesh}]"
        where = f"{a.placement_group}[{a.bundle_index}]" if a.placement_group else "(no placement group)"
        if a.kind == "environment":
            extra = f"  runs {a.detail['agent']}"
        if a.devices:
            extra += f"  devices {','.join(map(str, a.devices))}"
        if a.worker_bundles:
            nodes = ",".join(f"n{n}" for n in a.detail["worker_nodes"])
            extra += (
                f"  vLLM Ray workers on bundles {a.worker_bundles[0]}-{a.worker_bundles[-1]} (nodes {nodes}), "
                f"{_resources(a.worker_resources)} each"
            )
        if len({b.node for b in req.actors}) > 1 and a.node >= 0:
            extra += f"  node n{a.node}"
        if a.core_hosts:
            first = a.core_hosts[0]
            extra += f"  front end of {first.cores} engine core(s) per node; core hosts on bundles " + ", ".join(
                f"{h.bundle_index} (n{h.node}, DP ranks {h.start_rank}-{h.start_rank + h.cores - 1})"
                for h in a.core_hosts
            )
        lines.append(f"  {a.name:<24} {a.kind:<9} {where}  {_resources(a.resources)}{extra}")
    trainers = req.trainer_ranks()
    if trainers:
        steps = f"; {req.optimizer_steps} optimizer steps per training step" if req.optimizer_steps > 1 else ""
        lines.append(f"trainer layout: {trainers[0].detail['layout']}{steps}")
    if req.token_mixers:
        lines.append(f"trainer model: {req.token_mixers}")
    for seam, kernel in req.trainer_kernels.items():
        lines.append(f"trainer kernel, {SEAM_LABELS[seam]}: {kernel}")
    if req.pipeline:
        lines.append(f"trainer pipeline: {req.pipeline}")
    for role, args in req.engines.items():
        shown = {k: v for k, v in sorted(args.items()) if k != "model"}
        lines.append(f"engine {role}: model {args.get('model')}; " + ", ".join(f"{k}={v}" for k, v in shown.items()))
    lines.append(f"weight sync: {req.weight_sync['method']}: {req.weight_sync['how']}")
    if req.rollout_feed:
        lines.append(f"rollout feed: {req.rollout_feed}")
    if req.refusals:
        lines.append("refused: this runtime cannot execute the plan:")
        lines += [f"  - {r}" for r in req.refusals]
    else:
        lines.append("nothing started (dry run)")
    return "\n".join(lines)
