"""Warnings a compiled plan carries: long-context memory fractions, thin headroom, ranks idle in a minibatch."""

from __future__ import annotations

from rlc.compiler import memory, search
from rlc.compiler.diagnostics import Diagnostic
from rlc.compiler.load import LineMap
from rlc.compiler.resolve import Problem

#: Context past which a pinned vLLM share above the planner's own cap draws a warning (long prefills).
LONG_CONTEXT = 32768


def long_context_warnings(problem: Problem, lines: LineMap, file: str) -> list[Diagnostic]:
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


#: /dev/shm must hold the staged weights with this much room to spare (the runtime's `host_moves.SHM_HEADROOM`).
SHM_HEADROOM = 1.1
#: Share of a node's host memory a tmpfs such as /dev/shm may fill by default (Linux: half of RAM).
SHM_DEFAULT_SHARE = 0.5


def shm_staging(problem: Problem, best: search.Candidate, lines: LineMap, file: str) -> list[Diagnostic]:
    """RLC307 when a colocated sync stages more in each node's /dev/shm than a default tmpfs holds: every node's
    writer stages the whole model there (`inplace`, `shared_memory`), and a node whose /dev/shm is too small
    stops the run at its first sync."""
    sync = best.sync
    if best.mode != "colocated" or sync is None or sync.method not in ("inplace", "shared_memory"):
        return []
    sizes = memory.model_sizes(problem.arch)
    gib = sizes.total * memory.dtype_bytes(problem.target) * SHM_HEADROOM / 2**30
    room = problem.target.host_memory_gib * SHM_DEFAULT_SHARE
    if gib <= room:
        return []
    return [
        Diagnostic(
            "RLC307",
            f"weight sync {sync.method} stages the whole model in each node's /dev/shm: {gib:,.0f} GiB with room "
            f"to spare, more than a default /dev/shm of half the node's {problem.target.host_memory_gib:,.0f} GiB",
            "mode",
            "warning",
            "enlarge /dev/shm on every node (mount -o remount,size=...) or run disaggregated",
            lines.line_for("mode"),
            file,
        )
    ]
