"""Trainer checkpoints: weights as an HF folder (or the LoRA adapter) plus sharded optimizer state.

The weights are written whole by rank 0 (so a checkpoint is also a model `rlc export` and vLLM can read);
the optimizer state is saved sharded with torch.distributed.checkpoint under the parameters' model names, so
a checkpoint restores into the same layout. Every file a rank writes is fsynced before it returns (the
optimizer shards by torch itself), so the driver's COMPLETE marker never precedes the data on disk.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint import fsync_tree, full_after_failed_write, write_synced
from . import lora as lora_lib

__all__ = ["TrainerCheckpoints"]


class TrainerCheckpoints:
    """Mixin of `TrainerWorker`: collective save and restore."""

    rank: int
    model: Any
    optimizer: Any
    lora: dict[str, Any] | None
    step: int

    def save_checkpoint(self, ckpt_dir: str) -> str:
        """Weights as an HF folder (rank 0) and sharded optimizer state (every rank), fsynced. Collective.

        A full disk is raised as an OSError with its errno (`rlc run` names it), on every rank: rank 0's failed
        weight write is shared before the optimizer save, where the other ranks would otherwise wait for it. A write
        that failed without saying why, on a filesystem left (nearly) full, is a full disk too
        (`full_after_failed_write`: torch's "unexpected pos").
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        root = Path(ckpt_dir)
        failed: Exception | None = None
        try:
            if self.lora:  # the base never changes: the adapter is the checkpoint (`rlc export` folds it in)
                self.save_adapter(str(root / "adapter"))  # type: ignore[attr-defined]
            else:
                self.save_weights(str(root / "hf"), export=True)  # type: ignore[attr-defined]
            if self.rank == 0:
                write_synced(root / "trainer_state.json", json.dumps({"step": self.step}, sort_keys=True))
                fsync_tree(root / ("adapter" if self.lora else "hf"))
        except Exception as exc:
            failed = exc
        _raise_together(failed, root)
        optim = get_optimizer_state_dict(self.model, self.optimizer.optimizers)
        try:  # the shards are fsynced by torch (FileSystemWriter's sync_files)
            dcp.save({"optim": optim}, checkpoint_id=str(self._optim_dir(root)), process_group=self._optim_group())
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            full = full_after_failed_write(exc, root)
            if full is None:
                raise
            raise _located(full, root) from exc
        dist.barrier()
        return str(root)

    def _optim_dir(self, root: Path) -> Path:
        """Where the sharded optimizer state goes. Pipeline stages each save their own (their parameter groups name
        different layers, and one shared folder would keep only the first stage's)."""
        pipe = getattr(self, "pipeline", None)
        return root / "optim" if pipe is None else root / "optim" / f"stage-{pipe.stage}"

    def _optim_group(self) -> Any:
        """The ranks that save one optimizer folder together: every rank, or one pipeline stage's (its data, context
        and tensor-parallel ranks: TP peers hold different slices of the same weights, which one folder must hold
        together; made on first use, by every rank, as checkpoints are collective)."""
        pipe = getattr(self, "pipeline", None)
        if pipe is None:
            return None
        group = getattr(self, "_stage_group", None)
        if group is None:
            world = self.mesh.world  # type: ignore[attr-defined]
            inner = tuple(name for name in world.mesh_dim_names if name != "pp")
            group = world[inner]._flatten("stage").get_group()
            self._stage_group = group
        return group

    def load_checkpoint(self, ckpt_dir: str) -> int:
        """Restore weights, optimizer state and step from ``save_checkpoint``'s folder. Collective."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from ..rollout.weight_sync import iter_safetensors

        root = Path(ckpt_dir)
        if self.lora:
            full, _ = lora_lib.read_adapter(root / "adapter")
        else:
            full = self.checkpoint_names.inward_dict(dict(iter_safetensors(root / "hf")))  # type: ignore[attr-defined]
        set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True, strict=False))
        optimizers = self.optimizer.optimizers
        state = {"optim": get_optimizer_state_dict(self.model, optimizers)}
        dcp.load(state, checkpoint_id=str(self._optim_dir(root)), process_group=self._optim_group())
        set_optimizer_state_dict(self.model, optimizers, state["optim"])
        if self.optimizer.offload:
            self.optimizer.move_state(torch.device("cpu"))
        self.step = int(json.loads((root / "trainer_state.json").read_text())["step"])
        return self.step


def _located(full: OSError, root: Path) -> OSError:
    """A disk-full error that names where it happened (the checkpoint's folder when the library did not say)."""
    return OSError(full.errno, full.strerror or "No space left on device", full.filename or str(root))


def _raise_together(failed: Exception | None, root: Path) -> None:
    """Raise on every rank when a rank's write failed (collective): a full disk as an OSError, anything else
    as itself on the rank it happened on and as a RuntimeError naming that rank on the others. The summaries are
    a few words each, exchanged as objects: torch serialises them into a byte tensor on the group's device (the
    current CUDA / NPU device under nccl / hccl, the host under gloo), so this runs on every backend rlc uses."""
    summary: tuple[int | None, str, str | None] | None = None
    full = full_after_failed_write(failed, root) if failed is not None else None
    if full is not None:
        full = _located(full, root)
        summary = (full.errno, full.strerror, full.filename)
    elif failed is not None:
        summary = (None, f"{type(failed).__name__}: {failed}", None)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, summary)
    if full is not None:
        raise full from failed
    if failed is not None:
        raise failed
    for rank, other in enumerate(gathered):
        if other is not None:
            code, text, filename = other
            if code is not None:
                raise OSError(code, text, filename)
            raise RuntimeError(f"trainer rank {rank} could not write the checkpoint's weights ({text})")
