"""The OpenAI-compatible endpoint a rollout engine serves to agents, from inside its Ray actor.

`AgentServer` mounts vLLM's own OpenAI app (`build_app` + `init_app_state`) on the engine's `AsyncLLM`, behind
rlc's `SessionRouter`, and serves it with uvicorn on the actor's event loop, bound to its node's address. Agents
call `/v1/chat/completions` and `/v1/completions` with a session key; the `RecordingClient` files each call's
tokens, log-probs and per-token policy versions under that session, and, where the engine captures its routers'
choices (`routing_capture`), each call's routing. Weight updates are the engine's (`RolloutEngine`): a call that
spans one carries both versions, token by token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlc.runtime.agent.recording import FetchRouting, RecordingClient
from rlc.runtime.agent.router import SessionRouter
from rlc.runtime.agent.sessions import Limits, SessionRecord, SessionTable

__all__ = ["AgentServer", "node_address"]

#: Seconds the server keeps an idle connection open.
KEEP_ALIVE_S = 300


def node_address() -> str:
    """This node's address in the Ray cluster (loopback outside Ray: tests drive the engine in-process)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # not in Ray
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


class AgentServer:
    """The session table and the OpenAI app of one engine; `start` once its `AsyncLLM` runs."""

    def __init__(
        self,
        engine_args: Mapping[str, Any],
        agent: Mapping[str, Any],
        sampling: Mapping[str, Any],
        routing_capture: str | None = None,
    ) -> None:
        """``routing_capture``: the engine's ("rlc" or "vllm"), or None where it captures no routing."""
        self.engine_args = dict(engine_args)
        self.routing_capture = routing_capture
        self.served_name = str(agent.get("served_model_name") or engine_args["model"])
        self.tool_call_parser = agent.get("tool_call_parser")
        self.limits = Limits(
            max_turns=int(agent.get("max_turns", 8)),
            max_tokens_per_turn=int(agent.get("max_tokens_per_turn", 1024)),
            max_context_tokens=int(agent.get("max_context_tokens", engine_args.get("max_model_len") or 0)),
            temperature=float(sampling.get("temperature", 1.0)),
            top_p=float(sampling.get("top_p", 1.0)),
        )
        self.sessions = SessionTable(self.limits)
        self.base_url = ""
        self._server: Any = None
        self._serving: asyncio.Task | None = None

    async def start(self, llm: Any, version: Callable[[], int]) -> None:
        """Serve the app on this node's address; returns once uvicorn listens (or raises within 5 s)."""
        import uvicorn
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app

        client = RecordingClient(llm, self.sessions, version, self._routing(llm))
        args = app_args(
            str(self.engine_args["model"]),
            self.served_name,
            self.tool_call_parser,
            int(self.engine_args.get("max_logprobs") or 1),
        )
        tasks = await llm.get_supported_tasks()
        app = build_app(args, tasks, llm.model_config)
        await init_app_state(client, app.state, args, tasks)  # type: ignore[arg-type]
        host = node_address()
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

    def _routing(self, llm: Any) -> FetchRouting | None:
        """How the recording client asks the engine for a finished call's routing; None keeps it from asking."""
        if self.routing_capture is None:
            return None
        from rlc.runtime.rollout.routing_capture import output_routing

        return functools.partial(output_routing, llm, capture=self.routing_capture)

    @property
    def serving(self) -> bool:
        return self._serving is not None and not self._serving.done()

    def open_sessions(self, keys: Sequence[str], timeout_s: float) -> int:
        """Admit calls with these keys for `timeout_s` seconds from now; returns how many sessions are open."""
        for key in keys:
            self.sessions.open(key, timeout_s)
        return len(self.sessions)

    async def close_sessions(self, llm: Any, keys: Sequence[str]) -> list[SessionRecord | None]:
        """Stop admitting calls with these keys, abort their running calls, and return what each recorded."""
        records = []
        for key in keys:
            session = self.sessions.get(key)
            running = list(session.running) if session is not None else []
            records.append(self.sessions.close(key))
            for request_id in running:
                with contextlib.suppress(Exception):
                    await llm.abort(request_id)
        return records

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._serving is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._serving, 10)
