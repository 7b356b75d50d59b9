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


def _unexpected_pos() -> BaseException:
    """What torch.distributed.checkpoint raises when a shard's write ran out of space (measured on a full tmpfs):
    torch's zip writer reports the short write by position, with no errno."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException(
        "write", {0: (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), [])}
    )


@pytest.mark.parametrize(("free", "full"), [(1 << 20, True), (10 << 30, False)], ids=["full", "room"])
def test_an_optimizer_save_that_fails_on_a_full_disk_without_saying_so_is_a_full_disk(
    one_rank: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, free: int, full: bool
) -> None:
    """torch's "unexpected pos" with the checkpoint's filesystem (nearly) full is raised as ENOSPC naming the
    checkpoint; with room left it is not mistaken for one and stays what it was."""
    import shutil

    import torch.distributed.checkpoint as dcp

    def save(*args: Any, **kwargs: Any) -> None:
        raise _unexpected_pos()

    monkeypatch.setattr(dcp, "save", save)
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100 << 30, (100 << 30) - free, free)
    )
    root = tmp_path / "ckpt"
    with pytest.raises(BaseException) as caught:
        FakeTrainer().save_checkpoint(str(root))
    if full:
        assert isinstance(caught.value, OSError) and caught.value.errno == errno.ENOSPC
        assert caught.value.filename == str(root) and "1.0 MiB free" in caught.value.strerror
    else:
        assert "unexpected pos" in str(caught.value) and not isinstance(caught.value, OSError)


def test_a_really_full_filesystem_under_the_optimizer_save_is_a_full_disk(one_rank: None, tmp_path: Path) -> None:
    """The same on a real 1 MiB tmpfs, where the mount is allowed (root): the weights fit, the optimizer state of a
    512 x 512 layer (2 MiB) does not."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        trainer = FakeTrainer()
        trainer.model = torch.nn.Linear(512, 512)
        adam = torch.optim.AdamW(trainer.model.parameters())
        trainer.model(torch.ones(1, 512)).sum().backward()
        adam.step()
        trainer.optimizer = SimpleNamespace(optimizers=[adam], offload=False)
        with pytest.raises(OSError) as caught:
            trainer.save_checkpoint(str(mount / "ckpt"))
        assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(mount / "ckpt")
    finally:
        subprocess.run(["umount", str(mount)], check=True)
