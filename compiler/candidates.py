"""Complete layouts: every role's option and devices, the step estimate they add up to, and their ranking.

A candidate is priced once its roles are chosen: the weight sync depends on where the pools sit (a broadcast
that stays in one node uses the intra-node link), the colocated switch on the trainer's device state.
Runners-up are told apart from the winner by the term of the step that made them lose.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlc.compiler import cost
from rlc.compiler.memory import RolloutLayout
from rlc.compiler.options import RoleSearch, RolloutOption, TeacherOption, TrainOption
from rlc.compiler.search_context import Context
from rlc.schemas.plan import WEIGHT_SYNC_EXECUTABLE, WEIGHT_SYNC_TP_SLICES


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
    #: How its weights reach the engines (`sync_choice`), with the seconds the step counts.
    sync: cost.SyncOption | None = None

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

    @property
    def devices_used(self) -> int:
        """Devices this layout occupies (colocated roles share theirs); the rest of the cluster idles."""
        if self.mode == "colocated":
            return self.train.layout.world_size
        return self.train.layout.world_size + self.rollout.layout.devices + sum(t.layout.devices for t in self.teachers)

    def key(self) -> tuple:
        """Rank: faster first; ties go to the quicker trainer, then fewer training devices, then the quicker
        rollout, then fewer rollout devices, then smaller engines, then the text.

        An asynchronous step paced by the trainer hides the rollout, so several rollout layouts tie on
        tokens/s. The quicker one leaves the most slack for the estimate's error and for long-tail batches;
        among equals the one on fewer devices, then the smaller engine (fewer collectives on the decode path,
        less throughput lost with one engine) wins. `engine_search.rollout_rank` orders rollout options the
        same way, so the allocation may keep only the best rollout per pool.
        """
        ro = self.rollout.layout
        return (
            -round(self.step.tokens_per_s, 3),
            round(self.step.train_s, 6),
            self.train.layout.world_size,
            round(self.step.rollout_s, 6),
            ro.devices,
            ro.engine_devices,
            ro.tp,
            self.summary,
        )


#: What each position of `Candidate.key` means, for the tie-break verdict.
KEY_NAMES = (
    "tokens/s",
    "the quicker trainer",
    "fewer training devices",
    "the quicker rollout",
    "fewer rollout devices",
    "smaller engines",
    "narrower engine TP",
    "the layout text",
)


@dataclass
class SearchResult:
    """The winner, the ranked runners-up and, when nothing fits, why."""

    best: Candidate | None
    ranked: list[Candidate]
    failures: dict[str, RoleSearch]
    evaluated: int = 0


def crosses_nodes(ctx: Context, mode: str, train_devices: int, rollout_end: int) -> bool:
    """Whether the weight sync leaves node 0.

    Disaggregated: the senders are the first trainer ranks (node 0), so a broadcast group spans the devices up to
    the rollout pool's end. Colocated: each node's leader rank gathers the weights, which crosses the scale-out
    link as soon as the trainer spans nodes.
    """
    end = train_devices if mode == "colocated" else rollout_end
    return end > ctx.devices_per_node


def sync_shape(
    ctx: Context,
    mode: str,
    train_devices: int,
    engine: RolloutLayout | None,
    rollout_end: int,
    trainer: TrainOption | None = None,
) -> cost.SyncShape:
    """Where a layout's weights go (`cost.SyncShape`): the trainer's ranks and nodes, the engines, and whether the
    sync leaves the senders' node. `engine` None: a bound before the engines are chosen, priced in-node; without
    the `trainer` option the gather is taken as streamed and senders' memory as ample (both lower the bound)."""
    dpn = ctx.devices_per_node
    streamed, room, pp = True, float("inf"), 1
    if trainer is not None and trainer.layout.backend == "fsdp2":
        # rlc's trainer; a Megatron layout (priced only against published runs) exports stage by stage, each
        # stage's ranks their own layers, which the streamed single-stage path stands for.
        merged = ctx.spec.lora is not None and not ctx.lora_adapter
        pp = trainer.layout.pp
        streamed = pp == 1 and not merged
    if trainer is not None:
        room = trainer.memory.capacity_gib - trainer.memory.total_gib
    cross = crosses_nodes(ctx, mode, train_devices, rollout_end) if engine is not None or mode == "colocated" else False
    return cost.SyncShape(
        mode=mode,
        trainer_ranks=train_devices,
        trainer_nodes=max(1, -(-train_devices // dpn)),
        cross_node=cross,
        devices_per_node=dpn,
        engine=engine,
        adapter_params=ctx.adapter_params,
        streamed=streamed,
        sender_room_gib=room,
        trainer_pp=pp,
    )


def sync_options(ctx: Context, shape: cost.SyncShape) -> list[cost.SyncOption]:
    """Every weight-sync method this layout could run, priced, fastest first; a served LoRA adapter has one."""
    if ctx.adapter_params:
        return [cost.adapter_option(ctx.sizes, ctx.target, shape)]
    requested = ctx.spec.rollout.weight_sync
    sliced = WEIGHT_SYNC_TP_SLICES.get(ctx.sizes.arch.hf_architecture, frozenset())
    return cost.priced_options(
        ctx.sizes, ctx.target, shape, requested=requested, executable=WEIGHT_SYNC_EXECUTABLE, sliced=sliced
    )


def sync_choice(ctx: Context, shape: cost.SyncShape) -> cost.SyncOption:
    """The weight sync the plan runs for this layout (`cost.pick`)."""
    return cost.pick(sync_options(ctx, shape))


def sync_bound_s(ctx: Context, shape: cost.SyncShape) -> float:
    """A lower bound on the sync of any layout this shape stands for: the fastest eligible option's seconds."""
    options = sync_options(ctx, shape)
    eligible = [o for o in options if o.eligible] or options
    return min(o.seconds for o in eligible)


def combine(
    ctx: Context,
    mode: str,
    tr: TrainOption,
    ro: RolloutOption,
    teachers: tuple[TeacherOption, ...],
    starts: tuple[int, int, tuple[int, ...]],
) -> Candidate:
    """Price a complete layout: weight sync for where the pools sit, switch for a colocated trainer."""
    sizes, target, work = ctx.sizes, ctx.target, ctx.work
    adapter = ctx.adapter_params
    shape = sync_shape(ctx, mode, tr.layout.world_size, ro.layout, starts[1] + ro.layout.devices, tr)
    sync = sync_choice(ctx, shape)
    switch = tr.switch_s if mode == "colocated" else 0.0
    if mode == "colocated" and adapter:
        switch += cost.engine_offload_s(sizes, target, cost.engine_weight_share(sizes, ro.layout))
    teacher_s = max((t.seconds for t in teachers), default=0.0)
    step = cost.step_time(
        mode, work, ro.time, tr.seconds, teacher_s, sync.seconds, switch, target.efficiency.step_overhead_s
    )
    return Candidate(mode, tr, ro, teachers, step, starts[0], starts[1], starts[2], sync)


def step_terms(c: Candidate, effective: bool = True) -> dict[str, float]:
    """Seconds each term adds to the step: all of them when the phases run one after another; only the
    slowest of rollout, teachers and training (plus the sync) when an asynchronous step overlaps them.
    `effective=False` gives every phase's own seconds."""
    s = c.step
    terms = {"rollout": s.rollout_s, "teachers": s.teacher_s, "train": s.train_s, "sync": s.sync_s}
    terms["switch"] = s.switch_s
    if effective and c.mode == "disaggregated" and s.step_s < s.rollout_s + s.teacher_s + s.train_s + s.sync_s - 1e-9:
        paced = max(("rollout", "teachers", "train"), key=lambda k: terms[k])
        terms = {k: (v if k in (paced, "sync") else 0.0) for k, v in terms.items()}
    return terms


def losing_terms(winner: Candidate, other: Candidate) -> list[tuple[str, float, float]]:
    """The step terms in which `other` is slower, largest first: (term, other's seconds, winner's seconds)."""
    mine, theirs = step_terms(winner), step_terms(other)
    worse = [(k, theirs[k], mine[k]) for k in theirs if theirs[k] - mine[k] > 1e-6]
    return sorted(worse, key=lambda x: -(x[1] - x[2]))


def runner_up_verdict(winner: Candidate, other: Candidate) -> str:
    """Why `other` lost to `winner`, in numbers: the step term(s) that cost it, or the tie-break that did."""
    if other.step.tokens_per_s < winner.step.tokens_per_s - 1e-9 and round(other.step.tokens_per_s, 3) < round(
        winner.step.tokens_per_s, 3
    ):
        head = (
            f"slower: {other.step.tokens_per_s:,.0f} vs {winner.step.tokens_per_s:,.0f} tok/s "
            f"({other.step.step_s:.3g} vs {winner.step.step_s:.3g} s/step)"
        )
        raw = step_terms(winner, effective=False)
        parts = []
        for k, o, w in losing_terms(winner, other)[:2]:
            hidden = f", the winner's {raw[k]:.3g} s hides behind its other phases" if w == 0 < raw[k] else ""
            parts.append(f"{k} +{o - w:.3g} s ({o:.3g} vs {w:.3g} s{hidden})")
        return head + ("; loses on " + ", ".join(parts) if parts else "")
    a, b = winner.key(), other.key()
    index = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a) - 1)
    return f"as fast ({other.step.tokens_per_s:,.0f} tok/s) but loses the tie-break to {KEY_NAMES[index]}"


def loser_term(winner: Candidate, other: Candidate) -> str:
    """The one step term that cost `other` the most, or `tie` when it is as fast."""
    terms = losing_terms(winner, other)
    if other.step.tokens_per_s >= winner.step.tokens_per_s - 1e-9 or not terms:
        return "tie"
    return terms[0][0]
