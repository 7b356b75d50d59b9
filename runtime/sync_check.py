"""After every weight sync, each engine must serve the trainer's weights: a probe scored on both sides says so.

A sync can corrupt an engine's policy with no error: vLLM's CPU expert kernels kept their start-up weights after
a reload (measured 1.9-5.8 nats off), a weight-name mapping can skip a tensor, a bucket can land in the wrong
place. The log-probs the trainer then learns from would silently be another policy's. So, before the sync, the
trainer scores a probe (the first sequences of the batch it just trained on, a few dozen tokens) with its new
weights at temperature 1; after the sync every engine scores the same tokens (vLLM's prompt log-probs, which are
untempered) on each of its engine cores (an engine with attention data parallelism holds a copy of the weights per
core), and a mean |difference| above the plan's `schedule.sync_check_max_gap` stops the run, naming the
engine. The cost is one short forward on each side per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlc.runtime.errors import RunError, resume_command

__all__ = ["PROBE_SEQUENCES", "PROBE_TOKENS", "SyncCheck", "probe_of"]

#: Sequences of the trained batch the probe takes, and tokens of each (prompt first, then the response).
PROBE_SEQUENCES = 2
PROBE_TOKENS = 64
#: Seconds the engines may take to score the probe before the run stops (a short forward each).
CHECK_TIMEOUT_S = 300


def probe_of(input_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    """The probe: the first `PROBE_SEQUENCES` sequences with at least two tokens, cut to `PROBE_TOKENS`."""
    return [list(ids[:PROBE_TOKENS]) for ids in input_ids if len(ids) >= 2][:PROBE_SEQUENCES]


def mean_gap(trainer_rows: Sequence[Sequence[float]], engine_rows: Sequence[Sequence[float]]) -> float:
    """Mean |trainer − engine| over the probe's scored tokens (the trainer's entry 0 has no prediction)."""
    diffs = [
        abs(t - e)
        for trainer, engine in zip(trainer_rows, engine_rows, strict=True)
        for t, e in zip(trainer[1:], engine, strict=True)
    ]
    return sum(diffs) / max(len(diffs), 1)


class SyncCheck:
    """One run's post-sync check: `expect` before the sync, `verify` after it."""

    def __init__(self, trainer: Any, rollout: Any, max_gap: float) -> None:
        """`rollout`: the run's `RolloutPool` (its engines are read at each check: restarts replace them)."""
        self.trainer, self.rollout, self.max_gap = trainer, rollout, max_gap
        self._probe: list[list[int]] = []
        self._expected: list[list[float]] = []

    def expect(self, input_ids: Sequence[Sequence[int]]) -> None:
        """Score the probe with the trainer's current (new, not yet synced) weights."""
        self._probe = probe_of(input_ids)
        self._expected = (
            self.trainer.compute_logprobs({"input_ids": self._probe}, temperature=1.0) if self._probe else []
        )

    def verify(self, version: int) -> float:
        """Every engine scores the probe; returns the largest engine's mean gap (NaN when no engine could be checked:
        all restarted or gone since the sync), or stops the run above the bound.

        An engine that died or was restarted since the sync is skipped: it is loaded with the current weights before
        it serves again.
        """
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if not self._probe:
            return 0.0
        worst = float("nan")
        for index, engine in enumerate(self.rollout.engines):
            try:
                held, by_core = ray.get(
                    [engine.get_version(), engine.prompt_logprobs_by_core(self._probe)], timeout=CHECK_TIMEOUT_S
                )
            except RayActorError:
                continue
            except GetTimeoutError:
                raise RunError(
                    f"engine {index} did not score the post-sync probe within {CHECK_TIMEOUT_S} s; the run stopped: "
                    f"`{resume_command('PLAN')}` continues from the last checkpoint"
                ) from None
            if held != version:
                continue
            gaps = [mean_gap(self._expected, rows) for rows in by_core]
            gap = max(gaps)
            if gap > self.max_gap:
                where = f"engine {index}" + (f" (its engine core {gaps.index(gap)})" if len(gaps) > 1 else "")
                raise RunError(
                    f"after the weight sync to version {version}, {where} scores the trainer's tokens "
                    f"{gap:.3g} nats apart on average (bound {self.max_gap:g}, `schedule.sync_check_max_gap`): it "
                    "serves other weights than the trainer's, so its samples would train on another policy. The "
                    f"run stopped; `{resume_command('PLAN')}` restarts the engines from the last checkpoint"
                )
            worst = gap if worst != worst else max(worst, gap)  # NaN until the first engine answers
        return worst
