"""Device allocation: which devices each role gets, searched best-first against lower bounds.

Pools are parts of one node (multiples of the target's device group, die pairs on A3) or whole nodes. The
trainer's pool starts at device 0, the rollout pool right after it, teachers at the end of the cluster; TP
groups stay inside a node (`engine_search.groups_in_nodes`). A plan may leave devices idle, so the layouts
possible on N devices are also possible on more: adding devices never yields a slower plan.

Every pool size is a candidate. Rollout searches are cheap and run for every size; trainer searches are
not, so each allocation gets a lower bound first (its exact rollout, teachers and sync, and the trainer's
FLOPs at peak MFU, `trainer_search.train_lower_bound_s`) and allocations are priced in order of that bound
until the next bound cannot beat the best plan in hand. That is exact: every allocation that could win,
or tie the winner, is priced. `Context.exhaustive` prices every (trainer pool, rollout pool) pair instead.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field
from math import inf, lcm

from rlc.compiler import cost
from rlc.compiler.candidates import Candidate, SearchResult, combine, sync_bound_s, sync_shape
from rlc.compiler.engine_search import rollout_rank, rollout_search, teacher_search
from rlc.compiler.options import RoleSearch, RolloutOption, TeacherOption, record
from rlc.compiler.search_context import Context
from rlc.compiler.trainer_search import train_lower_bound_s, train_search

#: Relative slack of the bound test: a bound within it of the best is priced (ties are decided by the rank).
BOUND_SLACK = 1e-6
#: Trainer seconds a tying allocation's trainer must be within of the leader's to still be priced: above
#: the 1e-6 s that `Candidate.key` rounds train times to.
TIE_MARGIN_S = 2e-6
#: Teacher memory shares tried, smallest first, when teachers share the devices with everything else.
COLOCATED_TEACHER_FRACTIONS = (0.1, 0.15, 0.2, 0.3, 0.4, 0.5)
#: vLLM memory shares tried on cpu, where trainer and engine stay resident side by side (no sleep mode).
CPU_ROLLOUT_FRACTIONS = (0.5, 0.4, 0.3, 0.2, 0.1)

Teachers = tuple[tuple[TeacherOption, ...], tuple[int, ...]]


def pool_sizes(ctx: Context, limit: int) -> list[int]:
    """Pool sizes up to `limit`: multiples of the device group inside one node, then whole nodes."""
    g, dpn = ctx.target.device_group_size, ctx.devices_per_node
    return list(range(g, min(dpn, limit) + 1, g)) + list(range(2 * dpn, limit + 1, dpn))


@dataclass
class Allocation:
    """Pools for every role but the trainer's options, with a lower bound on the step they can reach."""

    mode: str
    train_devices: int
    resident_gib: float
    rollouts: list[RolloutOption]
    rollout_start: int
    teachers: Teachers
    bound_s: float
    failures: dict[str, RoleSearch] = field(default_factory=dict)

    def price(self, ctx: Context, train_bar: float = inf) -> list[Candidate]:
        """Candidates from the trainer's best options on this pool (all of them when exhaustive); with a
        `train_bar`, only trainers that could score below it (see `train_search`)."""
        colocated = self.mode == "colocated"
        ts = train_search(ctx, self.train_devices, self.resident_gib, colocated=colocated, bar=train_bar)
        if not ts.options:
            if train_bar == inf:
                record(self.failures, "train", ts)
            return []
        options, starts = self.teachers
        where = (0, self.rollout_start, starts)
        out = []
        for i, tr in enumerate(ts.options):
            for j, ro in enumerate(self.rollouts):
                if (i and j) and not ctx.exhaustive:
                    continue
                out.append(combine(ctx, self.mode, tr, ro, options, where))
        return out


def _bound(ctx: Context, mode: str, n_train: int, ro: RolloutOption, teachers: Teachers, rollout_end: int) -> float:
    sync = sync_bound_s(ctx, sync_shape(ctx, mode, n_train, ro.layout, rollout_end))
    teacher_s = max((t.seconds for t in teachers[0]), default=0.0)
    lower = train_lower_bound_s(ctx, n_train)
    overhead = ctx.target.efficiency.step_overhead_s
    return cost.step_time(mode, ctx.work, ro.time, lower, teacher_s, sync, 0.0, overhead).step_s


# --------------------------------------------------------------------------------------------- colocated


def _colocated_teachers(ctx: Context, n: int, failures: dict[str, RoleSearch]) -> tuple[Teachers, float] | None:
    """Teachers on the shared devices, each at the smallest memory share it fits in; and the GiB they keep."""
    pins = ctx.spec.placement.teachers
    chosen: list[TeacherOption] = []
    resident = 0.0
    for name in ctx.teacher_sizes:
        pin = pins.get(name)
        option = None
        for frac in [pin.memory_fraction] if pin and pin.memory_fraction else COLOCATED_TEACHER_FRACTIONS:
            ts = teacher_search(ctx, name, n, 0, resident, fraction=frac)
            if ts.options:
                option = ts.options[0]
                break
            failures.setdefault(f"teacher-{name}", ts)
        if option is None:
            return None
        failures.pop(f"teacher-{name}", None)
        chosen.append(option)
        resident += option.memory.total_gib - ctx.target.reserve_gib - option.memory.items.get("other_roles", 0.0)
    return (tuple(chosen), tuple(0 for _ in chosen)), resident


def colocated_sizes(ctx: Context) -> list[int]:
    pins = ctx.spec.placement
    pinned = pins.train.devices or pins.rollout.devices
    return [pinned] if pinned else pool_sizes(ctx, ctx.total)


def colocated(ctx: Context, n: int, failures: dict[str, RoleSearch]) -> list[Allocation]:
    """Every role on the same `n` devices: the train phase and the rollout phase must each fit beside what
    stays (teachers; on cpu, where nothing sleeps, the other phase's role too).

    Misses are reported from the largest pool only (the most memory a role can get there); on it the trainer
    is searched even when the engines do not fit, so that every role that cannot fit is named.
    """
    report = n == max(colocated_sizes(ctx))
    if not report:
        failures = {}
    found = _colocated_teachers(ctx, n, failures)
    if found is None:
        return []
    teachers, teacher_gib = found
    if ctx.target.kind != "cpu":
        rs = rollout_search(ctx, n, 0, teacher_gib, sync=True)
        if not rs.options:
            record(failures, "rollout", rs)
            if report:
                ts = train_search(ctx, n, teacher_gib, colocated=True)
                if not ts.options:
                    record(failures, "train", ts)
            return []
        bound = _bound(ctx, "colocated", n, rs.options[0], teachers, n)
        return [Allocation("colocated", n, teacher_gib, rs.options[:2], 0, teachers, bound, failures)]
    pin = ctx.spec.placement.rollout.memory_fraction
    for frac in [pin] if pin else CPU_ROLLOUT_FRACTIONS:
        resident = teacher_gib + frac * ctx.target.usable_hbm_gib
        ts = train_search(ctx, n, resident, colocated=True)
        if not ts.options:
            record(failures, "train", ts)
            continue
        best = ts.options[0].memory
        train_gib = best.total_gib - ctx.target.reserve_gib - best.items.get("other_roles", 0.0)
        rs = rollout_search(ctx, n, 0, teacher_gib + train_gib, sync=True, fraction=frac)
        if not rs.options:
            record(failures, "rollout", rs)
            continue
        failures.pop("train", None)
        bound = _bound(ctx, "colocated", n, rs.options[0], teachers, n)
        return [Allocation("colocated", n, resident, rs.options[:2], 0, teachers, bound, failures)]
    return []


# --------------------------------------------------------------------------------------------- teachers


def _teacher_minimum(ctx: Context, name: str, limit: int, failures: dict[str, RoleSearch]) -> int | None:
    """Fewest devices (a pool size, at most `limit`) on which teacher `name` fits; pinned counts as is."""
    pin = ctx.spec.placement.teachers.get(name)
    if pin and pin.devices:
        return pin.devices
    failed: dict[str, RoleSearch] = {}
    for count in pool_sizes(ctx, limit):
        ts = teacher_search(ctx, name, count, ctx.total - count, 0.0)
        if ts.options:
            return count
        record(failed, name, ts)
    found = failed.get(name)
    if found is None or found.closest is None:
        found = RoleSearch(reason=f"no pool of up to {limit} devices is left for it beside the trainer and rollout")
    record(failures, f"teacher-{name}", found)
    return None


def _at_least(ctx: Context, count: int) -> int:
    """The smallest pool size holding `count` devices."""
    sizes = pool_sizes(ctx, max(count, ctx.devices_per_node) + ctx.devices_per_node)
    return sizes[bisect.bisect_left(sizes, count)]


def teacher_pools(ctx: Context, failures: dict[str, RoleSearch]) -> list[Teachers]:
    """Teacher pools to try, each as (options, start devices), packed at the end of the device range.

    Each teacher starts from the fewest devices it fits on; the pools then grow together by powers of two
    while at least two device groups stay for the trainer and rollout, so the search can trade rollout and
    training devices for teacher throughput where the teachers would otherwise pace the step.
    """
    names = list(ctx.teacher_sizes)
    if not names:
        return [((), ())]
    g = ctx.target.device_group_size
    pins = ctx.spec.placement.teachers
    limit = ctx.total - 2 * g
    minimum: list[int] = []
    for name in names:
        m = _teacher_minimum(ctx, name, limit - sum(minimum), failures)
        if m is None:
            return []
        minimum.append(m)
    pinned = [bool(pins.get(n) and pins[n].devices) for n in names]
    out: list[Teachers] = []
    factor = 1
    while True:
        counts = [m if fixed else _at_least(ctx, m * factor) for m, fixed in zip(minimum, pinned, strict=True)]
        start = ctx.total - sum(counts)
        if factor > 1 and sum(counts) > limit:
            break
        if start < 2 * g:
            failures["teacher-" + names[0]] = RoleSearch(
                reason=f"teachers pinned to {sum(counts)} of {ctx.total} devices leave too few for trainer and rollout"
            )
            break
        options: list[TeacherOption] = []
        starts: list[int] = []
        for name, count in zip(names, counts, strict=True):
            ts = teacher_search(ctx, name, count, start, 0.0)
            if not ts.options:
                record(failures, f"teacher-{name}", ts)
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
            failures.pop(f"teacher-{name}", None)
    return out


# --------------------------------------------------------------------------------------------- disaggregated


def saturation_size(ctx: Context) -> int:
    """The smallest whole-node pool on which every rollout layout gives each attention rank one sample at most.

    A rank's time (`cost.rollout_time`) depends on the pool only through the samples each rank gets, so past
    one per rank a larger pool runs every (TP, EP) layout exactly as fast on more devices, and
    `rollout_rank` prefers fewer: the search stops there. Ranks are devices / TP, so the bound is samples ×
    the widest TP, rounded up to whole nodes and to a multiple of every engine size (so each layout exists).
    """
    pin, arch, dpn = ctx.spec.placement.rollout, ctx.sizes.arch, ctx.devices_per_node
    widest_tp = pin.tp or dpn
    engines = [widest_tp, dpn]
    if arch.moe is not None:
        engines.append(pin.ep or arch.moe.num_experts)
    step = lcm(*engines)
    return -(-ctx.work.samples * widest_tp // step) * step


class _RolloutPools:
    """The best rollout pool of at most k devices from a start, for every k: rollout searches are cheap, so all
    sizes are searched once and a running best answers each query. Options depend on the start only through
    its place in the node (TP groups stay inside nodes), so one instance serves every trainer size ending there.
    """

    def __init__(self, ctx: Context, phase: int, max_size: int, failures: dict[str, RoleSearch]) -> None:
        pin = ctx.spec.placement.rollout.devices
        sync = ctx.work.staleness == 0
        self.sizes: list[int] = []
        self.best: list[RolloutOption | None] = []
        self.each: list[list[RolloutOption]] = []
        held: RolloutOption | None = None
        saturated = saturation_size(ctx)
        for n in [pin] if pin else pool_sizes(ctx, max_size):
            if n > saturated and not (pin or ctx.exhaustive):
                break  # every larger pool repeats an option of a smaller one on more devices
            rs = rollout_search(ctx, n, phase, 0.0, sync=sync)
            if not rs.options:
                record(failures, "rollout", rs)
            elif held is None or rollout_rank(rs.options[0], sync) < rollout_rank(held, sync):
                held = rs.options[0]
            self.sizes.append(n)
            self.best.append(held)
            self.each.append(rs.options)

    def upto(self, limit: int) -> RolloutOption | None:
        i = bisect.bisect_right(self.sizes, limit) - 1
        return self.best[i] if i >= 0 else None


def train_sizes(ctx: Context, remaining: int) -> list[int]:
    g = ctx.target.device_group_size
    pins = ctx.spec.placement
    if pins.train.devices:
        return [pins.train.devices] if pins.train.devices + g <= remaining else []
    return pool_sizes(ctx, remaining - g)


def _no_rollout() -> cost.RolloutTime:
    return cost.RolloutTime(0.0, 0.0, 0.0, 0.0, 1, 0.0)


@dataclass(frozen=True)
class _TrainerPool:
    """A trainer pool not yet given a rollout pool: its bound leaves the rollout out (and syncs in-node)."""

    mode: str
    train_devices: int
    teachers: Teachers
    remaining: int

    def bound(self, ctx: Context) -> float:
        # No engine layout yet: nothing per engine worker and every trainer rank sending keep this a lower bound.
        shape = sync_shape(ctx, self.mode, self.train_devices, None, self.train_devices)
        sync = sync_bound_s(ctx, shape)
        teacher_s = max((t.seconds for t in self.teachers[0]), default=0.0)
        lower = train_lower_bound_s(ctx, self.train_devices)
        overhead = ctx.target.efficiency.step_overhead_s
        return cost.step_time(self.mode, ctx.work, _no_rollout(), lower, teacher_s, sync, 0.0, overhead).step_s


class _Disaggregated:
    """Expands trainer pools into allocations with the best rollout pools after them."""

    def __init__(self, ctx: Context, failures: dict[str, RoleSearch]) -> None:
        self.ctx, self.failures = ctx, failures
        self.pools: dict[tuple[int, int], _RolloutPools] = {}

    def trainer_pools(self) -> list[_TrainerPool]:
        out = []
        for teachers in teacher_pools(self.ctx, self.failures):
            remaining = teachers[1][0] if teachers[1] else self.ctx.total
            out += [_TrainerPool("disaggregated", n, teachers, remaining) for n in train_sizes(self.ctx, remaining)]
        return out

    def expand(self, tp: _TrainerPool) -> list[Allocation]:
        """Per trainer pool, the best rollout pool that stays in node 0 (an intra-node weight broadcast) and the
        best overall; every rollout pool size when exhaustive."""
        ctx, dpn, n_train = self.ctx, self.ctx.devices_per_node, tp.train_devices
        phase = n_train % dpn
        key = (tp.remaining, phase)
        if key not in self.pools:
            self.pools[key] = _RolloutPools(ctx, phase, tp.remaining - phase, self.failures)
        rp, limit = self.pools[key], tp.remaining - n_train
        if ctx.exhaustive:
            picks = [opts[0] for n, opts in zip(rp.sizes, rp.each, strict=True) if opts and n <= limit]
        else:
            inside = rp.upto(dpn - n_train) if n_train < dpn else None
            picks = [ro for ro in (inside, rp.upto(limit)) if ro is not None]
            if len(picks) == 2 and picks[0] is picks[1]:
                picks.pop()
        out = []
        for ro in picks:
            bound = _bound(ctx, "disaggregated", n_train, ro, tp.teachers, n_train + ro.layout.devices)
            out.append(Allocation("disaggregated", n_train, 0.0, [ro], n_train, tp.teachers, bound, self.failures))
        return out


def allocate(ctx: Context, result: SearchResult) -> tuple[list[Candidate], dict[str, RoleSearch]]:
    """Price allocations in order of their lower bounds until the next bound cannot beat the best candidate.

    Trainer pools enter with a bound that leaves the rollout out; taken from the queue, they are expanded into
    allocations with their rollout pools (searched then, so pools no plan could use are never searched), which
    re-enter with their full bounds; taken again, they are priced. Returns every priced candidate and the misses
    of the mode tried (colocated misses first: sharing every device is the most memory a role can get, so its
    closest breakdown is the honest lower bound).
    """
    mode = ctx.spec.mode
    if mode == "auto" and ctx.spec.rollout.agent is not None:
        mode = "disaggregated"  # agents' tools run while the trainer steps (rule RLC220 refuses colocated)
    colocated_failures: dict[str, RoleSearch] = {}
    disaggregated_failures: dict[str, RoleSearch] = {}
    queue: list[tuple[float, int, object]] = []
    count = 0

    def push(bound: float, item: object) -> None:
        nonlocal count
        heapq.heappush(queue, (bound, count, item))
        count += 1

    split = _Disaggregated(ctx, disaggregated_failures)
    if mode in ("colocated", "auto"):
        for n in colocated_sizes(ctx):
            pool = _TrainerPool("colocated", n, ((), ()), n)
            push(pool.bound(ctx), pool)
    if mode in ("disaggregated", "auto") and ctx.total >= 2 * ctx.target.device_group_size:
        for pool in split.trainer_pools():
            push(pool.bound(ctx), pool)
    best = inf
    lead: Candidate | None = None
    cands: list[Candidate] = []
    while queue:
        bound, _, item = heapq.heappop(queue)
        if not ctx.exhaustive and bound > best * (1 + BOUND_SLACK):
            break
        if isinstance(item, _TrainerPool):
            grown = (
                colocated(ctx, item.train_devices, colocated_failures)
                if item.mode == "colocated"
                else split.expand(item)
            )
            for a in grown:
                push(a.bound_s, a)
            continue
        assert isinstance(item, Allocation)
        # An allocation whose bound reaches the best step can only tie it, and ties go to the quicker trainer
        # (`Candidate.key`): a trainer that cannot be quicker than the leader's cannot win.
        # (A colocated trainer's score also holds its phase switch, which the key's train time leaves out.)
        tie_only = lead is not None and item.mode == "disaggregated" and bound >= best * (1 - BOUND_SLACK)
        priced = item.price(ctx, lead.step.train_s + TIE_MARGIN_S if tie_only else inf)
        result.evaluated += 1
        cands += priced
        best = min([best, *(c.step.step_s for c in priced)])
        lead = min([c for c in (lead, *priced) if c is not None], key=Candidate.key, default=None)
    return cands, colocated_failures or disaggregated_failures
