"""Colocated weights through shared memory (`schedule.weight_sync: shared_memory`): the trainer's writer rank copies
the weights into a segment in /dev/shm, the engine's workers map it and load views of it.

The weight path runs as a run drives it (`WeightPush`, the trainer rank's `save_weights_shared`, the worker
extension's `load_from_shared_memory`) with the Ray calls made in-process and the engine's final copy done into a
transformers model, so it takes seconds; the cpu-colocated end-to-end run checks vLLM serving the result.
"""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
import torch

from rlc.runtime.host_moves import shared_tag, stale_glob
from rlc.runtime.rollout.shared_weights import (
    HEADER_BYTES,
    SharedWeightsExtension,
    SharedWeightsWriter,
    read_header,
    segment_layout,
    segment_name,
)
from rlc.runtime.weight_push import WeightPush

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")


class Worker(SharedWeightsExtension):
    """vLLM's worker as the extension sees it: its reload copies every view into the model's tensors."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.loads = 0

    def _rlc_reload(self, weights) -> None:  # type: ignore[no-untyped-def]
        own = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in weights:
                own[name].copy_(tensor)
        self.loads += 1


class Engine:
    """A rollout engine actor's calls, made in-process (`ray.get` of their results is the identity below)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.version = -1

    def node_ids(self) -> list[str]:
        return ["node-a"]

    def healthy(self) -> bool:
        return True

    def update_weights_from_shared_memory(self, path: str, meta, version: int) -> float:  # type: ignore[no-untyped-def]
        self.worker.load_from_shared_memory(path, meta, version)
        self.version = version
        return 0.0


class Trainer:
    """A trainer group of in-process ranks (`TrainerGroup`'s calls)."""

    def __init__(self, worker) -> None:  # type: ignore[no-untyped-def]
        self.workers = [worker]

    def save_weights_shared(self, *args):  # type: ignore[no-untyped-def]
        return [w.save_weights_shared(*args) for w in self.workers]

    def hosts_info(self) -> list[dict]:
        return [{"rank": 0, "node_id": "node-a", "shm_free": 1 << 40}]

    def weight_meta(self) -> list:
        return self.workers[0].weight_meta()

    def remove_dir(self, path: str, rank: int = 0) -> None:
        self.workers[rank].remove_dir(path)


@pytest.fixture
def in_process_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: refs)
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (list(refs), []))


@pytest.fixture(scope="module")
def trainer_rank(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from rlc.runtime.train.trainer import TrainerWorker

    return TrainerWorker(0, 1, None, 0, str(tiny_model_dir), "cpu", {"lr": 1e-2})


def _train(rank) -> None:  # type: ignore[no-untyped-def]
    batch = {
        "input_ids": [[1, 5, 6, 7, 8, 9], [1, 4, 3, 6, 2]],
        "loss_mask": [[0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1]],
        "behaviour_logprobs": [[0.0, 0, 0, 0, -1.0, -1.0], [0.0, 0, 0, -1.0, -1.0]],
        "advantages": [1.0, -1.0],
    }
    rank.train_step(batch, {"clip": 0.2})


def _ours(run_dir: Path) -> list[Path]:
    return sorted(SHM.glob(Path(stale_glob(shared_tag(run_dir, os.getpid()))).name))


@pytest.mark.slow
def test_a_colocated_sync_leaves_the_engine_holding_the_trainers_weights_and_the_run_end_removes_it(
    trainer_rank, tiny_model_dir: Path, tmp_path: Path, in_process_ray
) -> None:
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    # What a killed run on the same run directory left behind: removed on the first write.
    stale = SHM / f"rlc-{shared_tag(run_dir, 4_000_000)}-r0"
    stale.mkdir()
    (stale / "weights-0.shm").write_bytes(b"\0" * 4096)
    served = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    engine = Engine(Worker(served))
    plan = types.SimpleNamespace(lora=None, schedule=types.SimpleNamespace(weight_sync="shared_memory"))
    said: list[str] = []
    push = WeightPush(plan, Trainer(trainer_rank), types.SimpleNamespace(engines=[engine]), run_dir, said.append, 0)  # type: ignore[arg-type]
    try:
        push.prepare()
        assert "rank 0 → engine(s) 0 via /dev/shm/rlc-shm-" in said[0]
        for version in (1, 2):
            _train(trainer_rank)
            push.sync(version, lambda index: None)
            want = trainer_rank.sync_state_dict()
            got = served.state_dict()
            assert engine.version == version
            assert all(torch.equal(got[name], want[name]) for name in want), "the engine holds other weights"
        assert not stale.exists()
        (folder,) = push.written_dirs.values()
        assert _ours(run_dir) == [Path(folder)]
        # The segment is rewritten in place: one file, one mapping in the worker, across syncs.
        assert [p.name for p in Path(folder).iterdir()] == [Path(segment_name(folder, push.meta())).name]
        assert engine.worker.loads == 2
        mapped = engine.worker._rlc_shm
        # An engine restarted to the weights it had: nothing is written again, the segment is mapped and loaded.
        writes = trainer_rank._shm_writer.version
        push.forget(0)
        push.push_files([0], 2)
        assert trainer_rank._shm_writer.version == writes and engine.worker.loads == 3
        assert engine.worker._rlc_shm[0] == mapped[0]
    finally:
        # The run's end, after a failure too (the controller's `close`): every folder a rank wrote goes.
        for rank, folder in push.written_dirs.items():
            push.trainer.remove_dir(folder, rank)
    assert _ours(run_dir) == []


@pytest.mark.slow
def test_a_rank_left_without_engines_drops_its_segment(trainer_rank, tmp_path: Path) -> None:
    folder = str(SHM / f"rlc-{shared_tag(tmp_path, os.getpid())}-r0")
    meta = trainer_rank.weight_meta()
    try:
        path = trainer_rank.save_weights_shared({0: folder}, meta, 1)[0]
        assert Path(path).is_file()
        assert trainer_rank.save_weights_shared({}, meta, 2) == {}  # its engines moved to another node
        assert not Path(folder).exists() and trainer_rank._shm_writer is None
    finally:
        trainer_rank.remove_dir(folder)


def test_a_segment_refuses_another_version_another_layout_and_a_missing_file(tmp_path: Path) -> None:
    meta = [("a", (3, 5), "float32"), ("b", (7,), "bfloat16"), ("c", (2, 2), "float32")]
    weights = {"a": torch.randn(3, 5), "b": torch.randn(7), "c": torch.randn(2, 2, dtype=torch.float64)}
    offsets, size = segment_layout(meta)
    assert offsets[0] == HEADER_BYTES and all(o % 64 == 0 for o in offsets) and size % 64 == 0
    folder = str(SHM / f"rlc-{shared_tag(tmp_path, os.getpid())}-r0")
    writer = SharedWeightsWriter(folder)
    try:
        path = writer.write(weights, meta, 3)
        model = torch.nn.Module()
        for name, shape, dtype in meta:
            model.register_buffer(name, torch.zeros(shape, dtype=getattr(torch, dtype)))
        worker = Worker(model)
        assert worker.load_from_shared_memory(path, meta, 3) == 3
        # Cast to the announced dtypes on the way in, exactly as a broadcast would.
        assert all(torch.equal(model.get_buffer(n), weights[n].to(getattr(torch, d))) for n, _, d in meta)
        with pytest.raises(RuntimeError, match="holds version 3, not version 4"):
            worker.load_from_shared_memory(path, meta, 4)
        with pytest.raises(RuntimeError, match="another layout"):
            worker.load_from_shared_memory(path, [*meta[:2], ("c", (4,), "float32")], 3)
        with pytest.raises(FileNotFoundError, match="no shared-memory weight segment"):
            worker.load_from_shared_memory(path + ".gone", meta, 3)
        # A leftover under the same name (a killed run's, same driver pid) is taken over, its version cleared first.
        other = SharedWeightsWriter(folder)
        other._open(path, size)
        assert read_header(other._map)[0] == -1
        with pytest.raises(RuntimeError, match="an unfinished write"):
            worker.load_from_shared_memory(path, meta, 3)
        other.write(weights, meta, 5)
        assert worker.load_from_shared_memory(path, meta, 5) == 3
        other.close()
        # A folder removed under a live writer (a cleanup): the next write makes the segment again.
        assert not Path(path).exists()
        assert writer.write(weights, meta, 6) == path and Path(path).is_file()
        assert worker.load_from_shared_memory(path, meta, 6) == 3
    finally:
        writer.close()
    assert not Path(folder).exists()


def test_a_full_dev_shm_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    folder = str(SHM / f"rlc-{shared_tag(tmp_path, os.getpid())}-r0")
    writer = SharedWeightsWriter(folder)
    try:
        with pytest.raises(OSError, match="mount a larger /dev/shm"):
            writer.write({"a": torch.zeros(4)}, [("a", (4,), "float32")], 1)
        assert list(Path(folder).iterdir()) == []
    finally:
        writer.close()
