"""`WeightPush`: how the trainer's new weights reach the rollout engines, by the plan's sync path.

`broadcast` sends them over collective groups of the plan's sending trainer ranks (rank 0, or ranks 0..k-1 each
with its share of the buckets) and the engine workers, every worker receiving every byte or, with TP slicing, only
its shard (rebuilt when an engine restarts); `disk` writes a safetensors folder that engines load; `inplace`
(colocated) writes it into each engine node's /dev/shm through a trainer rank on that node (`host_moves`);
`shared_memory` (colocated, cpu) has that rank copy the weights into a shared-memory segment the engines' workers
map (`rollout.shared_weights`); LoRA runs served as adapters write the adapter instead. A sync that loses an engine
restarts it and is redone, a bounded number of times.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rlc.runtime.errors import RunError, resume_command
from rlc.runtime.host_moves import HostMoves, plan_host_moves, shared_tag, stale_glob, weight_bytes
from rlc.runtime.rollout.pool import RolloutPool
from rlc.runtime.rollout.weight_sync import SyncGroups, sync_bucket_bytes
from rlc.schemas.plan import Plan

__all__ = ["SYNC_TIMEOUT_S", "WeightPush"]

#: Seconds one weight sync may take, its retries included, before the run stops with a resumable message (a hung
#: collective or engine would otherwise stall the run with no word).
SYNC_TIMEOUT_S = 1800
#: What gloo, HCCL and NCCL say when a peer's address cannot be reached: a network problem (often a loopback or
#: wrong interface on a cluster of several nodes), which a restart of healthy engines cannot mend.
NETWORK_ERROR = re.compile(
    r"connection refused|connect(ion)? timed out|no route to host|network is unreachable|connectFullMesh|"
    r"cannot assign requested address|ECONNREFUSED|EHOSTUNREACH|hccl\w*.*(socket|connect)|nccl\w*.*(socket|connect)",
    re.IGNORECASE,
)
#: Seconds between health checks of the engines while a sync waits: an engine whose vLLM core died mid-sync (its
#: collective RPC into the dead core may never return) is named and restarted within about this long.
HEALTH_EVERY_S = 15.0
#: Seconds one engine may take to answer a health check before it counts as busy (not dead).
HEALTH_TIMEOUT_S = 10.0


class EngineLost(RuntimeError):
    """Engines found dead while a sync waited for them."""

    def __init__(self, engines: list[int]) -> None:
        self.engines = engines
        super().__init__(f"rollout engine(s) {', '.join(map(str, engines))} died during the weight sync")


def sync_method(plan: Plan) -> str:
    """How weights reach the engines: adapter (LoRA served by vLLM), or the plan's broadcast, disk or inplace."""
    return "adapter" if plan.lora is not None and plan.lora.rollout == "adapter" else plan.schedule.weight_sync


class WeightPush:
    """The weight path of one run: its sync group, its colocated writers, the last version every engine holds."""

    def __init__(
        self,
        plan: Plan,
        trainer: Any,
        rollout: RolloutPool,
        run_dir: Path,
        message: Callable[[str], None],
        version: int,
    ) -> None:
        self.plan, self.trainer, self.rollout, self.run_dir, self.message = plan, trainer, rollout, run_dir, message
        self.lora_adapter = sync_method(plan) == "adapter"
        self.synced_version = version
        self._group: SyncGroups | None = None  # the broadcast's groups, once formed
        self._slices: tuple[int, list[list[Any]]] | None = None  # tp slicing: TP size, each TP rank's cut
        self.last_broadcast_s: dict[str, float] = {}  # the last broadcast's seconds, engines' side and trainer's
        self._in_group: set[int] = set()
        self._host_moves: HostMoves | None = None  # colocated: who writes the weights into which node's /dev/shm
        self.written_dirs: dict[int, str] = {}  # folders trainer ranks wrote, removed at the end
        self._meta: list[Any] | None = None
        self._shm_held: dict[int, tuple[str, int]] = {}  # shared_memory: each writer's folder and the version in it

    def meta(self) -> list[Any]:
        """Names, shapes and dtypes of what a sync sends: fixed for the run, so asked of the trainer once."""
        if self._meta is None:
            self._meta = self.trainer.weight_meta()
        return self._meta

    def forget(self, index: int) -> None:
        """A restarted engine is not in the sync group (the next sync rebuilds it) and may be on another node."""
        self._in_group.discard(index)
        self._group = None
        self._host_moves = None

    def sync(self, version: int, restarted: Callable[[int], None], attempts: int = 3) -> None:
        """Move the trainer's weights into every engine; an engine lost mid-sync is restarted (`restarted` tells
        the controller, which forgets its work and calls `forget`) and the sync redone, all within one bound.

        Live engines whose calls had not returned are restarted too (one stuck joining a group that never forms
        would otherwise hold the retry up); a connection error while every engine is healthy is a network problem
        and stops the run at once with what to set, rather than being retried as an engine death."""
        from ray.exceptions import RayActorError, RayTaskError

        deadline = time.monotonic() + SYNC_TIMEOUT_S
        for attempt in range(1, attempts + 1):
            self._calls = {}
            try:
                self._sync_once(version, deadline)
                self.synced_version = version
                return
            except (RayActorError, RayTaskError, EngineLost) as exc:
                cause = getattr(exc, "cause", None) or exc
                why = next((line for line in str(cause).splitlines() if line.strip()), "")
                if isinstance(exc, RayTaskError) and NETWORK_ERROR.search(f"{exc}\n{cause}") and not self._any_dead():
                    raise RunError(self._network_message(why)) from None
                if attempt == attempts:
                    raise
                self.message(f"weight sync failed ({type(cause).__name__}: {why[:200]}); reviving engines and retrying")
                stuck = self._stuck()
                self._group = None
                with contextlib.suppress(Exception):  # the sender's group may already be broken
                    self.trainer.close_weight_sync()
                revived = self.rollout.revive()
                stuck = [i for i in stuck if i not in revived]
                if stuck:
                    self.message(f"restarting engine(s) {', '.join(map(str, stuck))}, alive but stuck in the sync")
                    revived += self.rollout.revive(stuck, force=True)
                for index in revived:
                    restarted(index)

    def _network_message(self, why: str) -> str:
        backend = getattr(self.rollout, "sync_backend", "collective")
        return (
            f"the weight-sync group could not connect ({why[:200]}) while every engine is alive: the trainer and the "
            f"engines cannot reach each other at the addresses the {backend} group binds. On several nodes, start "
            "every node with RLC_SOCKET_IFNAME set to the interface that connects them (launch.sh takes the route to "
            f"the head's when it is unset); the run stopped: `{resume_command('PLAN')}` continues from the last "
            "checkpoint"
        )

    def _any_dead(self) -> bool:
        return bool(_dead(dict(enumerate(self.rollout.engines))))

    def _stuck(self) -> list[int]:
        """The engines whose calls of the failed attempt have not returned."""
        import ray

        stuck = []
        for index, refs in sorted(getattr(self, "_calls", {}).items()):
            with contextlib.suppress(Exception):
                if ray.wait(list(refs), num_returns=len(refs), timeout=0)[1]:
                    stuck.append(index)
        return stuck

    def method(self) -> str:
        """adapter (LoRA served by vLLM), or the plan's broadcast, disk or inplace (see `host_moves`)."""
        return sync_method(self.plan)

    def prepare(self) -> None:
        """Check, before any step, that the plan's weight path works here (its senders and slicing too); colocated
        runs find their writers."""
        self._check_sync_shape()
        if self.method() in ("inplace", "shared_memory"):
            self._moves()

    def _moves(self) -> HostMoves:
        """Which trainer rank writes into which node's /dev/shm for which engines; decided once and logged,
        forgotten when an engine is restarted (it may land on another node)."""
        if self._host_moves is None:
            import ray

            ranks = self.trainer.hosts_info()
            nodes = ray.get([e.node_ids() for e in self.rollout.engines])
            shared = self.method() == "shared_memory"
            if shared:
                # A segment this run already holds is rewritten in place: its bytes count as free for it.
                from rlc.runtime.rollout.shared_weights import segment_layout

                held = segment_layout(self.meta())[1]
                ranks = [{**r, "shm_free": r["shm_free"] + held * (r["rank"] in self.written_dirs)} for r in ranks]
                tag = shared_tag(self.run_dir, os.getpid())
            else:
                tag = f"{os.getpid()}-{abs(hash(str(self.run_dir))) % 10**8}"
            self._host_moves = plan_host_moves(ranks, nodes, weight_bytes(self.meta()), tag)
            how = " (shared-memory segments the engines map)" if shared else ""
            self.message(f"colocated weight moves through host memory: {self._host_moves.describe()}{how}")
        return self._host_moves

    def push_files(self, indices: list[int], version: int) -> None:
        """Write the current weights (or LoRA adapter) as files and have engines `indices` load them."""

        engines = [self.rollout.engines[i] for i in indices]
        if self.lora_adapter:
            # A new folder per version: vLLM identifies an adapter by id and path, and an engine may still
            # be reading the previous one.
            root = self.run_dir / "sync"
            path = self.trainer.save_adapter(str(root / f"adapter-v{version:06d}"))
            _bounded([e.update_lora_adapter(path, version) for e in engines], dict(zip(indices, engines, strict=True)))
            for old in sorted(root.glob("adapter-v*"))[:-2]:
                shutil.rmtree(old, ignore_errors=True)
            return
        if self.method() == "shared_memory":
            self._push_shared(indices, engines, version)
            return
        if self.method() == "inplace":
            moves = self._moves()
            self.written_dirs.update(self.trainer.save_weights_per_node(moves.dirs))
            folders = [moves.folder_for(i) for i in indices]
        else:
            path = self.trainer.save_weights(str(self.run_dir / "sync" / "latest"))
            folders = [str(Path(path).parent)] * len(indices)
        refs = [e.update_weights_from_path(f, version) for e, f in zip(engines, folders, strict=True)]
        _bounded(refs, dict(zip(indices, engines, strict=True)))

    def _push_shared(self, indices: list[int], engines: list[Any], version: int) -> None:
        """`shared_memory`: the writer ranks copy the weights into their node's segment (skipped when every segment
        holds `version` already: an engine restarted to the current weights, or a retried load), then engines map it.

        After an engine restart re-plans the writers, a rank left with no engine drops its segment in the same
        collective call, and its folder is removed from the run's list."""
        from rlc.runtime.rollout.shared_weights import segment_name

        moves = self._moves()
        meta = self.meta()
        held = {rank: (folder, version) for rank, folder in moves.dirs.items()}
        if held != self._shm_held:
            # The writers' own node's folders of earlier runs go on the first write (`host_moves.stale_glob`).
            stale = stale_glob(shared_tag(self.run_dir, os.getpid()))
            written = self.trainer.save_weights_shared(moves.dirs, meta, version, stale)
            for rank in set(self.written_dirs) - set(moves.dirs):  # its writer dropped the segment and folder
                self.written_dirs.pop(rank)
            self.written_dirs.update({rank: moves.dirs[rank] for part in written for rank in part})
            self._shm_held = held
        refs = [
            e.update_weights_from_shared_memory(segment_name(moves.folder_for(i), meta), meta, version)
            for i, e in zip(indices, engines, strict=True)
        ]
        _bounded(refs, dict(zip(indices, engines, strict=True)))

    def _sync_once(self, version: int, deadline: float | None = None) -> None:
        import ray

        engines = self.rollout.engines
        if self.method() != "broadcast":
            self.push_files(list(range(len(engines))), version)
            return
        meta = self.meta()
        refs: list[Any] = []
        if self._group is None:
            for index in sorted(self._in_group):  # leave the old groups; a broken one may refuse politely
                with contextlib.suppress(Exception):
                    ray.get(engines[index].close_sync_group(), timeout=60)
            groups = self._form_groups()
            per_engine = (groups["worlds"][0] - 1) // len(engines)  # each engine's workers in one group
            refs = [e.init_sync_groups(groups, 1 + i * per_engine) for i, e in enumerate(engines)]
            self._calls = {i: [ref] for i, ref in enumerate(refs)}
            self._in_group = set(range(len(engines)))
            self._group = groups
        updates = [e.update_weights_broadcast(meta, version, self._group["bucket_bytes"]) for e in engines]
        for i, ref in enumerate(updates):
            self._calls.setdefault(i, []).append(ref)
        refs += updates
        sending = self.trainer.sync_weights_async(self._group, meta)
        refs += sending
        # A dead engine's side of the broadcast may never return; the trainer's side then waits out its collective
        # timeout (`rollout.weight_sync.SYNC_TIMEOUT_S`) before the retry's calls reach it.
        done = _bounded(refs, dict(enumerate(engines)), deadline)
        # The slowest engine's update (pause, receive, load, resume) and the slowest trainer rank's gather and send.
        self.last_broadcast_s = {
            "engines": max(done[len(refs) - len(sending) - len(updates) : len(refs) - len(sending)], default=0.0),
            "trainer": max(done[len(refs) - len(sending) :], default=0.0),
        }

    # ---------------------------------------------------------------- broadcast: senders and slicing

    def sync_shape(self) -> tuple[int, str]:
        """The plan's broadcast senders and slicing (plans older than those fields: 1 sender, full)."""
        schedule = self.plan.schedule
        senders = getattr(schedule, "weight_sync_senders", 1)
        slicing = getattr(schedule, "weight_sync_slicing", "full")
        return int(1 if senders is None else senders), str(slicing or "full")

    def _check_sync_shape(self) -> None:
        """Refuse a plan whose senders or slicing this runtime cannot execute as stated, before any step."""
        senders, slicing = self.sync_shape()
        if self.method() != "broadcast":
            if (senders, slicing) != (1, "full"):
                raise RunError(
                    f"the plan states weight_sync_senders {senders} and weight_sync_slicing {slicing!r} for weight "
                    f"sync {self.method()!r}; both apply to broadcast only (1 and 'full' elsewhere): compile the plan "
                    "again"
                )
            return
        world = int(getattr(self.trainer, "world_size", 1))
        if not 1 <= senders <= world:
            raise RunError(
                f"the plan's weight_sync_senders is {senders}, but the trainer has {world} rank(s) and each sender is "
                f"one of them: set it between 1 and {world} (compile the plan again)"
            )
        if slicing not in ("full", "tp"):
            raise RunError(f"weight_sync_slicing {slicing!r}: this runtime slices 'full' or 'tp'")
        if slicing == "tp":
            self._tp_slices()

    def _form_groups(self) -> SyncGroups:
        """The sync groups of this formation: ``senders`` trainer ranks, each hosting one group per TP rank of the
        engines (one under full slicing), on fresh ports of its own node."""
        senders, slicing = self.sync_shape()
        tp, slices = self._tp_slices() if slicing == "tp" else (1, None)
        workers = self.rollout.workers
        if workers % tp:
            raise RunError(f"engines of {workers} workers cannot be cut into TP {tp} groups")
        return SyncGroups(
            senders=senders,
            slicing=slicing,
            tp=tp,
            addresses=self.trainer.weight_sync_addresses(senders, tp),
            worlds=[1 + len(self.rollout.engines) * (workers // tp)] * tp,
            backend=self.rollout.sync_backend,
            bucket_bytes=sync_bucket_bytes(self.meta(), senders),
            slices=slices,
        )

    def _tp_slices(self) -> tuple[int, list[list[Any]]]:
        """tp slicing: the engines' TP size and what each TP rank's workers receive of every tensor, asked of the
        first engine's workers once (every engine serves the same model at the same TP); says how many tensors go
        as shards, replicated or whole, and the bytes each worker receives."""
        if self._slices is None:
            import ray

            from rlc.runtime.rollout.tp_slices import shard_numel
            from rlc.runtime.rollout.weight_sync import dtype_from_str

            meta = self.meta()
            try:
                reports = ray.get(self.rollout.engines[0].sync_shards(meta), timeout=300)
            except Exception as exc:
                cause = getattr(exc, "cause", None) or exc
                raise RunError(f"weight_sync_slicing 'tp' cannot run on these engines: {cause}") from None
            tp = int(reports[0]["tp_size"])
            by_rank: dict[int, list[Any]] = {}
            for report in reports:
                if by_rank.setdefault(int(report["tp_rank"]), report["slices"]) != report["slices"]:
                    raise RunError("engine workers of one TP rank would receive different shards (mixed layouts?)")
            if sorted(by_rank) != list(range(tp)):
                raise RunError(f"the engine's workers report TP ranks {sorted(by_rank)} for TP {tp}")
            slices = [by_rank[r] for r in range(tp)]
            full = weight_bytes(meta)
            per_worker = max(
                sum(
                    shard_numel(shape, spec) * dtype_from_str(dt).itemsize
                    for (_, shape, dt), spec in zip(meta, row, strict=True)
                )
                for row in slices
            )
            counts = reports[0]["counts"]
            whole = reports[0]["whole"]
            self.message(
                f"weight sync sliced for TP {tp}: {counts['slice']} tensor(s) as each worker's shard, "
                f"{counts['replicated']} replicated, {counts['whole']} whole through vLLM's loader"
                + (f" (e.g. {', '.join(whole[:3])})" if whole else "")
                + f", {counts['skip']} tied alias(es) not sent; at most {per_worker / 2**20:.1f} MiB of "
                f"{full / 2**20:.1f} MiB per worker"
            )
            self._slices = (tp, slices)
        return self._slices


def _bounded(refs: list[Any], engines: Mapping[int, Any] | None = None, deadline: float | None = None) -> list[Any]:
    """`ray.get` of a sync's calls by `deadline` (default: SYNC_TIMEOUT_S from now), or a clear stop (the last
    checkpoint resumes the run); every HEALTH_EVERY_S it waits, `engines` are checked, and EngineLost names the dead
    ones (a call that failed raises its own error first)."""
    import ray

    deadline = time.monotonic() + SYNC_TIMEOUT_S if deadline is None else deadline
    while True:
        wait_s = max(0.0, min(HEALTH_EVERY_S, deadline - time.monotonic()))
        ready, waiting = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
        if not waiting:
            return ray.get(list(refs))
        ray.get(ready)  # a call that already failed (an engine actor that exited) raises its error now
        dead = _dead(engines or {})
        if dead:
            raise EngineLost(dead)
        if time.monotonic() >= deadline:
            raise RunError(
                f"a weight sync did not finish within {SYNC_TIMEOUT_S} s (an engine or the trainer is stuck); "
                f"the run stopped: `{resume_command('PLAN')}` continues from the last checkpoint"
            )


def _dead(engines: Mapping[int, Any]) -> list[int]:
    """The pool indices of the engines whose actor exited or whose vLLM core died (one busy past HEALTH_TIMEOUT_S
    is not counted: a long load answers late)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    dead = []
    for index, engine in sorted(engines.items()):
        try:
            if not ray.get(engine.healthy(), timeout=HEALTH_TIMEOUT_S):
                dead.append(index)
        except RayActorError:
            dead.append(index)
        except GetTimeoutError:
            continue
    return dead
