"""Parameters reach the trainer's device shard by shard: nothing moves the whole loaded model before FSDP2 (and
TP / EP) shard it, since a large MoE model does not fit one device unsharded. On cpu the move is a no-op, so the
test records the order of calls: a `Module.to` on a module still holding unsharded parameters, after the model is
loaded, is the whole-model move this forbids."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow


def test_no_module_moves_whole_before_it_is_sharded(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.fsdp as fsdp
    from torch.distributed.tensor import DTensor

    from rlc.runtime.train import trainer as trainer_module

    events: list[tuple[str, int, int]] = []  # (call, module id, unsharded elements)
    loaded = False
    real_to, real_shard, real_install = (
        torch.nn.Module.to,
        fsdp.fully_shard,
        trainer_module.install_packed_linear_attention,
    )

    def to(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if loaded:
            plain = sum(p.numel() for p in self.parameters() if not isinstance(p, DTensor))
            events.append(("to", id(self), plain))
        return real_to(self, *args, **kwargs)

    def shard(module, *args, **kwargs):  # type: ignore[no-untyped-def]
        events.append(("shard", id(module), sum(p.numel() for p in module.parameters())))
        return real_shard(module, *args, **kwargs)

    def install(model, platform):  # type: ignore[no-untyped-def]
        nonlocal loaded
        loaded = True  # the trainer's first step after loading the model on the host
        return real_install(model, platform)

    monkeypatch.setattr(torch.nn.Module, "to", to)
    monkeypatch.setattr(fsdp, "fully_shard", shard)
    monkeypatch.setattr(trainer_module, "install_packed_linear_attention", install)
    w = trainer_module.TrainerWorker(0, 1, None, 0, str(tiny_model_dir), "cpu", {"packing": True})
    try:
        assert loaded
        moved_whole = [e for e in events if e[0] == "to" and e[2] > 0]
        assert not moved_whole, moved_whole
        sharded = [e for e in events if e[0] == "shard"]
        layers = len(w.model.model.layers)
        assert len(sharded) == layers + 1 and sharded[-1][1] == id(w.model)  # one unit a layer, then the root
        assert all(p.device == w.device and isinstance(p, DTensor) for p in w.model.parameters())
    finally:
        w.shutdown()
