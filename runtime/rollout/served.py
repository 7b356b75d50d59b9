"""A rollout engine that serves vLLM's OpenAI-compatible app from inside its Ray actor, for agentic rollouts.

`ServedEngine` builds vLLM's `AsyncLLM` from the plan's engine arguments, mounts vLLM's own OpenAI app
(`build_app` + `init_app_state`) behind rlc's `SessionRouter`, and serves it with uvicorn on the actor's event
loop, bound to its node's address. Agents call `/v1/chat/completions` and `/v1/completions` with a session key;
the `RecordingClient` files each call's tokens, log-probs and per-token policy versions under that session.

Weight updates happen while it serves: pause (in-flight calls freeze), load the new weights through the same
worker extension as `RolloutEngine` (`collective_rpc`), drop every cached KV block, including those of the
frozen calls so they are prefilled again under the new weights, label the version, resume. A call that spans an
update carries both versions, token by token. The method names match `RolloutEngine`'s, so the controller's
weight-sync paths drive either.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rlc.runtime.agent.recording import RecordingClient
from rlc.runtime.agent.router import SessionRouter
from rlc.runtime.agent.sessions import Limits, SessionRecord, SessionTable

from .engine import NotSupported, engine_setup
from .weight_sync import DEFAULT_BUCKET_BYTES, TensorMeta

__all__ = ["ServedEngine", "served_engine_actor"]

#: Seconds a weight update may keep generation paused before it is reported as stuck.
UPDATE_TIMEOUT_S = 600
#: Seconds a weight-sync group join may take (the trainer joins as soon as it sends).
JOIN_TIMEOUT_S = 300
#: Seconds the server keeps an idle connection open.
KEEP_ALIVE_S = 300


def _node_address() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # not in Ray (tests drive the class in-process)
        pass
    return "127.0.0.1"


def app_args(model: str, served_name: str, tool_call_parser: str | None, max_logprobs: int) -> argparse.Namespace:
    """vLLM's own `vllm serve` argument namespace for the app (not the engine, which is built separately)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["--model", model, "--served-model-name", served_name, "--disable-log-stats"]
    argv += ["--max-logprobs", str(max_logprobs), "--disable-uvicorn-access-log"]
    if tool_call_parser:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser]
    return make_arg_parser(FlexibleArgumentParser()).parse_args(argv)


class ServedEngine:
    """AsyncLLM + OpenAI app + session router; a plain class, so tests can run it on their own event loop."""

    def __init__(
        self,
        engine_args: Mapping[str, Any],
        platform: str = "cpu",
        env: Mapping[str, str] | None = None,
        version: int = 0,
        agent: Mapping[str, Any] | None = None,
        sampling: Mapping[str, Any] | None = None,
    ) -> None:
        self.platform, args = engine_setup(engine_args, platform, env)
        if args.get("enable_lora"):
            raise NotSupported("the agent endpoint serves merged weights; LoRA adapters are not served to agents")
        self.engine_args = args
        self.version = int(version)
        agent = dict(agent or {})
        sampling = dict(sampling or {})
        self.served_name = str(agent.get("served_model_name") or args["model"])
        self.tool_call_parser = agent.get("tool_call_parser")
        self.limits = Limits(
            max_turns=int(agent.get("max_turns", 8)),
            max_tokens_per_turn=int(agent.get("max_tokens_per_turn", 1024)),
            max_context_tokens=int(agent.get("max_context_tokens", args.get("max_model_len") or 0)),
            temperature=float(sampling.get("temperature", 1.0)),
            top_p=float(sampling.get("top_p", 1.0)),
        )
        self.sessions = SessionTable(self.limits)
        self.llm: Any = None
        self.base_url = ""
        self.startup_s = 0.0
        self._start: asyncio.Task | None = None
        self._server: Any = None
        self._serving: asyncio.Task | None = None
        self._update_lock: asyncio.Lock | None = None
        # This actor runs calls concurrently and Ray does not keep an async actor's calls in submission order,
        # where RolloutEngine runs them in order: a broadcast update sent right after init_sync_group may start
        # first, so it waits (bounded) until the group is joined.
        self._joined: asyncio.Event | None = None

    # ---------------------------------------------------------------- start and serve

    async def ready(self) -> float:
        """Start the engine and the server once (tens of seconds); returns the seconds it took."""
        if self._start is None:
            self._start = asyncio.ensure_future(self._start_serving())
        await self._start
        return self.startup_s

    async def _start_serving(self) -> None:
        import uvicorn
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.v1.engine.async_llm import AsyncLLM

        t0 = time.perf_counter()
        self._update_lock = asyncio.Lock()
        self._joined = asyncio.Event()
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_args))
        await self.llm.update_weight_version(str(self.version))
        client = RecordingClient(self.llm, self.sessions, lambda: self.version)
        args = app_args(
            str(self.engine_args["model"]),
            self.served_name,
            self.tool_call_parser,
            int(self.engine_args.get("max_logprobs") or 1),
        )
        tasks = await self.llm.get_supported_tasks()
        app = build_app(args, tasks, self.llm.model_config)
        await init_app_state(client, app.state, args, tasks)  # type: ignore[arg-type]
        host = _node_address()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        port = sock.getsockname()[1]
        # Keep-alive well past the clients' (httpx: 5 s): a server closing an idle connection as a client reuses
        # it fails that call; agents idle for a whole training step between turns.
        config = uvicorn.Config(
            SessionRouter(app, self.sessions),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=KEEP_ALIVE_S,
            backlog=4096,
        )
        self._server = uvicorn.Server(config)
        self._serving = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        for _ in range(500):  # up to 5 s for uvicorn to listen
            if self._server.started:
                break
            if self._serving.done():
                self._serving.result()  # raises what stopped it
            await asyncio.sleep(0.01)
        else:
            raise RuntimeError(f"the agent endpoint on {host}:{port} did not start listening within 5 s")
        self.base_url = f"http://{host}:{port}/v1"
        self.startup_s = time.perf_counter() - t0

    def endpoint(self) -> str:
        """The base URL agents call (…/v1)."""
        return self.base_url

    # ---------------------------------------------------------------- sessions

    def open_sessions(self, keys: Sequence[str], timeout_s: float) -> int:
        """Admit calls with these keys for `timeout_s` seconds from now; returns how many sessions are open."""
        for key in keys:
            self.sessions.open(key, timeout_s)
        return len(self.sessions)

    async def close_sessions(self, keys: Sequence[str]) -> list[SessionRecord | None]:
        """Stop admitting calls with these keys, abort their running calls, and return what each recorded."""
        records = []
        for key in keys:
            session = self.sessions.get(key)
            running = list(session.running) if session is not None else []
            records.append(self.sessions.close(key))
            for request_id in running:
                with contextlib.suppress(Exception):
                    await self.llm.abort(request_id)
        return records

    # ---------------------------------------------------------------- weight updates while serving

    async def _update(self, method: str, args: tuple[Any, ...], version: int) -> float:
        """Pause, run `method` in every worker (it reloads weights), drop cached KV, label `version`, resume."""
        assert self._update_lock is not None, "engine not started"
        t0 = time.perf_counter()
        async with self._update_lock:
            await self.llm.pause_generation(mode="keep", clear_cache=False)
            try:
                await asyncio.wait_for(self.llm.collective_rpc(method, args=args), UPDATE_TIMEOUT_S)
                # Frozen calls are preempted and prefilled again under the new weights.
                await self.llm.reset_prefix_cache(reset_running_requests=True)
                await self.llm.update_weight_version(str(int(version)))
                self.version = int(version)
            finally:
                await self.llm.resume_generation()
        return time.perf_counter() - t0

    async def update_weights_from_path(self, path: str, version: int) -> float:
        """Reload weights from a safetensors file or directory; returns seconds taken."""
        return await self._update("load_from_safetensors", (str(path),), version)

    async def update_weights_broadcast(
        self, meta: Sequence[TensorMeta], version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> float:
        """Receive a broadcast state dict announced by `meta` (concurrently with the trainer's send) and load it."""
        assert self._joined is not None, "engine not started"
        try:
            await asyncio.wait_for(self._joined.wait(), JOIN_TIMEOUT_S)
        except TimeoutError:
            raise RuntimeError(f"no weight-sync group joined within {JOIN_TIMEOUT_S} s of a broadcast") from None
        meta = [(n, tuple(s), str(d)) for n, s, d in meta]
        return await self._update("receive_broadcast", (meta, bucket_bytes), version)

    async def init_sync_group(
        self, host: str, port: int, rank: int, world_size: int, backend: str | None = None
    ) -> int:
        """Join the trainer's weight-sync group (blocks until the trainer joins); returns this engine's first rank."""
        assert self._joined is not None, "engine not started"
        backend = backend or self.platform.dist_backend
        self._joined.clear()
        ranks = await asyncio.wait_for(
            self.llm.collective_rpc("init_sync_group", args=(host, port, rank, world_size, backend)), JOIN_TIMEOUT_S
        )
        self._joined.set()
        return min(ranks)

    async def close_sync_group(self) -> None:
        if self._joined is not None:
            self._joined.clear()
        await self.llm.collective_rpc("close_sync_group")

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.llm.reset_prefix_cache())

    def update_lora_adapter(self, path: str, version: int) -> float:
        raise NotSupported("the agent endpoint serves merged weights; LoRA adapters are not served to agents")

    async def prompt_logprobs(self, token_ids_list: Sequence[Sequence[int]]) -> list[list[float]]:
        """Forward-only scoring, as `RolloutEngine.prompt_logprobs`: log p(x_t | x_<t) for t ≥ 1 (temperature 1),
        for the post-sync check (`runtime/sync_check`). Runs beside the agents' calls."""
        from vllm import SamplingParams

        assert self.llm is not None, "engine not started"
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        result = []
        for n, ids in enumerate(token_ids_list):
            final = None
            request_id = f"rlc-probe-{self.version}-{n}-{time.monotonic_ns()}"
            async for out in self.llm.generate({"prompt_token_ids": list(ids)}, params, request_id):
                final = out
            steps = (final.prompt_logprobs if final is not None else None) or []
            result.append([float(step[tok].logprob) for tok, step in zip(ids[1:], steps[1:], strict=True)])
        return result

    # ---------------------------------------------------------------- status

    def get_version(self) -> int:
        return self.version

    def spec_decode_metrics(self) -> dict[str, float]:
        return {}  # not read from the async engine yet

    def healthy(self) -> bool:
        """Whether vLLM's engine core and the server still run."""
        if self.llm is None:
            return self._start is None or not self._start.done() or self._start.exception() is None
        return not bool(getattr(self.llm, "errored", False)) and not (self._serving and self._serving.done())

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    async def shutdown(self) -> None:
        """Stop serving and the engine-core process."""
        if self._server is not None:
            self._server.should_exit = True
            if self._serving is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._serving, 10)
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown()


def served_engine_actor(**options: Any) -> Any:
    """`ServedEngine` as an async Ray actor: uvicorn and every method share the actor's event loop, so calls run
    concurrently (a weight update, session bookkeeping and serving all at once)."""
    import ray

    options.setdefault("num_cpus", 1)
    options.setdefault("max_concurrency", 1000)
    return ray.remote(ServedEngine).options(**options)
