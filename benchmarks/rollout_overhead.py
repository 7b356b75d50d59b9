"""rlc's rollout throughput as a ratio to plain vLLM with the same engine settings, measured in one run.

What: output tokens per second of generation on the quickstart's tiny model (built locally with
``build_tiny_model``) with the engine arguments of the quickstart plan's rollout role, compiled with
``rollout.max_response_len=64`` so every sample is 64 tokens (``ignore_eos`` and no ``stop_token_ids``, on
which vLLM stops even with ``ignore_eos``; actual tokens are counted).
Every path samples the same prompts (the plan's seeded arithmetic stream), ``n = group_size`` (8),
temperature 1.0, top-p 1.0, one behaviour log-prob per token, no detokenization.

Paths (only one engine is alive at a time, because every path competes for the same cores):
  A  plain ``vllm.LLM(**plan_engine_args).generate(batch_prompts prompts, SamplingParams(n, logprobs=0))``
     in this process: the baseline.
  B  the runtime's path: the engine as a Ray actor (``rollout_engine_actor``, as ``rlc run`` starts it)
     driven by the real ``Controller``'s rollout side (``_fill``/``_collect``: its chunking, staleness
     admission, ray.wait polling and reward scoring). The trainer is replaced by an instant step that
     frees the batch's slots in the staleness gate once a batch is complete (the policy version stays 0),
     so rollout is the bottleneck and the gate keeps the engine fed as in a run whose training is free.
  B1 the same Ray actor, one ``generate`` call per whole batch (measured alternately with B on the same
     engine): A -> B1 is the cost of rlc's engine wrapper (its RL engine default
     ``logprobs_mode=processed_logprobs``, the conversion to ``Sample``) plus the Ray hop;
     B1 -> B is the cost of the controller (chunking, admission, polling, reward scoring).

Engine lifetimes run in the order A B B A (each path twice, balanced around the middle against
drift); within each lifetime, after a warm-up, several repetitions of a few batches each are timed. The
table shows the median tokens/s of each path over all its repetitions and the ratio to A's median.

Run: python benchmarks/rollout_overhead.py [--reps 5] [--batches 4]   (about 4 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "quickstart.yaml"
MAX_TOKENS = 64
AIM = 0.95  # rlc's rollout path should cost at most 5% of plain vLLM's throughput
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the table readable; engines inherit it


def log(text: str) -> None:
    print(f"[rollout_overhead] {text}", file=sys.stderr, flush=True)


def compile_plan(work: Path) -> Any:
    from rlc.compiler.manifest import load_plan

    out = work / "plan"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "rlc",
            "compile",
            str(SPEC),
            "-o",
            str(out),
            "--set",
            f"rollout.max_response_len={MAX_TOKENS}",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    plan = load_plan(out)
    plan.model.path = str(work / "model")
    return plan


def batches_of_prompts(plan: Any, tokenizer: Any, count: int) -> list[list[list[int]]]:
    """The first ``count`` batches of the plan's prompt stream, as the controller would see them."""
    from rlc.runtime.prompts import PromptStream

    stream = PromptStream(plan.data, tokenizer, plan.algorithm.seed, plan.sampling.max_prompt_len)
    return [[list(item.prompt_ids) for item in stream.take(plan.schedule.batch_prompts)] for _ in range(count)]


class Bench:
    def __init__(self, plan: Any, work: Path, reps: int, batches: int) -> None:
        from rlc.runtime.launch import load_inputs, prepare_model

        self.plan = plan
        self.work = work
        self.reps = reps
        self.batches = batches
        self.model_path, _ = prepare_model(plan, log)
        self.tokenizer, self.reward_fn = load_inputs(plan, self.model_path)
        role = plan.roles_of("rollout")[0]
        self.engine_args = {**role.engine, "model": str(self.model_path)}
        self.env = {**plan.env, **role.env}
        os.environ.update(self.env)  # vLLM reads its settings when the engine starts
        self.n = plan.schedule.group_size
        # warm-up + reps × batches, the same prompt sequence for every path
        self.prompts = batches_of_prompts(plan, self.tokenizer, 2 + reps * batches)
        self.results: dict[str, list[float]] = {"A": [], "B": [], "B1": []}

    def request(self, ids: list[int]) -> dict[str, Any]:
        s = self.plan.sampling
        return {
            "prompt_ids": ids,
            "n": self.n,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
        }

    # ------------------------------------------------------------------ A: plain vLLM

    def plain_vllm(self) -> None:
        from vllm import LLM, SamplingParams

        s = self.plan.sampling
        params = SamplingParams(
            n=self.n,
            temperature=s.temperature,
            top_p=s.top_p,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
        )
        llm = LLM(**self.engine_args)

        def run(batch: list[list[int]]) -> int:
            outs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
            return sum(len(c.token_ids) for o in outs for c in o.outputs)

        try:
            self._timed("A", run)
        finally:
            llm.llm_engine.engine_core.shutdown()
            gc.collect()

    def _timed(self, name: str, run: Any) -> None:
        for batch in self.prompts[:2]:
            run(batch)
        for rep in range(self.reps):
            chunk = self.prompts[2 + rep * self.batches : 2 + (rep + 1) * self.batches]
            t0 = time.perf_counter()
            tokens = sum(run(batch) for batch in chunk)
            self.results[name].append(tokens / (time.perf_counter() - t0))

    # ------------------------------------------------------------------ B: Ray actor + Controller

    def runtime_path(self) -> None:
        import ray

        from rlc.runtime.controller import Controller
        from rlc.runtime.rollout.engine import rollout_engine_actor
        from rlc.runtime.rollout.pool import RolloutPool
        from rlc.schemas.registry import load_target

        bench = self
        resource = load_target(self.plan.target).ray_resource
        tp = self.plan.roles_of("rollout")[0].parallel.tp

        def make_engine(index: int, *_: Any) -> Any:  # as launch.build_roles, without the placement group
            cls = rollout_engine_actor(
                name=f"bench-rollout-{index}",
                num_cpus=0,
                resources={resource: tp},
                runtime_env={"env_vars": self.env},
                max_concurrency=1,
            )
            return cls.remote(self.engine_args, self.plan.platform, self.env, 0)

        class RolloutOnly(Controller):
            def _requests(self, items):  # type: ignore[no-untyped-def]
                # vLLM stops on stop_token_ids even with ignore_eos: drop them so every sample is MAX_TOKENS long.
                full = {"stop_token_ids": [], "ignore_eos": True, "max_tokens": MAX_TOKENS}
                return [{**r, **full} for r in super()._requests(items)]

        pool = RolloutPool(self.plan, make_engine)
        pool.wait_ready()
        run_dir = self.work / "controller"
        run_dir.mkdir(exist_ok=True)
        ctl = RolloutOnly(self.plan, run_dir, self.tokenizer, self.reward_fn, pool, trainer=None)
        actor = pool.engines[0]

        def controller_batches(count: int) -> int:
            """Drive the controller until ``count`` batches are complete.

            An instant 'train' consumes each batch and gives its samples' slots back to the staleness gate (as a
            version bump would) while the policy version stays 0, so no sample is ever too stale.
            """
            tokens = 0
            done = 0
            while done < count:
                ctl._fill()
                ctl._collect(timeout=0.05)
                while len(ctl.finished) >= ctl.batch_prompts:
                    ctl.finished.sort(key=lambda g: g.item.cursor)
                    groups, ctl.finished = ctl.finished[: ctl.batch_prompts], ctl.finished[ctl.batch_prompts :]
                    tokens += sum(len(ids) for g in groups for ids in g.output_ids)
                    ctl.gate.retract(ctl.gate.batch_samples)
                    done += 1
            return tokens

        def drain() -> None:
            ray.get(list(ctl.inflight))
            ctl.inflight.clear()
            ctl.finished.clear()
            ctl.gate.submitted = 0  # the discarded samples give back their slots

        def whole_batch(batch: list[list[int]]) -> int:
            groups = ray.get(actor.generate.remote([bench.request(ids) for ids in batch]))
            return sum(len(s.output_ids) for g in groups for s in g)

        try:
            controller_batches(2)
            drain()
            whole_batch(self.prompts[0])
            for rep in range(self.reps):
                t0 = time.perf_counter()
                tokens = controller_batches(self.batches)
                self.results["B"].append(tokens / (time.perf_counter() - t0))
                drain()
                chunk = self.prompts[2 + rep * self.batches : 2 + (rep + 1) * self.batches]
                t0 = time.perf_counter()
                tokens = sum(whole_batch(batch) for batch in chunk)
                self.results["B1"].append(tokens / (time.perf_counter() - t0))
        finally:
            ctl.close()
            with contextlib.suppress(Exception):
                ray.get(actor.shutdown.remote(), timeout=60)
            pool.shutdown()
            time.sleep(2)  # let the engine-core process exit before the next engine starts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per engine lifetime")
    parser.add_argument("--batches", type=int, default=4, help="batches (batch_prompts × n samples) per repetition")
    args = parser.parse_args()

    import ray

    from rlc.runtime.launch import start_ray

    with tempfile.TemporaryDirectory(prefix="rlc-bench-rollout-") as tmp:
        work = Path(tmp)
        plan = compile_plan(work)
        bench = Bench(plan, work, args.reps, args.batches)
        start_ray(plan, log)
        try:
            for name in ("A", "B", "B", "A"):
                t0 = time.perf_counter()
                {"A": bench.plain_vllm, "B": bench.runtime_path}[name]()
                log(f"path {name} done in {time.perf_counter() - t0:.0f} s")
        finally:
            ray.shutdown()

    res = bench.results
    base = statistics.median(res["A"])
    s = plan.schedule
    print(
        f"rollout tokens/s, tiny model, {s.batch_prompts} prompts x n={s.group_size} x {MAX_TOKENS} tokens per batch, "
        f"{args.reps * 2} reps x {args.batches} batches per path (median, min-max)"
    )
    labels = {
        "A": "plain vllm.LLM.generate, whole batch",
        "B1": "RolloutEngine Ray actor, whole batch",
        "B": f"Ray actor + Controller ({plan.schedule.rollout_chunk_prompts}-prompt chunks)",
    }
    print(f"{'path':4s} {'':44s} {'tokens/s':>10s} {'min':>9s} {'max':>9s} {'ratio':>7s}")
    for name in ("A", "B1", "B"):
        vals = res[name]
        med = statistics.median(vals)
        print(f"{name:4s} {labels[name]:44s} {med:10.0f} {min(vals):9.0f} {max(vals):9.0f} {med / base:7.2f}")
    ratio = statistics.median(res["B"]) / base
    print(
        f"summary: rlc rollout (Ray actor + controller) runs at {ratio:.2f}x plain vLLM's tokens/s "
        f"({'meets' if ratio >= AIM else 'below'} the {AIM} aim); the same actor fed whole batches "
        f"{statistics.median(res['B1']) / base:.2f}x"
    )


if __name__ == "__main__":
    main()
