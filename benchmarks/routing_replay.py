"""Rollout routing replay (R3) on the cpu MoE example: how far the trainer's log-probs sit from the engine's, how
spread the importance weights are, and how it learns, with the router's experts replayed from the engine
(`rollout`), from the proximal pass (`proximal`), or not at all (`off`).

What: `examples/cpu-moe.yaml` (tiny Qwen3-MoE, 8 experts top-2, EP 2 trainer, one vLLM engine) with the trainer in
bfloat16 compute against the float32 engine, so the two sides' routers disagree on near-tied tokens as a bf16
accelerator run's do, and two minibatches per step (so the proximal replay has a pass to replay). Per variant and
seed: the share of (token, MoE layer) pairs whose trainer-chosen experts equal the engine's before replay
(`moe/rollout_routing_agreement`), the engine-trainer log-prob gap on the sampled tokens under the same weights
(`logprob_gap/mean`, `/max`), the largest behaviour importance weight (`behave_imp_weight/max`), and the mean reward
of the first and the last fifth of the steps. Every variant runs the same seeds.

Run: python benchmarks/routing_replay.py [--steps 400] [--seeds 0,1,2] [--only rollout,off] [--json out.json]
(400 steps: about 3-4 minutes per run on 2 cores; ``--steps 20 --seeds 0`` for a smoke run)
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from pathlib import Path

from algorithms import ROOT, chosen_variants, fifths, keep, run_spec, variant_arguments

SPEC = ROOT / "examples" / "cpu-moe.yaml"
COMMON = {"train.precision": "bfloat16", "algorithm.minibatches": "2"}
VARIANTS = ("off", "proximal", "rollout")
METRICS = ("moe/rollout_routing_agreement", "logprob_gap/mean", "logprob_gap/max", "behave_imp_weight/max")


def run(variant: str, seed: int, work: Path, steps: int) -> dict[str, float | str]:
    """One run: its reward curve's ends and the means of the routing metrics over its steps."""
    rows, wall = run_spec(SPEC, {**COMMON, "train.routing_replay": variant}, work / f"{variant}-{seed}", steps, seed)
    first, last = fifths([r["reward/mean"] for r in rows])
    result: dict[str, float | str] = {"variant": variant, "seed": float(seed), "first": first, "last": last}
    for key in METRICS:
        values = [r[key] for r in rows if key in r]
        result[key] = statistics.fmean(values) if values else float("nan")
    result["step_s"] = statistics.median(r["time/step_s"] for r in rows)
    result["wall_s"] = wall
    return result


def table(results: list[dict[str, float | str]]) -> str:
    """The README's markdown table: each variant's means over seeds."""
    lines = [
        "| replay | agreement | log-prob gap, mean | gap, max | max importance weight | reward first → last fifth |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for variant in VARIANTS:
        mine = [r for r in results if r["variant"] == variant]
        if not mine:
            continue

        def mean(key: str, rows: list[dict[str, float | str]] = mine) -> float:
            return statistics.fmean(float(r[key]) for r in rows)

        agreement = mean(METRICS[0])  # nan where nothing was captured (replay off or proximal)
        shown = "not captured" if math.isnan(agreement) else f"{agreement:.4f}"
        lines.append(
            f"| {variant} | {shown} | {mean(METRICS[1]):.2e} | {mean(METRICS[2]):.3f} | "
            f"{mean(METRICS[3]):.3f} | {mean('first'):.2f} → {mean('last'):.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    variant_arguments(parser, 400)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    args = parser.parse_args()
    variants = chosen_variants(parser, args.only, list(VARIANTS))
    seeds = [int(s) for s in args.seeds.split(",") if s]
    work = args.work or Path(tempfile.mkdtemp(prefix="rlc-routing-replay-"))
    results = []
    for seed in seeds:  # interleaved: machine drift lands on every variant alike
        for variant in variants:
            keep(results, run(variant, seed, work, args.steps), args.json)
    print(table(results))


if __name__ == "__main__":
    main()
