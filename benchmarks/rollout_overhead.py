"""rlc's rollout throughput as a ratio to plain vLLM with the same engine settings, measured in one run.

What: output tokens per second of generation on the quickstart's tiny model (built locally with
``build_tiny_model``) with the engine arguments of the quickstart plan's rollout role, compiled with
``rollout.max_response_len=64`` so every sample is 64 tokens (``ignore_eos`` and no ``stop_token_ids``, on
which vLLM stops even with ``ignore_eos``; actual tokens are counted).
Every path samples the same prompts (the plan's seeded arithmetic stream), ``n = group_size`` (8),
temperature 1.0, top-p 1.0, one behaviour log-prob per token, no detokenization.

Paths:
  A  plain ``vllm.LLM(**plan_engine_args).generate(batch_prompts prompts, SamplingParams(n, logprobs=0))``
     in this process: the baseline.
  As plain vLLM again, each prompt's ``SamplingParams`` carrying the seed the plan gives it
     (``runtime/seeds.py``): the baseline for B, whose requests carry the same seeds. A -> As is what
     vLLM's seeded sampler costs by itself.
  B  the runtime's path: the engine as a Ray actor (``rollout_engine_actor``, as ``rlc run`` starts it)
     driven by the real ``Controller``'s workflow (``fill``/``collect``: its feed, staleness
     admission, its wait on results and reward scoring). The trainer is replaced by an instant step that
     frees the batch's slots in the staleness gate once a batch is complete (the policy version stays 0),
     so rollout is the bottleneck and the gate keeps the engine fed as in a run whose training is free.
  B1 the same Ray actor, one ``generate`` call per whole batch: A -> B1 is the cost of rlc's engine wrapper
     (its RL engine default ``logprobs_mode=processed_logprobs``, the conversion to ``Sample``) plus the Ray
     hop.
  Bu the controller of the same plan with what ``algorithm.deterministic: false`` changes on the rollout side:
     no per-request seeds (``runtime/seeds.py``, what makes runs repeat exactly and replay): B1 -> Bu is the
     controller's feed itself (admission, waiting, reward scoring while the engine waits at max_staleness 0),
     Bu -> B what the seeds cost inside vLLM's sampler. B / As is the controller's cost at equal sampling work.

Both engines are alive for the whole run and every repetition times every path back to back, in an
order that rotates from one repetition to the next: this machine's speed drifts by tens of percent from
minute to minute, so a baseline measured minutes apart from its path decides nothing. Neither engine uses
CPU while the other path runs (vLLM runs in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the idle engine's
CPU-seconds during the other paths are measured and printed). Each path gets the threads the plan gives the
rollout role (the cpu target's one device per engine is one core: the Ray actor runs with
``OMP_NUM_THREADS=1``, so plain vLLM does too).
The table shows each path's median tokens/s over the repetitions, the median of the per-repetition ratios to
A (the paired figure the summary reports), and the generating process's CPU-milliseconds per 1,000 tokens (the
engine actor's for B1, Bu and B: the controller's own work is in the driver and shows in their tokens/s).

Run: python benchmarks/rollout_overhead.py [--reps 12] [--batches 3]   (about 6 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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
# Ray starts rlc's engine actors (num_cpus=0) with OMP_NUM_THREADS=1, one core per cpu-target device: plain vLLM in
# this process gets the same, set before torch is imported.
os.environ["OMP_NUM_THREADS"] = "1"


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


#: One prompt as the controller sees it: (its cursor in the plan's prompt stream, its token ids).
Prompt = tuple[int, list[int]]


def batches_of_prompts(plan: Any, tokenizer: Any, count: int) -> list[list[Prompt]]:
    """The first ``count`` batches of the plan's prompt stream, as the controller would see them."""
    from rlc.runtime.prompts import PromptStream

    stream = PromptStream(plan.data, tokenizer, plan.algorithm.seed, plan.sampling.max_prompt_len)
    return [
        [(item.cursor, list(item.prompt_ids)) for item in stream.take(plan.schedule.batch_prompts)]
        for _ in range(count)
    ]


PATHS = ("A", "As", "B1", "Bu", "B")


def cpu_seconds(process: Any) -> float:
    """User + system CPU-seconds of a ``psutil.Process`` so far."""
    times = process.cpu_times()
    return times.user + times.system


class Bench:
    """Both engines (plain vLLM in this process, rlc's engine actor with the controller) and the timed paths."""

    def __init__(self, plan: Any, work: Path, reps: int, batches: int) -> None:
        from rlc.runtime.run_inputs import load_inputs, prepare_model

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
        self.results: dict[str, list[float]] = {name: [] for name in PATHS}
        # Each engine's CPU-s while the other one generated: the actor's during A, this process's during B1 (not
        # during B or Bu, whose controller runs in this process).
        self.idle_cpu: dict[str, float] = {"actor": 0.0, "plain": 0.0}
        # The generating process's CPU-ms per 1,000 tokens: steadier than tokens/s when the machine's speed drifts.
        self.cpu_per_ktok: dict[str, list[float]] = {name: [] for name in PATHS}
        self.threads: dict[str, int] = {}

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

    def plain_vllm(self, stack: contextlib.ExitStack) -> dict[str, Any]:
        """Start plain vLLM in this process; returns the A and As runners (``run(batch) -> tokens``)."""
        import torch
        from vllm import LLM, SamplingParams

        from rlc.runtime.seeds import request_seed

        s = self.plan.sampling

        def params(seed: int | None) -> Any:
            return SamplingParams(
                n=self.n,
                temperature=s.temperature,
                top_p=s.top_p,
                max_tokens=MAX_TOKENS,
                ignore_eos=True,
                logprobs=0,
                detokenize=False,
                seed=seed,
            )

        llm = LLM(**self.engine_args)
        stack.callback(llm.llm_engine.engine_core.shutdown)
        self.threads["A"] = torch.get_num_threads()
        unseeded = params(None)

        def run(batch: list[Prompt], seeded: bool) -> int:
            sampling = (
                [params(request_seed(self.plan.algorithm.seed, cursor)) for cursor, _ in batch] if seeded else unseeded
            )
            outs = llm.generate([{"prompt_token_ids": ids} for _, ids in batch], sampling, use_tqdm=False)
            return sum(len(c.token_ids) for o in outs for c in o.outputs)

        return {
            "A": lambda batches: sum(run(b, seeded=False) for b in batches),
            "As": lambda batches: sum(run(b, seeded=True) for b in batches),
        }

    # ------------------------------------------------------------------ B: Ray actor + Controller

    def runtime_path(self, stack: contextlib.ExitStack) -> tuple[dict[str, Any], int]:
        """Start rlc's engine actor and two rollout-only controllers; returns the B1, Bu and B runners (each
        ``run(batches) -> tokens``) and the actor's pid."""
        import ray

        from rlc.runtime.controller import Controller
        from rlc.runtime.rollout.engine import rollout_engine_actor
        from rlc.runtime.rollout.pool import RolloutPool
        from rlc.runtime.workflows.generate import GenerateWorkflow
        from rlc.schemas.registry import load_target

        bench = self
        resource = load_target(self.plan.target).ray_resource
        tp = self.plan.roles_of("rollout")[0].parallel.tp

        def make_engine(index: int, *_: Any) -> Any:  # as role_actors.build_roles, without the placement group
            cls = rollout_engine_actor(
                name=f"bench-rollout-{index}",
                num_cpus=0,
                resources={resource: tp},
                runtime_env={"env_vars": self.env},
            )
            return cls.remote(self.engine_args, self.plan.platform, self.env, 0)

        class FullLength(GenerateWorkflow):
            def requests(self, items):  # type: ignore[no-untyped-def]
                # vLLM stops on stop_token_ids even with ignore_eos: drop them so every sample is MAX_TOKENS long.
                full = {"stop_token_ids": [], "ignore_eos": True, "max_tokens": MAX_TOKENS}
                return [{**r, **full} for r in super().requests(items)]

        pool = RolloutPool(self.plan, make_engine)
        stack.callback(pool.shutdown)
        pool.wait_ready()
        actor = pool.engines[0].actor
        stack.callback(lambda: ray.get(actor.shutdown.remote(), timeout=60))
        # What `algorithm.deterministic: false` changes on the rollout side: no per-request seeds.
        unseeded = self.plan.model_copy(deep=True)
        unseeded.reproducibility.seeded_sampling = False
        controllers = {}
        for name, plan in (("B", self.plan), ("Bu", unseeded)):
            run_dir = self.work / f"controller-{name}"
            run_dir.mkdir(exist_ok=True)
            controllers[name] = Controller(
                plan, run_dir, self.tokenizer, self.reward_fn, pool, trainer=None, workflow=FullLength
            )
            stack.callback(controllers[name].close)
        # Self-contained: the actor cannot import this module, so the probe names nothing from it.
        probe = lambda _: (__import__("os").getpid(), __import__("torch").get_num_threads())  # noqa: E731
        pid, threads = ray.get(actor.__ray_call__.remote(probe))
        self.threads["B"] = threads

        def controller_batches(ctl: Controller, batches: list[list[Prompt]]) -> int:
            """Drive ``ctl`` until ``len(batches)`` batches are complete (it draws its own prompts from the same
            stream, so the count is what matters).

            An instant 'train' consumes each batch and gives its samples' slots back to the staleness gate (as a
            version bump would) while the policy version stays 0, so no sample is ever too stale.
            """
            tokens = 0
            done = 0
            wf = ctl.workflow
            while done < len(batches):
                wf.fill()
                wf.collect(timeout=0.05)
                while (groups := wf.next_batch()) is not None:
                    tokens += sum(len(ids) for g in groups for ids in g.output_ids)
                    ctl.gate.retract(ctl.gate.batch_samples)
                    done += 1
            # Leave nothing in flight: the other paths must not share the engine with a request of this one.
            ray.get(list(wf.inflight))
            wf.inflight.clear()
            wf.finished.clear()
            ctl.gate.submitted = 0  # the discarded samples give back their slots
            return tokens

        def whole_batch(batches: list[list[Prompt]]) -> int:
            total = 0
            for batch in batches:
                groups = ray.get(actor.generate.remote([bench.request(ids) for _, ids in batch]))
                total += sum(len(s.output_ids) for g in groups for s in g)
            return total

        runners = {name: functools.partial(controller_batches, ctl) for name, ctl in controllers.items()}
        return {"B1": whole_batch, **runners}, pid

    def measure(self) -> None:
        """Start both engines, warm each path, then time every path in each repetition, rotating the order."""
        import psutil

        with contextlib.ExitStack() as stack:
            plain_runners = self.plain_vllm(stack)
            actor_runners, actor_pid = self.runtime_path(stack)
            runners = {**plain_runners, **actor_runners}
            this, actor = psutil.Process(), psutil.Process(actor_pid)
            # name -> (the process that generates, the idle engine's process and its idle_cpu key, if measured)
            roles = {
                "A": (this, (actor, "actor")),
                "As": (this, None),
                "B1": (actor, (this, "plain")),
                "Bu": (actor, None),
                "B": (actor, None),
            }
            for run in runners.values():
                run(self.prompts[:2])
            for rep in range(self.reps):
                chunk = self.prompts[2 + rep * self.batches : 2 + (rep + 1) * self.batches]
                for name in PATHS[rep % len(PATHS) :] + PATHS[: rep % len(PATHS)]:
                    engine, idle = roles[name]
                    busy0 = cpu_seconds(engine)
                    idle0 = cpu_seconds(idle[0]) if idle else 0.0
                    t0 = time.perf_counter()
                    tokens = runners[name](chunk)
                    self.results[name].append(tokens / (time.perf_counter() - t0))
                    self.cpu_per_ktok[name].append(1e6 * (cpu_seconds(engine) - busy0) / tokens)
                    if idle:
                        self.idle_cpu[idle[1]] += cpu_seconds(idle[0]) - idle0
                log(f"repetition {rep + 1}/{self.reps} done")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=12, help="timed repetitions (each times every path once)")
    parser.add_argument("--batches", type=int, default=3, help="batches per path and repetition")
    args = parser.parse_args()

    import ray

    from rlc.runtime.ray_start import start_ray

    with tempfile.TemporaryDirectory(prefix="rlc-bench-rollout-") as tmp:
        work = Path(tmp)
        plan = compile_plan(work)
        bench = Bench(plan, work, args.reps, args.batches)
        start_ray(plan, log)
        try:
            t0 = time.perf_counter()
            bench.measure()
            log(f"measured in {time.perf_counter() - t0:.0f} s")
        finally:
            ray.shutdown()

    res = bench.results
    base = statistics.median(res["A"])
    paired = {name: statistics.median(v / a for v, a in zip(res[name], res["A"], strict=True)) for name in PATHS}
    s = plan.schedule
    print(
        f"rollout tokens/s, tiny model, {s.batch_prompts} prompts x n={s.group_size} x {MAX_TOKENS} tokens per batch, "
        f"{args.reps} reps x {args.batches} batches per path, paths alternating (median, min-max)"
    )
    labels = {
        "A": "plain vllm.LLM.generate, whole batch",
        "As": "plain vllm.LLM.generate, the plan's seeds",
        "B1": "RolloutEngine Ray actor, whole batch",
        "Bu": "Ray actor + Controller, deterministic: false",
        "B": f"Ray actor + Controller ({s.rollout_chunk_prompts}-prompt requests)",
    }
    print(
        f"{'path':4s} {'':44s} {'tokens/s':>10s} {'min':>9s} {'max':>9s} {'ratio':>7s} {'paired':>7s} "
        f"{'engine CPU-ms/1k tok':>21s}"
    )
    for name in PATHS:
        vals = res[name]
        med = statistics.median(vals)
        print(
            f"{name:4s} {labels[name]:44s} {med:10.0f} {min(vals):9.0f} {max(vals):9.0f} {med / base:7.2f} "
            f"{paired[name]:7.2f} {statistics.median(bench.cpu_per_ktok[name]):21.1f}"
        )
    print(
        f"torch threads: plain vLLM {bench.threads['A']}, engine actor {bench.threads['B']}; idle engine's CPU-s while "
        f"the other ran: actor during A {bench.idle_cpu['actor']:.2f}, plain during B1 {bench.idle_cpu['plain']:.2f}"
    )
    ratio = paired["B"]
    # B against plain vLLM given the same seeded requests: the controller's cost at equal sampling work.
    same_seeds = statistics.median(b / a for b, a in zip(res["B"], res["As"], strict=True))
    print(
        f"summary: rlc rollout (Ray actor + controller) runs at {same_seeds:.2f}x plain vLLM given the same seeded "
        f"requests ({'meets' if same_seeds >= AIM else 'below'} the {AIM} aim; median of per-repetition ratios) and "
        f"{ratio:.2f}x unseeded plain vLLM; seeds alone cost plain vLLM {paired['As']:.2f}x; the actor fed whole "
        f"batches {paired['B1']:.2f}x; the controller without per-request seeds (algorithm.deterministic: false) "
        f"{paired['Bu']:.2f}x"
    )


if __name__ == "__main__":
    main()
