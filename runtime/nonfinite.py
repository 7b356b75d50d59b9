"""Non-finite numbers stop where they appear: a train step whose loss or gradient norm is not finite skips its update,
the controller counts such steps and stops the run past the plan's bound, and an engine's non-finite behaviour
log-prob stops the run before it can reach a loss.

The trainer (`TrainerWorker.train_step`) reports a step's skips as numbers, as all its statistics travel: how many of
its optimizer steps were skipped (``skipped_steps``) and a code for the first quantity that was not finite
(``nonfinite``: an index into `QUANTITIES`, plus one; 0 when none). `skip_metrics` turns them into the step's metrics,
`SkipCount` counts skipped steps in a row and, at the bound, gives the `RunError` that names the step, the quantity
and the checkpoint to resume from; `skip_text` is the progress line's account.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from rlc.runtime.errors import RunError, resume_command

__all__ = ["QUANTITIES", "SkipCount", "check_engine_logprobs", "nonfinite_code", "skip_metrics", "skip_text"]

#: What a train step checks before its optimizer step, in the order it computes them.
QUANTITIES = ("loss", "grad_norm")

#: How each quantity is named to people.
_SAID = {"loss": "loss", "grad_norm": "gradient norm"}


def nonfinite_code(bad: Sequence[bool]) -> int:
    """The code of the first quantity (in `QUANTITIES` order) flagged not finite; 0 when none is."""
    return next((code for code, flagged in enumerate(bad, start=1) if flagged), 0)


def quantity(code: float) -> str:
    """The quantity a `nonfinite` code stands for."""
    return QUANTITIES[int(code) - 1]


def skip_metrics(result: Mapping[str, float]) -> dict[str, float | str]:
    """A train step's skips as metrics: the optimizer steps skipped and, when any was, the first quantity that was not
    finite (text, in metrics.jsonl only)."""
    skipped = float(result.get("skipped_steps", 0.0))
    if not skipped:
        return {"train/skipped_updates": 0.0}
    return {"train/skipped_updates": skipped, "train/nonfinite": quantity(result["nonfinite"])}


class SkipCount:
    """Consecutive train steps with a skipped update, against the plan's `schedule.max_nonfinite_steps`."""

    def __init__(self, limit: int, run_dir: Path) -> None:
        self.limit, self.run_dir = limit, run_dir
        self.in_row = 0
        self.first_step = 0  # the first step of the current run of skips
        self.first_quantity = ""

    def record(self, step: int, stats: Mapping[str, object]) -> dict[str, float]:
        """Counts step `step` (its `skip_metrics`) when any of its updates was skipped; returns the count in a row."""
        what = stats.get("train/nonfinite")
        if not isinstance(what, str):
            self.in_row = 0
        else:
            if self.in_row == 0:
                self.first_step, self.first_quantity = step, what
            self.in_row += 1
        return {"train/nonfinite_skipped": float(self.in_row)}

    @property
    def exhausted(self) -> bool:
        """Whether the run must stop: the bound of consecutive skipped steps is reached."""
        return self.in_row >= self.limit

    def error(self, step: int) -> RunError:
        """The stop at the bound: the step, the first non-finite quantity, what the weights are, where to resume."""
        from rlc.runtime.checkpoint import CheckpointError, latest_checkpoint

        try:
            found = latest_checkpoint(self.run_dir)
        except CheckpointError as exc:
            resume = f"the newest checkpoint cannot be resumed ({exc})"
        else:
            resume = (
                f"`{resume_command()}` continues from the newest checkpoint, {found[0].name} (step {found[1].step})"
                if found is not None
                else "no checkpoint was completed, so a new run starts from the beginning (pass --overwrite)"
            )
        said = _SAID[self.first_quantity]
        return RunError(
            f"step {step}: a non-finite {said} (first at step {self.first_step}) skipped the update of {self.in_row} "
            f"steps in a row, the plan's bound (schedule.max_nonfinite_steps = {self.limit}); no non-finite value "
            f"reached the weights. The run stopped: {resume}, once what made the {said} non-finite (rewards, "
            "learning rate, data) is fixed"
        )


def skip_text(metrics: Mapping[str, object]) -> str:
    """The progress line's words for a step whose update was skipped ('' for any other step)."""
    what = metrics.get("train/nonfinite")
    if not isinstance(what, str):
        return ""
    skipped, steps = metrics.get("train/skipped_updates", 0), metrics.get("train/optimizer_steps", 1)
    update = "update skipped" if skipped == steps else f"{skipped:g} of {steps:g} updates skipped"
    return f"non-finite {_SAID.get(what, what)}, {update} ({metrics.get('train/nonfinite_skipped', 1):g} in a row)"


def check_engine_logprobs(rows: Iterable[Sequence[float]], engine: int, step: int, source: str) -> None:
    """Stop the run when an engine's behaviour log-probs hold a NaN or an infinity: they would become the loss's
    importance weights (the decoupled loss would silently drop such a token, plain PPO's loss would be NaN).
    ``source`` names what the rows came from (a generate request, an agent trajectory). One sum per row: a
    non-finite entry makes the sum non-finite."""
    for index, row in enumerate(rows):
        total = sum(row)
        if not math.isfinite(total):
            bad = next((v for v in row if not math.isfinite(v)), total)
            raise RunError(
                f"rollout engine {engine} returned a non-finite log-prob ({bad}) for a sampled token of {source} "
                f"(sequence {index}), at step {step}, before any of it was trained on. The run stopped: "
                f"`{resume_command()}` continues from the newest checkpoint (if it happens again, the engine's "
                "weights or kernels are broken)"
            )
