"""The recording engine client, with a stand-in engine: what a session call files, and what it leaves alone."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from rlc.runtime.agent.recording import RecordingClient, token_versions
from rlc.runtime.agent.sessions import Limits, SessionTable


@dataclass
class Logprob:
    logprob: float


@dataclass
class Span:
    version: str
    start: int
    end: int


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str = "stop"
    weight_versions: list[Span] | None = None


@dataclass
class Output:
    prompt_token_ids: list[int]
    outputs: list[Completion]
    finished: bool = True


@dataclass
class Params:
    logprobs: int | None = None


@dataclass
class Engine:
    finish_reason: str = "stop"
    seen: list[Any] = field(default_factory=list)
    model_config: str = "the model config"

    async def generate(self, prompt: Any, params: Params, request_id: str, **_: Any):  # type: ignore[no-untyped-def]
        self.seen.append((request_id, params.logprobs))
        spans = [Span("3", 0, 2), Span("4", 2, 3)]
        comp = Completion(
            [7, 8, 2], [{7: Logprob(-0.1)}, {8: Logprob(-0.2)}, {2: Logprob(-0.3)}], self.finish_reason, spans
        )
        yield Output([1, 5, 6], [comp])


def run(engine: Engine, request_id: str) -> SessionTable:
    table = SessionTable(Limits(3, 8, 64, 1.0, 1.0))
    session = table.open("key", 10)
    assert session.sid == 1
    client = RecordingClient(engine, table, lambda: 3)

    async def go() -> None:
        async for _ in client.generate({"prompt_token_ids": [1, 5, 6]}, Params(), request_id):
            pass

    asyncio.run(go())
    return table


def test_a_session_call_is_filed_with_ids_logprobs_and_versions_per_token() -> None:
    engine = Engine()
    table = run(engine, "chatcmpl-rlc-s1-c1")
    record = table.close("key")
    assert record is not None
    (call,) = record.calls
    assert call.prompt_ids == (1, 5, 6) and call.output_ids == (7, 8, 2)
    assert call.logprobs == (-0.1, -0.2, -0.3) and call.versions == (3, 3, 4)
    assert engine.seen == [("chatcmpl-rlc-s1-c1", 0)]  # the engine was asked for the sampled token's log-prob
    assert record.unfinished == 0


def test_other_requests_and_aborted_calls_are_not_filed() -> None:
    engine = Engine()
    table = run(engine, "cmpl-someone-else")
    assert table.close("key").calls == []  # type: ignore[union-attr]
    assert engine.seen == [("cmpl-someone-else", None)]  # and their sampling is untouched
    assert run(Engine(finish_reason="abort"), "chatcmpl-rlc-s1-c1").close("key").calls == []  # type: ignore[union-attr]


def test_the_client_passes_everything_else_through() -> None:
    client = RecordingClient(Engine(), SessionTable(Limits(1, 1, 1, 1.0, 1.0)), lambda: 0)
    assert client.model_config == "the model config"


def test_versions_without_a_label_take_the_engines() -> None:
    assert token_versions(None, 3, 7) == [7, 7, 7]
    assert token_versions([Span("default", 0, 2), Span("9", 2, 3)], 3, 7) == [7, 7, 9]
