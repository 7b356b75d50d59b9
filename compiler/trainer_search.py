"""Trainer layouts for one device count on fsdp2, the trainer rlc executes: parallel degrees, recompute, offload
and token budgets.

Per degree tuple, memory (which only falls with more offload and smaller token budgets) is probed at its
lightest first, and an overflow there rules out the rest; choices dominated by one that already fits (more
offload or recompute at the same budget) are skipped, and so are tuples whose time lower bound cannot beat
the layouts already kept. `Context.exhaustive` turns the pruning off for tests. Results are memoised per
device count, resident memory and objective in the context.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from math import inf

from rlc.compiler import cost, memory
from rlc.compiler.memory import MemoryBreakdown
from rlc.compiler.options import RoleSearch, TrainOption
from rlc.compiler.search_context import Context
from rlc.schemas.layout import (
    CpKind,
    TrainLayout,
    backend_recomputes,
    cp_problem,
    default_cp_kind,
    fsdp2_runs_ep,
    fsdp2_runs_tp,
    linear_heads,
    tp_problem,
)

RECOMPUTE_ORDER = ("none", "selective", "full")
OFFLOAD_ORDER = ((False, False), (False, True), (True, True))
#: Micro-batch token budgets tried, as multiples of the longest sequence, largest first: bigger micro-batches
#: keep the device busier, so the largest that fits is taken.
MBT_MULTIPLES = (4, 2, 1)
#: Trainer layouts kept per device count (the fastest), to combine with rollout layouts.
KEEP_TRAIN = 3
_PROTOTYPE = TrainLayout(world_size=1)


def pow2_upto(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def train_search(
    ctx: Context, n: int, resident_gib: float = 0.0, *, colocated: bool = False, bar: float = inf
) -> RoleSearch:
    """Best trainer layouts on `n` devices (fitting ones sorted by score, then summary); memoised per context.

    `colocated`: the trainer shares its devices with the engines, so each option also pays the phase switch
    (its device state to host and back, `cost.switch_s`) and must find room for that state in host memory.
    `bar`: only layouts that could score below it matter (the caller can at best tie a plan whose trainer
    scores `bar`); degrees whose time lower bound exceeds it are skipped, so the result may be empty, and it
    is not memoised.
    """
    if bar < inf and not ctx.exhaustive:
        return _train_search(ctx, n, resident_gib, colocated, bar)
    key = ("train", n, resident_gib, colocated)
    if key not in ctx.memo:
        ctx.memo[key] = _train_search(ctx, n, resident_gib, colocated)
    return ctx.memo[key]


def train_lower_bound_s(ctx: Context, n: int) -> float:
    """Seconds no trainer on `n` devices can beat: its FLOPs without recompute at the target's MFU.

    Every term `cost.train_time` adds (bubble, communication, offload, recompute FLOPs) is non-negative, so the
    device allocation can skip a device count whose bound already loses to a plan in hand.
    """
    flops = cost.train_flops(ctx.sizes, ctx.work, "none")
    return flops / (n * ctx.target.bf16_tflops * 1e12 * cost.train_mfu(ctx.sizes, ctx.target))


def _cp_kinds(ctx: Context, backend: str, tp: int, cp: int) -> list[CpKind]:
    """CP kinds to try for (tp, cp): the pinned one; else Ulysses where the heads allow it, otherwise ring,
    which the fsdp2 runtime executes on cpu only (`layout.runtime_gaps`), so there it is offered on cpu or
    when nothing else is possible for a pinned CP. Hybrid models' linear-attention heads must split too, and
    ring is never offered for them on fsdp2."""
    pin = ctx.spec.placement.train
    arch = ctx.sizes.arch
    if cp == 1:
        return ["ulysses"]
    if pin.cp_kind:
        return [pin.cp_kind] if cp_problem(arch, tp, cp, pin.cp_kind) is None else []
    kind = default_cp_kind(arch, tp, cp)
    if kind == "ring" and backend == "fsdp2" and ctx.target.kind != "cpu" and not pin.cp:
        return []
    heads = linear_heads(arch)
    if heads and backend == "fsdp2" and not pin.cp and (kind == "ring" or heads[0] % cp or heads[1] % cp):
        return []  # Gated-DeltaNet layers run Ulysses over whole heads only (`layout.linear_attention_gaps`)
    return [kind]


def _train_search(ctx: Context, n: int, resident_gib: float, colocated: bool, limit: float = inf) -> RoleSearch:
    """FSDP2 layouts: the one trainer rlc executes. A megatron pin is refused (RLC223), unless the context prices
    published Megatron runs (`Context.price_megatron`), which searches Megatron's degrees as it models them."""
    spec, arch = ctx.spec, ctx.sizes.arch
    pin = spec.placement.train
    found = RoleSearch()
    megatron = "megatron" in (pin.backend, spec.train.backend)
    if megatron and not ctx.price_megatron:
        found.reason = "the megatron backend is pinned, and nothing in rlc executes Megatron (use backend: fsdp2)"
        return found
    backend = "megatron" if megatron else "fsdp2"
    rc_pin = pin.recompute or (spec.train.recompute if spec.train.recompute != "auto" else None)
    if rc_pin and rc_pin not in backend_recomputes(backend):
        found.reason = f"recompute: {rc_pin} is not what the fsdp2 trainer does (full or none)"
        return found
    recomputes = [rc_pin] if rc_pin else [r for r in RECOMPUTE_ORDER if r in backend_recomputes(backend)]
    off_pin = pin.offload or (
        spec.train.offload if (spec.train.offload.params or spec.train.offload.optimizer) else None
    )
    # FSDP2's parameter offload runs the optimizer step on the host, so its state lives there too.
    offloads = (
        [(off_pin.params, off_pin.optimizer or (off_pin.params and not megatron))] if off_pin else list(OFFLOAD_ORDER)
    )
    mbt_pin = pin.micro_batch_tokens or spec.train.micro_batch_tokens
    mbts = [mbt_pin] if mbt_pin else [_round_up(ctx.longest * m, 128) for m in MBT_MULTIPLES]
    dpn = ctx.devices_per_node
    tps = [pin.tp] if pin.tp else [t for t in pow2_upto(min(dpn, n)) if tp_problem(arch, t) is None]
    if not pin.tp and not megatron:  # only what the fsdp2 runtime executes (`layout.runtime_gaps`)
        hybrid = linear_heads(arch) is not None
        tps = [t for t in tps if fsdp2_runs_tp(t, arch.num_kv_heads, hybrid)]
    # FSDP2 runs pipeline stages when the plan pins them (`layout.pipeline_gaps` says with what); its free search
    # shards instead.
    pps = [pin.pp] if pin.pp else list(pow2_upto(min(arch.num_layers, n))) if megatron else [1]
    if arch.moe is None:
        eps = [1]
    else:
        eps = (
            [pin.ep]
            if pin.ep
            else [e for e in pow2_upto(min(arch.moe.num_experts, n)) if arch.moe.num_experts % e == 0]
        )
    # Context parallelism splits packed micro-batches: without packing there is nothing to split.
    cps_all = [pin.cp] if pin.cp else (pow2_upto(min(16, n)) if spec.train.packing else [1])
    divisible = [
        Shape(backend, tp, pp, cp, kind, ep)
        for tp in tps
        for cp in cps_all
        for kind in _cp_kinds(ctx, backend, tp, cp)
        for ep in eps
        for pp in pps
        if not n % (tp * pp * cp) and not (ep > 1 and (tp * cp * (n // (tp * pp * cp))) % ep)
    ]
    # fsdp2's EP groups (`layout.fsdp2_runs_ep`), unless the pins themselves leave no other choice
    shapes = [
        s
        for s in divisible
        if megatron or fsdp2_runs_ep(s.ep, s.tp, s.cp, n // (s.tp * s.pp * s.cp)) or (pin.ep and pin.cp)
    ]
    if not shapes:
        found.reason = _no_shape_reason(n, divisible)
        return found
    found.tried = tried_degrees(n, shapes)
    fastest: list[float] = []  # scores of the KEEP_TRAIN best options so far: the bar for pruning
    # Best first by the degrees' time lower bound, so the bar rises fast and the rest stop at once.
    bounds = {s: _train_lower_bound_s(ctx, n, s, recomputes[0], mbts) for s in shapes}
    for shape in sorted(shapes, key=lambda s: (bounds[s], s.key())):
        bar = min(fastest[-1] if len(fastest) >= KEEP_TRAIN and not ctx.exhaustive else inf, limit)
        if bounds[shape] > bar * (1 + 1e-9):
            break
        had = len(found.options)
        _train_degree(ctx, found, n, shape, recomputes, offloads, mbts, resident_gib, colocated, bar)
        if len(found.options) > had:
            fastest = heapq.nsmallest(KEEP_TRAIN, fastest + [o.score for o in found.options[had:]])
    found.options.sort(key=lambda o: (round(o.score, 6), o.layout.summary()))
    del found.options[KEEP_TRAIN if not ctx.exhaustive else len(found.options) :]
    return found


def _no_shape_reason(n: int, divisible: list[Shape]) -> str:
    """Why no fsdp2 degrees run on `n` devices: the EP groups (naming the first tuple they rule out), or the
    pins against the model's heads and experts."""
    if not divisible:
        return f"no fsdp2 degrees on {n} devices satisfy the pins and the model's heads and experts"
    s = divisible[0]
    dp = n // (s.tp * s.pp * s.cp)
    return (
        f"EP {s.ep} with TP {s.tp}, PP {s.pp}, CP {s.cp} on {n} devices leaves DP {dp}, and the fsdp2 trainer splits "
        "the experts over the TP ranks when TP divides EP, then over every CP rank of data-parallel ranks (CP must "
        "divide the rest of EP and its quotient must divide DP)"
    )


def tried_degrees(n: int, shapes: list[Shape]) -> str:
    """The fsdp2 degrees searched on `n` devices, for a refusal to say what did not fit."""

    def values(name: str) -> str:
        return "/".join(str(v) for v in sorted({getattr(s, name) for s in shapes}))

    degrees = ", ".join(f"{name.upper()} {values(name)}" for name in ("tp", "pp", "cp", "ep"))
    return f"{len(shapes)} fsdp2 degree tuples on {n} devices ({degrees})"


def _layout_memory(ctx: Context, layout: TrainLayout, resident: float, colocated: bool) -> MemoryBreakdown:
    """The trainer's device memory for `layout` beside `resident` GiB of other roles."""
    return memory.train_memory(
        ctx.sizes,
        layout,
        ctx.target,
        logprob_chunk_tokens=ctx.spec.train.logprob_chunk_tokens,
        lora_rank=ctx.lora_rank,
        lora_targets=ctx.lora_targets,
        reference=ctx.reference,
        devices_per_node=ctx.devices_per_node,
        resident_gib=resident,
        sync_group=not colocated and ctx.spec.rollout.weight_sync != "disk",
    )


@dataclass(frozen=True)
class Shape:
    """The degrees of a trainer layout, before recompute, offload and the token budget are chosen."""

    backend: str
    tp: int
    pp: int
    cp: int
    cp_kind: CpKind
    ep: int

    def key(self) -> tuple:
        return (self.backend, self.tp, self.pp, self.cp, self.cp_kind, self.ep)

    def layout(
        self, ctx: Context, n: int, recompute: str, off_params: bool, off_optimizer: bool, mbt: int
    ) -> TrainLayout:
        # A copy of a validated prototype: a third of model_construct's cost, and the search builds thousands.
        return _PROTOTYPE.model_copy(
            update=dict(
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
        )


def _train_lower_bound_s(ctx: Context, n: int, shape: Shape, rc: str, mbts: list[int]) -> float:
    """Seconds no layout with these degrees and this recompute can beat (`cost.train_time`): compute at the
    smallest pipeline bubble (smallest budget, most micro-batches) plus communication at the fewest
    micro-batches (largest budget; per-micro-batch latencies, launches and FSDP2 gathers only grow with their
    number), without offload traffic."""
    pp = shape.pp
    layout = shape.layout(ctx, n, rc, False, False, mbts[0])
    t = cost.train_time(ctx.sizes, layout, ctx.target, ctx.work, ctx.devices_per_node)
    micro = ctx.work.micro_batches_per_step(layout.dp, mbts[-1])
    bubble = (pp - 1) / (micro + pp - 1)
    return t.compute_s / (1 - bubble) + t.tp_s + t.cp_s + t.ep_s + t.dp_s + t.overhead_s


def _option(ctx: Context, layout: TrainLayout, mem: MemoryBreakdown, colocated: bool) -> TrainOption | None:
    """The priced option, or None when a colocated trainer's state does not fit its node's host memory."""
    t = cost.train_time(ctx.sizes, layout, ctx.target, ctx.work, ctx.devices_per_node)
    if not colocated:
        return TrainOption(layout, mem, t)
    state = memory.train_state_gib(mem)
    host = state * min(ctx.devices_per_node, layout.world_size)
    if ctx.target.kind != "cpu" and host > ctx.target.host_memory_gib * memory.HOST_MEMORY_FRACTION:
        return None
    return TrainOption(layout, mem, t, cost.switch_s(ctx.target, state))


def _train_degree(
    ctx: Context,
    found: RoleSearch,
    n: int,
    shape: Shape,
    recomputes: list[str],
    offloads: list[tuple[bool, bool]],
    mbts: list[int],
    resident: float,
    colocated: bool,
    bound: float = inf,
) -> bool:
    """Evaluate one degree tuple over recompute × offload (largest fitting token budget each).

    Keeps the best fitting choice (all of them when exhaustive). Returns True when the tuple fits with no
    recompute and no offload: a deeper pipeline with the same TP/CP/EP then only adds bubble, so the caller
    skips it (pruning). When not exhaustive, choices the one just found dominates (more recompute at the same
    budget; more offload too, unless the trainer shares devices, where offloaded state is state the switch
    does not move) are skipped, and so is a recompute whose time lower bound exceeds `bound` (the slowest
    layout the caller keeps) or the tuple's best so far: it could enter neither.
    """
    best: TrainOption | None = None
    cheapest = dominant = False
    seen: dict[tuple, tuple[TrainLayout, MemoryBreakdown]] = {}

    def evaluate(rc: str, off_p: bool, off_o: bool, mbt: int) -> tuple[TrainLayout, MemoryBreakdown]:
        key = (rc, off_p, off_o, mbt)
        if key not in seen:
            layout = shape.layout(ctx, n, rc, off_p, off_o, mbt)
            mem = _layout_memory(ctx, layout, resident, colocated)
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
        if beaten(rc, min(bound, best.score if best else inf)):
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
                option = _option(ctx, layout, mem, colocated)
                if option is None:
                    break
                if ctx.exhaustive:
                    found.options.append(option)
                elif best is None or (round(option.score, 6), layout.summary()) < (
                    round(best.score, 6),
                    best.layout.summary(),
                ):
                    best = option
                plain = rc == "none" and not off_p and not off_o
                cheapest = cheapest or plain
                dominant = dominant or (plain and mbt == mbts[0])
                break
            if not ctx.exhaustive and not colocated and mem.fits and layout.micro_batch_tokens == mbts[0]:
                # The largest budget fits: more offload keeps that budget and only adds host traffic.
                break
        if not ctx.exhaustive and dominant:
            # No recompute, no offload, largest budget: every other recompute only adds FLOPs.
            break
    if best is not None:
        found.options.append(best)
    return cheapest
