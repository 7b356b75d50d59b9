"""Weights out of the trainer: what engines load (gathered, LoRA merged, draft head left out) and how.

Every method is collective (FSDP2 gathers shards, TP gathers DTensor slices); only the ranks that write or
send keep the result. Engines receive weights three ways, chosen by the plan: a broadcast from the plan's
sending ranks (rank 0, or ranks 0..k-1 each with its share of the buckets) over stateless process groups,
safetensors files rank 0 writes (disk or LoRA adapters), or, colocated, files each node's leader rank writes into
its own node's host memory for the engines on that node.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..rollout.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    SyncGroups,
    SyncSender,
    TensorMeta,
    one_group,
    write_safetensors,
)
from . import lora as lora_lib
from .checkpoint_names import CheckpointNames
from .memory_probe import measured

__all__ = ["WeightExport"]


class WeightExport:
    """Mixin of `TrainerWorker`: gathered weights, adapters, HF folders, the broadcast sender."""

    rank: int
    model: Any
    lora: dict[str, Any] | None
    lora_scaling: float
    peft: Any
    mesh: Any
    model_path: str
    platform: Any
    device: torch.device
    _sender: SyncSender | None
    _sender_key: tuple[str, int, int] | None
    _sender_groups: tuple[tuple[Any, ...], ...] | None  # the addresses of the groups `_sender` joined

    @property
    def checkpoint_names(self) -> CheckpointNames:
        """The base checkpoint's names for what leaves the trainer (`checkpoint_names`); read once."""
        names = getattr(self, "_checkpoint_names", None)
        if names is None:
            names = CheckpointNames.of(Path(self.model_path), [m[0] for m in self._module_meta()])
            self._checkpoint_names = names
        return names

    def _module_meta(self, dtype: str | None = None) -> list[TensorMeta]:
        # Pipeline stages hold part of the layers: the whole model's (name, shape, dtype), exchanged at start-up.
        whole = getattr(self, "_stage_meta", None)
        if whole is not None:
            meta = [(k, shape, (dtype or dt)) for k, (shape, dt) in whole.items()]
        else:
            sd = self.model.state_dict()  # DTensor shapes are global
            meta = [(k, tuple(v.shape), (dtype or str(v.dtype)).removeprefix("torch.")) for k, v in sd.items()]
        if self.lora:
            meta = lora_lib.merged_meta(meta)
        return [m for m in meta if not lora_lib.is_draft_key(m[0])]

    def weight_meta(self, dtype: str | None = None) -> list[TensorMeta]:
        """Names (the base checkpoint's), global shapes and dtypes of what a sync sends (``sync_state_dict``),
        without gathering."""
        names = self.checkpoint_names
        return [(names.outward(k), shape, dt) for k, shape, dt in self._module_meta(dtype)]

    def full_state_dict(self, keep: bool | None = None) -> dict[str, torch.Tensor] | None:
        """The unsharded weights in model names, on CPU, where `keep` (default: rank 0); None elsewhere.

        Collective: every rank walks the module's state dict in the same order and gathers each sharded tensor
        (one at a time, so a rank holds at most one whole tensor beyond its shards); the keepers copy it to host
        memory. The module's own state dict rather than torch's canonical ``get_model_state_dict``: the names are
        the same for the models rlc builds (HF recompute wraps no module; `weight_meta` announces these names),
        and the canonical path's per-call bookkeeping was half of a quickstart weight sync (~10 of 20 ms).
        """
        keep = self.rank == 0 if keep is None else keep
        pipe = getattr(self, "pipeline", None)
        # Under pipeline parallelism the first data-parallel rank of each stage collects its stage's tensors, rank 0
        # merges them and sends the whole to any other rank that keeps a copy (a colocated node's writer).
        coords = self.mesh.coords
        leader = pipe is not None and coords["dp"] == coords["cp"] == coords["tp"] == 0
        out: dict[str, torch.Tensor] = {}
        for name, value in self.model.state_dict().items():
            full = _unsharded(value)
            if (keep and pipe is None) or leader:
                out[name] = full.detach().to("cpu")
        if pipe is None:
            return out if keep else None
        merged = pipe.gather_to_first(out, self.device) if leader else None
        return _share_from_rank0(merged, keep, self.rank, self._stage_meta, self.device)

    def sync_state_dict(self, keep: bool | None = None) -> dict[str, torch.Tensor] | None:
        """What engines load, in the base checkpoint's names, where `keep` (default rank 0). Collective.

        LoRA adapters are merged into (copies of) the base weights, and a speculative-decoding head (MTP
        or draft keys) is left out: it stays frozen and the engines keep the one they loaded.
        """
        sd = self.full_state_dict(keep)
        if sd is None:
            return None
        if self.lora:
            sd = lora_lib.merged_state_dict(sd, self.lora_scaling)
        names = self.checkpoint_names
        return {names.outward(k): v for k, v in sd.items() if not lora_lib.is_draft_key(k)}

    def adapter_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The LoRA factors, unsharded, in model names, on rank 0. Collective (gathers only the adapters).

        FSDP2 and TP shards are gathered per tensor; under pipeline parallelism each stage holds its own layers'
        factors, so the first data-parallel rank of each stage collects them and rank 0 merges every stage's."""
        if not self.lora:
            raise RuntimeError("adapter_state_dict without lora")
        pipe = getattr(self, "pipeline", None)
        coords = self.mesh.coords
        leader = pipe is not None and coords["dp"] == coords["cp"] == coords["tp"] == 0
        out = {}
        for name, param in self.model.named_parameters():
            if lora_lib.is_lora_key(name):
                full = _unsharded(param)
                if (self.rank == 0 and pipe is None) or leader:
                    out[name] = full.detach().to("cpu")
        if pipe is None:
            return out if self.rank == 0 else None
        return pipe.gather_to_first(out, self.device, only=lora_lib.is_lora_key) if leader else None

    def save_adapter(self, out_dir: str) -> str | None:
        """The LoRA adapter in PEFT format (what vLLM's LoRARequest and PeftModel load). Collective."""
        tensors = self.adapter_state_dict()
        if self.rank != 0:
            return None
        config = self.peft.peft_config[lora_lib.ADAPTER_NAME]
        return str(lora_lib.write_adapter(tensors, config, out_dir, self.model_path))

    def _write_hf(self, sd: dict[str, torch.Tensor], out_dir: str, export: bool = False) -> str:
        """`export`: a drop-in replacement for the base folder (its config, and its tensors the trainer never held:
        a vision tower, the frozen MTP head); otherwise the weights an engine reloads, with the model's config."""
        out = Path(out_dir)
        base = Path(self.model_path)
        if export and self.checkpoint_names.extra:
            sd = {**sd, **_base_tensors(base, self.checkpoint_names.extra)}
        path = write_safetensors(sd, out)
        if export:
            out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(base / "config.json", out / "config.json")
        else:
            self.model.config.save_pretrained(out)
        copy_tokenizer_files(self.model_path, out)
        return str(path)

    @measured("sync")
    def save_weights(self, out_dir: str, export: bool = False) -> str | None:
        """HF-format folder an engine can load or reload from (weights, config, tokenizer). Collective.

        `export` (checkpoints): the base folder's config and extra tensors come along (`_write_hf`).
        """
        sd = self.sync_state_dict()
        return self._write_hf(sd, out_dir, export) if self.rank == 0 and sd is not None else None

    @measured("sync")
    def save_weights_per_node(self, out_dirs: dict[int, str]) -> dict[int, str]:
        """Each rank in `out_dirs` (a node's leader) writes the weights to its folder (its node's host memory).

        Collective; returns {rank: safetensors path} for the ranks that wrote (only this rank's entry here).
        """
        sd = self.sync_state_dict(keep=self.rank in out_dirs)
        if self.rank not in out_dirs or sd is None:
            return {}
        return {self.rank: self._write_hf(sd, out_dirs[self.rank])}

    @measured("sync")
    def save_weights_shared(
        self, folders: dict[int, str], meta: Sequence[TensorMeta], version: int, stale: str | None = None
    ) -> dict[int, str]:
        """Each rank in `folders` (a node's writer) copies the weights into its shared-memory segment there, laid out
        by `meta` and stamped `version`, for the engines on its node to map (`shared_weights`). Collective.

        The segment is made on a rank's first write (removing `stale`, earlier runs' folders on its node) and
        rewritten in place after; a rank no longer in `folders` (its engines moved) drops its own. Returns {rank:
        segment path} for the ranks that wrote (only this rank's entry here).
        """
        from ..rollout.shared_weights import SharedWeightsWriter

        sd = self.sync_state_dict(keep=self.rank in folders)
        writer: SharedWeightsWriter | None = getattr(self, "_shm_writer", None)
        if writer is not None and writer.folder != folders.get(self.rank):
            writer.close()
            writer = self._shm_writer = None
        if self.rank not in folders or sd is None:
            return {}
        if writer is None:
            writer = self._shm_writer = SharedWeightsWriter(folders[self.rank], stale)
        return {self.rank: writer.write(sd, meta, version)}

    @measured("sync")
    def sync_weights_broadcast(
        self, host: str, port: int, world_size: int, meta: Sequence[TensorMeta] | None = None
    ) -> float:
        """Today's single sender: gather the weights and broadcast them from rank 0 to the engines (`sync_weights`
        over `one_group`). Collective. Returns seconds taken."""
        return self._sync_weights(one_group(host, port, world_size, self.platform.dist_backend), meta)

    @measured("sync")
    def sync_weights(self, groups: SyncGroups, meta: Sequence[TensorMeta] | None = None) -> float:
        """Send the weights over the sync groups (`SyncGroups`): ranks 0..k-1 each send their share of the buckets,
        every rank takes part in the gathers. Collective. Returns seconds taken."""
        return self._sync_weights(groups, meta)

    def _sync_weights(self, groups: SyncGroups, meta: Sequence[TensorMeta] | None) -> float:
        """Each sender joins its groups on first use (engines join concurrently with ``init_sync_groups``) and keeps
        them for later syncs. Where the module's tensors are what engines load (no LoRA merge, no pipeline stages),
        the weights are gathered tensor by tensor in announced order and only the owning sender keeps each, so
        gathering the next bucket overlaps sending the last; otherwise every sender gathers the whole state dict
        first (`sync_state_dict`)."""
        t0 = time.perf_counter()
        world = dist.get_world_size() if dist.is_initialized() else 1
        senders = int(groups["senders"])
        if not 1 <= senders <= world:
            raise ValueError(
                f"weight_sync_senders {senders}: the trainer has {world} rank(s), and each sender is one of them"
            )
        sender = self._sync_sender(groups) if self.rank < senders else None
        meta = list(meta) if meta is not None else self.weight_meta()
        if sender is not None:
            sender.start(meta, int(groups.get("bucket_bytes") or DEFAULT_BUCKET_BYTES), self.device)
        module_names = self._streamable(meta)
        if module_names is not None:
            state = self.model.state_dict()
            for i, name in enumerate(module_names):
                full = _unsharded(state[name])  # collective: every rank gathers every tensor, in announced order
                if sender is not None and sender.owns(i):
                    sender.push(i, full)
                del full
        else:
            sd = self.sync_state_dict(keep=sender is not None)
            if sender is not None:
                assert sd is not None
                for i, (name, _, _) in enumerate(meta):
                    if sender.owns(i):
                        sender.push(i, sd[name])
        if sender is not None:
            sender.finish()
        return time.perf_counter() - t0

    def _streamable(self, meta: Sequence[TensorMeta]) -> list[str] | None:
        """The module's state-dict name of each announced tensor, where every one is a module tensor as it is (no
        LoRA merge, no pipeline stage split); None otherwise."""
        if getattr(self, "pipeline", None) is not None or self.lora:
            return None
        names = self.checkpoint_names
        module = {names.outward(k): k for k in self.model.state_dict()}
        found = [module.get(name) for name, _, _ in meta]
        return None if any(n is None for n in found) else found  # type: ignore[return-value]

    def _sync_sender(self, groups: SyncGroups) -> SyncSender:
        """This rank's sender of ``groups``, joined on first use (a new formation has new ports)."""
        key = tuple(tuple(a) for a in groups["addresses"])
        if self._sender is None or getattr(self, "_sender_groups", None) != key:
            self.close_weight_sync()
            self._sender = SyncSender.of(groups, self.rank)
            self._sender_groups = key
        return self._sender

    def sync_addresses(self, count: int) -> list[list[Any]]:
        """This rank's IP and ``count`` distinct ports free on its node, for the sync groups it will host."""
        import socket

        import ray

        socks = [socket.socket() for _ in range(count)]
        try:
            for sock in socks:
                sock.bind(("", 0))
            ports = [sock.getsockname()[1] for sock in socks]
        finally:
            for sock in socks:
                sock.close()
        host = ray.util.get_node_ip_address()
        return [[host, port] for port in ports]

    def close_weight_sync(self) -> None:
        """Leave the weight-sync groups, if this rank joined any."""
        if self._sender is not None:
            self._sender.close()
        self._sender, self._sender_key = None, None
        self._sender_groups = None


def _share_from_rank0(
    weights: dict[str, torch.Tensor] | None,
    keep: bool,
    rank: int,
    meta: dict[str, tuple[tuple[int, ...], str]],
    device: torch.device,
) -> dict[str, torch.Tensor] | None:
    """Rank 0's `weights` on every rank that keeps a copy (collective over the trainer group: who keeps is
    exchanged first, then rank 0 sends each tensor to each keeper, in `meta`'s order and shapes); None where
    `keep` is False. Everything travels as tensors on `device`, the group's (nccl and hccl take no host tensors)."""
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=device)
    flags[rank] = int(keep)
    dist.all_reduce(flags)
    keepers = [dst for dst, wants in enumerate(flags.tolist()) if wants and dst != 0]
    if rank == 0:
        assert weights is not None
        for dst in keepers:
            for name in meta:
                dist.send(weights[name].to(device), dst=dst)
        return weights if keep else None
    if not keep:
        return None
    out = {}
    for name, (shape, dtype) in meta.items():
        buf = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=device)
        dist.recv(buf, src=0)
        out[name] = buf.to("cpu")
    return out


def _unsharded(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor: gathered over its mesh (a one-device mesh holds it already), from the
    device where offloaded shards live on the host."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return value
    mesh = value.device_mesh
    if mesh.size() == 1:
        return value.to_local()
    if value.device.type != mesh.device_type:  # parameter offload: shards on the host, collectives on the device
        local = value.to_local().to(mesh.device_type)
        value = DTensor.from_local(
            local, mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )
    return value.full_tensor()


def _base_tensors(base: Path, keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """`keys` read from the base folder's safetensors files (only those tensors are loaded)."""
    from safetensors import safe_open

    wanted, out = set(keys), {}
    for path in sorted(base.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name in wanted:
                    out[name] = handle.get_tensor(name)
    return out


def copy_tokenizer_files(src: str, dst: Path) -> None:
    """Copy tokenizer and generation files so ``dst`` is a complete model folder for vLLM."""
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config", "chat_template")):
            shutil.copy2(os.path.join(src, name), dst / name)
