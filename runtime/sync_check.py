"""After every weight sync, each engine must serve the trainer's weights: a probe scored on both sides says so.

A sync can corrupt an engine's policy with no error: vLLM's CPU expert kernels kept their start-up weights after
a reload (measured 1.9-5.8 nats off), a weight-name mapping can skip a tensor, a bucket can land in the wrong
place, an engine can report the new version while serving the old one. The log-probs the trainer then learns from
would silently be another policy's. So the trainer scores a probe (the first sequences of the batch it trains on, a
few dozen tokens) at temperature 1 twice: with the weights before the step (`before_step`, one extra short
forward) and with its new weights (`expect`); after the sync every engine scores the same tokens (vLLM's prompt
log-probs, which are untempered) on each of its engine cores (an engine with attention data parallelism holds a
copy of the weights per core). The run stops, naming the engine and core, when

1. any engine log-prob is NaN or infinite (so is the gap then: `gap > bound` alone would read NaN as a pass);
2. the step moved the probe (mean |new − old|, m) by more than `schedule.sync_check_min_step` (3x
   `schedule.sync_check_noise`, n, the largest gap a fresh sync shows for the plan's dtype and model), and the
   engine is nearer the old scores than the new by more than n (`before + n < gap`): it did not take the step (left
   one version behind, or a layer missed). Why this is sound: the mean |a − b| over the probe's tokens obeys the
   triangle inequality. An engine that took the step, `g` from the new scores, is at least `m − g` from the old,
   so it is stopped only if `m − g + n < g`, i.e. `g > (m + n) / 2`, over 2n once `m > 3n`: no engine within twice
   the largest fresh gap ever measured is called stale (the bound below tolerates 3n; a fresh engine between 2n
   and 3n may be called stale on a step that moved the probe less than `2g − n`). An engine that missed the step,
   `b ≤ n` from the old scores, is at least `m − b` from the new, and `b + n < m − b` holds for every such `b`
   once `m > 3n`: it is stopped;
3. the mean |engine − new| exceeds `schedule.sync_check_max_gap` (3x the noise, at least 1e-3): other weights.

What no log-prob check can see: a step that moves the probe less than the engine's own noise. In float32 that
noise is ~1e-6 and any step is seen. In bfloat16 it is 0.004-0.018 nats on a dense model: the quickstart model at
its lr (5e-4) moves the probe 0.01-0.26 a step, so an engine one version behind is caught on each step that moves
the probe past 0.054 (or past the bound); at the lr of real post-training (1e-6 on billions of parameters) a
step moves it far less, and an engine one version behind is seen only once the versions it missed add up past
that. A missed layer is seen once its share of the steps does: one of the quickstart's two layers holds 0.005-0.1
nats of a step. With routed experts in bfloat16 (noise 0.136, one published figure and none of rlc's own; bound
0.408, looser than the 0.25 every bf16 plan had before; no test shows a stale bf16 MoE engine caught) this check
sees only gross failures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NoReturn

from rlc.runtime.errors import RunError, resume_command

__all__ = ["PROBE_SEQUENCES", "PROBE_TOKENS", "SyncCheck", "mean_gap", "probe_of"]

#: Sequences of the trained batch the probe takes, and tokens of each (prompt first, then the response).
PROBE_SEQUENCES = 2
PROBE_TOKENS = 64
#: Seconds the engines may take to score the probe before the run stops (a short forward each).
CHECK_TIMEOUT_S = 300


def probe_of(input_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    """The probe: the first `PROBE_SEQUENCES` sequences with at least two tokens, cut to `PROBE_TOKENS`."""
    return [list(ids[:PROBE_TOKENS]) for ids in input_ids if len(ids) >= 2][:PROBE_SEQUENCES]


def _scored(trainer_rows: Sequence[Sequence[float]]) -> list[float]:
    """The trainer's log-probs of the tokens the engines score: its entry 0 of each row has no prediction."""
    return [v for row in trainer_rows for v in row[1:]]


def _mean_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / max(len(a), 1)


def mean_gap(trainer_rows: Sequence[Sequence[float]], engine_rows: Sequence[Sequence[float]]) -> float:
    """Mean |trainer − engine| over the probe's scored tokens (the trainer's entry 0 has no prediction)."""
    for trainer, engine in zip(trainer_rows, engine_rows, strict=True):
        if len(trainer) - 1 != len(engine):
            raise ValueError(f"the engine scored {len(engine)} tokens of a {len(trainer)}-token probe sequence")
    return _mean_abs_diff(_scored(trainer_rows), [v for row in engine_rows for v in row])


def _non_finite(values: Sequence[float]) -> int:
    return sum(not math.isfinite(v) for v in values)


class SyncCheck:
    """One run's post-sync check: `before_step` before training, `expect` before the sync, `verify` after it."""

    def __init__(
        self,
        trainer: Any,
        rollout: Any,
        max_gap: float,
        noise: float | None = None,
        min_step: float | None = None,
    ) -> None:
        """`rollout`: the run's `RolloutPool` (its engines are read at each check: restarts replace them).
        `noise`, `min_step`: the plan's `schedule.sync_check_noise` and `schedule.sync_check_min_step`; either None
        leaves out the weights-before-the-step comparison."""
        self.trainer, self.rollout, self.max_gap = trainer, rollout, max_gap
        self.noise, self.min_step = (noise, min_step) if noise is not None and min_step is not None else (None, None)
        self._probe: list[list[int]] = []
        self._expected: list[list[float]] = []
        self._before: list[float] = []
        #: Mean |new − old| trainer log-prob over the probe's scored tokens at the last check (NaN: not scored).
        self.moved = float("nan")

    def _score(self, probe: list[list[int]]) -> list[list[float]]:
        return self.trainer.compute_logprobs({"input_ids": probe}, temperature=1.0) if probe else []

    def before_step(self, input_ids: Sequence[Sequence[int]]) -> None:
        """Score the probe with the trainer's weights before the step (what an engine that missed the sync serves).
        One short forward; none where the plan states no noise figure."""
        self._probe = probe_of(input_ids)
        self._before = _scored(self._score(self._probe)) if self.noise is not None else []

    def expect(self, input_ids: Sequence[Sequence[int]]) -> None:
        """Score the probe with the trainer's current (new, not yet synced) weights."""
        probe = probe_of(input_ids)
        if probe != self._probe:  # no `before_step` for this batch: nothing to compare the step with
            self._probe, self._before = probe, []
        self._expected = self._score(probe)
        new = _scored(self._expected)
        bad = _non_finite(new)
        if bad:
            raise RunError(
                f"the trainer's new weights score {bad} of the post-sync probe's tokens as NaN or infinite: they "
                f"are not synced to the engines. The run stopped; `{resume_command('PLAN')}` continues from the "
                "last checkpoint"
            )
        self.moved = _mean_abs_diff(new, self._before) if len(self._before) == len(new) and new else float("nan")

    def verify(self, version: int) -> float:
        """Every engine scores the probe; returns the largest engine's mean gap (NaN when no engine could be checked:
        all restarted or gone since the sync), or stops the run (`judge`).

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
            gap = self.judge(index, version, by_core)
            worst = gap if worst != worst else max(worst, gap)  # NaN until the first engine answers
        return worst

    def judge(self, index: int, version: int, by_core: Sequence[Sequence[Sequence[float]]]) -> float:
        """Engine `index`'s probe log-probs, by engine core, against the trainer's: the largest core's mean gap, or a
        `RunError` naming the engine and core (non-finite scores, nearer the weights before the step, or past the
        bound)."""
        gaps: list[float] = []
        for core, rows in enumerate(by_core):
            where = f"engine {index}" + (f" (its engine core {core})" if len(by_core) > 1 else "")
            scores = [v for row in rows for v in row]
            bad = _non_finite(scores)
            if bad:
                self._stop(
                    version,
                    f"{where} scores {bad} of the trainer's {len(scores)} probe tokens as NaN or infinite",
                )
            gap = mean_gap(self._expected, rows)
            if self._resolved():
                before = _mean_abs_diff(self._before, scores)
                if before + (self.noise or 0.0) < gap:  # `_resolved`: the noise is set
                    self._stop(
                        version,
                        f"{where} scores the trainer's tokens nearer its weights before the step ({before:.3g} nats "
                        f"apart on average) than its new weights ({gap:.3g}), by more than a fresh sync's "
                        f"{self.noise:g} (`schedule.sync_check_noise`); the step moved them {self.moved:.3g}, past "
                        f"{self.min_step:g} (`schedule.sync_check_min_step`): the engine did not take the step (the "
                        "sync left it a version behind, or missed part of its layers)",
                    )
            if not gap <= self.max_gap:  # NaN fails too
                self._stop(
                    version,
                    f"{where} scores the trainer's tokens {gap:.3g} nats apart on average (bound {self.max_gap:g}, "
                    "`schedule.sync_check_max_gap`): it serves other weights than the trainer's",
                )
            gaps.append(gap)
        return max(gaps) if gaps else float("nan")

    def _resolved(self) -> bool:
        """Whether the step moved the probe enough, against the plan's noise, to tell new weights from old."""
        return self.min_step is not None and self.moved == self.moved and self.moved > self.min_step

    @staticmethod
    def _stop(version: int, what: str) -> NoReturn:
        raise RunError(
            f"after the weight sync to version {version}, {what}, so its samples would train on another policy. "
            f"The run stopped; `{resume_command('PLAN')}` restarts the engines from the last checkpoint"
        )
