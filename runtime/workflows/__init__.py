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

from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # types only: none of these modules imports a workflow
    from rlc.runtime.metrics import MetricsLogger
    from rlc.runtime.prompts import PromptStream
    from rlc.runtime.rollout.pool import RolloutPool
    from rlc.runtime.rollout_log import RolloutLog
    from rlc.runtime.staleness import StalenessGate
    from rlc.runtime.stall import StallWatch
    from rlc.runtime.trace import StepTrace
    from rlc.schemas.plan import Plan

__all__ = ["Loop", "Workflow"]


class Loop(Protocol):
    """What a workflow may use of the loop that runs it (`runtime.controller.Controller`): the run's facts, the
    staleness gate and prompt stream, the step's counters and logs, three questions about the engines, and the
    reference policy's log-probs for advantages that need them (reinforce_pp)."""

    plan: Plan
    run_dir: Path
    tokenizer: Any
    rollout: RolloutPool
    staleness: int  # the plan's bound (a colocated plan states 0)
    step: int
    version: int
    total_steps: int
    gate: StalenessGate
    prompts: PromptStream
    training: Future | None  # the trainer's step while it runs
    stall: StallWatch
    rollout_tokens: int  # this step's generated tokens
    interrupted_samples: int  # this step's samples a weight update interrupted
    logger: MetricsLogger
    rollout_log: RolloutLog
    trace: StepTrace

    def may_admit(self) -> bool:
        """Whether new rollouts may start now."""

    def engine_load(self, engines_in_flight: Iterable[int]) -> dict[int, int]:
        """Work items each serving engine holds."""

    def restart_engine(self, index: int) -> None:
        """Restart a dead engine; it takes no work until it has the current weights."""

    def reference_logprobs(self, batch: dict[str, Any]) -> list[list[float]]:
        """The reference policy's per-token log-probs of a batch's sequences (trainer thread only)."""


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
        """The trainer's batch of these groups, the step's rollout metrics, and each sequence's domain (runs on the
        trainer thread, which may score the batch under the reference policy)."""

    def batch_record(self, groups: list[Any]) -> list[tuple[int, int]]:
        """The groups as RUN/rollouts.jsonl's batch records them: (request id, prompt cursor)."""

    def resume_cursor(self) -> int:
        """The oldest prompt not yet trained on: where a resumed run restarts the prompt stream."""

    def in_flight(self) -> list[str]:
        """What is running, for a stall's message."""

    def close(self) -> None:
        """Stop waiting for anything still running."""
