"""What a failing agent costs: the policy for trajectories whose agent raised, hung or returned no reward.

A trajectory whose agent raised scores 0 (its tokens still train: what the policy did led there); one whose agent
returned something that is not a reward, or whose runner failed, is a failed reward as in `tasks.rewards.RewardGuard`:
its group trains with zero advantages (no baseline holds); one that timed out is dropped and its task re-issued. Each
is counted, the first of each kind is reported with its task; when more than `max_failed_share` of the last
batch-worth of trajectories failed, the run stops with a RunError naming the agent, the task and the reason.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from rlc.runtime.agent.runner import Episode
from rlc.runtime.errors import RunError

__all__ = ["AgentGuard"]


def _clip(text: object, limit: int = 120) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else f"{shown[: limit - 20]}...' ({len(str(text))} chars)"


class AgentGuard:
    def __init__(self, agent: str, window: int, share: float, log: Callable[[str], None]) -> None:
        self.agent, self.window, self.share, self.log = agent, max(1, window), share, log
        self.allowed = int(share * self.window)
        self.recent: deque[bool] = deque(maxlen=self.window)
        self.counts = {"error": 0, "timeout": 0}
        self._reported: set[str] = set()

    def record(self, episode: Episode, prompt: str) -> None:
        """Count `episode`'s outcome; raise RunError when failures pass the stated share."""
        failed = episode.status != "ok"
        self.recent.append(failed)
        if not failed:
            return
        self.counts[episode.status] = self.counts.get(episode.status, 0) + 1
        where = f" at {episode.where}" if episode.where else ""
        what = f"agent {self.agent!r} {episode.error}{where} (task {_clip(prompt)})"
        total = sum(self.recent)
        if total > self.allowed:
            raise RunError(
                f"{what}; {total} of the last {len(self.recent)} trajectories failed, and the run stops past "
                f"{self.allowed} ({self.share:.0%} of a batch of {self.window}): fix the agent (checkpoints so far "
                "are kept; `--resume` continues)"
            )
        kind = episode.status + ":" + episode.error.split(":")[0]
        if kind not in self._reported:
            self._reported.add(kind)
            consequence = "dropped and its task re-issued" if episode.status == "timeout" else "scored 0"
            self.log(
                f"warning: {what}; the trajectory is {consequence} (up to {self.allowed} failed trajectories per "
                f"{self.window} before the run stops; agent/errors and agent/timeouts count them)"
            )

    def take(self) -> dict[str, int]:
        counts, self.counts = self.counts, {"error": 0, "timeout": 0}
        return counts
