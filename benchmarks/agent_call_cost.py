"""What one agent model call costs the served engine's host beyond decoding: the planner's agent-call overhead.

What: the host seconds per chat call of rlc's served engine path (vLLM's OpenAI-compatible app in the engine's Ray
actor behind rlc's ``SessionRouter``: HTTP, the chat template, tokenization, detokenization, the per-session
recording, and the ``openai`` client), on the cpu target. The planner prices an engine serving n calls in one turn
round at about n x this figure on top of its decode steps (``AGENT_CALL_OVERHEAD_S["cpu"]``).

How: the calculator model of ``examples/cpu-agent.yaml`` (built locally with ``build_tiny_model``) served by
``rollout_engine_actor`` with the engine args, env, agent and sampling settings of that example's compiled plan (its
``rollout`` role), started once in a local Ray shaped like the tests' ``ray_cluster``. For n in (1, 8, 32, 96)
(96 = the example's trajectories in flight on its one engine), n sessions are opened and n concurrent
``chat.completions.create`` calls go out, one ``Endpoint.async_openai()`` client per session in one asyncio loop,
as the calculator agent makes them (message ``47+38=``, ``skip_special_tokens: False``):

  chat1  ``max_tokens=1``: one prefill and one sampled token per call, so wall(n) is mostly per-call host work.
  chat8  ``max_tokens=8`` (the example's turn budget): adds the decode steps, for comparison.

wall(n) is the time from launching the n calls (clients included) to the last reply. Each repetition times every
(path, n) once, in an order that rotates between repetitions (this machine's speed drifts); the table shows
medians. The summary's figure is the least-squares slope of the median chat1 wall(n) over n: the serial host
seconds each further call adds on one engine. The engine actor's CPU-seconds per call (its process and children)
and this process's (the clients': the real run's agent runner, another process) are shown too.

Run: python benchmarks/agent_call_cost.py [--reps 5] [--json PATH]   (about 1.5 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "cpu-agent.yaml"
SIZES = (1, 8, 32, 96)
PATHS = {"chat1": 1, "chat8": 8}  # path -> max_tokens
#: One timed batch: wall seconds, engine CPU-seconds, client (this process's) CPU-seconds, output tokens.
Sample = tuple[float, float, float, int]
#: path -> n -> one Sample per repetition.
Raw = dict[str, dict[int, list[Sample]]]
MESSAGES = [{"role": "user", "content": "47+38="}]
START_TIMEOUT_S = 900.0  # the engine's start-up (vLLM on two cores)
CALL_TIMEOUT_S = 120.0  # one batch of calls, and each session's clock
RAY_TIMEOUT_S = 60.0  # one session-bookkeeping call to the actor
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the output readable; the engine inherits it


def log(text: str) -> None:
    print(f"[agent_call_cost] {text}", file=sys.stderr, flush=True)


def compile_plan(work: Path) -> dict[str, Any]:
    """The example's plan, as JSON: read directly so the benchmark needs nothing of the compiler's Python API."""
    out = work / "plan"
    cmd = [sys.executable, "-m", "rlc", "compile", str(SPEC), "-o", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=300)
    return json.loads((out / "plan.json").read_text())


def cpu_seconds(pid: int) -> float:
    """User + system CPU-seconds of a process and its live children so far (the engine core may be a child)."""
    import psutil

    total = 0.0
    proc = psutil.Process(pid)
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


class Bench:
    """One served engine and the timed batches of concurrent chat calls."""

    def __init__(self, actor: Any, base_url: str, model: str, engine_pid: int) -> None:
        self.actor = actor
        self.base_url = base_url
        self.model = model
        self.engine_pid = engine_pid

    async def _ray(self, ref: Any) -> Any:
        return await asyncio.wait_for(ref, RAY_TIMEOUT_S)

    async def batch(self, n: int, max_tokens: int) -> Sample:
        """n concurrent calls, each in its own session; returns (wall s, engine CPU-s, client CPU-s, output tokens)."""
        from rlc.agents.llm import Endpoint

        keys = [secrets.token_hex(8) for _ in range(n)]
        await self._ray(self.actor.open_sessions.remote(keys, CALL_TIMEOUT_S))
        endpoints = [Endpoint(self.base_url, k, self.model, max_tokens, 3, CALL_TIMEOUT_S) for k in keys]

        async def call(llm: Endpoint) -> int:  # as the calculator agent makes one turn
            client = llm.async_openai()
            try:
                reply = await client.chat.completions.create(
                    model=llm.model,
                    messages=MESSAGES,
                    max_tokens=max_tokens,
                    extra_body={"skip_special_tokens": False},
                )
            finally:
                await client.close()
            return reply.usage.completion_tokens if reply.usage else 0

        try:
            cpu0, client0 = cpu_seconds(self.engine_pid), time.process_time()
            t0 = time.perf_counter()
            tokens = await asyncio.wait_for(asyncio.gather(*(call(e) for e in endpoints)), CALL_TIMEOUT_S)
            wall = time.perf_counter() - t0
            cpu, client = cpu_seconds(self.engine_pid) - cpu0, time.process_time() - client0
        finally:
            records = await self._ray(self.actor.close_sessions.remote(keys))
        recorded = sum(len(r.calls) for r in records if r is not None)
        if recorded != n:
            raise RuntimeError(f"{n} calls made, {recorded} recorded")
        return wall, cpu, client, sum(tokens)

    async def measure(self, reps: int) -> Raw:
        """Warm every (path, n) once, then time each once per repetition in a rotating order."""
        configs = [(path, n) for path in PATHS for n in SIZES]
        results: Raw = {p: {n: [] for n in SIZES} for p in PATHS}
        for path, n in configs:
            await self.batch(n, PATHS[path])
        for rep in range(reps):
            shift = rep % len(configs)
            for path, n in configs[shift:] + configs[:shift]:
                results[path][n].append(await self.batch(n, PATHS[path]))
            log(f"repetition {rep + 1}/{reps} done")
        return results


async def run(plan: dict[str, Any], model_dir: Path, reps: int) -> dict[str, Any]:
    """Start the served engine as `rlc run` would for the example, measure, and always shut it down."""
    import ray

    from rlc.runtime.rollout.engine import rollout_engine_actor

    (role,) = [r for r in plan["roles"] if r["name"] == "rollout"]
    engine_args = {**role["engine"], "model": str(model_dir)}
    env = {**plan["env"], **role["env"]}
    agent, sampling = plan["agent"], plan["sampling"]
    actor = rollout_engine_actor(num_cpus=0, runtime_env={"env_vars": env}).remote(
        engine_args, plan["platform"], env, 0, plan["schedule"]["weight_update"], agent, sampling
    )
    try:
        startup = await asyncio.wait_for(actor.ready.remote(), START_TIMEOUT_S)
        log(f"engine served in {startup:.1f} s")
        base_url = await asyncio.wait_for(actor.endpoint.remote(), RAY_TIMEOUT_S)
        probe = lambda _: __import__("os").getpid()  # noqa: E731  (the actor cannot import this module)
        pid = await asyncio.wait_for(actor.__ray_call__.remote(probe), RAY_TIMEOUT_S)
        bench = Bench(actor, base_url, agent["served_model_name"], pid)
        t0 = time.perf_counter()
        results = await bench.measure(reps)
        log(f"measured in {time.perf_counter() - t0:.0f} s")
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(actor.shutdown.remote(), RAY_TIMEOUT_S)
        ray.kill(actor)
    return {"engine_args": engine_args, "env": env, "max_num_seqs": engine_args.get("max_num_seqs"), "raw": results}


def report(raw: Raw, reps: int) -> dict[str, Any]:
    """Print the table and the summary; returns the figures for --json."""
    print(f"agent chat calls on the served engine (cpu-agent.yaml's plan), {reps} reps, medians (min-max of wall)")
    print(
        f"{'path':6s} {'n':>4s} {'wall ms':>9s} {'min':>8s} {'max':>8s} {'ms/call':>8s} "
        f"{'engine CPU-ms/call':>19s} {'client CPU-ms/call':>19s} {'tokens/call':>12s}"
    )
    figures: dict[str, Any] = {}
    for path in PATHS:
        rows = {}
        for n in SIZES:
            walls = [s[0] for s in raw[path][n]]
            wall = statistics.median(walls)
            cpu, client, toks = (statistics.median(s[i] for s in raw[path][n]) / n for i in (1, 2, 3))
            rows[n] = {"wall_s": wall, "walls_s": walls, "per_call_s": wall / n, "engine_cpu_per_call_s": cpu}
            rows[n] |= {"client_cpu_per_call_s": client, "tokens_per_call": toks}
            print(
                f"{path:6s} {n:4d} {wall * 1e3:9.1f} {min(walls) * 1e3:8.1f} {max(walls) * 1e3:8.1f} "
                f"{wall / n * 1e3:8.2f} {cpu * 1e3:19.2f} {client * 1e3:19.2f} {toks:12.2f}"
            )
        xs = [float(n) for n in SIZES]
        b, a = statistics.linear_regression(xs, [rows[n]["wall_s"] for n in SIZES])
        # The same fit per repetition: how steady the slope is on a drifting machine.
        per_rep = [statistics.linear_regression(xs, [raw[path][n][r][0] for n in SIZES]).slope for r in range(reps)]
        figures[path] = {"by_n": rows, "slope_s": b, "intercept_s": a, "slope_per_rep_s": per_rep}
        print(
            f"{path}: wall(n) ~ {a * 1e3:.1f} ms + {b * 1e3:.2f} ms x n (least squares over medians); per-repetition "
            f"slopes {min(per_rep) * 1e3:.2f}-{max(per_rep) * 1e3:.2f} ms"
        )
    c1, c8 = figures["chat1"], figures["chat8"]
    print(
        f"summary: per-call host cost (slope of chat1 wall over n) {c1['slope_s'] * 1e3:.2f} ms; one call's latency "
        f"wall(1) {c1['by_n'][1]['wall_s'] * 1e3:.1f} ms; chat8 slope {c8['slope_s'] * 1e3:.2f} ms, wall(1) "
        f"{c8['by_n'][1]['wall_s'] * 1e3:.1f} ms; per call at n=96: chat1 {c1['by_n'][96]['per_call_s'] * 1e3:.2f} ms, "
        f"chat8 {c8['by_n'][96]['per_call_s'] * 1e3:.2f} ms"
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (each times every path and n once)")
    parser.add_argument("--json", type=Path, default=None, help="write the results to this file")
    args = parser.parse_args()

    import ray

    from rlc.runtime.tasks.model_builder import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="rlc-bench-agent-call-") as tmp:
        work = Path(tmp)
        plan = compile_plan(work)
        model_dir = build_tiny_model(work / "model", seed=0, task="calculator")
        # As the tests' ray_cluster fixture: two real cores, logical CPUs.
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        try:
            out = asyncio.run(run(plan, model_dir, args.reps))
        finally:
            ray.shutdown()

    figures = report(out["raw"], args.reps)
    if args.json:
        data = {
            "reps": args.reps,
            "sizes": list(SIZES),
            "engine_args": {**out["engine_args"], "model": "(built calculator model)"},
            "env": out["env"],
            **figures,
        }
        args.json.write_text(json.dumps(data, indent=2) + "\n")
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
