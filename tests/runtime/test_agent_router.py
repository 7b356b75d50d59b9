"""The session router in front of the OpenAI app, driven with a stand-in app (no engine): keys, budgets, rewrites."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from rlc.runtime.agent.router import SessionRouter
from rlc.runtime.agent.sessions import Limits, SessionTable

LIMITS = Limits(max_turns=2, max_tokens_per_turn=8, max_context_tokens=64, temperature=0.7, top_p=0.9)


class EchoApp:
    """Answers every request with what it received (body and request id), or a chosen status and body."""

    def __init__(self, status: int = 200, body: bytes | None = None, delay: float = 0.0) -> None:
        self.status, self.body, self.delay = status, body, delay
        self.seen: list[dict[str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        message = await receive()
        request = json.loads(message["body"] or b"{}")
        headers = dict(scope["headers"])
        self.seen.append({"request": request, "request_id": headers.get(b"x-request-id", b"").decode()})
        await asyncio.sleep(self.delay)
        body = self.body if self.body is not None else json.dumps(self.seen[-1]).encode()
        await send({"type": "http.response.start", "status": self.status, "headers": []})
        await send({"type": "http.response.body", "body": body})


def call(router: SessionRouter, path: str, body: dict[str, Any] | bytes, key: str | None) -> tuple[int, dict]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if delivered:
            await asyncio.sleep(3600)
        delivered = True
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(router(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(payload)


def router_with(app: EchoApp, timeout_s: float = 60.0) -> tuple[SessionRouter, SessionTable]:
    table = SessionTable(LIMITS)
    table.open("key-1", timeout_s)
    return SessionRouter(app, table), table


def test_unknown_keys_are_refused_with_an_openai_error() -> None:
    router, _ = router_with(EchoApp())
    status, body = call(router, "/v1/chat/completions", {"messages": []}, "not-a-session")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _ = call(router, "/v1/chat/completions", {"messages": []}, None)
    assert status == 401


def test_a_session_call_is_tagged_capped_and_sampled_as_the_trainer_assumes() -> None:
    app = EchoApp()
    router, table = router_with(app)
    request = {"messages": [], "max_tokens": 500, "temperature": 0.0, "top_k": 3, "presence_penalty": 1.0}
    status, body = call(router, "/v1/chat/completions", request, "key-1")
    assert status == 200
    sent = body["request"]
    assert sent["max_tokens"] == 8 and sent["temperature"] == 0.7 and sent["top_p"] == 0.9
    assert "top_k" not in sent and "presence_penalty" not in sent
    session = table.get("key-1")
    assert session is not None and table.for_request("chatcmpl-" + body["request_id"]) is session
    # A call without max_tokens gets the turn budget.
    _, body = call(router, "/v1/completions", {"prompt": "1+"}, "key-1")
    assert body["request"]["max_tokens"] == 8


def test_past_the_turn_budget_calls_get_context_length_exceeded() -> None:
    router, table = router_with(EchoApp())
    for _ in range(2):
        assert call(router, "/v1/completions", {"prompt": "x"}, "key-1")[0] == 200
    status, body = call(router, "/v1/completions", {"prompt": "x"}, "key-1")
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    record = table.close("key-1")
    assert record is not None and record.truncated == "turns" and record.refused == 1


def test_the_engines_too_long_prompt_error_becomes_context_length_exceeded() -> None:
    message = {"error": {"message": "This model's maximum context length is 48 tokens. However, ...", "code": 400}}
    router, table = router_with(EchoApp(400, json.dumps(message).encode()))
    status, body = call(router, "/v1/completions", {"prompt": "x"}, "key-1")
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert "48 tokens" in body["error"]["message"]
    assert table.get("key-1").truncated == "context"  # type: ignore[union-attr]


def test_streaming_n_above_one_and_bad_json_are_refused() -> None:
    router, _ = router_with(EchoApp())
    assert call(router, "/v1/chat/completions", {"stream": True}, "key-1")[0] == 400
    assert call(router, "/v1/chat/completions", {"n": 2}, "key-1")[0] == 400
    status, body = call(router, "/v1/chat/completions", b"[1, 2", "key-1")
    assert status == 400 and body["error"]["code"] == "invalid_json"


def test_a_call_past_the_episode_clock_is_cut_off() -> None:
    # The engine would answer after 5 s; a 408 means the router cut the call off at its 0.2 s clock.
    router, table = router_with(EchoApp(delay=5.0), timeout_s=0.2)
    status, body = call(router, "/v1/completions", {"prompt": "x"}, "key-1")
    assert status == 408 and body["error"]["code"] == "timeout"
    assert table.get("key-1").truncated == "timeout"  # type: ignore[union-attr]


def test_other_paths_are_not_served() -> None:
    router, _ = router_with(EchoApp())
    status, body = call(router, "/v1/embeddings", {}, "key-1")
    assert status == 404 and body["error"]["code"] == "not_found"


def test_closed_sessions_and_duplicate_keys() -> None:
    table = SessionTable(LIMITS)
    table.open("a", 10)
    with pytest.raises(ValueError, match="already open"):
        table.open("a", 10)
    assert table.close("a") is not None and table.close("a") is None
    assert table.for_request("cmpl-unrelated") is None
