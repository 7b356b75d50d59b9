"""Held-out published runs (benchmarks/published_runs.yaml): each is expressible and priced within reason.

`benchmarks/estimate_accuracy.py` prints how far each estimate is from the measured step; here what must hold
whatever the calibration: every run compiles with its published layout pinned, and its measured step lies within
the band its target's profile states (`estimate_uncertainty`, the "likely" range explain and SUMMARY print). A
change to the time model that moves a published run outside that band must widen the band, with its evidence,
or fix the model: the band is a promise to users.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import yaml
from paths import REPO

_spec = importlib.util.spec_from_file_location("estimate_accuracy", REPO / "benchmarks" / "estimate_accuracy.py")
accuracy = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(accuracy)  # type: ignore[union-attr]
RUNS = accuracy.load_runs()


def test_runs_are_described() -> None:
    ids = [r["id"] for r in RUNS]
    assert len(ids) == len(set(ids)) >= 10
    for run in RUNS:
        assert run["source"].get("url") or {"repo", "path", "commit"} <= set(run["source"]), run["id"]
        assert run["measured"]["step_s"] > 0 and run["mean_sample_tokens"] > 0, run["id"]
        assert isinstance(run["reference"], bool) and run["extra_forwards"] in (0, 1, 2), run["id"]
        # With several minibatches the source's old-log-prob pass is rlc's proximal pass: counting it again as
        # an extra forward would price it twice.
        algo = yaml.safe_load(run["spec"])["algorithm"]
        if algo.get("minibatches", 1) > 1 and algo.get("decoupled_loss", True):
            assert run["extra_forwards"] == 0, run["id"]


@pytest.mark.parametrize("run", RUNS, ids=[r["id"] for r in RUNS])
def test_published_layout_is_priced(run: dict) -> None:
    (row,) = accuracy.compare([run])
    assert "error" not in row, row
    assert math.isfinite(row["ratio"]) and 0.1 < row["ratio"] < 10, row
    fast, slow = row["band"]
    if run.get("outside_band"):  # a stated mechanism rlc does not have; the note must stay true
        assert not row["in_band"], f"{run['id']} is inside its band now: drop its outside_band note"
    else:
        assert row["in_band"], f"measured {row['measured_s']} s is outside {row['predicted_s']} s ÷{fast} to ×{slow}"
