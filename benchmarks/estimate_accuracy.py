"""The planner's step-time estimates against published runs it was not fitted on (benchmarks/published_runs.yaml).

What: each held-out run is priced as written there (the published layout pinned, on its target), with the
run's mean tokens per sample and the extra forward passes it made, and its estimate is set against the
measured step time, and against the measured phases where the source splits them (generation, training,
weight sync). The table prints predicted / measured per run; the summary gives the median and geometric mean
of the step ratios and how many runs are predicted too fast (ratio < 1) or too slow, and how many land within
the band their target's profile states (`estimate_uncertainty`, which explain prints as the "likely" range;
`!` marks a run outside it). A ratio of 0.5 means the planner expects the step in half the time it took.

Two constants of the time model are fitted on some of these runs, and the summary keeps them apart: the GPU
profiles' decode bandwidth efficiency and MoE training ratio come from the per-phase timings of the runs marked
`fit: true` (benchmarks/fit_gpu_efficiency.py). The headline summary is over the other runs, held out: the
Ascend profiles' efficiencies and overheads were fitted on the shared deployments (tests/compile/test_deployments.py),
and the other terms added for these comparisons each take their figure from a public measurement of something
else, cited beside the code (`cost.links.EP_WIDTH_BANDWIDTH`, `cost.overheads.EAGER_LAYER_LAUNCH_S`). What the runs'
sources publish about their layout is pinned in their specs (published_runs.yaml), never chosen to move a
ratio. Megatron layouts, which `rlc validate` refuses (nothing in rlc executes them), are priced with the
planner's Megatron models (`Context.price_megatron`) so that the comparison is with what actually ran.

Leave-one-out (the figure to quote): each run is priced as if it had never been seen. What these runs fix is
fitted again without the run, and the run is predicted with that fit: a `fit: true` run's GPU efficiencies are
refitted on the other fit runs (benchmarks/fit_gpu_efficiency.py's `fit`); a held-out run's estimate already is
out of sample for them. Its band is the one the other runs' out-of-sample residuals give (the widest too-slow
and too-fast factors of the runs on the same kind of target, npu or gpu), so "in band" asks whether the run
falls inside what the others would have promised. The summary gives the median published / estimated factor
(measured over predicted: 2 means the step took twice the estimate), the share within 1.3x, the share inside
the leave-one-out band and inside the target's stated band, and the same factor per phase where the source
splits the step. The in-sample figures (shipped profiles, bands stated by profiles that were read from these
runs) print beside it, labelled so. What stays in sample even here: the Ascend profiles' efficiencies were set
with the shared deployments in view (runs marked `deployment:`); their rows say so.

The compile path only (no torch): about 30 seconds (the refits).

Run: python benchmarks/estimate_accuracy.py [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "benchmarks" / "published_runs.yaml"

#: measured key -> the estimate's field it is compared with
PHASES = {"gen_s": "rollout_s", "train_s": "train_s", "sync_s": "sync_s"}
#: measured forward-only passes the sources time apart from training (the estimate counts them in training)
FORWARD_PASSES = ("ref_s", "old_log_prob_s")


def load_runs(path: Path = RUNS) -> list[dict[str, Any]]:
    return list(yaml.safe_load(path.read_text())["runs"])


def estimate(run: dict[str, Any]) -> Any:
    """The planner's best plan for the run as published (its `StepTime` is `.step`), or an error string."""
    from rlc.compiler import search
    from rlc.compiler.validate import check_text

    spec = yaml.safe_load(run["spec"])
    pins = (spec.get("placement") or {}).get("train") or {}
    megatron = pins.get("backend") == "megatron"
    if megatron:  # checked as its fsdp2 twin (`rlc validate` refuses Megatron, RLC223), then priced as published
        pins["backend"] = "fsdp2"
    text = yaml.safe_dump({"name": run["id"], "data": {"train": "arithmetic"}, **spec}, sort_keys=False)
    checked = check_text(text, "spec.yaml", target=run["target"])
    if checked.problem is None:
        errors = [f"{d.code} {d.message}" for d in checked.report.diagnostics if d.severity == "error"]
        return "; ".join(errors) or "no plan"
    problem = checked.problem
    if megatron:
        placement = problem.spec.placement
        train_pin = placement.train.model_copy(update={"backend": "megatron"})
        published = problem.spec.model_copy(update={"placement": placement.model_copy(update={"train": train_pin})})
        problem = dataclasses.replace(problem, spec=published)
    ctx = search.make_context(problem, price_megatron=megatron)
    prompt = run["mean_prompt_tokens"]
    if prompt is None:
        # Unpublished: the measured sample split between prompt and response in proportion to the run's caps (the
        # planner's half-the-cap prompt can exceed a short run's whole sample).
        caps = ctx.work.max_prompt + ctx.work.max_response
        prompt = run["mean_sample_tokens"] * ctx.work.max_prompt / caps
    work = dataclasses.replace(
        ctx.work,
        prompt_tokens=prompt,
        response_tokens=run["mean_sample_tokens"] - prompt,
        reference=bool(run["reference"]),
        extra_forwards=int(run["extra_forwards"]),
    )
    best = search.search_context(dataclasses.replace(ctx, work=work, memo={})).best
    return best if best is not None else "no plan fits"


def band_of(target: str) -> tuple[float, float]:
    """The factors by which the target's profile says measured step times may fall short of the estimate and
    exceed it (explain's "likely" range)."""
    from rlc.schemas.profiles import find_target

    profile = find_target(target)[0]
    return profile.uncertainty_below, profile.estimate_uncertainty


def compare(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for run in runs:
        best = estimate(run)
        if isinstance(best, str):
            rows.append({"id": run["id"], "error": best})
            continue
        measured = run["measured"]
        ratio = best.step.step_s / measured["step_s"]
        fast, slow = band_of(run["target"])
        row: dict[str, Any] = {
            "id": run["id"],
            "target": run["target"],
            "predicted_s": best.step.step_s,
            "measured_s": measured["step_s"],
            "ratio": ratio,
            "band": [fast, slow],
            "in_band": 1 / slow <= ratio <= fast,  # measured within predicted / fast .. predicted x slow
            "outside_band": run.get("outside_band"),
            "fit": bool(run.get("fit")),
            "plan": best.summary,
        }
        phases = dict(measured)
        if "train_s" in phases:  # the estimate's training includes its reference and extra forward passes
            phases["train_s"] += sum(measured.get(k, 0.0) for k in FORWARD_PASSES)
        for key, field in PHASES.items():
            if key in phases:
                row[f"{key}_ratio"] = getattr(best.step, field) / phases[key]
        rows.append(row)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    return {
        "runs": len(ratios),
        "median": statistics.median(ratios),
        "geomean": statistics.geometric_mean(ratios),
        "too_fast": sum(r < 1 for r in ratios),
        "too_slow": sum(r > 1 for r in ratios),
        "within_1_5x": sum(1 / 1.5 <= r <= 1.5 for r in ratios),
        "in_band": sum(bool(r.get("in_band")) for r in rows),
        "outside_band_explained": sum(not r.get("in_band", True) and bool(r.get("outside_band")) for r in rows),
    }


#: Leave-one-out summaries' tolerance for "close": the issue's target for the median factor.
CLOSE = 1.3


def _kind(target: str) -> str:
    from rlc.schemas.profiles import find_target

    return str(find_target(target)[0].kind)


def _gpu_fit() -> Any:
    """benchmarks/fit_gpu_efficiency.py as a module (it imports this one, so it is loaded only when needed)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fit_gpu_efficiency", ROOT / "benchmarks" / "fit_gpu_efficiency.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def leave_one_out(runs: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run predicted by a model fitted without it, with the band the other runs' out-of-sample residuals
    give. A held-out run's in-sample row already is out of sample; a fit run is priced after refitting the GPU
    efficiencies on the other fit runs."""
    from rlc.schemas.registry import load_arch, load_target

    fit_runs = [r for r in runs if r.get("fit")]
    fitter = _gpu_fit() if fit_runs else None
    if fitter is not None:
        for run in fit_runs:
            run["moe"] = load_arch(yaml.safe_load(run["spec"])["model"]["name"]).moe is not None
        shipped = load_target("h100").efficiency
        start = {name: float(getattr(shipped, name)) for name in fitter.BOUNDS}
    out = []
    for run, row in zip(runs, rows, strict=True):
        if "error" in row:
            continue
        loo = dict(row)
        if run.get("fit") and fitter is not None:
            values = fitter.fit([r for r in fit_runs if r is not run], start)
            (loo,) = fitter.with_values(values, [run])
        loo["kind"] = _kind(run["target"])
        loo["factor"] = 1 / loo["ratio"]
        loo["in_sample_for"] = "Ascend efficiencies" if run.get("deployment") else ""
        out.append(loo)
    for row in out:
        others = [r["factor"] for r in out if r is not row and r["kind"] == row["kind"]]
        low, high = (min(others), max(others)) if others else (1.0, 1.0)
        row["loo_band"] = [low, high]
        row["in_loo_band"] = low <= row["factor"] <= high
    return out


def loo_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median published / estimated factor, the share within CLOSE, the shares inside the leave-one-out band and
    the stated band, and per phase (estimated / published inverted) where the sources split the step."""
    factors = [r["factor"] for r in rows]
    n = len(factors)
    phases = {}
    for key in PHASES:
        split = [1 / r[f"{key}_ratio"] for r in rows if f"{key}_ratio" in r]
        if split:
            phases[key] = {"runs": len(split), "median_factor": statistics.median(split)}
    return {
        "runs": n,
        "median_factor": statistics.median(factors),
        "geomean_factor": statistics.geometric_mean(factors),
        "optimistic": sum(f > 1 for f in factors),
        "within_close": sum(1 / CLOSE <= f <= CLOSE for f in factors) / n,
        "in_loo_band": sum(r["in_loo_band"] for r in rows) / n,
        "in_stated_band": sum(bool(r["in_band"]) for r in rows) / n,
        "phases": phases,
        "derived_band": {
            kind: [min(fs), max(fs)]
            for kind in sorted({r["kind"] for r in rows})
            if (fs := [r["factor"] for r in rows if r["kind"] == kind])
        },
    }


def print_loo(rows: list[dict[str, Any]], s: dict[str, Any], label: str) -> None:
    print(f"\n{label}")
    print(f"{'run':40s} {'factor':>6s} {'loo band':>11s}  {'in sample for':s}")
    for r in rows:
        band = "/".join(f"{b:.2f}" for b in r["loo_band"])
        print(f"{r['id']:40s} {r['factor']:6.2f} {' ' if r['in_loo_band'] else '!'}{band:>10s}  {r['in_sample_for']}")
    phases = ", ".join(f"{k[:-2]} {v['median_factor']:.2f} ({v['runs']} runs)" for k, v in s["phases"].items())
    bands = ", ".join(f"{k} {lo:.2f}-{hi:.2f}" for k, (lo, hi) in s["derived_band"].items())
    print(
        f"leave-one-out: {s['runs']} runs, published / estimated factor median {s['median_factor']:.2f}, geometric "
        f"mean {s['geomean_factor']:.2f}; {s['optimistic']} optimistic; {s['within_close']:.0%} within {CLOSE}x; "
        f"{s['in_loo_band']:.0%} inside the band the other runs give, {s['in_stated_band']:.0%} inside the target's "
        f"stated band; per phase median factor: {phases}; out-of-sample factor range per kind: {bands}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the rows and the summary here")
    args = parser.parse_args()
    runs = load_runs()
    rows = compare(runs)
    print("in sample (shipped profiles; their bands were read from these runs):")
    print(
        f"{'run':40s} {'target':6s} {'predicted':>9s} {'measured':>9s} {'ratio':>6s} {'band':>10s}  "
        "phases (predicted / measured)"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['id']:40s} not expressible: {r['error'][:150]}")
            continue
        phases = "  ".join(f"{k[:-2]} {r[f'{k}_ratio']:.2f}" for k in PHASES if f"{k}_ratio" in r)
        print(
            f"{r['id']:40s} {r['target']:6s} {r['predicted_s']:9.1f} {r['measured_s']:9.1f} {r['ratio']:6.2f} "
            f"{' ' if r['in_band'] else '!'}{'/'.join(f'{b:g}' for b in r['band']):>9s}  {phases}"
        )
    held_out = summary([r for r in rows if not r.get("fit")])
    fitted = summary([r for r in rows if r.get("fit")])
    for name, s in (("in-sample summary, held out", held_out), ("in-sample summary, fit runs", fitted)):
        print(
            f"{name}: {s['runs']} runs, predicted / measured step time median {s['median']:.2f}, geometric mean "
            f"{s['geomean']:.2f}; {s['too_fast']} predicted too fast, {s['too_slow']} too slow, "
            f"{s['within_1_5x']} within 1.5x; {s['in_band']} within their target's stated band (explain's range), "
            f"{s['outside_band_explained']} outside it for a stated mechanism (published_runs.yaml outside_band)"
        )
    loo = leave_one_out(runs, rows)
    loo_s = loo_summary(loo)
    print_loo(loo, loo_s, "leave-one-out (each run predicted by a fit without it; the figure to quote):")
    if args.json:
        out = {"rows": rows, "summary": held_out, "summary_fit": fitted, "loo_rows": loo, "loo_summary": loo_s}
        args.json.write_text(json.dumps(out, indent=2, sort_keys=True))


if __name__ == "__main__":
    sys.exit(main())
