"""The plan's weight sync: the method the chosen layout runs, every method priced for it, and why the others lost.

The search prices each layout's sync by the fastest method the runtime executes (`candidates.sync_choice`); this
module states that choice in the plan (`schedule.weight_sync*`), with its estimate, the bytes each engine worker
receives and the runner-up, so that `rlc explain` and SUMMARY.md can say which path runs and why.
"""

from __future__ import annotations

from typing import Any

from rlc.compiler import cost
from rlc.compiler.candidates import Candidate, sync_options, sync_shape
from rlc.compiler.search_context import Context
from rlc.compiler.sync_lines import sync_bytes, sync_label
from rlc.schemas.plan import WeightSyncOption

__all__ = ["schedule_fields", "sync_of", "verdict"]

#: The IPC zero-copy path a colocated accelerator plan would take if the runtime had it, per kind.
IPC_PATH = {"gpu": "CUDA IPC handles", "npu": "torch_npu's IPC handles (what AReaL-Ascend's AWEX maps)"}


def sync_of(ctx: Context, best: Candidate) -> tuple[cost.SyncOption, list[cost.SyncOption]]:
    """The winner's sync and every option priced for its layout (fastest first)."""
    shape = sync_shape(
        ctx, best.mode, best.train.layout.world_size, best.rollout.layout, _rollout_end(best), best.train
    )
    options = sync_options(ctx, shape)
    chosen = best.sync or cost.pick(options)
    return chosen, options


def _rollout_end(best: Candidate) -> int:
    return best.rollout_start + best.rollout.layout.devices


def _label(o: cost.SyncOption) -> str:
    return sync_label(o.method, o.senders, o.slicing)


def _deciding_term(chosen: cost.SyncOption, other: cost.SyncOption) -> str:
    """The term that costs `other` the most against `chosen`: `send 12.1 vs 3.0 s`."""
    mine = dict(chosen.terms)
    worst = max(other.terms, key=lambda t: t[1] - mine.get(t[0], 0.0))
    return f"{worst[0]} {worst[1]:.3g} vs {mine.get(worst[0], 0.0):.3g} s"


def verdict(chosen: cost.SyncOption, other: cost.SyncOption) -> str:
    """Why `other` is not the plan's: chosen, not executed or not allowed, or slower and by which term."""
    if other == chosen:
        return "chosen"
    if other.why_not:
        faster = " (faster)" if other.seconds < chosen.seconds - 1e-9 else ""
        return f"{other.why_not}{faster}"
    if other.seconds <= chosen.seconds * (1 + cost.SYNC_TIE) + 1e-12:
        return f"as fast within {cost.SYNC_TIE:.0%}: the simpler {_label(chosen)} runs"
    return f"slower: {other.seconds:.3g} vs {chosen.seconds:.3g} s ({_deciding_term(chosen, other)})"


def _runner_up(chosen: cost.SyncOption, options: list[cost.SyncOption]) -> cost.SyncOption | None:
    """The best option the plan does not run: a faster one it cannot run first, else the next fastest."""
    others = [o for o in options if o != chosen]
    faster = [o for o in others if o.seconds < chosen.seconds * (1 - cost.SYNC_TIE)]
    return (faster or others or [None])[0]


def note(ctx: Context, best: Candidate, chosen: cost.SyncOption, options: list[cost.SyncOption]) -> str:
    """One paragraph: what runs, its estimate and bytes per worker, the runner-up and why it lost, and for a
    colocated accelerator plan that the host path runs until IPC zero-copy exists."""
    ro = best.rollout.layout
    workers = ro.replicas * ro.engine_devices
    heads = {
        "adapter": "LoRA adapters: trainer rank 0 writes each version, every engine loads it",
        "inplace": "inplace: each node's first trainer rank writes the weights as safetensors into /dev/shm and "
        "every engine worker copies its shard",
        "shared_memory": "shared_memory: the trainer rank on the engines' node writes flat tensors into POSIX "
        "shared memory that the engine workers map",
        "disk": "disk: trainer rank 0 writes safetensors to RUN/sync, every engine worker reads its shard",
    }
    head = heads.get(chosen.method, "")
    if chosen.method == "broadcast":
        senders = f"{chosen.senders} trainer ranks, each over its own group" if chosen.senders > 1 else "trainer rank 0"
        what = "its TP slice" if chosen.slicing == "tp" else "every byte"
        head = f"broadcast from {senders} to {workers} engine worker(s), each receiving {what}"
    text = f"{head}: {sync_bytes(chosen.bytes_per_worker)} per worker, ~{chosen.seconds:.3g} s per sync"
    runner = _runner_up(chosen, options)
    if runner is not None:
        text += f"; runner-up {_label(runner)} ~{runner.seconds:.3g} s: {verdict(chosen, runner)}"
    if best.mode == "colocated" and ctx.target.kind in IPC_PATH and chosen.method == "inplace":
        text += (
            f". On {ctx.target.kind} the colocated path goes through host memory until rlc maps the trainer's "
            f"device memory through {IPC_PATH[ctx.target.kind]} (zero-copy, not in the runtime yet)"
        )
    return text + "."


def _schedule_method(ctx: Context, best: Candidate, chosen: cost.SyncOption) -> str:
    """`schedule.weight_sync`: the chosen method; a served adapter keeps the path the base would take (the runtime
    sends the adapter whatever it says)."""
    if chosen.method != "adapter":
        return chosen.method
    if ctx.spec.rollout.weight_sync == "disk":
        return "disk"
    return "inplace" if best.mode == "colocated" else "broadcast"


def schedule_fields(ctx: Context, best: Candidate) -> dict[str, Any]:
    """The schedule's weight-sync fields for the winner."""
    chosen, options = sync_of(ctx, best)
    return {
        "weight_sync": _schedule_method(ctx, best, chosen),
        "weight_sync_senders": chosen.senders,
        "weight_sync_slicing": chosen.slicing,
        "weight_sync_note": note(ctx, best, chosen, options),
        "weight_sync_options": [
            WeightSyncOption(
                method=o.method,  # type: ignore[arg-type]
                senders=o.senders,
                slicing=o.slicing,  # type: ignore[arg-type]
                seconds=round(o.seconds, 3),
                bytes_per_worker=round(o.bytes_per_worker),
                runs=o.runs,
                verdict=verdict(chosen, o),
            )
            for o in options
        ],
    }
