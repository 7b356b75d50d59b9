"""The engine cores of one further node of a rollout engine whose attention data parallelism spans nodes.

vLLM runs such an engine as one front end (the engine's `RolloutEngine` actor, with its own node's cores) and, on
every other node, that node's engine cores started headless: each core binds its TP devices of the node and joins
the front end over vLLM's data-parallel RPC (the handshake address the front end listens on), after which the front
end drives every core alike (requests, pauses, `collective_rpc` weight loads). This actor is that headless start,
placed on the node's planned bundle with the node's planned devices (`launch_request.CoreHost`); the front end
creates it, so it lives and dies with the engine.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from .engine_setup import engine_setup

__all__ = ["EngineCoreHost", "core_host_actor"]


class EngineCoreHost:
    """vLLM's headless engine cores (data-parallel ranks [start_rank, start_rank + cores)) on this node."""

    def __init__(
        self,
        engine_args: Mapping[str, Any],
        platform: str,
        env: Mapping[str, str] | None,
        start_rank: int,
        cores: int,
        address: str,
        rpc_port: int,
    ) -> None:
        """Start the cores; they wait for the front end's handshake, which its own start-up answers."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.utils.network_utils import get_tcp_uri
        from vllm.v1.engine.utils import CoreEngineProcManager
        from vllm.v1.executor import Executor

        from rlc.runtime.raylet_watch import exit_with_raylet

        exit_with_raylet()  # cores whose node's Ray is gone must not hold its devices
        _, args = engine_setup(engine_args, platform, env)
        args.update(
            data_parallel_start_rank=int(start_rank),
            data_parallel_size_local=int(cores),
            data_parallel_address=address,
            data_parallel_rpc_port=int(rpc_port),
        )
        engine = AsyncEngineArgs(**args)
        config = engine.create_engine_config(usage_context=UsageContext.ENGINE_CONTEXT, headless=True)
        self._manager = CoreEngineProcManager(
            local_engine_count=int(cores),
            start_index=int(start_rank),
            local_start_index=0,
            vllm_config=config,
            local_client=False,
            handshake_address=get_tcp_uri(address, int(rpc_port)),
            executor_class=Executor.get_class(config),
            log_stats=not engine.disable_log_stats,
        )
        self._stopped = threading.Event()

    def node_id(self) -> str:
        """The Ray node these cores run on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def watch(self) -> str:
        """Block while every core runs; returns (so the front end sees it) once one has exited or `close` ran."""
        self._manager.monitor_engine_liveness()
        failed = self._manager.failed_proc_name
        if failed and not self._stopped.is_set():
            return f"engine core {failed} on this node exited"
        return ""

    def close(self) -> None:
        """Stop the cores now rather than at garbage collection."""
        self._stopped.set()
        self._manager.shutdown()


def core_host_actor(**options: Any) -> Any:
    """`EngineCoreHost` as a Ray actor with `options` (Ray's: resources, scheduling strategy, runtime env); `watch`
    blocks a thread of its own, so `close` and `node_id` still answer."""
    import ray

    from rlc.runtime.ray_resources import ray_options

    options["max_concurrency"] = 4
    options.setdefault("num_cpus", 0)
    return ray.remote(EngineCoreHost).options(**ray_options(options))
