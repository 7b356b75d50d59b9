"""Run directories made by hand for the readers of runs (calibrate, explain --measured): a plan and metrics rows."""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["write_run_dir"]


def write_run_dir(run: Path, plan, truth: dict[str, float], tokens: float, steps: int, **extra: float) -> Path:  # type: ignore[no-untyped-def]
    """A run directory holding `plan` and `steps` metrics rows: `truth`'s phase times ±5% (seeded by the folder's
    name), the first step three times as long (warm-up steps are skipped), `tokens` trained, and `extra` keys."""
    run.mkdir()
    (run / "plan.json").write_text(plan.model_dump_json())
    rng = random.Random(run.name)
    rows = []
    for step in range(1, steps + 1):
        jitter = {k: v * rng.uniform(0.95, 1.05) for k, v in truth.items()}
        rows.append(
            {
                "step": step,
                "time/rollout_s": jitter["rollout"],
                "time/train_s": jitter["train"],
                "time/weight_sync_s": jitter["sync"],
                "time/step_s": jitter["step"] * (3 if step == 1 else 1),
                "train/tokens": tokens,
                **extra,
            }
        )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run
