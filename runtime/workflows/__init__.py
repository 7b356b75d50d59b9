"""Rollout workflows: what feeds the controller's one streaming loop (AReaL's `RolloutWorkflow` idea).

The loop (`runtime.controller.Controller`) owns the trainer side, the staleness gate, the step and its
bookkeeping; a workflow owns what runs on the engines and comes back as groups (one prompt's samples, the unit of
GRPO advantage normalisation). Workflows are small plug-ins chosen by the run:

  generate-and-score  `generate.GenerateWorkflow`: one generate request per prompt's group, scored by the reward;
  replay              `replay.ReplayWorkflow`: the same requests a recorded run made, in its order and versions;
  agent episode       `rlc.runtime.agent.workflow.AgentWorkflow`: trajectories an agent drives over the engines'
                      OpenAI endpoint.

Distillation is not a workflow: teachers score whatever batch the workflow built, beside the trainer.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Workflow"]


class Workflow(Protocol):
    """What the loop asks of a workflow; every call runs on the loop's (driver) thread."""

    def fill(self) -> None:
        """Admit and start work while the staleness bound and the engines' concurrency allow."""

    def collect(self, timeout: float) -> None:
        """Take in finished work, waiting up to `timeout` for some (or for the trainer's step to end)."""

    def has_batch(self) -> bool:
        """Whether a whole batch has finished (the loop then waits on nothing before training)."""

    def next_batch(self) -> list[Any] | None:
        """The next step's groups, once they have finished; None before."""

    def build_batch(self, groups: list[Any]) -> tuple[dict[str, Any], dict[str, float], list[str | None]]:
        """The trainer's batch of these groups, the step's rollout metrics, and each sequence's domain."""

    def batch_record(self, groups: list[Any]) -> list[tuple[int, int]]:
        """The groups as RUN/rollouts.jsonl's batch records them: (request id, prompt cursor)."""

    def resume_cursor(self) -> int:
        """The oldest prompt not yet trained on: where a resumed run restarts the prompt stream."""

    def in_flight(self) -> list[str]:
        """What is running, for a stall's message."""

    def close(self) -> None:
        """Stop waiting for anything still running."""
