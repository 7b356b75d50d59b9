"""Streaming rollout against the whole-share feed it replaced, on long-tailed responses, measured in one run.

What: output tokens per second and running sequences of one rollout engine, the actor `rlc run` starts
(`rollout_engine_actor`, vLLM's async engine), on the quickstart's tiny model (built locally) with the engine
arguments of the quickstart plan compiled with `rollout.max_response_len=500`, `max_num_seqs` set to
`--concurrency` (the engine runs at most that many sequences at once) and log stats on (to read vLLM's
running-sequences gauge). Response lengths are long-tailed as RL's are: each sample's length is drawn from an
exponential law (mean 48 tokens, capped at 500) and enforced with `max_tokens` and `ignore_eos`, the same
lengths for both feeds in a repetition.

Feeds, alternated (the order flips every repetition; this machine's speed drifts minute to minute):
  share   the feed before streaming (kept here only): the engine's whole share of a step, `--concurrency`
          samples, as one generate call; the next share once it returns, i.e. once its longest sample ends.
  stream  the controller's feed now (`compiler/cost/rollout.py`): one request per sample group (here one sample), up to
          STREAM_OVERFILL x max_num_seqs of them held by the engine, each finished one replaced at once; vLLM's
          waiting queue refills a freed slot without waiting for that round trip.
Both generate `--samples` samples per repetition. Reported per feed: tokens/s (median over repetitions), the
mean running sequences over the whole run (the gauge sampled every 50 ms), and for the stream its steady state
(from the first full admission to the last new request) as a fraction of the engine's concurrency
(max_num_seqs); then the median of the per-repetition tokens/s ratios stream / share.

Run: python benchmarks/rollout_stream.py [--reps 3] [--samples 1024] [--concurrency 128]   (~4 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlc.compiler.cost import STREAM_OVERFILL

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "quickstart.yaml"
MEAN_LEN = 48
CAP = 500  # the tiny model has 512 positions; prompts take up to 8
SAMPLE_EVERY_S = 0.05
AIM_RATIO = 1.3
AIM_OCCUPANCY = 0.9


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def compile_plan(out: Path) -> dict[str, Any]:
    import json

    subprocess.run(
        [sys.executable, "-m", "rlc", "compile", str(SPEC), "-o", str(out), "--set", f"rollout.max_response_len={CAP}"],
        check=True,
        capture_output=True,
    )
    return json.loads((out / "plan.json").read_text())


def lengths(rep: int, samples: int) -> list[int]:
    rng = random.Random(rep)
    return [max(1, min(CAP, round(rng.expovariate(1 / MEAN_LEN)))) for _ in range(samples)]


class Sampler:
    """Reads the engine's running-sequences gauge every SAMPLE_EVERY_S while a feed runs."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.points: list[tuple[float, float]] = []
        self._stop = asyncio.Event()

    async def run(self) -> None:
        while not self._stop.is_set():
            self.points.append((time.perf_counter(), float(await self.engine.running_sequences.remote())))
            await asyncio.sleep(SAMPLE_EVERY_S)

    def stop(self) -> None:
        self._stop.set()

    def mean(self, start: float = 0.0, end: float = float("inf")) -> float:
        values = [v for t, v in self.points if start <= t <= end]
        return statistics.fmean(values) if values else 0.0


def request(prompt: list[int], max_tokens: int, seed: int) -> dict[str, Any]:
    return {
        "prompt_ids": prompt,
        "n": 1,
        "temperature": 1.0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "seed": seed,
    }


async def share_feed(engine: Any, prompts: list[list[int]], lens: list[int], concurrency: int) -> dict[str, float]:
    sampler = Sampler(engine)
    watching = asyncio.ensure_future(sampler.run())
    t0 = time.perf_counter()
    tokens = 0
    for start in range(0, len(lens), concurrency):
        batch = [
            request(prompts[i % len(prompts)], lens[i], i) for i in range(start, min(len(lens), start + concurrency))
        ]
        results = await engine.generate.remote(batch)
        tokens += sum(len(s.output_ids) for r in results for s in r)
    elapsed = time.perf_counter() - t0
    sampler.stop()
    await watching
    return {"tokens_per_s": tokens / elapsed, "running": sampler.mean(), "steady": sampler.mean()}


async def stream_feed(engine: Any, prompts: list[list[int]], lens: list[int], concurrency: int) -> dict[str, float]:
    sampler = Sampler(engine)
    watching = asyncio.ensure_future(sampler.run())
    t0 = time.perf_counter()
    pending: set[asyncio.Future] = set()
    sent = tokens = 0
    full_at = last_sent_at = 0.0
    held = STREAM_OVERFILL * concurrency
    while sent < len(lens) or pending:
        while sent < len(lens) and len(pending) < held:
            ref = engine.generate.remote([request(prompts[sent % len(prompts)], lens[sent], sent)])
            pending.add(asyncio.ensure_future(ref))
            sent += 1
            if sent == held:
                full_at = time.perf_counter()
            if sent == len(lens):
                last_sent_at = time.perf_counter()
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        tokens += sum(len(s.output_ids) for fut in done for r in fut.result() for s in r)
    elapsed = time.perf_counter() - t0
    sampler.stop()
    await watching
    return {
        "tokens_per_s": tokens / elapsed,
        "running": sampler.mean(),
        "steady": sampler.mean(full_at + 0.5, last_sent_at),  # half a second for the first prefill wave
    }


async def main_async(args: argparse.Namespace) -> int:
    import ray

    from rlc.runtime.rollout.engine import rollout_engine_actor
    from rlc.runtime.tasks.model_builder import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="rlc-stream-"))
    plan = compile_plan(tmp / "plan")
    model = build_tiny_model(tmp / "model", seed=0)
    (role,) = [r for r in plan["roles"] if r["name"] == "rollout"]
    engine_args = {**role["engine"], "model": str(model), "disable_log_stats": False, "max_num_seqs": args.concurrency}
    env = {**plan["env"], **role["env"]}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompts = [tokenizer(f"{a}+{b}=").input_ids for a in range(10) for b in range(10)]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    engine = rollout_engine_actor(num_cpus=1, runtime_env={"env_vars": env}).remote(engine_args, "cpu", env)
    log(f"engine ready in {await engine.ready.remote():.1f} s; max_num_seqs {engine_args.get('max_num_seqs')}")
    await engine.generate.remote([request(prompts[0], 16, 0)] * 8)  # warm-up
    feeds = {"share": share_feed, "stream": stream_feed}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in feeds}
    for rep in range(args.reps):
        lens = lengths(rep, args.samples)
        order = list(feeds) if rep % 2 == 0 else list(reversed(feeds))
        for name in order:
            got = await feeds[name](engine, prompts, lens, args.concurrency)
            results[name].append(got)
            log(f"rep {rep} {name:6s} {got['tokens_per_s']:7.0f} tok/s, running {got['running']:5.1f} mean")
    await engine.shutdown.remote()
    ray.shutdown()
    ratios = [s["tokens_per_s"] / c["tokens_per_s"] for s, c in zip(results["stream"], results["share"], strict=True)]
    steady = statistics.median(r["steady"] for r in results["stream"]) / args.concurrency
    print(
        f"rollout feeds, tiny model, {args.samples} samples/rep, lengths ~ Exp(mean {MEAN_LEN}) capped {CAP}, "
        f"max_num_seqs {args.concurrency}, {args.reps} reps (median):"
    )
    print(f"{'feed':8s} {'tokens/s':>9s} {'running mean':>13s}")
    for name, rows in results.items():
        tps = statistics.median(r["tokens_per_s"] for r in rows)
        running = statistics.median(r["running"] for r in rows)
        print(f"{name:8s} {tps:9.0f} {running:13.1f}")
    ratio = statistics.median(ratios)
    print(
        f"stream / share tokens/s: {ratio:.2f}x (aim >= {AIM_RATIO}x); per rep {', '.join(f'{r:.2f}' for r in ratios)}"
    )
    print(f"stream steady-state running / max_num_seqs: {steady:.2f} (aim >= {AIM_OCCUPANCY})")
    return 0 if ratio >= AIM_RATIO and steady >= AIM_OCCUPANCY else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=128)
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
