"""The ASGI layer in front of vLLM's OpenAI app: session keys, per-trajectory budgets, and the sampling RL needs.

Every generation call must carry an open session's key (`Authorization: Bearer <key>`); the router tags it with
a request id naming the session (so the recording client files it there), caps `max_tokens` at the turn budget,
refuses the call past the turn budget or the episode's wall clock, and sets the sampling the trainer assumes
(the plan's temperature and top-p; penalties and biases removed), because behaviour log-probs must come from
the distribution the trainer scores. Errors are OpenAI-shaped JSON, so clients raise their usual exceptions; a
prompt over the context gets `context_length_exceeded` and ends the trajectory truncated.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rlc.runtime.agent.sessions import Session, SessionTable

__all__ = ["GENERATION_PATHS", "SessionRouter", "openai_error"]

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
OPEN_PATHS = ("/health", "/ping")
KEYED_PATHS = ("/v1/models", "/tokenize", "/detokenize")
#: Request fields that would move the sampled distribution away from the one the trainer scores.
DROPPED_FIELDS = (
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "bad_words",
    "allowed_token_ids",
    "min_tokens",
    "use_beam_search",
    "seed",
)
_CONTEXT_WORDS = ("maximum context length", "context length", "too long", "max_model_len")


def openai_error(status: int, message: str, code: str, kind: str = "invalid_request_error") -> tuple[int, bytes]:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return status, json.dumps(body).encode()


async def _reply(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name.lower() == b"authorization":
            text = value.decode("latin-1")
            return text[7:].strip() if text.lower().startswith("bearer ") else None
    return None


class SessionRouter:
    """Wraps the OpenAI app; see the module docstring."""

    def __init__(self, app: Any, sessions: SessionTable) -> None:
        self.app = app
        self.sessions = sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if path not in GENERATION_PATHS and path not in KEYED_PATHS:
            await _reply(send, *openai_error(404, f"{path} is not served to agents", "not_found"))
            return
        session = self.sessions.get(_bearer(scope) or "")
        if session is None:
            await _reply(
                send,
                *openai_error(401, "unknown or closed session key", "invalid_api_key", "authentication_error"),
            )
            return
        if path in KEYED_PATHS or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        await self._generate(scope, receive, send, session)

    def _refuse(self, session: Session, request: dict[str, Any]) -> tuple[int, bytes] | None:
        limits = self.sessions.limits
        if request.get("stream"):
            return openai_error(400, "streaming is not supported by this endpoint; call without stream", "unsupported")
        if int(request.get("n") or 1) != 1:
            return openai_error(400, "n must be 1: each call is one step of one trajectory", "unsupported")
        if session.started >= limits.max_turns:
            session.truncated = "turns"
            return openai_error(
                400,
                f"this trajectory has used its {limits.max_turns} model calls (max_turns)",
                "context_length_exceeded",
            )
        if time.monotonic() >= session.deadline:
            session.truncated = session.truncated or "timeout"
            return openai_error(408, "this trajectory is past its timeout_s", "timeout")
        return None

    def _rewrite(self, request: dict[str, Any]) -> dict[str, Any]:
        limits = self.sessions.limits
        out = {k: v for k, v in request.items() if k not in DROPPED_FIELDS}
        for key in ("max_tokens", "max_completion_tokens"):
            if out.get(key) is not None:
                out[key] = max(1, min(int(out[key]), limits.max_tokens_per_turn))
        if out.get("max_tokens") is None and out.get("max_completion_tokens") is None:
            out["max_tokens"] = limits.max_tokens_per_turn
        out["temperature"] = limits.temperature
        out["top_p"] = limits.top_p
        return out

    async def _generate(self, scope: Scope, receive: Receive, send: Send, session: Session) -> None:
        raw = await _read_body(receive)
        try:
            request = json.loads(raw or b"{}")
            if not isinstance(request, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            await _reply(send, *openai_error(400, f"the request body is not a JSON object: {exc}", "invalid_json"))
            return
        refusal = self._refuse(session, request)
        if refusal is not None:
            session.refused += 1
            await _reply(send, *refusal)
            return
        body = json.dumps(self._rewrite(request)).encode()
        request_id = session.next_request_id()
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in (b"x-request-id", b"content-length")]
        headers += [(b"x-request-id", request_id.encode()), (b"content-length", str(len(body)).encode())]
        inner = {**scope, "headers": headers}
        sent = False

        async def replay() -> dict[str, Any]:
            # The rewritten body once, then the real connection's events: vLLM cancels a request whose client
            # disconnects, which must mean the agent's connection, not the end of our replay.
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        captured: list[dict[str, Any]] = []

        async def capture(message: dict[str, Any]) -> None:
            captured.append(message)

        remaining = session.deadline - time.monotonic()
        try:
            await asyncio.wait_for(self.app(inner, replay, capture), timeout=max(0.001, remaining))
        except TimeoutError:
            session.truncated = session.truncated or "timeout"
            await _reply(send, *openai_error(408, "this trajectory is past its timeout_s", "timeout"))
            return
        await self._forward(send, captured, session)

    async def _forward(self, send: Send, captured: list[dict[str, Any]], session: Session) -> None:
        """Send the app's response on, turning vLLM's too-long-prompt error into `context_length_exceeded`."""
        start = next((m for m in captured if m["type"] == "http.response.start"), None)
        if start is None:
            await _reply(send, *openai_error(500, "the engine returned no response", "engine_error", "server_error"))
            return
        if start["status"] == 400:
            body = b"".join(m.get("body", b"") for m in captured if m["type"] == "http.response.body")
            text = body.decode("utf-8", "replace")
            if any(word in text.lower() for word in _CONTEXT_WORDS):
                session.truncated = "context"
                message = _error_message(text) or "the prompt exceeds the context"
                await _reply(send, *openai_error(400, message, "context_length_exceeded"))
                return
        for message in captured:
            await send(message)


def _error_message(text: str) -> str | None:
    try:
        data = json.loads(text)
    except ValueError:
        return None
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or "")
    return str(data.get("message")) if isinstance(data, dict) and data.get("message") else None
