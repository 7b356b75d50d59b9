"""Weight sync: what each way of moving new weights from the trainer to the engines costs, from the target's links.

A sync has up to four parts, priced per method below:
  gather   the trainer's FSDP2 shards become whole tensors, one at a time (an all-gather over the trainer), for
           the ranks that send or write them;
  move     the bytes travel: collective groups (broadcast), a file on shared disk (disk), a file in each node's
           /dev/shm (inplace) or flat tensors in POSIX shared memory (shared_memory);
  reload   every engine worker copies and repacks the shard it serves (vLLM reload_weights), all at once, and
           pays a fixed cost per tensor it loads (TENSOR_LOAD_S);
  overhead the target's fixed seconds per sync (RPCs to every engine, group barriers).
Bytes per engine worker: the whole model, or with `slicing` "tp" the worker's tensor-parallel shard of what the
runtime cuts for the model (`schemas.plan.WEIGHT_SYNC_TP_SLICES`; routed experts arrive whole on an engine with
EP > 1 or attention DP). A LoRA adapter served by the engines moves as a small file whatever the method
(`adapter_option`).

The achieved rates are per target kind, each from a measurement named beside it; a profile's own figure
(`efficiency.weight_sync_*`, which `rlc calibrate` fits from measured `time/weight_sync_s`) wins over the kind's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rlc.compiler.cost.links import COLLECTIVE_LATENCY_S, collective_s
from rlc.compiler.memory import ModelSizes, RolloutLayout, dtype_bytes, rollout_weights_bytes
from rlc.schemas.target import TargetProfile

__all__ = [
    "BUCKET_BYTES",
    "SYNC_FIGURES",
    "SYNC_TIE",
    "TENSOR_LOAD_S",
    "WEIGHT_SYNC_DISK_GBPS",
    "WEIGHT_SYNC_HOST_SHARE",
    "WEIGHT_SYNC_LINK_SHARE",
    "SyncOption",
    "SyncShape",
    "adapter_option",
    "bound_shape",
    "checkpoint_tensors",
    "engine_weight_share",
    "max_senders",
    "pick",
    "priced_options",
    "shard_share",
    "sync_figure",
    "sync_seconds",
    "worker_bytes",
    "worker_tensors",
]

#: Share of a device's link one weight-sync sender (or receiver) achieves, buckets and their round trips
#: included: seconds = bytes / (share × link). gpu: 0.9, verl issue 7167 (GH200 nodes, four NICs of ~25 GB/s:
#: trainer rank 0 alone broadcast at ~25 GB/s, its one NIC; with every trainer rank of its node in the group,
#: ~90 of the ~100 GB/s). npu: 0.21, verl's checkpoint-engine benchmark (verl/checkpoint_engine/README.md, HCCL
#: backend: Qwen3-30B-A3B, ~61 GB in bf16, from a 4-rank FSDP trainer to 30 receivers on 2 × 16 Ascend 910C dies,
#: ~11 s, 5.3 GB/s) over a die's 25 GB/s scale-out share; vime measured the same model on one host of 4 + 4 NPUs
#: at 43.5 s per full HCCL update (docs/sparse_hccl_performance.md), Megatron export and engine reload included.
#: cpu: 0.5, today's cpu figure (the profile's collective_efficiency, with which the quickstart's sync was
#: calibrated), until the runtime's cpu weight-sync benchmark measures each method.
WEIGHT_SYNC_LINK_SHARE = {"gpu": 0.9, "npu": 0.21, "cpu": 0.5}
#: Share of host_to_device_bandwidth_gbps a colocated sync achieves staging weights through host memory (each
#: node's writer: device to host, then the /dev/shm file or segment; each engine worker: its shard back).
#: gpu: 0.28, fitted so that the host path is no faster per byte than NeMo-RL's colocated refit, which moves the
#: same bytes device to device through CUDA IPC without the two host copies: the NeMo-RL v0.3 release blog
#: (2025-07-21, "Results", H100, colocated) publishes refit times of 7 s for Qwen3-32B and 14 s for
#: Llama-3.1-70B on 64 GPUs, which this share reproduces for rlc's path (1.02x and 1.04x with TENSOR_LOAD_S);
#: Qwen3-30B-A3B's 12 s is TENSOR_LOAD_S's source, and Llama-3.1-8B's 5 s on one node stays 0.65x (fixed costs
#: beyond this model). These four runs are `fit: true` in benchmarks/published_runs.yaml. npu: [derived] the gpu
#: share (no published timing of a host-staged sync on Ascend; AReaL's AWEX maps host memory there too, with its
#: IPC backend on cpu). cpu: 1, today's figure, until the runtime's
#: cpu benchmark measures the file and shared-memory paths.
WEIGHT_SYNC_HOST_SHARE = {"gpu": 0.28, "npu": 0.28, "cpu": 1.0}
#: Rate a disk sync writes its safetensors folder and engines read it, GB/s. npu: 4.0, fitted with TENSOR_LOAD_S
#: to vime's disk benchmark (docs/weight-sync-benchmark-20260831.md, 8 + 4 NPUs, vLLM TP 4, full updates in the
#: steady state): Qwen3-4B in 5.4 s and Qwen3-30B-A3B in 56.6 s (alone they fit 2.9 and 5.2; 4.0 prices them at
#: 0.84x and 1.08x). gpu: the same figure (a shared filesystem, not the accelerator, sets it; no GPU measurement).
#: cpu: 2.0, today's figure (local disk), until measured.
WEIGHT_SYNC_DISK_GBPS = {"gpu": 4.0, "npu": 4.0, "cpu": 2.0}
#: Seconds per checkpoint tensor an engine worker loads in a sync, beyond its bytes: the per-tensor Python of the
#: trainer's gather (one collective per tensor) and of vLLM's weight loaders (routed experts load one tensor at a
#: time), which shows in models of many small tensors. gpu: 0.3 ms, NeMo-RL v0.3's refit times (H100, colocated,
#: vLLM TP 4; the release blog of 2025-07-21): Qwen3-30B-A3B took 12 s against Qwen3-32B's 7 s for about as many
#: bytes (61 vs 65 GB) and ~18,300 more tensors; 5.4 s (the 5 s measured plus the 0.4 s the bytes alone would
#: save) / 18,300 ≈ 0.3 ms. npu: 2.1 ms, vime's full HCCL update of Qwen3-30B-A3B on 4 + 4 NPUs (43.5 s,
#: docs/sparse_hccl_performance.md, ~19,000 tensors) less the 2.8 s its bytes take here, per tensor; that includes
#: vime's Megatron export, which rlc's per-tensor FSDP2 gather stands in for. cpu: 0, today's (rlc's tiny models
#: have tens of tensors, whose cost the calibrated per-sync overhead holds), until the runtime measures it.
TENSOR_LOAD_S = {"gpu": 0.3e-3, "npu": 2.1e-3, "cpu": 0.0}
#: Checkpoint tensors per decoder layer besides routed experts: Qwen3's q, k, v, o, q_norm, k_norm, gate, up, down
#: and two layer norms; an MoE layer's router and shared expert take the dense MLP's place, and latent or linear
#: attention trades q/k/v/o for about as many. Plus the embedding, the final norm and the head (HF checkpoints'
#: weight maps: Qwen3-30B-A3B lists 18,867 tensors, this count 18,963).
LAYER_TENSORS = 11
#: Bytes per broadcast bucket (the runtime's `weight_sync.DEFAULT_BUCKET_BYTES`, 256 MiB): each bucket is one
#: collective, so it pays the collective's latency once.
BUCKET_BYTES = 256 << 20
#: Options within this share of the fastest count as equally fast: the simpler one runs (fewer senders, whole
#: tensors), since gains this small are inside the model's resolution.
SYNC_TIE = 0.02
#: A sync's figures a profile may state, with the kind defaults above.
SYNC_FIGURES = {
    "weight_sync_link_share": WEIGHT_SYNC_LINK_SHARE,
    "weight_sync_host_share": WEIGHT_SYNC_HOST_SHARE,
    "weight_sync_disk_gbps": WEIGHT_SYNC_DISK_GBPS,
}


def sync_figure(target: TargetProfile, name: str) -> float:
    """A weight-sync figure: the profile's (e.g. `rlc calibrate`'s fit), else its kind's default."""
    value = getattr(target.efficiency, name)
    return SYNC_FIGURES[name][target.kind] if value is None else float(value)


@dataclass(frozen=True)
class SyncShape:
    """Where a layout's weights go: the trainer's ranks and nodes, the engines, whether the sync leaves a node.

    `engine` None prices a lower bound before the engines are chosen (nothing per engine worker, every trainer
    rank sending). `cross_node`: a broadcast reaches engines outside the senders' node; colocated, the trainer
    spans nodes.
    """

    mode: str
    trainer_ranks: int
    trainer_nodes: int
    cross_node: bool
    devices_per_node: int
    engine: RolloutLayout | None = None
    adapter_params: int = 0
    #: The trainer gathers tensor by tensor while its senders send the buckets already full (the runtime streams
    #: a module's own tensors: no LoRA merge, no pipeline stages), so gather and send overlap.
    streamed: bool = True
    #: Device memory a sender has to spare (its trainer device's headroom) for the groups TP slices add.
    sender_room_gib: float = float("inf")
    #: The trainer's pipeline stages: with several, each stage's first rank collects its layers, rank 0 merges the
    #: whole model and sends it to every other rank that sends or writes (`_gather_s`).
    trainer_pp: int = 1


@dataclass(frozen=True)
class SyncOption:
    """One priced way to sync: its seconds split into terms, the bytes each engine worker receives, and whether
    the planner may pick it (`runs`: the runtime executes it; `allowed`: the spec and the mode permit it)."""

    method: str
    senders: int
    slicing: str
    seconds: float
    bytes_per_worker: float
    terms: tuple[tuple[str, float], ...]
    runs: bool = True
    allowed: bool = True
    why_not: str = ""

    @property
    def eligible(self) -> bool:
        return self.runs and self.allowed

    def complexity(self) -> tuple[int, int]:
        return (self.senders, self.slicing == "tp")


def _full_bytes(sizes: ModelSizes, target: TargetProfile, adapter_params: int) -> float:
    """What a sync moves in all: the whole model in the compute dtype, or the LoRA adapters."""
    return (adapter_params or sizes.total) * dtype_bytes(target)


def engine_weight_share(sizes: ModelSizes, layout: RolloutLayout) -> float:
    """Share of the full weights one device of an engine with `layout` holds (dense parts over TP, routed
    experts over EP or TP): what each engine worker copies in and repacks when new weights arrive."""
    full = sizes.dense + sizes.embedding + sizes.head + sizes.expert
    return rollout_weights_bytes(sizes, layout.tp, layout.ep, 1) / full if full else 1.0


def shard_share(sizes: ModelSizes, engine: RolloutLayout | None) -> float:
    """Share of the full weights one engine worker serves (`engine_weight_share`); 0 before the engines exist."""
    return 0.0 if engine is None else engine_weight_share(sizes, engine)


def checkpoint_tensors(sizes: ModelSizes) -> tuple[int, int]:
    """(tensors outside the routed experts, routed-expert tensors) of the model's checkpoint: LAYER_TENSORS per
    decoder layer plus embedding, final norm and head; gate, up and down per routed expert of every MoE layer."""
    arch = sizes.arch
    other = arch.num_layers * LAYER_TENSORS + 3
    if arch.moe is None:
        return other, 0
    moe_layers = sum(1 for i in range(arch.num_layers) if arch.layer_is_moe(i))
    return other, moe_layers * arch.moe.num_experts * 3


def worker_tensors(sizes: ModelSizes, engine: RolloutLayout | None) -> float:
    """Tensors one engine worker loads in a sync: every non-expert tensor, and its EP rank's share of the routed
    experts (vLLM skips the others before loading; an engine of TP alone loads every expert's slice)."""
    if engine is None:
        return 0.0
    other, experts = checkpoint_tensors(sizes)
    return other + experts / max(1, engine.ep)


def worker_bytes(
    sizes: ModelSizes,
    target: TargetProfile,
    engine: RolloutLayout | None,
    slicing: str,
    sliced: frozenset[str] = frozenset({"dense"}),
) -> float:
    """Bytes one engine worker receives from a broadcast. full: every byte. tp: its TP shard of the parts the
    runtime cuts for this model (`sliced`: "dense" = attention, dense MLP, embedding and head; "experts" = routed
    experts, cut only on an engine of TP alone: one with EP > 1 or attention DP gets them whole), the rest whole.
    0 before the engines are known."""
    if engine is None:
        return 0.0
    full = _full_bytes(sizes, target, 0)
    if slicing == "full" or engine.tp == 1:
        return full
    b = dtype_bytes(target)
    dense = (sizes.dense + sizes.embedding + sizes.head) * b
    experts = sizes.expert * b
    if "dense" in sliced:
        full -= dense * (1 - 1 / engine.tp)
    if "experts" in sliced and engine.ep == 1 and engine.attention_dp == 1:
        full -= experts * (1 - 1 / engine.tp)
    return full


def _gather_s(target: TargetProfile, shape: SyncShape, volume: float, keepers: int) -> float:
    """The trainer making whole tensors of its shards for the `keepers` ranks that send or write them.

    One stage: FSDP2 hands every rank of the group each whole tensor (an all-gather per tensor), so the gather
    moves the full volume whoever keeps it. Inside a node it runs at the intra-node link; across nodes a ring's
    channels leave each node through its devices' NICs in parallel, so at min(intra, devices per node ×
    scale-out) (NCCL's and HCCL's multi-channel rings), at the target's collective efficiency.
    Pipeline stages: each stage's first rank collects its layers and sends them to rank 0, which then sends the
    whole model to each other keeper, point to point (runtime `full_state_dict`, `_share_from_rank0`): keepers ×
    volume through rank 0's link (scale-out once the trainer spans nodes).
    """
    if shape.trainer_ranks <= 1:
        return 0.0
    if shape.trainer_pp > 1:
        link = target.inter_node_bandwidth_gbps if shape.trainer_nodes > 1 else target.intra_node_bandwidth_gbps
        return max(1, keepers) * collective_s(target, volume, link, count=max(1.0, volume / BUCKET_BYTES))
    link = target.intra_node_bandwidth_gbps
    if shape.trainer_nodes > 1:
        link = min(link, shape.devices_per_node * target.inter_node_bandwidth_gbps)
    buckets = max(1.0, volume / BUCKET_BYTES)
    return collective_s(target, volume, link, count=buckets, nodes=shape.trainer_nodes)


def _engine_devices_per_node(shape: SyncShape) -> int:
    assert shape.engine is not None
    return max(1, min(shape.devices_per_node, shape.engine.devices))


def _terms(
    sizes: ModelSizes,
    target: TargetProfile,
    shape: SyncShape,
    method: str,
    senders: int,
    slicing: str,
    sliced: frozenset[str] = frozenset({"dense"}),
) -> tuple[tuple[str, float], ...]:
    volume = _full_bytes(sizes, target, shape.adapter_params)
    shard = volume if shape.adapter_params else volume * shard_share(sizes, shape.engine)
    reload = shard / (target.efficiency.weight_reload_gbps * 1e9)
    tensors = ("tensors", worker_tensors(sizes, shape.engine) * TENSOR_LOAD_S[target.kind])
    overhead = target.efficiency.weight_sync_overhead_s
    if shape.adapter_params:
        # A served LoRA adapter: trainer rank 0 writes it under RUN/sync, every engine loads it as a LoRA request.
        disk = sync_figure(target, "weight_sync_disk_gbps") * 1e9
        return (("write", volume / disk), ("read", volume / disk), ("reload", reload), ("overhead", overhead))
    writers = {"broadcast": senders, "inplace": shape.trainer_nodes, "shared_memory": shape.trainer_nodes}
    gather = _gather_s(target, shape, volume, writers.get(method, 1))
    if method == "broadcast":
        # k senders each send their stripe of the buckets over their own group to every engine worker: the
        # stripes leave through k devices' links at once (verl issue 7167: 25 → 90 GB/s), each worker takes in
        # its bytes from a peer in its node, and across nodes each engine node takes in the unique bytes through
        # its devices' NICs. The slowest of the three paces the move.
        share = sync_figure(target, "weight_sync_link_share")
        link = target.inter_node_bandwidth_gbps if shape.cross_node else target.intra_node_bandwidth_gbps
        buckets = max(1.0, volume / BUCKET_BYTES)
        out = volume / (senders * share * link * 1e9) + buckets / senders * COLLECTIVE_LATENCY_S[target.kind]
        received = worker_bytes(sizes, target, shape.engine, slicing, sliced)
        into_worker = received / (share * target.intra_node_bandwidth_gbps * 1e9)
        into_node = 0.0
        if shape.cross_node and shape.engine is not None:
            into_node = volume / (share * target.inter_node_bandwidth_gbps * _engine_devices_per_node(shape) * 1e9)
        move = max(out, into_worker, into_node)
        # Streamed, the gather of the next bucket overlaps the send of the last: only its excess shows.
        shown = max(0.0, gather - move) if shape.streamed else gather
        return (("gather", shown), ("send", move), ("reload", reload), tensors, ("overhead", overhead))
    host = sync_figure(target, "weight_sync_host_share") * target.host_to_device_bandwidth_gbps * 1e9
    if method == "inplace":
        # Each node's first trainer rank copies the gathered weights to host and writes them as safetensors into
        # /dev/shm; every engine worker there copies back only the shard it serves (vLLM's loaders narrow each
        # tensor to the rank's TP slice and skip experts outside its EP rank before the device copy).
        return (
            ("gather", gather),
            ("host write", volume / host),
            ("host read", shard / host),
            ("reload", reload),
            tensors,
            ("overhead", overhead),
        )
    if method == "shared_memory":
        # One write of flat tensors into POSIX shared memory that the engine's workers map: their reload copies
        # straight from the mapping, with no file to read first.
        return (("gather", gather), ("host write", volume / host), ("reload", reload), tensors, ("overhead", overhead))
    if method == "disk":
        # Trainer rank 0 writes the safetensors folder once; every worker reads its shard of it, all at once.
        disk = sync_figure(target, "weight_sync_disk_gbps") * 1e9
        return (
            ("gather", gather),
            ("write", volume / disk),
            ("read", shard / disk),
            ("reload", reload),
            tensors,
            ("overhead", overhead),
        )
    raise ValueError(f"unknown weight-sync method {method!r}")


def sync_seconds(
    sizes: ModelSizes,
    target: TargetProfile,
    shape: SyncShape,
    method: str,
    senders: int = 1,
    slicing: str = "full",
    sliced: frozenset[str] = frozenset({"dense"}),
) -> float:
    """Seconds one sync takes by `method` (with `senders` and `slicing` for broadcast; `sliced`: the parts the
    runtime cuts into TP shards for this model): the sum of its terms."""
    return sum(v for _, v in _terms(sizes, target, shape, method, senders, slicing, sliced))


def max_senders(target: TargetProfile, shape: SyncShape) -> int:
    """Most trainer ranks that may send at once: at most the trainer's ranks, and each sender's group costs every
    engine worker `sync_group_gib` of device memory, which must fit in what vLLM's share leaves beside the
    reserve (the first group already sits in the reserve)."""
    if shape.engine is None:
        return max(1, shape.trainer_ranks)
    room = target.usable_hbm_gib * (1.0 - shape.engine.memory_fraction) - target.reserve_gib
    groups = 1 + int(max(0.0, room) / target.sync_group_gib) if target.sync_group_gib > 0 else shape.trainer_ranks
    return max(1, min(shape.trainer_ranks, groups))


def _sender_counts(most: int) -> list[int]:
    """1, 2, 4, ... up to `most`, and `most` itself."""
    counts, k = [], 1
    while k < most:
        counts.append(k)
        k *= 2
    return [*counts, most]


def priced_options(
    sizes: ModelSizes,
    target: TargetProfile,
    shape: SyncShape,
    *,
    requested: str,
    executable: frozenset[str],
    sliced: frozenset[str] = frozenset(),
) -> list[SyncOption]:
    """Every way this layout could sync, priced, fastest first (ties: the simpler first).

    Disaggregated: broadcast with 1, 2, 4, ... senders (`max_senders`), whole tensors or TP slices (an engine of
    TP > 1), and disk. Colocated: inplace, shared_memory (cpu only: the engine's workers map host memory; on
    accelerators IPC handles would, which the runtime does not have), and disk. `requested` is the spec's
    rollout.weight_sync: disk picks disk; auto and broadcast pick among the others (disk needs a filesystem every
    node sees, which only the spec can vouch for). `executable`: the runtime's `WEIGHT_SYNC_EXECUTABLE`; `sliced`:
    the parts of this model the runtime cuts into TP shards (`WEIGHT_SYNC_TP_SLICES`), without which TP slices are
    not offered (they would be every byte anyway).
    """
    options: list[SyncOption] = []

    def add(method: str, senders: int = 1, slicing: str = "full") -> None:
        terms = _terms(sizes, target, shape, method, senders, slicing, sliced)
        missing = [
            name
            for name, needed in ((method, True), ("senders", senders > 1), ("tp_slicing", slicing == "tp"))
            if needed and name not in executable
        ]
        groups = shape.engine.tp if shape.engine is not None and slicing == "tp" else 1
        if requested == "disk":
            allowed, why = method == "disk", "the spec asks for disk"
        elif method == "disk":
            allowed, why = False, "disk needs rollout.weight_sync: disk (a filesystem every node sees)"
        elif (groups - 1) * target.sync_group_gib > shape.sender_room_gib:
            allowed = False
            why = (
                f"each sender would hold a group per engine TP rank ({groups} x {target.sync_group_gib:g} GiB), more "
                f"than its device's {shape.sender_room_gib:.2f} GiB of headroom"
            )
        else:
            allowed, why = True, ""
        if missing:
            why = f"the runtime does not execute {' or '.join(missing)} yet"
        volume = _full_bytes(sizes, target, shape.adapter_params)
        if method == "broadcast":
            received = worker_bytes(sizes, target, shape.engine, slicing, sliced)
        else:
            received = volume * shard_share(sizes, shape.engine)
        options.append(
            SyncOption(
                method,
                senders,
                slicing,
                sum(v for _, v in terms),
                received,
                terms,
                runs=not missing,
                allowed=allowed,
                why_not=why if not (allowed and not missing) else "",
            )
        )

    if shape.mode == "colocated":
        add("inplace")
        if target.kind == "cpu":
            add("shared_memory")
    else:
        cut = (
            sliced
            and shape.engine is not None
            and worker_bytes(sizes, target, shape.engine, "tp", sliced) < (_full_bytes(sizes, target, 0))
        )
        slicings = ["full", "tp"] if cut else ["full"]
        for k in _sender_counts(max_senders(target, shape)):
            for slicing in slicings:
                add("broadcast", k, slicing)
    add("disk")
    return sorted(options, key=lambda o: (o.seconds, o.complexity(), o.method))


def pick(options: list[SyncOption]) -> SyncOption:
    """The option a plan runs: the fastest eligible one, and among those within SYNC_TIE of it the simplest (fewer
    senders, whole tensors). With none eligible (a spec asking for what the runtime lacks), the fastest that
    runs."""
    eligible = [o for o in options if o.eligible] or [o for o in options if o.runs] or options
    fastest = min(o.seconds for o in eligible)
    near = [o for o in eligible if o.seconds <= fastest * (1 + SYNC_TIE) + 1e-12]
    return min(near, key=lambda o: (o.complexity(), o.seconds, o.method))


def adapter_option(sizes: ModelSizes, target: TargetProfile, shape: SyncShape) -> SyncOption:
    """A LoRA adapter served by the engines: one small file, written once and loaded by every engine."""
    terms = _terms(sizes, target, shape, "disk", 1, "full")
    volume = _full_bytes(sizes, target, shape.adapter_params)
    return SyncOption("adapter", 1, "full", sum(v for _, v in terms), volume, terms)


def bound_shape(shape: SyncShape) -> SyncShape:
    """The shape a lower bound prices before the engines exist: no engine (nothing per worker)."""
    return replace(shape, engine=None)
