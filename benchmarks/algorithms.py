"""Each algorithm rlc's spec selects, learning the quickstart task: the reward curve of every estimator and of the
DAPO and GSPO examples against GRPO, on the same seeds.

What: for each variant, one `rlc run` of the quickstart (tiny Qwen3, one-digit addition, 16 prompts × 8 samples,
lr 5e-4, max_staleness 0) with one algorithm choice changed, and the mean reward of the first and the last fifth of
its steps. The reward is the policy's own success rate: `reward/generated_mean` where dynamic sampling drops
groups (its `reward/mean` is over the trained groups only, which it biases towards half right), else
`reward/mean`. Also the median step time, and for DAPO the mean groups generated per trained group.

Variants: grpo (quickstart.yaml as shipped), dr_grpo, rloo, reinforce_pp (β 0.01, k1: it scores every batch under
a reference policy too), reinforce_pp_batchnorm, reinforce_pp_baseline (quickstart.yaml with `algorithm.name` set),
dapo (examples/cpu-dapo.yaml), gspo (examples/cpu-gspo.yaml). Every run uses the same seed, so the prompts and the
model's warm-up are the same; the samples differ once the policies do.

Run: python benchmarks/algorithms.py [--steps 600] [--seed 0] [--only grpo,dapo] [--json out.json] [--work DIR]
(600 steps: about 3-4 minutes per variant on 2 cores; ``--steps 20`` for a smoke run)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"

#: name → (spec file, --set overrides)
VARIANTS: dict[str, tuple[Path, dict[str, str]]] = {
    "grpo": (QUICKSTART, {}),
    "dr_grpo": (QUICKSTART, {"algorithm.name": "dr_grpo"}),
    "rloo": (QUICKSTART, {"algorithm.name": "rloo"}),
    "reinforce_pp": (QUICKSTART, {"algorithm.name": "reinforce_pp", "algorithm.reward_kl_coef": "0.01"}),
    "reinforce_pp_batchnorm": (QUICKSTART, {"algorithm.name": "reinforce_pp_batchnorm"}),
    "reinforce_pp_baseline": (QUICKSTART, {"algorithm.name": "reinforce_pp_baseline"}),
    "dapo": (ROOT / "examples" / "cpu-dapo.yaml", {}),
    "gspo": (ROOT / "examples" / "cpu-gspo.yaml", {}),
}


def run_spec(spec: Path, sets: dict[str, str], work: Path, steps: int, seed: int) -> tuple[list[dict], float]:
    """Compile `spec` with `sets` overridden and run it in `work`; its metrics rows and the run's wall seconds."""
    out, run_dir = work / "plan", work / "run"
    sets = {
        **sets,
        "algorithm.steps": str(steps),
        "algorithm.seed": str(seed),
        "output.dir": str(run_dir),
        "output.checkpoint_every": str(steps),
    }
    cmd = [sys.executable, "-m", "rlc", "compile", str(spec), "-o", str(out)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    t0 = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    with (work / "run.log").open("w") as log:
        subprocess.run([sys.executable, "-m", "rlc", "run", str(out)], check=True, stdout=log, stderr=log, cwd=ROOT)
    wall = time.perf_counter() - t0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()], wall


def fifths(values: list[float]) -> tuple[float, float]:
    """Means of the first and the last fifth of a curve."""
    fifth = max(1, len(values) // 5)
    return statistics.fmean(values[:fifth]), statistics.fmean(values[-fifth:])


def run_variant(name: str, work: Path, steps: int, seed: int) -> dict[str, float | str]:
    """Compile and run one variant; its reward curve's ends and its step time."""
    spec, sets = VARIANTS[name]
    rows, wall = run_spec(spec, sets, work / name, steps, seed)
    rewards = [r.get("reward/generated_mean", r["reward/mean"]) for r in rows]
    fifth = max(1, len(rows) // 5)
    first, last = fifths(rewards)
    result: dict[str, float | str] = {
        "variant": name,
        "steps": float(len(rows)),
        "reward_first_fifth": first,
        "reward_last_fifth": last,
        "gain": last - first,
        "step_s": statistics.median(r["time/step_s"] for r in rows[fifth:] or rows),
        "wall_s": wall,
    }
    draws = [r["rollout/generated_per_kept"] for r in rows if "rollout/generated_per_kept" in r]
    if draws:
        result["generated_per_kept"] = statistics.fmean(draws)
    return result


def table(results: list[dict[str, float | str]]) -> str:
    """The README's markdown table."""
    grpo = next((r for r in results if r["variant"] == "grpo"), None)
    lines = [
        "| algorithm | reward, first fifth | reward, last fifth | gain | vs GRPO | s/step | generated per kept |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        vs = f"{float(r['gain']) - float(grpo['gain']):+.3f}" if grpo is not None and r is not grpo else ""
        draws = f"{float(r['generated_per_kept']):.2f}" if "generated_per_kept" in r else ""
        lines.append(
            f"| {r['variant']} | {float(r['reward_first_fifth']):.3f} | {float(r['reward_last_fifth']):.3f} | "
            f"{float(r['gain']):+.3f} | {vs} | {float(r['step_s']):.3f} | {draws} |"
        )
    return "\n".join(lines)


def variant_arguments(parser: argparse.ArgumentParser, steps: int) -> None:
    """The options every variant benchmark takes."""
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--only", default="", help="comma-separated variants (default: all)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--work", type=Path, help="keep plans and runs here (default: a temporary folder)")


def chosen_variants(parser: argparse.ArgumentParser, only: str, known: list[str]) -> list[str]:
    """The variants `--only` names (all by default); an unknown name is a usage error."""
    names = [n for n in only.split(",") if n] or list(known)
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    return names


def keep(results: list[dict[str, float | str]], result: dict[str, float | str], path: Path | None) -> None:
    """Print one run's result as it lands and add it to `results` (and the `--json` file: a long benchmark stopped
    part-way keeps what it measured)."""
    print(json.dumps(result), flush=True)
    results.append(result)
    if path:
        path.write_text(json.dumps(results, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    variant_arguments(parser, 600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    names = chosen_variants(parser, args.only, list(VARIANTS))
    work = args.work or Path(tempfile.mkdtemp(prefix="rlc-algorithms-"))
    results = []
    for name in names:
        keep(results, run_variant(name, work, args.steps, args.seed), args.json)
    print(table(results))


if __name__ == "__main__":
    main()
