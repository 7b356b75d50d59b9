"""The trainer's part of a checkpoint: its files are fsynced before it returns, and a full disk on the rank that
writes the weights is raised on every rank as an OSError with its errno (one process over gloo, no Ray)."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from rlc.runtime.train.checkpoints import TrainerCheckpoints  # noqa: E402


class FakeTrainer(TrainerCheckpoints):
    """A one-rank trainer: a linear model and its optimizer; `save_weights` writes a file or fails as told."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.rank, self.step, self.lora = 0, 7, None
        self.model = torch.nn.Linear(4, 2)
        adam = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.model(torch.ones(1, 4)).sum().backward()
        adam.step()
        self.optimizer = SimpleNamespace(optimizers=[adam], offload=False)
        self.fail = fail

    def save_weights(self, out_dir: str, export: bool = False) -> str:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "model.safetensors").write_bytes(b"weights")
        if self.fail is not None:
            raise self.fail
        return str(out / "model.safetensors")


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_trainer_fsyncs_what_it_wrote(one_rank: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[Path] = []
    real = os.fsync

    def fsync(fd: int) -> Any:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    root = tmp_path / "ckpt"
    FakeTrainer().save_checkpoint(str(root))
    root = root.resolve()
    for path in (root / "trainer_state.json", root / "hf" / "model.safetensors", root / "hf"):
        assert path in synced, f"{path.name} is not fsynced by the trainer"
    assert (root / "optim").is_dir()


@pytest.mark.parametrize(
    "fail",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        Exception("Error while serializing: I/O error: No space left on device (os error 28)"),  # safetensors
    ],
)
def test_a_full_disk_is_an_oserror_naming_the_checkpoint(one_rank: None, tmp_path: Path, fail: BaseException) -> None:
    root = tmp_path / "ckpt"
    with pytest.raises(OSError) as caught:
        FakeTrainer(fail=fail).save_checkpoint(str(root))
    assert caught.value.errno == errno.ENOSPC
    assert caught.value.filename == str(root)
    assert not (root / "optim").exists()  # it stopped before the optimizer save the other ranks would wait in
