"""Trainer checkpoints: weights as an HF folder (or the LoRA adapter) plus sharded optimizer state.

The weights are written whole by rank 0 (so a checkpoint is also a model `rlc export` and vLLM can read);
the optimizer state is saved sharded with torch.distributed.checkpoint under the parameters' model names, so
a checkpoint restores into the same layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

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
        """Weights as an HF folder (rank 0) and sharded optimizer state (every rank). Collective."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        root = Path(ckpt_dir)
        if self.lora:  # the base never changes: the adapter is the checkpoint (`rlc export --merged` folds it in)
            self.save_adapter(str(root / "adapter"))  # type: ignore[attr-defined]
        else:
            self.save_weights(str(root / "hf"), export=True)  # type: ignore[attr-defined]
        optim = get_optimizer_state_dict(self.model, self.optimizer.optimizers)
        dcp.save({"optim": optim}, checkpoint_id=str(self._optim_dir(root)), process_group=self._optim_group())
        if self.rank == 0:
            (root / "trainer_state.json").write_text(json.dumps({"step": self.step}, sort_keys=True))
        dist.barrier()
        return str(root)

    def _optim_dir(self, root: Path) -> Path:
        """Where the sharded optimizer state goes. Pipeline stages each save their own (their parameter groups name
        different layers, and one shared folder would keep only the first stage's)."""
        pipe = getattr(self, "pipeline", None)
        return root / "optim" if pipe is None else root / "optim" / f"stage-{pipe.stage}"

    def _optim_group(self) -> Any:
        """The ranks that save one optimizer folder together: every rank, or one pipeline stage's."""
        pipe = getattr(self, "pipeline", None)
        return None if pipe is None else self.mesh.shard_group  # type: ignore[attr-defined]

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
