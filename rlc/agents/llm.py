"""`Endpoint`: what an agent gets as `llm`, the handle to the OpenAI-compatible server of its trajectory.

The api key is the trajectory's session key: every call made with it is recorded into that trajectory, so an
agent must not share it between trajectories. The helpers build clients that never retry on their own (a retry
is a new call the recorder must then drop) and time out with the episode. Each client has its own small HTTP
connection pool: one pool shared by a process's trajectories spent most of an agent runner's CPU finding a free
connection (httpcore scans every connection for every request: 128 trajectories at once took 10 s per episode of
a 0.5 s model time), while a plain-http pool costs under a millisecond to build.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Endpoint"]

#: Connections of one trajectory's client: its calls are sequential, a few spare for agents that overlap them.
#: Idle connections are dropped well before the server's keep-alive (300 s) ends them under a request.
_LIMITS = dict(max_connections=8, max_keepalive_connections=4, keepalive_expiry=30.0)


def _http_client(asynchronous: bool) -> Any:
    """A plain-http httpx client for one trajectory (no certificate store: the engine's address is http)."""
    import httpx

    cls = httpx.AsyncClient if asynchronous else httpx.Client
    return cls(limits=httpx.Limits(**_LIMITS), timeout=None, verify=False)


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible endpoint bound to one trajectory (plain data: it travels to agent processes)."""

    base_url: str  # ends in /v1
    api_key: str  # the trajectory's session key
    model: str  # the served model name
    max_tokens: int  # per call (the server caps larger requests)
    max_turns: int  # calls per trajectory (the server refuses more)
    timeout_s: float  # what is left of the episode when it starts
    options: dict[str, Any] = field(default_factory=dict)  # the spec's rollout.agent.options

    def openai(self) -> Any:
        """A synchronous `openai.OpenAI` client for this trajectory."""
        import openai

        return openai.OpenAI(
            base_url=self.base_url,
            api_key=self.api_key,
            timeout=self.timeout_s,
            max_retries=0,
            http_client=_http_client(False),
        )

    def async_openai(self) -> Any:
        """An `openai.AsyncOpenAI` client for this trajectory."""
        import openai

        return openai.AsyncOpenAI(
            base_url=self.base_url,
            api_key=self.api_key,
            timeout=self.timeout_s,
            max_retries=0,
            http_client=_http_client(True),
        )

    def litellm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `litellm.completion` (and tools built on it, such as mini-swe-agent's
        `model_kwargs`): the OpenAI-compatible provider pointed at this endpoint."""
        return {
            "model": f"openai/{self.model}",
            "api_base": self.base_url,
            "api_key": self.api_key,
            "timeout": self.timeout_s,
            "num_retries": 0,
        }

    def env(self) -> dict[str, str]:
        """Environment variables for an agent started as its own process (OPENAI_* are what the `openai`
        package reads)."""
        return {
            "OPENAI_BASE_URL": self.base_url,
            "OPENAI_API_KEY": self.api_key,
            "RLC_MODEL": self.model,
            "RLC_MAX_TOKENS": str(self.max_tokens),
            "RLC_MAX_TURNS": str(self.max_turns),
            "RLC_TIMEOUT_S": f"{self.timeout_s:g}",
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
