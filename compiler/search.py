"""Layout search: split devices between roles and pick each role's parallel degrees and budgets.

Roles are independent given their device counts, so the search finds the best few layouts per role and
device count once (memoised), then combines them over the device splits. Candidates that do not fit memory
are kept with their verdict so that the plan can say why a layout lost, and so that an infeasible spec gets
the closest breakdown in its diagnostic.

Pruning keeps a 1,024-device MoE search well under a second. Per degree tuple, memory (which only falls with
more offload and smaller token budgets) is probed at its lightest first, and an overflow there rules out the
rest; choices dominated by one that already fits (more offload or recompute at the same budget) are skipped,
and so are tuples whose time lower bound cannot beat the layouts already kept. Deeper pipelines are skipped
once a shallower one fits without recompute or offload, large clusters' splits go coarse then fine, and role
searches are memoised per device count. `exhaustive=True` turns the pruning off for tests.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from math import ceil, inf

from rlc.compiler import cost, memory
from rlc.compiler.memory import MemoryBreakdown, ModelSizes, RolloutLayout
from rlc.compiler.resolve import Problem
from rlc.schemas.layout import (
    BF16,
    FP32,
    CpKind,
    Precision,
    TrainLayout,
    backend_recomputes,
    cp_problem,
    default_cp_kind,
    tp_problem,
)
from rlc.schemas.target import TargetProfile

#: Highest vLLM memory share the planner chooses on its own; above it long prefills have OOMed even though
#: the static budget fit (vllm-ascend issue 3357: Qwen3-235B TP16 at 0.95 with a 90K prompt).
MAX_AUTO_FRACTION = 0.9
#: Concurrent sequences the planner allows per vLLM scheduler when nothing is pinned.
MAX_AUTO_SEQS = 1024
#: Splits evaluated in the coarse pass of a large cluster before refining around the best.
COARSE_SPLITS = 12
RECOMPUTE_ORDER = ("none", "selective", "full")
OFFLOAD_ORDER = ((False, False), (False, True), (True, True))
#: Micro-batch token budgets tried, as multiples of the longest sequence, largest first: bigger micro-batches
#: keep the device busier, so the largest that fits is taken.
MBT_MULTIPLES = (4, 2, 1)
#: Trainer layouts kept per device count (the fastest), to combine with rollout layouts.
KEEP_TRAIN = 3


def _pow2_upto(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


@dataclass(frozen=True)
class Context:
    """Everything the search reads, derived once from the problem."""

    problem: Problem
    sizes: ModelSizes
    target: TargetProfile
    devices_per_node: int
    nodes: int
    total: int
    work: cost.Workload
    max_model_len: int
    longest: int
    lora_rank: int | None
    lora_targets: str | list[str]
    lora_adapter: bool
    reference: bool
    mtp: bool
    teacher_sizes: dict[str, ModelSizes]
    exhaustive: bool
    precision: Precision = FP32
    #: Role searches already done, by role and arguments: splits and teacher pool sizes revisit device counts.
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def spec(self):  # type: ignore[no-untyped-def]
        return self.problem.spec


def lora_rollout_mode(problem: Problem) -> str:
    """adapter when the engine serves LoRA well, else merged.

    auto → adapter, except MoE models on NPUs: vllm-ascend's LoRA is experimental and excludes fused MC2
    and dynamic EPLB (research notes §3.6), so the adapters are merged into the base before each sync.
    """
    lora = problem.spec.lora
    if lora is None:
        return "merged"
    if lora.rollout != "auto":
        return lora.rollout
    return "merged" if (problem.arch.is_moe and problem.target.kind == "npu") else "adapter"


def train_precision(problem: Problem) -> Precision:
    """The trainer's dtypes: `train.precision`, where auto is bf16 compute on accelerators and fp32 on cpu.

    Parameters, optimizer state and gradient reduction stay fp32 either way (FSDP2 mixed precision). The cpu
    target defaults to fp32 so that trainer and vLLM (which runs fp32 there) agree on log-probs.
    """
    choice = problem.spec.train.precision
    if choice == "auto":
        return FP32 if problem.target.kind == "cpu" else BF16
    return BF16 if choice == "bfloat16" else FP32


def make_context(problem: Problem, exhaustive: bool = False) -> Context:
    """Derive the search context from a resolved problem."""
    spec = problem.spec
    mtp = spec.rollout.mtp
    uses_mtp_layers = mtp is not None and mtp.method != "ngram" and problem.arch.mtp_layers > 0
    longest = spec.rollout.max_total_len
    work = cost.workload(
        batch_prompts=spec.algorithm.batch_prompts,
        group_size=spec.algorithm.group_size,
        max_prompt_len=spec.rollout.max_prompt_len,
        max_response_len=spec.rollout.max_response_len,
        staleness=spec.algorithm.max_staleness,
        decoupled=spec.algorithm.decoupled_loss,
        reference=spec.algorithm.kl_coef > 0 and spec.lora is None,
        lora=spec.lora is not None,
        mtp_tokens=mtp.num_speculative_tokens if mtp else 0,
        mtp_acceptance=mtp.acceptance_rate if mtp else 0.0,
        mtp_draft_layers=1 if uses_mtp_layers else 0,
    )
    return Context(
        problem=problem,
        sizes=memory.model_sizes(problem.arch),
        target=problem.target,
        devices_per_node=problem.devices_per_node,
        nodes=spec.cluster.nodes,
        total=problem.total_devices,
        work=work,
        max_model_len=longest,
        longest=longest,
        lora_rank=spec.lora.rank if spec.lora else None,
        lora_targets=spec.lora.target_modules if spec.lora else "all-linear",
        lora_adapter=spec.lora is not None and lora_rollout_mode(problem) == "adapter",
        reference=spec.algorithm.kl_coef > 0 and spec.lora is None,
        mtp=uses_mtp_layers,
        teacher_sizes={name: memory.model_sizes(a) for name, a in sorted(problem.teacher_archs.items())},
        exhaustive=exhaustive,
        precision=train_precision(problem),
    )


# --------------------------------------------------------------------------------------------- options


@dataclass(frozen=True)
class TrainOption:
    layout: TrainLayout
    memory: MemoryBreakdown
    time: cost.TrainTime

    @property
    def seconds(self) -> float:
        return self.time.total_s


@dataclass(frozen=True)
class RolloutOption:
    layout: RolloutLayout
    memory: MemoryBreakdown
    seqs: int
    time: cost.RolloutTime


@dataclass(frozen=True)
class TeacherOption:
    name: str
    layout: RolloutLayout
    memory: MemoryBreakdown
    seqs: int
    seconds: float


@dataclass
class RoleSearch:
    """Fitting options for one role and device count, best first, and the closest miss."""

    options: list = field(default_factory=list)
    closest: MemoryBreakdown | None = None
    closest_layout: object | None = None
    reason: str = ""

    def miss(self, breakdown: MemoryBreakdown, layout: object) -> None:
        """Remember the layout closest to fitting (device overflow; host-memory misses rank last)."""
        if self.closest is None or _overflow(breakdown) < _overflow(self.closest):
            self.closest, self.closest_layout = breakdown, layout


def _overflow(b: MemoryBreakdown) -> float:
    return b.total_gib - b.capacity_gib + (1e6 if b.problems else 0.0)


def _record(failures: dict[str, RoleSearch], role: str, found: RoleSearch) -> None:
    """Keep, per role, the closest miss over every device count tried."""
    held = failures.get(role)
    if (
        held is None
        or held.closest is None
        or (found.closest is not None and _overflow(found.closest) < _overflow(held.closest))
    ):
        failures[role] = found


def train_search(ctx: Context, n: int, resident_gib: float = 0.0) -> RoleSearch:
    """Best trainer layouts on `n` devices (fitting ones sorted by time, then summary); memoised per context."""
    key = ("train", n, resident_gib)
    if key not in ctx.memo:
        ctx.memo[key] = _train_search(ctx, n, resident_gib)
    return ctx.memo[key]


def _cp_kinds(ctx: Context, backend: str, tp: int, cp: int) -> list[CpKind]:
    """CP kinds to try for (tp, cp): the pinned one; else Ulysses where the heads allow it, otherwise ring,
    which the fsdp2 runtime executes on cpu only (`layout.runtime_gaps`), so there it is offered on cpu or
    when nothing else is possible for a pinned CP."""
    pin = ctx.spec.placement.train
    arch = ctx.sizes.arch
    if cp == 1:
        return ["ulysses"]
    if pin.cp_kind:
        return [pin.cp_kind] if cp_problem(arch, tp, cp, pin.cp_kind) is None else []
    kind = default_cp_kind(arch, tp, cp)
    if kind == "ring" and backend == "fsdp2" and ctx.target.kind != "cpu" and not pin.cp:
        return []
    return [kind]


def _train_search(ctx: Context, n: int, resident_gib: float) -> RoleSearch:
    spec, arch = ctx.spec, ctx.sizes.arch
    pin = spec.placement.train
    found = RoleSearch()
    backend_pin = pin.backend or (spec.train.backend if spec.train.backend != "auto" else None)
    if backend_pin:
        backends = [backend_pin]
    elif arch.is_moe or any(v and v > 1 for v in (pin.pp, pin.ep)):
        backends = ["megatron"]
    else:
        backends = ["fsdp2", "megatron"]
    rc_pin = pin.recompute or (spec.train.recompute if spec.train.recompute != "auto" else None)
    off_pin = pin.offload or (
        spec.train.offload if (spec.train.offload.params or spec.train.offload.optimizer) else None
    )
    mbt_pin = pin.micro_batch_tokens or spec.train.micro_batch_tokens
    mbts = [mbt_pin] if mbt_pin else [_round_up(ctx.longest * m, 128) for m in MBT_MULTIPLES]
    dpn = ctx.devices_per_node
    long_cp = max(1, ctx.longest // 4096)
    fastest: list[float] = []  # seconds of the KEEP_TRAIN fastest options so far: the bar for pruning
    for backend in backends:
        recomputes = [rc_pin] if rc_pin else [r for r in RECOMPUTE_ORDER if r in backend_recomputes(backend)]
        if rc_pin and rc_pin not in backend_recomputes(backend):
            continue  # e.g. selective on fsdp2, which checkpoints whole layers only
        if off_pin:
            # FSDP2's parameter offload runs the optimizer step on the host, so its state lives there too.
            offloads = [(off_pin.params, off_pin.optimizer or (off_pin.params and backend == "fsdp2"))]
        else:
            offloads = list(OFFLOAD_ORDER)
        tps = [pin.tp] if pin.tp else [t for t in _pow2_upto(min(dpn, n)) if tp_problem(arch, t) is None]
        if backend == "fsdp2":
            pps, eps = [1], [1]
        else:
            pps = [pin.pp] if pin.pp else [p for p in _pow2_upto(min(arch.num_layers, n))]
            if arch.moe is None:
                eps = [1]
            else:
                eps = (
                    [pin.ep]
                    if pin.ep
                    else [e for e in _pow2_upto(min(arch.moe.num_experts, n)) if arch.moe.num_experts % e == 0]
                )
        cps_all = [pin.cp] if pin.cp else _pow2_upto(min(16, n))
        for tp in tps:
            # CP beyond what the context needs only splits activations further: all-to-alls and no FLOPs saved.
            # Megatron splits activations with TP and PP as well, so there it is skipped outright; FSDP2 has no
            # other split, and a larger CP can beat recompute, so it is skipped only once a smaller CP fits
            # without recompute or offload (a 16-device dense case picked CP 4 exhaustively, CP 1 pruned).
            plain_fit = backend != "fsdp2"
            for cp in cps_all:
                if not pin.cp and not ctx.exhaustive and cp > long_cp and plain_fit:
                    continue
                for cp_kind in _cp_kinds(ctx, backend, tp, cp):
                    for ep in eps:
                        for pp in pps:
                            if n % (tp * pp * cp):
                                continue
                            dp = n // (tp * pp * cp)
                            if ep > 1 and (tp * cp * dp) % ep:
                                continue
                            bound = fastest[-1] if len(fastest) >= KEEP_TRAIN and not ctx.exhaustive else inf
                            had = len(found.options)
                            shape = Shape(backend, tp, pp, cp, cp_kind, ep)
                            cheapest_fit = _train_degree(
                                ctx, found, n, shape, recomputes, offloads, mbts, resident_gib, bound
                            )
                            if len(found.options) > had:
                                fastest = heapq.nsmallest(
                                    KEEP_TRAIN, fastest + [o.seconds for o in found.options[had:]]
                                )
                            plain_fit = plain_fit or cheapest_fit
                            if cheapest_fit and not ctx.exhaustive:
                                break
        if backend == "fsdp2" and found.options and not backend_pin:
            break  # fsdp2 for dense models that fit; megatron only when it does not
    found.options.sort(key=lambda o: (round(o.seconds, 6), o.layout.summary()))
    del found.options[KEEP_TRAIN if not ctx.exhaustive else len(found.options) :]
    return found


@dataclass(frozen=True)
class Shape:
    """The degrees of a trainer layout, before recompute, offload and the token budget are chosen."""

    backend: str
    tp: int
    pp: int
    cp: int
    cp_kind: CpKind
    ep: int

    def layout(
        self, ctx: Context, n: int, recompute: str, off_params: bool, off_optimizer: bool, mbt: int
    ) -> TrainLayout:
        return TrainLayout.model_construct(
            world_size=n,
            backend=self.backend,
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            cp_kind=self.cp_kind,
            ep=self.ep,
            recompute=recompute,
            offload_params=off_params,
            offload_optimizer=off_optimizer,
            micro_batch_tokens=mbt,
            precision=ctx.precision,
        )


def _train_lower_bound_s(ctx: Context, n: int, shape: Shape, rc: str, mbts: list[int]) -> float:
    """Seconds no layout with these degrees and this recompute can beat (`cost.train_time`): compute at the
    smallest pipeline bubble (smallest budget, most micro-batches) plus communication at the fewest
    micro-batches (largest budget; per-micro-batch latencies and FSDP2 gathers only grow with their number),
    without offload traffic."""
    pp = shape.pp
    layout = shape.layout(ctx, n, rc, False, False, mbts[0])
    t = cost.train_time(ctx.sizes, layout, ctx.target, ctx.work, ctx.devices_per_node)
    micro = max(1, ceil(ctx.work.trained_tokens / layout.dp / mbts[-1]))
    bubble = (pp - 1) / (micro + pp - 1)
    return t.compute_s / (1 - bubble) + t.tp_s + t.cp_s + t.ep_s + t.dp_s


def _train_degree(
    ctx: Context,
    found: RoleSearch,
    n: int,
    shape: Shape,
    recomputes: list[str],
    offloads: list[tuple[bool, bool]],
    mbts: list[int],
    resident: float,
    bound: float = inf,
) -> bool:
    """Evaluate one degree tuple over recompute × offload (largest fitting token budget each).

    Keeps the fastest fitting choice (all of them when exhaustive). Returns True when the tuple fits with no
    recompute and no offload: a deeper pipeline with the same TP/CP/EP then only adds bubble, so the caller
    skips it (pruning). When not exhaustive, choices the one just found dominates (more offload or more
    recompute at the same budget) are skipped, and so is a recompute whose time lower bound exceeds `bound`
    (the slowest layout the caller keeps) or the tuple's best so far: it could enter neither.
    """
    best: TrainOption | None = None
    cheapest = dominant = False
    seen: dict[tuple, tuple[TrainLayout, MemoryBreakdown]] = {}

    def evaluate(rc: str, off_p: bool, off_o: bool, mbt: int) -> tuple[TrainLayout, MemoryBreakdown]:
        key = (rc, off_p, off_o, mbt)
        if key not in seen:
            layout = shape.layout(ctx, n, rc, off_p, off_o, mbt)
            mem = memory.train_memory(
                ctx.sizes,
                layout,
                ctx.target,
                logprob_chunk_tokens=ctx.spec.train.logprob_chunk_tokens,
                lora_rank=ctx.lora_rank,
                lora_targets=ctx.lora_targets,
                reference=ctx.reference,
                devices_per_node=ctx.devices_per_node,
                resident_gib=resident,
            )
            seen[key] = (layout, mem)
        return seen[key]

    smallest = mbts[-1]  # budgets run largest first; memory grows with the budget
    host_short: set[tuple[bool, bool]] = set()  # offloads whose host memory is short: the same for every rc
    lower: dict[str, float] = {}

    def beaten(rc: str, limit: float) -> bool:
        if limit == inf:
            return False
        if rc not in lower:
            lower[rc] = _train_lower_bound_s(ctx, n, shape, rc, mbts)
        return lower[rc] > limit * (1 + 1e-9)

    if beaten(recomputes[0], bound) and all(beaten(rc, bound) for rc in recomputes):
        return False
    # What no recompute changes (everything but activations) may overflow the device on its own: then no
    # choice fits, and the lightest recompute's most offloaded layout is the tuple's closest miss.
    for off_p, off_o in reversed(offloads):
        layout, mem = evaluate(recomputes[-1], off_p, off_o, smallest)
        if mem.problems:
            continue
        if mem.total_gib - mem.items.get("activations", 0.0) > mem.capacity_gib + 1e-9:
            found.miss(mem, layout)
            return False
        break
    for rc in recomputes:
        if beaten(rc, min(bound, best.seconds if best else inf)):
            continue
        # Device memory only falls as more is offloaded and as the token budget shrinks. So the most offloaded
        # layout whose host memory suffices, at the smallest budget, is this recompute's closest miss: when it
        # overflows the device, nothing else with this recompute fits (host-short layouts rank last anyway).
        skip = False
        for off_p, off_o in reversed(offloads):
            if (off_p, off_o) in host_short:
                continue
            layout, mem = evaluate(rc, off_p, off_o, smallest)
            if mem.problems:
                host_short.add((off_p, off_o))
                found.miss(mem, layout)
                continue
            if not mem.fits:
                found.miss(mem, layout)
                skip = True
            break
        if skip:
            continue
        for off_p, off_o in offloads:
            if (off_p, off_o) in host_short:
                continue
            layout, mem = evaluate(rc, off_p, off_o, smallest)
            if not mem.fits:
                found.miss(mem, layout)
                continue
            for mbt in mbts:
                layout, mem = evaluate(rc, off_p, off_o, mbt)
                if not mem.fits:
                    found.miss(mem, layout)
                    continue
                t = cost.train_time(ctx.sizes, layout, ctx.target, ctx.work, ctx.devices_per_node)
                option = TrainOption(layout, mem, t)
                if ctx.exhaustive:
                    found.options.append(option)
                elif best is None or (round(option.seconds, 6), layout.summary()) < (
                    round(best.seconds, 6),
                    best.layout.summary(),
                ):
                    best = option
                plain = rc == "none" and not off_p and not off_o
                cheapest = cheapest or plain
                dominant = dominant or (plain and mbt == mbts[0])
                break
            if not ctx.exhaustive and mem.fits and layout.micro_batch_tokens == mbts[0]:
                # The largest budget fits: more offload keeps that budget and only adds host traffic.
                break
        if not ctx.exhaustive and dominant:
            # No recompute, no offload, largest budget: every other recompute only adds FLOPs.
            break
    if best is not None:
        found.options.append(best)
    return cheapest


def _groups_in_nodes(start: int, count: int, group: int, dpn: int) -> bool:
    """Every consecutive `group` of devices from `start` lies inside one node (TP never spans nodes)."""
    return all((s // dpn) == ((s + group - 1) // dpn) for s in range(start, start + count, group))


def rollout_search(
    ctx: Context, n: int, start: int, outside_gib: float, *, sync: bool, fraction: float | None = None
) -> RoleSearch:
    """Best vLLM layouts on `n` devices starting at global device index `start`; memoised per context."""
    key = ("rollout", n, start, outside_gib, sync, fraction)
    if key not in ctx.memo:
        ctx.memo[key] = _rollout_search(ctx, n, start, outside_gib, sync=sync, fraction=fraction)
    return ctx.memo[key]


def _rollout_search(
    ctx: Context, n: int, start: int, outside_gib: float, *, sync: bool, fraction: float | None
) -> RoleSearch:
    arch = ctx.sizes.arch
    pin = ctx.spec.placement.rollout
    found = RoleSearch()
    dpn = ctx.devices_per_node
    tps = [pin.tp] if pin.tp else [t for t in _pow2_upto(min(dpn, n)) if arch.num_attention_heads % t == 0]
    if fraction is None:
        fraction = pin.memory_fraction or round(
            min(MAX_AUTO_FRACTION, memory.max_memory_fraction(ctx.target, outside_gib)) - 0.005, 2
        )
    if fraction <= 0.02:
        found.reason = f"no memory left for rollout engines beside {outside_gib:.1f} GiB of other roles"
        return found
    for tp in tps:
        if n % tp or not _groups_in_nodes(start, n, tp, dpn):
            continue
        if arch.moe is None:
            eps = [1]
        elif pin.ep:
            eps = [pin.ep]
        else:
            eps = [1] + [
                e
                for e in _pow2_upto(min(n, arch.moe.num_experts))
                if e > tp and e % tp == 0 and arch.moe.num_experts % e == 0
            ]
        for ep in eps:
            engine = max(tp, ep)
            if n % engine or engine % tp:
                continue
            layout = RolloutLayout(n, tp, ep, fraction, pin.max_num_seqs or 0, _batched_tokens(ctx))
            mem, seqs = memory.rollout_memory(
                ctx.sizes,
                layout,
                ctx.target,
                max_model_len=ctx.max_model_len,
                mtp=ctx.mtp,
                lora_rank=ctx.lora_rank if ctx.lora_adapter else None,
                lora_targets=ctx.lora_targets,
                resident_gib=outside_gib,
                planned_context=ctx.work.inflight_context,
            )
            if not mem.fits:
                found.miss(mem, layout)
                continue
            max_seqs = pin.max_num_seqs or max(1, min(seqs, MAX_AUTO_SEQS))
            layout = RolloutLayout(n, tp, ep, fraction, max_seqs, max(_batched_tokens(ctx), max_seqs))
            t = cost.rollout_time(ctx.sizes, layout, ctx.target, ctx.work, dpn, max_seqs)
            found.options.append(RolloutOption(layout, mem, seqs, t))
    key = (lambda o: o.time.sync_s) if sync else (lambda o: o.time.async_s)
    found.options.sort(key=lambda o: (round(key(o), 6), o.layout.summary()))
    del found.options[2 if not ctx.exhaustive else len(found.options) :]
    return found


def _batched_tokens(ctx: Context) -> int:
    """vLLM max_num_batched_tokens: 8192 (chunked prefill) on accelerators, 2048 on the cpu target."""
    return 2048 if ctx.target.kind == "cpu" else 8192


TEACHER_BATCHED_TOKENS = 4096


def teacher_search(
    ctx: Context, name: str, n: int, start: int, outside_gib: float, fraction: float | None = None
) -> RoleSearch:
    """Forward-only vLLM engines for one teacher on `n` devices (prompt log-probs of student samples)."""
    key = ("teacher", name, n, start, outside_gib, fraction)
    if key not in ctx.memo:
        ctx.memo[key] = _teacher_search(ctx, name, n, start, outside_gib, fraction)
    return ctx.memo[key]


def _teacher_search(
    ctx: Context, name: str, n: int, start: int, outside_gib: float, fraction: float | None
) -> RoleSearch:
    sizes = ctx.teacher_sizes[name]
    arch = sizes.arch
    pin = ctx.spec.placement.teachers.get(name)
    found = RoleSearch()
    dpn = ctx.devices_per_node
    tps = [pin.tp] if pin and pin.tp else [t for t in _pow2_upto(min(dpn, n)) if arch.num_attention_heads % t == 0]
    tokens = TEACHER_BATCHED_TOKENS
    logits = memory.gib(tokens * arch.vocab_size * 4 * 2)
    frac = (
        (pin.memory_fraction if pin else None)
        or fraction
        or round(min(MAX_AUTO_FRACTION, memory.max_memory_fraction(ctx.target, outside_gib + logits)) - 0.005, 2)
    )
    share = _teacher_share(ctx, name)
    for tp in tps:
        if n % tp or not _groups_in_nodes(start, n, tp, dpn):
            continue
        layout = RolloutLayout(n, tp, 1, frac, 0, tokens)
        mem, seqs = memory.rollout_memory(
            sizes,
            layout,
            ctx.target,
            max_model_len=ctx.max_model_len,
            resident_gib=outside_gib,
            role=f"teacher-{name}",
            prompt_logprobs=True,
            planned_context=ctx.work.context_tokens,
        )
        if not mem.fits:
            found.miss(mem, layout)
            continue
        layout = RolloutLayout(n, tp, 1, frac, max(1, min(seqs, MAX_AUTO_SEQS)), tokens)
        seconds = cost.teacher_time_s(sizes, n, ctx.target, ctx.work, share)
        seconds += ctx.work.samples * share / layout.replicas * 0.0  # engines run in parallel
        found.options.append(TeacherOption(name, layout, mem, seqs, seconds + 0.01 * tp))
    found.options.sort(key=lambda o: (round(o.seconds, 6), o.layout.tp))
    return found


def _teacher_share(ctx: Context, name: str) -> float:
    """Share of samples a teacher scores: 1/teachers under domain routing, all of them under mixture."""
    distill = ctx.spec.distill
    if distill is None:
        return 0.0
    return 1.0 if distill.routing == "mixture" else 1.0 / len(distill.teachers)


# --------------------------------------------------------------------------------------------- candidates


@dataclass(frozen=True)
class Candidate:
    """One complete layout with its estimate."""

    mode: str
    train: TrainOption
    rollout: RolloutOption
    teachers: tuple[TeacherOption, ...]
    step: cost.StepTime
    train_start: int = 0
    rollout_start: int = 0
    teacher_starts: tuple[int, ...] = ()

    @property
    def summary(self) -> str:
        """Mode and every role's devices and choices, so that two candidates never read alike:
        `disaggregated: train 16 (fsdp2 tp1 pp1 cp1 dp16 recompute=none mbt=10240) + rollout 8 (2x vllm tp4
        mem=0.90) + teacher-math 4 (2x vllm tp2 mem=0.85)`."""
        parts = [
            f"{self.mode}: train {self.train.layout.world_size} ({self.train.layout.summary()})",
            f"rollout {self.rollout.layout.devices} ({self.rollout.layout.summary()})",
        ]
        parts += [f"teacher-{t.name} {t.layout.devices} ({t.layout.summary()})" for t in self.teachers]
        return " + ".join(parts)

    def key(self) -> tuple:
        """Rank: faster first; ties go to the quicker trainer, then fewer training devices, then the quicker
        rollout, then smaller engines, then the text.

        An asynchronous step paced by the trainer hides the rollout, so several rollout layouts tie on
        tokens/s. The quicker one leaves the most slack for the estimate's error and for long-tail batches;
        among equals the smaller engine (fewer collectives on the decode path, less throughput lost with one
        engine) wins. The summary text used to decide these ties, and `1x vllm tp8` sorts before
        `8x vllm tp1`, so ties went to the widest engine.
        """
        ro = self.rollout.layout
        return (
            -round(self.step.tokens_per_s, 3),
            round(self.step.train_s, 6),
            self.train.layout.world_size,
            round(self.step.rollout_s, 6),
            ro.engine_devices,
            ro.tp,
            self.summary,
        )


@dataclass
class SearchResult:
    """The winner, the ranked runners-up and, when nothing fits, why."""

    best: Candidate | None
    ranked: list[Candidate]
    failures: dict[str, RoleSearch]
    evaluated: int = 0


def _combine(
    ctx: Context,
    mode: str,
    tr: TrainOption,
    ro: RolloutOption,
    teachers: tuple[TeacherOption, ...],
    starts: tuple[int, int, tuple[int, ...]],
    state_gib: float,
) -> Candidate:
    sizes, target, work = ctx.sizes, ctx.target, ctx.work
    adapter = memory.lora_params(sizes.arch, ctx.lora_rank, ctx.lora_targets) if ctx.lora_adapter else 0
    method = _sync_method(ctx, mode)
    # Across nodes the broadcast crosses the scale-out link, and so does a colocated run's gather to each
    # node's leader rank (which then hands the weights to its node's engines through host memory).
    cross = ctx.nodes > 1
    sync = cost.weight_sync_s(sizes, target, method, cross_node=cross, adapter_params=adapter)
    switch = cost.switch_s(target, state_gib) if mode == "colocated" else 0.0
    teacher_s = max((t.seconds for t in teachers), default=0.0)
    step = cost.step_time(mode, work, ro.time, tr.seconds, teacher_s, sync, switch)
    return Candidate(mode, tr, ro, teachers, step, starts[0], starts[1], starts[2])


def _sync_method(ctx: Context, mode: str) -> str:
    if ctx.spec.rollout.weight_sync == "disk":
        return "disk"
    if mode == "colocated":
        return "inplace"
    return "broadcast"


def _colocated(ctx: Context, result: SearchResult) -> list[Candidate]:
    """All roles share every device: train phase and rollout phase must each fit beside what stays."""
    n, target = ctx.total, ctx.target
    pins = ctx.spec.placement
    if (pins.train.devices and pins.train.devices != n) or (pins.rollout.devices and pins.rollout.devices != n):
        n = pins.train.devices or pins.rollout.devices or n
    teachers: list[TeacherOption] = []
    teacher_gib = 0.0
    for name in ctx.teacher_sizes:
        pin = pins.teachers.get(name)
        chosen = None
        for frac in [pin.memory_fraction] if pin and pin.memory_fraction else [0.1, 0.15, 0.2, 0.3, 0.4, 0.5]:
            ts = teacher_search(ctx, name, n, 0, teacher_gib, fraction=frac)
            if ts.options:
                chosen = ts.options[0]
                break
            result.failures.setdefault(f"teacher-{name}", ts)
        if chosen is None:
            return []
        result.failures.pop(f"teacher-{name}", None)
        teachers.append(chosen)
        teacher_gib += chosen.memory.total_gib - target.reserve_gib - chosen.memory.items.get("other_roles", 0.0)
    out: list[Candidate] = []
    cpu = target.kind == "cpu"
    fractions: list[float | None] = [None]
    if cpu:
        fractions = [pins.rollout.memory_fraction] if pins.rollout.memory_fraction else [0.5, 0.4, 0.3, 0.2, 0.1]
    for frac in fractions:
        rollout_resident = (frac or 0.0) * target.usable_hbm_gib if cpu else 0.0
        ts = train_search(ctx, n, teacher_gib + rollout_resident)
        result.evaluated += 1
        if not ts.options:
            result.failures["train"] = ts
            continue
        result.failures.pop("train", None)
        train_resident = 0.0
        if cpu:
            best = ts.options[0].memory
            train_resident = best.total_gib - target.reserve_gib - best.items.get("other_roles", 0.0)
        rs = rollout_search(ctx, n, 0, teacher_gib + train_resident, sync=True, fraction=frac)
        if not rs.options:
            result.failures["rollout"] = rs
            continue
        result.failures.pop("rollout", None)
        for tr in ts.options:
            state = memory.train_state_gib(tr.memory)
            host = state * min(ctx.devices_per_node, n)
            if not cpu and host > target.host_memory_gib * memory.HOST_MEMORY_FRACTION:
                continue
            for ro in rs.options:
                out.append(
                    _combine(ctx, "colocated", tr, ro, tuple(teachers), (0, 0, tuple(0 for _ in teachers)), state)
                )
        if out:
            break
    return out


def _pool_granularity(ctx: Context, pools: int = 2) -> int:
    """Device granularity of disaggregated pools.

    One node splits in device groups (die pairs on A3). Several nodes split in whole nodes, unless there are
    more pools than nodes (trainer, rollout and two teachers on two A3 nodes): then pools share nodes in
    device groups too. TP groups stay inside one node either way (`_groups_in_nodes`).
    """
    if ctx.nodes == 1 or pools > ctx.nodes:
        return ctx.target.device_group_size
    return ctx.devices_per_node


def _teacher_minimum(ctx: Context, result: SearchResult, name: str, g: int, limit: int) -> int | None:
    """Fewest devices (a multiple of `g`, at most `limit`) on which teacher `name` fits; pinned counts as is."""
    pin = ctx.spec.placement.teachers.get(name)
    if pin and pin.devices:
        return pin.devices
    failed: dict[str, RoleSearch] = {}
    for count in range(g, limit + 1, g):
        ts = teacher_search(ctx, name, count, ctx.total - count, 0.0)
        if ts.options:
            return count
        _record(failed, name, ts)
    found = failed.get(name)
    if found is None or found.closest is None:
        found = RoleSearch(
            reason=f"no pool of up to {limit} devices (in groups of {g}) is left for it beside the trainer and rollout"
        )
    _record(result.failures, f"teacher-{name}", found)
    return None


def _teacher_allocations(
    ctx: Context, result: SearchResult, g: int
) -> list[tuple[tuple[TeacherOption, ...], tuple[int, ...]]]:
    """Teacher pools to try, each as (options, start devices), packed at the end of the device range.

    Each teacher starts from the fewest devices it fits on; the pools then grow together by powers of two
    while at least two device groups stay for the trainer and rollout, so the search can trade rollout and
    training devices for teacher throughput where the teachers would otherwise pace the step.
    """
    names = list(ctx.teacher_sizes)
    if not names:
        return [((), ())]
    pins = ctx.spec.placement.teachers
    limit = ctx.total - 2 * g
    minimum: list[int] = []
    for name in names:
        m = _teacher_minimum(ctx, result, name, g, limit - sum(minimum))
        if m is None:
            return []
        minimum.append(m)
    pinned = [bool(pins.get(n) and pins[n].devices) for n in names]
    out: list[tuple[tuple[TeacherOption, ...], tuple[int, ...]]] = []
    factor = 1
    while True:
        counts = [m if fixed else m * factor for m, fixed in zip(minimum, pinned, strict=True)]
        start = ctx.total - sum(counts)
        if factor > 1 and sum(counts) > limit:
            break
        if start < 2 * g:
            result.failures["teacher-" + names[0]] = RoleSearch(
                reason=f"teachers pinned to {sum(counts)} of {ctx.total} devices leave too few for trainer and rollout"
            )
            break
        options: list[TeacherOption] = []
        starts: list[int] = []
        for name, count in zip(names, counts, strict=True):
            ts = teacher_search(ctx, name, count, start, 0.0)
            if not ts.options:
                _record(result.failures, f"teacher-{name}", ts)
                break
            options.append(ts.options[0])
            starts.append(start)
            start += count
        else:
            out.append((tuple(options), tuple(starts)))
        if all(pinned):
            break
        factor *= 2
    if out:
        for name in names:
            result.failures.pop(f"teacher-{name}", None)
    return out


def _disaggregated(ctx: Context, result: SearchResult) -> list[Candidate]:
    """Separate pools for train, rollout and each teacher, over the device splits and teacher pool sizes."""
    g = _pool_granularity(ctx, 2 + len(ctx.teacher_sizes))
    cands: list[Candidate] = []
    for teachers, starts_t in _teacher_allocations(ctx, result, g):
        cands += _train_rollout_splits(ctx, result, g, teachers, starts_t)
    if cands:
        result.failures.pop("train", None)
        result.failures.pop("rollout", None)
    return cands


def _train_rollout_splits(
    ctx: Context,
    result: SearchResult,
    g: int,
    teachers: tuple[TeacherOption, ...],
    starts_t: tuple[int, ...],
) -> list[Candidate]:
    """Trainer and rollout pools over the devices before the teachers', trainer first."""
    pins = ctx.spec.placement
    remaining = starts_t[0] if starts_t else ctx.total
    if pins.train.devices and pins.rollout.devices:
        splits = [pins.train.devices] if pins.train.devices + pins.rollout.devices <= remaining else []
        rollout_fixed: int | None = pins.rollout.devices
    elif pins.train.devices:
        splits, rollout_fixed = [pins.train.devices], None
    elif pins.rollout.devices:
        splits, rollout_fixed = [remaining - pins.rollout.devices], pins.rollout.devices
    else:
        splits, rollout_fixed = list(range(g, remaining - g + 1, g)), None
    splits = [s for s in splits if 0 < s < remaining]
    sync = ctx.work.staleness == 0

    def evaluate(n_train: int) -> list[Candidate]:
        n_roll = rollout_fixed or remaining - n_train
        if n_roll <= 0 or n_train + n_roll > remaining:
            return []
        ts = train_search(ctx, n_train)
        rs = rollout_search(ctx, n_roll, n_train, 0.0, sync=sync)
        result.evaluated += 1
        if not ts.options:
            _record(result.failures, "train", ts)
        if not rs.options:
            _record(result.failures, "rollout", rs)
        out = []
        for i, tr in enumerate(ts.options[:2]):
            for j, ro in enumerate(rs.options[:2]):
                if i and j:
                    continue
                out.append(_combine(ctx, "disaggregated", tr, ro, tuple(teachers), (0, n_train, tuple(starts_t)), 0.0))
        return out

    cands: list[Candidate] = []
    if ctx.exhaustive or len(splits) <= COARSE_SPLITS:
        for s in splits:
            cands += evaluate(s)
    else:
        step = ceil(len(splits) / COARSE_SPLITS)
        coarse = splits[::step]
        seen: set[int] = set()
        for s in coarse:
            seen.add(s)
            cands += evaluate(s)
        if cands:
            best = min(cands, key=Candidate.key).train.layout.world_size
            idx = splits.index(best)
            for s in splits[max(0, idx - step) : idx + step + 1]:
                if s not in seen:
                    cands += evaluate(s)
    return cands


def search(problem: Problem, exhaustive: bool = False) -> SearchResult:
    """Find the fastest layout that fits (and the ranked rest) for the problem's mode."""
    ctx = make_context(problem, exhaustive)
    return search_context(ctx)


def search_context(ctx: Context) -> SearchResult:
    """Search colocated and/or disaggregated layouts; on failure keep the most telling misses.

    When nothing fits, colocated misses are reported first: sharing every device is the most memory a role
    can get, so its closest breakdown is the honest lower bound.
    """
    result = SearchResult(None, [], {})
    mode = ctx.spec.mode
    cands: list[Candidate] = []
    colocated_failures: dict[str, RoleSearch] = {}
    if mode in ("colocated", "auto"):
        cands += _colocated(ctx, result)
        colocated_failures, result.failures = result.failures, {}
    if mode in ("disaggregated", "auto") and ctx.total >= 2 * ctx.target.device_group_size:
        cands += _disaggregated(ctx, result)
    if cands:
        result.failures = {}
    elif colocated_failures:
        result.failures = colocated_failures
    unique: dict[str, Candidate] = {}
    for c in sorted(cands, key=Candidate.key):
        unique.setdefault(c.summary, c)
    ranked = list(unique.values())
    result.ranked = ranked
    result.best = ranked[0] if ranked else None
    return result


def runner_up_verdict(winner: Candidate, other: Candidate) -> str:
    """Why `other` lost to `winner`, in numbers."""
    if other.step.tokens_per_s < winner.step.tokens_per_s - 1e-9:
        return f"slower: {other.step.tokens_per_s:,.0f} vs {winner.step.tokens_per_s:,.0f} tok/s"
    return (
        f"as fast ({other.step.tokens_per_s:,.0f} tok/s) but loses the tie-break "
        f"(more training devices or later in order)"
    )
