"""A group of ``TrainerWorker`` Ray actors (one per device) driven as one trainer with the plan's layout.

The group finds a rendezvous address on the node that will host rank 0 (a probe task scheduled exactly like
rank 0; a group of one needs none), starts one actor per rank, splits batches across the data-parallel ranks
(ranks that differ only in their context- or tensor-parallel coordinate get the same share), and gathers
results from one rank per data-parallel share. Every trainer method is collective, so the group always calls
all ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlc.schemas.layout import TrainLayout

from ..platform import Platform, get_platform
from ..ray_resources import ray_options
from ..rollout.weight_sync import TensorMeta
from .rendezvous import probe_address

__all__ = ["TrainerGroup", "minibatch_shares", "split_batch"]


def split_batch(batch: Mapping[str, Any], parts: int) -> list[dict[str, Any]]:
    """Split a batch of per-sequence lists into ``parts`` contiguous, nearly equal shares.

    Keys whose value is not a list of the batch's length (scalars, configs) are copied to every share.
    """
    n = len(batch["input_ids"])
    bounds = [n * i // parts for i in range(parts + 1)]
    shares = []
    for i in range(parts):
        lo, hi = bounds[i], bounds[i + 1]
        shares.append({k: (v[lo:hi] if isinstance(v, (list, tuple)) and len(v) == n else v) for k, v in batch.items()})
    return shares


def minibatch_shares(batch: Mapping[str, Any], minibatches: int, dp: int) -> list[Any]:
    """Each data-parallel rank's part of a train step: its share of the batch (one minibatch), or the list of
    its shares of the ``minibatches`` contiguous, nearly equal minibatches (each split across all ranks, so
    every optimizer step has samples and the ranks take it together)."""
    n = len(batch["input_ids"])
    if not 1 <= minibatches <= n:
        raise ValueError(f"{minibatches} minibatches for a batch of {n} sequences")
    if minibatches == 1:
        return split_batch(batch, dp)
    parts = [split_batch(part, dp) for part in split_batch(batch, minibatches)]
    return [[part[d] for part in parts] for d in range(dp)]


class TrainerGroup:
    """``world_size`` trainer actors (one per device) forming one FSDP2 group."""

    def __init__(
        self,
        world_size: int,
        model_path: str,
        platform: str | Platform = "cpu",
        train_cfg: Mapping[str, Any] | None = None,
        *,
        layout: TrainLayout | None = None,
        placement_group: Any = None,
        bundle_indices: Sequence[int] | None = None,
        num_cpus: float = 1,
        resources: Mapping[str, float] | None = None,
        env: Mapping[str, str] | None = None,
        rank_env: Sequence[Mapping[str, str]] | None = None,
        wait: bool = True,
    ) -> None:
        """Start the actors; returns once every rank has joined the group and sharded its model, or at once
        with ``wait=False`` (then `ready_refs` says when; a run starts its engines meanwhile). ``rank_env``: each
        rank's own additions to ``env`` (the devices the plan binds it to)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .trainer import TrainerWorker, default_layout

        self.world_size = world_size
        self.layout = layout or default_layout(world_size, dict(train_cfg or {}))
        if self.layout.world_size != world_size:
            raise ValueError(f"layout for {self.layout.world_size} ranks given to a group of {world_size}")
        coords = [self.layout.coordinates(r) for r in range(world_size)]
        self._share_of = [c["dp"] for c in coords]
        # One rank per data-parallel share answers for it: cp 0, tp 0, and its last pipeline stage (which computes
        # the log-probs).
        last = self.layout.pp - 1
        self._speakers = [r for r, c in enumerate(coords) if c["cp"] == 0 and c["tp"] == 0 and c["pp"] == last]
        self.platform = get_platform(platform)
        if bundle_indices is not None and len(bundle_indices) != world_size:
            raise ValueError(f"{len(bundle_indices)} bundle indices for {world_size} ranks")
        if rank_env is not None and len(rank_env) != world_size:
            raise ValueError(f"{len(rank_env)} per-rank environments for {world_size} ranks")

        def options(rank: int) -> dict[str, Any]:
            opts: dict[str, Any] = {"num_cpus": num_cpus}
            if resources:
                opts["resources"] = dict(resources)
            merged = {**(env or {}), **(rank_env[rank] if rank_env else {})}
            if merged:
                opts["runtime_env"] = {"env_vars": merged}
            if placement_group is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=placement_group,
                    placement_group_bundle_index=bundle_indices[rank] if bundle_indices is not None else rank,
                )
            return ray_options(opts)

        # A group of one needs no address; a larger one meets on the node of rank 0, found by a probe task
        # (a Ray worker of its own, which then idles for the whole run: ~1.5 CPU-s of start-up, measured).
        self.master_addr: str | None = None
        self.master_port = 0
        if world_size > 1:
            probe = ray.remote(probe_address).options(**{k: v for k, v in options(0).items() if k != "runtime_env"})
            self.master_addr, self.master_port = ray.get(probe.remote())
        actor_cls = ray.remote(TrainerWorker)
        self.workers = [
            actor_cls.options(**options(rank)).remote(
                rank, world_size, self.master_addr, self.master_port, model_path, self.platform, train_cfg, self.layout
            )
            for rank in range(world_size)
        ]
        self._constructed = [w.weight_meta.remote() for w in self.workers]
        if wait:
            ray.get(self._constructed)

    def ready_refs(self) -> list[Any]:
        """One reference per rank that resolves once the rank is built (or raises the error that stopped it)."""
        return list(self._constructed)

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        import ray

        return ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def _all_async(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(w, method).remote(*args, **kwargs) for w in self.workers]

    def compute_logprobs(
        self, batch: Mapping[str, Any], adapters: bool = True, temperature: float | None = None
    ) -> list[list[float]]:
        """Per-token log-probs of every sequence, in batch order (``adapters=False``: LoRA base model;
        ``temperature``: instead of the sampling one, e.g. 1.0 to compare with engines' prompt scores)."""
        import ray

        shares = split_batch(batch, self.layout.dp)
        refs = [
            w.compute_logprobs.remote(shares[d], adapters, temperature)
            for w, d in zip(self.workers, self._share_of, strict=True)
        ]
        parts = ray.get(refs)
        return [row for r in self._speakers for row in parts[r]]

    def train_step(
        self, batch: Mapping[str, Any], loss_fn_cfg: Mapping[str, Any] | None = None, minibatches: int = 1
    ) -> dict[str, float]:
        """One training step over the whole batch: ``minibatches`` optimizer steps, each on a contiguous, nearly
        equal part of it split across the data-parallel ranks; returns the group-wide stats (rank 0's)."""
        import ray

        shares = minibatch_shares(batch, minibatches, self.layout.dp)
        refs = [w.train_step.remote(shares[d], loss_fn_cfg) for w, d in zip(self.workers, self._share_of, strict=True)]
        return ray.get(refs)[0]

    def built_layouts(self) -> list[dict[str, Any]]:
        """Every rank's built layout and measured peak memory per phase (``TrainerWorker.built_layout``)."""
        return self._all("built_layout")

    def weight_meta(self, dtype: str | None = None) -> list[TensorMeta]:
        """What engines need to receive a broadcast (names, global shapes, dtypes)."""
        import ray

        return ray.get(self.workers[0].weight_meta.remote(dtype))

    def full_state_dict(self) -> dict[str, Any]:
        """Gathered weights from rank 0 (ships them to the driver: tests and small models only)."""
        return self._all("full_state_dict")[0]

    def save_weights(self, out_dir: str) -> str:
        """Write an HF folder engines can reload from; returns the safetensors path."""
        return self._all("save_weights", out_dir)[0]

    def save_adapter(self, out_dir: str) -> str:
        """Write the LoRA adapter in PEFT format (rank 0); returns its folder."""
        return self._all("save_adapter", out_dir)[0]

    def offload(self, what: Sequence[str]) -> float:
        """Move trainer state (params, grads, optimizer) to host on every rank; the slowest rank's seconds."""
        return max(self._all("offload", list(what)))

    def onload(self, what: Sequence[str]) -> float:
        """Bring offloaded trainer state back to the devices; the slowest rank's seconds."""
        return max(self._all("onload", list(what)))

    def weight_sync_address(self) -> tuple[str, int]:
        """A host and free port on rank 0's node for the weight-sync group."""
        import ray

        # Asked of rank 0 itself: the port must be free where the sender binds it.
        host, port = ray.get(self.workers[0].sync_address.remote())
        return host, port

    def weight_sync_addresses(self, senders: int, per_sender: int = 1) -> list[list[Any]]:
        """``per_sender`` [host, port] pairs on each of ranks 0..senders-1's nodes, rank by rank: the addresses of
        the sync groups each sending rank hosts (`weight_sync.SyncGroups`)."""
        import ray

        if not 1 <= senders <= self.world_size:
            raise ValueError(
                f"weight_sync_senders {senders}: the trainer has {self.world_size} rank(s), and each sender is one"
            )
        parts = ray.get([w.sync_addresses.remote(per_sender) for w in self.workers[:senders]])
        return [address for part in parts for address in part]

    def save_weights_shared(self, dirs: dict[int, str], meta: Any, version: int, stale: Any = None) -> list[Any]:
        """Each writer rank's shared-memory segment of the current weights (`WeightExport.save_weights_shared`)."""
        return self._all("save_weights_shared", dirs, meta, version, stale)

    def host_info(self) -> dict[str, Any]:
        """Rank 0's Ray node id and free /dev/shm bytes: rank 0 writes the gathered weights."""
        import ray

        return ray.get(self.workers[0].host_info.remote())

    def hosts_info(self) -> list[dict[str, Any]]:
        """Every rank's Ray node id and free /dev/shm bytes (colocated moves pick a writer per node)."""
        return self._all("host_info")

    def save_weights_per_node(self, dirs: dict[int, str]) -> dict[int, str]:
        """Ranks in `dirs` write the weights into their folder on their own node; {rank: safetensors path}."""
        written: dict[int, str] = {}
        for part in self._all("save_weights_per_node", dirs):
            written.update(part)
        return written

    def remove_dir(self, path: str, rank: int = 0) -> None:
        """Delete a folder on `rank`'s node."""
        import ray

        ray.get(self.workers[rank].remove_dir.remote(path))

    def sync_weights_broadcast_async(
        self, host: str, port: int, world_size: int, meta: Sequence[TensorMeta] | None = None
    ) -> list[Any]:
        """Start the broadcast on every rank and return Ray refs, so engines can be driven alongside.

        The caller issues the engines' ``init_sync_group`` / ``update_weights_broadcast`` calls,
        then waits on these refs and the engines' together.
        """
        return self._all_async("sync_weights_broadcast", host, port, world_size, meta)

    def sync_weights_async(self, groups: Mapping[str, Any], meta: Sequence[TensorMeta] | None = None) -> list[Any]:
        """Start a sync over ``groups`` (`weight_sync.SyncGroups`) on every rank (the senders send, all gather);
        returns Ray refs, so engines can be driven alongside (as `sync_weights_broadcast_async`)."""
        return self._all_async("sync_weights", dict(groups), meta)

    def close_weight_sync(self) -> None:
        """Leave the weight-sync group on every rank (before re-forming it with other engines)."""
        self._all("close_weight_sync")

    def save_checkpoint(self, ckpt_dir: str) -> str:
        """Collective checkpoint: HF weights plus sharded optimizer state."""
        return self._all("save_checkpoint", ckpt_dir)[0]

    def load_checkpoint(self, ckpt_dir: str) -> int:
        """Restore from ``save_checkpoint``; returns the restored step."""
        return self._all("load_checkpoint", ckpt_dir)[0]

    def shutdown(self) -> None:
        """Leave the process groups and end the actors."""
        import ray

        try:
            self._all("shutdown")
        finally:
            for w in self.workers:
                ray.kill(w)
            self.workers = []
