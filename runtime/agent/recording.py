"""The engine client the OpenAI app is given: vLLM's own, with every session call's tokens recorded on the way out.

vLLM's serving layer renders a chat or completion request to token ids and calls `engine_client.generate`;
what comes back (`RequestOutput`) holds the prompt ids, the sampled ids, their log-probs and the weight-version
spans of the tokens (vLLM labels each output token with the version set by `update_weight_version`). Recording
here, rather than parsing HTTP responses, takes those numbers exactly as the engine produced them, including
the versions no HTTP response carries, whatever the client asked to see. A session call always asks the engine
for the sampled token's log-prob; the response shows it only when the client asked. On an engine that captures
its routers' choices (rollout routing replay), the client is given `routing` and files each call's routing with
it once the call has finished; otherwise nothing more is asked of the engine.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from rlc.runtime.agent.sessions import SessionTable
from rlc.runtime.agent.trajectory import Call
from rlc.runtime.rollout.versions import token_versions

__all__ = ["FetchRouting", "RecordingClient", "call_from_output", "token_versions"]

#: The routing of each completion of a finished `RequestOutput` (`routing_capture.output_routing` of the engine).
FetchRouting = Callable[[Any], Awaitable[list[Any]]]


def call_from_output(output: Any, version: int, seconds: float) -> Call:
    """The `Call` of a finished `RequestOutput` with one completion."""
    comp = output.outputs[0]
    ids = tuple(int(t) for t in comp.token_ids)
    lps = tuple(float(step[tok].logprob) for tok, step in zip(ids, comp.logprobs or [], strict=True))
    if len(lps) != len(ids):
        raise RuntimeError(f"engine returned {len(lps)} log-probs for {len(ids)} tokens")
    return Call(
        prompt_ids=tuple(int(t) for t in output.prompt_token_ids or ()),
        output_ids=ids,
        logprobs=lps,
        versions=tuple(token_versions(getattr(comp, "weight_versions", None), len(ids), version)),
        finish_reason=comp.finish_reason,
        model_s=seconds,
    )


class RecordingClient:
    """Delegates everything to vLLM's `AsyncLLM`; `generate` of a session call also records it."""

    def __init__(self, engine: Any, sessions: SessionTable, version: Any, routing: FetchRouting | None = None) -> None:
        self._engine = engine
        self._sessions = sessions
        self._version = version  # a callable: the engine's current policy version
        self._routing = routing  # None: the engine captures no routing

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any
    ) -> AsyncGenerator:
        session = self._sessions.for_request(request_id)
        if session is None:
            async for out in self._engine.generate(prompt, sampling_params, request_id, *args, **kwargs):
                yield out
            return
        if sampling_params.logprobs is None:
            sampling_params.logprobs = 0  # the sampled token's log-prob: the behaviour policy
        started, version = time.monotonic(), self._version()
        session.running.add(request_id)
        call: Call | None = None
        try:
            last = None
            async for out in self._engine.generate(prompt, sampling_params, request_id, *args, **kwargs):
                last = out
                yield out
            if last is not None and last.finished and last.outputs and last.outputs[0].finish_reason != "abort":
                call = call_from_output(last, version, time.monotonic() - started)
                if self._routing is not None:  # session calls have n = 1 (the router refuses others)
                    call = dataclasses.replace(call, routed_experts=(await self._routing(last))[0])
        finally:
            session.running.discard(request_id)
        if call is not None:
            session.calls.append(call)
