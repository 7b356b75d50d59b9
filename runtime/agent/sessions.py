"""Per-trajectory sessions on one engine: who may call, within what budget, and what each call recorded.

A session is opened by the controller before its trajectory starts and closed when the agent returns; its key
is the agent's API key. The router (`router.SessionRouter`) admits a call only for an open session within its
turn budget and wall clock; the recording engine client (`recording.RecordingClient`) appends the engine's own
record of each finished call. Plain data and asyncio-free, so the bookkeeping is tested on its own.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from rlc.runtime.agent.trajectory import Call

__all__ = ["REQUEST_ID", "Limits", "Session", "SessionRecord", "SessionTable"]

#: Engine request ids of recorded calls: vLLM's prefix (chatcmpl-, cmpl-), then ours, then its suffixes.
REQUEST_ID = re.compile(r"rlc-s(\d+)-c(\d+)")


@dataclass(frozen=True)
class Limits:
    max_turns: int
    max_tokens_per_turn: int
    max_context_tokens: int
    temperature: float
    top_p: float


@dataclass
class SessionRecord:
    """What the controller gets back when it closes a session (plain data, travels through Ray)."""

    key: str
    calls: list[Call]
    truncated: str | None  # why the trajectory was cut short (turn or context budget), or None
    refused: int  # calls refused by the router
    model_s: float  # seconds the calls spent in the engine
    unfinished: int  # calls still running when the session closed (aborted, not recorded)


@dataclass
class Session:
    key: str
    sid: int
    deadline: float  # time.monotonic() past which calls are refused
    calls: list[Call] = field(default_factory=list)
    started: int = 0  # calls admitted (recorded or not)
    truncated: str | None = None
    refused: int = 0
    running: set[str] = field(default_factory=set)  # request ids in the engine

    def next_request_id(self) -> str:
        self.started += 1
        return f"rlc-s{self.sid}-c{self.started}"


class SessionTable:
    """The open sessions of one engine, by key and by the short id their request ids carry."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._by_key: dict[str, Session] = {}
        self._by_sid: dict[int, Session] = {}
        self._next = 0

    def open(self, key: str, timeout_s: float) -> Session:
        if key in self._by_key:
            raise ValueError("session key already open")
        self._next += 1
        session = Session(key, self._next, time.monotonic() + timeout_s)
        self._by_key[key] = session
        self._by_sid[session.sid] = session
        return session

    def get(self, key: str) -> Session | None:
        return self._by_key.get(key)

    def for_request(self, request_id: str) -> Session | None:
        found = REQUEST_ID.search(request_id)
        return self._by_sid.get(int(found.group(1))) if found else None

    def close(self, key: str) -> SessionRecord | None:
        session = self._by_key.pop(key, None)
        if session is None:
            return None
        self._by_sid.pop(session.sid, None)
        return SessionRecord(
            key=key,
            calls=list(session.calls),
            truncated=session.truncated,
            refused=session.refused,
            model_s=sum(c.model_s for c in session.calls),
            unfinished=len(session.running),
        )

    def __len__(self) -> int:
        return len(self._by_key)
