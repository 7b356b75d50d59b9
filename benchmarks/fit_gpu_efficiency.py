"""Fit the GPU profiles' decode and MoE-training efficiencies to published per-phase timings, then check them on
the published runs they were not fitted on.

What: the runs marked `fit: true` in benchmarks/published_runs.yaml (the NeMo-RL v0.3 blog's table, the one GPU
source that splits each step into generation, training, log-prob passes and refit, for dense and MoE models
under one framework) fix two efficiencies that every GPU profile (h100, h20, h800, a800) shares:

  decode_bandwidth_efficiency  the geometric mean of the fit runs' generation ratios (predicted / measured) is 1
  moe_train_ratio              the MoE fit runs' training ratio (training + log-prob passes) is 1

by golden-section search in log space, decode first, then the MoE ratio with the new decode, twice round. The
dense fit runs' training ratios (the profile's `train_mfu`) and the refit ratios are printed, not fitted: rlc's
colocated sync is its own mechanism (priced as rlc runs it). The check is every other GPU run of the file: its
step ratio under the shipped profiles and under the fitted values, with the summary estimate_accuracy.py prints.
The profiles are not written: the fitted values go into schemas/targets by hand, with this script named as
their source.

Run: python benchmarks/fit_gpu_efficiency.py   (about two minutes; the compile path only)
"""

from __future__ import annotations

import importlib.util
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from rlc.compiler import calibrate

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("estimate_accuracy", ROOT / "benchmarks" / "estimate_accuracy.py")
accuracy = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(accuracy)  # type: ignore[union-attr]

GPU_TARGETS = ("h100", "h20", "h800", "a800")
#: Search range of each parameter (absolute values).
BOUNDS = {"decode_bandwidth_efficiency": (0.1, 0.95), "moe_train_ratio": (0.05, 1.0)}
ROUNDS = 2


def with_values(values: dict[str, float], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """estimate_accuracy's rows for `runs` with the GPU profiles' efficiencies set to `values`."""
    from rlc.schemas.profiles import TARGETS_ENV
    from rlc.schemas.registry import load_target

    with tempfile.TemporaryDirectory() as folder:
        for name in GPU_TARGETS:
            data = load_target(name).model_dump(mode="json")
            data["efficiency"].update(values)
            (Path(folder) / f"{name}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        before = os.environ.get(TARGETS_ENV)
        os.environ[TARGETS_ENV] = folder
        try:
            return accuracy.compare(runs)
        finally:
            if before is None:
                del os.environ[TARGETS_ENV]
            else:
                os.environ[TARGETS_ENV] = before


def _loss(rows: list[dict[str, Any]], key: str) -> float:
    return sum(math.log(r[key]) ** 2 for r in rows if key in r)


def fit(fit_runs: list[dict[str, Any]], start: dict[str, float]) -> dict[str, float]:
    moe_runs = [r for r in fit_runs if r["moe"]]
    values = dict(start)
    for _ in range(ROUNDS):
        for name, runs, key in (
            ("decode_bandwidth_efficiency", fit_runs, "gen_s_ratio"),
            ("moe_train_ratio", moe_runs, "train_s_ratio"),
        ):

            def f(log_x: float, name: str = name, runs: list = runs, key: str = key) -> float:
                return _loss(with_values({**values, name: math.exp(log_x)}, runs), key)

            lo, hi = BOUNDS[name]
            values[name] = math.exp(calibrate.golden_section(f, math.log(lo), math.log(hi), rounds=18))
    return values


def show(title: str, rows: list[dict[str, Any]]) -> None:
    print(title)
    for r in rows:
        phases = "  ".join(f"{k[:-8]} {r[k]:.2f}" for k in ("gen_s_ratio", "train_s_ratio", "sync_s_ratio") if k in r)
        print(f"  {r['id']:42s} {r['ratio']:5.2f}{'' if r['in_band'] else ' !'}  {phases}")
    s = accuracy.summary(rows)
    ratios = [r["ratio"] for r in rows]
    print(
        f"  {s['runs']} runs: median {s['median']:.2f}, geometric mean {s['geomean']:.2f}, "
        f"{s['too_fast']} too fast / {s['too_slow']} too slow, within 1.5x {s['within_1_5x']}, "
        f"range {min(ratios):.2f}-{max(ratios):.2f}"
    )


def main() -> None:
    from rlc.schemas.registry import load_arch, load_target

    runs = [r for r in accuracy.load_runs() if r["target"] in GPU_TARGETS]
    for run in runs:
        run["moe"] = load_arch(yaml.safe_load(run["spec"])["model"]["name"]).moe is not None
    fit_runs = [r for r in runs if r.get("fit")]
    check_runs = [r for r in runs if not r.get("fit")]
    shipped = load_target("h100").efficiency
    start = {name: float(getattr(shipped, name)) for name in BOUNDS}
    print(f"shipped: {', '.join(f'{k} {v:.3g}' for k, v in start.items())}")
    values = fit(fit_runs, start)
    print(f"fitted on {len(fit_runs)} runs: {', '.join(f'{k} {v:.3g}' for k, v in values.items())}")
    show("fit runs, fitted values:", with_values(values, fit_runs))
    before, after = with_values({}, check_runs), with_values(values, check_runs)
    show("check runs, shipped profiles:", before)
    show("check runs, fitted values:", after)
    moved = statistics.median(a["ratio"] / b["ratio"] for a, b in zip(after, before, strict=True))
    print(f"check runs' step ratio, fitted / shipped: median {moved:.2f}")


if __name__ == "__main__":
    sys.exit(main())
