"""rlc against TRL's ``GRPOTrainer`` on the quickstart's work, both measured in one invocation.

What: for each system, seconds per GRPO step (median of the steps after the first 10%, a warm-up), steps/s,
generated tokens/s (completion tokens per step, end of sequence included, over the median step time),
CPU-seconds of its whole process tree (its process and every descendant: Ray's daemons and actors for rlc)
from start to end, the same tree's CPU-seconds per step over the steps after the warm-up (sampled against
each side's per-step progress, so start-up is left out), wall seconds, and the reward curve (mean reward of
the first and the last fifth of the steps); then the rlc/TRL ratios of steps/s and of CPU-seconds.

The work, made equal (each figure is read from the compiled quickstart plan, so both follow it):
  - the model: the quickstart's tiny Qwen3 with its character tokenizer, built once here with
    ``build_tiny_model``; rlc runs a copy, TRL loads the folder with transformers. fp32 on both sides
    (the plan's precision; TRL's bf16 default is turned off, and so is its gradient checkpointing, which
    the plan's layout does not use).
  - the prompts: the plan's seeded arithmetic stream, in its order, written to a JSONL file that TRL reads
    unshuffled (checked at every step); TRL's tokenization is checked against rlc's ids (``<bos>`` + characters)
    on the first 64 prompts.
  - the reward: ``exact_match`` (completion decoded without special tokens, stripped, equal to the answer).
  - the algorithm: 16 prompts x 8 samples per step and one optimizer step per batch (TRL: one generation
    batch of 128 per step, ``num_iterations=1``), at most 4 new tokens, temperature 1.0, top-p 1.0, clip 0.2,
    no KL (TRL ``beta=0``, so no reference model), AdamW at lr 5e-4 with a constant schedule, no weight
    decay, gradient-norm clip 1.0, group-normalised advantages, a token mean over the batch (TRL ``dapo``).
  - threads: one torch thread for TRL (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``), as each of rlc's
    actors runs with one; TRL generates with transformers (no vLLM) in its one process, rlc with vLLM in
    its rollout actor while its trainer actor holds the other core.
  - output: TRL saves nothing and rlc writes only its final checkpoint (``checkpoint_every`` = steps).

``--staleness N`` runs rlc at another ``max_staleness`` (TRL has no asynchronous mode): at 0 the work is equal
step for step; above 0 rlc generates while it trains, on samples up to N policy versions old, and the reward
columns show whether it still learns as fast.

Not equal, by design or because TRL has no switch for it: TRL's group std is unbiased with eps 1e-4 (rlc:
population std, eps 1e-6); rlc's loss is the decoupled PPO objective, whose importance weight (proximal over
vLLM's behaviour log-probs) is 1 up to numerics at the quickstart's staleness 0; the sampling streams
differ (vLLM's seeded requests vs transformers' sampler), so the reward curves agree in trend, not sample by
sample. Start-up (Ray, engines, imports, model loading) counts in the CPU-seconds and wall time, not in the
step times or CPU-seconds per step.

TRL is never a dependency of rlc: it runs from its own virtual environment, as a subprocess on a helper
program written to a temporary folder. Make that environment once with
    python3 -m venv ~/trl-venv && ~/trl-venv/bin/pip install trl
and pass ``--trl-python ~/trl-venv/bin/python`` (or set ``RLC_TRL_PYTHON``).

Run: python benchmarks/vs_trl.py [--steps 600] [--staleness N] [--seed N] [--json out.json] [--work DIR]
(the quickstart's 600 steps: about 10 minutes on 2 cores; ``--steps 20`` for a smoke run, about 2)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "quickstart.yaml"
WARMUP_SHARE = 0.1  # leading share of steps left out of the step-time median
SAMPLE_EVERY_S = 0.2  # process-tree CPU sampling interval
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

# The TRL side, run by the TRL venv's python with one argument (its settings file). It imports nothing from rlc.
TRL_PROGRAM = r'''
import json
import sys
import time

import datasets
import torch
import transformers
import trl
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

torch.set_num_threads(1)  # as each of rlc's actors (OMP_NUM_THREADS=1 is set by the parent too)
settings = json.loads(open(sys.argv[1]).read())
rows = [json.loads(line) for line in open(settings["prompts"])]
tokenizer = AutoTokenizer.from_pretrained(settings["model"], local_files_only=True)
for row in rows[:64]:
    ids = tokenizer(text=row["prompt"])["input_ids"]  # as GRPOTrainer tokenizes a plain-text prompt
    if ids != row["prompt_ids"]:
        raise SystemExit(f"TRL would tokenize {row['prompt']!r} as {ids}, rlc as {row['prompt_ids']}")
model = AutoModelForCausalLM.from_pretrained(settings["model"], dtype=torch.float32, local_files_only=True)

per_step = settings["batch_prompts"] * settings["group_size"]
calls = []  # one per generation batch, i.e. per optimizer step


def exact_match(prompts, completions, completion_ids, answer, **_):
    """rlc's exact_match: 1.0 when the completion, stripped, equals the answer."""
    start = len(calls) * settings["batch_prompts"]
    expected = [rows[start + i // settings["group_size"]]["prompt"] for i in range(len(prompts))]
    scores = [1.0 if c.strip() == str(a).strip() else 0.0 for c, a in zip(completions, answer, strict=True)]
    calls.append(
        {
            "reward": sum(scores) / len(scores),
            "tokens": sum(len(ids) for ids in completion_ids),
            "samples": len(scores),
            "in_order": list(prompts) == expected,
        }
    )
    return scores


class StepClock(TrainerCallback):
    """Wall seconds between consecutive optimizer-step ends (the first from the start of training)."""

    def __init__(self):
        self.last = None
        self.steps = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.steps.append(now - self.last)
        self.last = now
        with open(settings["progress"], "a") as f:  # one line per step: the parent samples CPU against it
            f.write(f"{state.global_step}\n")


config = GRPOConfig(
    output_dir=settings["output_dir"],
    max_steps=settings["steps"],
    per_device_train_batch_size=per_step,
    gradient_accumulation_steps=1,
    generation_batch_size=per_step,
    num_generations=settings["group_size"],
    num_iterations=1,
    max_completion_length=settings["max_tokens"],
    temperature=settings["temperature"],
    top_p=settings["top_p"],
    top_k=0,
    learning_rate=settings["lr"],
    lr_scheduler_type="constant",
    warmup_steps=0,
    optim="adamw_torch",
    adam_beta1=0.9,
    adam_beta2=0.999,
    adam_epsilon=1e-8,
    weight_decay=settings["weight_decay"],
    max_grad_norm=settings["grad_clip"],
    epsilon=settings["clip"],
    beta=settings["kl_coef"],
    loss_type="dapo",
    scale_rewards="group" if settings["normalize_std"] else "none",
    shuffle_dataset=False,
    use_vllm=False,
    use_cpu=True,
    bf16=False,
    fp16=False,
    gradient_checkpointing=False,
    seed=settings["seed"],
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    disable_tqdm=True,
    log_level="warning",
    log_completions=False,
    dataloader_num_workers=0,
)
clock = StepClock()
trainer = GRPOTrainer(
    model=model,
    reward_funcs=[exact_match],
    args=config,
    train_dataset=datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]),
    processing_class=tokenizer,
    callbacks=[clock],
)
trainer.train()
if len(calls) != len(clock.steps) or any(c["samples"] != per_step for c in calls):
    raise SystemExit(f"{len(calls)} generation batches for {len(clock.steps)} steps; expected one of {per_step} each")
if not all(c["in_order"] for c in calls):
    raise SystemExit("TRL did not take the prompts in the stream's order")
versions = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
with open(settings["result"], "w") as f:
    json.dump({"step_s": clock.steps, "calls": calls, "threads": torch.get_num_threads(), "versions": versions}, f)
'''


def log(text: str) -> None:
    print(f"[vs_trl] {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ measuring a process tree


@dataclass
class Usage:
    wall_s: float
    cpu_s: float  # the larger of the two lower bounds below
    cpu_sampled_s: float  # user+system of every process seen in the tree, at its last sample
    cpu_rusage_s: float  # RUSAGE_CHILDREN: the child and the descendants reaped under it
    processes: int  # distinct processes seen in the tree


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since start
    cpu_s: float  # the tree's CPU-seconds so far (as sampled)
    steps: int  # steps finished so far (lines in the progress file)


def count_lines(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def run_measured(cmd: list[str], env: dict[str, str], log_path: Path, progress: Path) -> tuple[Usage, list[Sample]]:
    """Run ``cmd`` to completion and measure its process tree's CPU time, sampled against its progress.

    ``progress`` is a file the command appends one line to per finished step, so the samples tell the CPU
    time of the steady steps apart from start-up. Two lower bounds of the total, since neither alone sees
    everything: sampling the tree misses a process's last interval before it exits (and processes shorter
    than one interval), and the kernel's children rusage misses descendants that are re-parented or never
    waited for (Ray's daemons and workers).
    """
    import psutil

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with log_path.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    seen: dict[tuple[int, float], float] = {}
    series: list[Sample] = []
    stop = threading.Event()

    def sample() -> None:
        try:
            root = psutil.Process(proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        for p in tree:
            try:
                with p.oneshot():
                    key, times = (p.pid, p.create_time()), p.cpu_times()
            except psutil.Error:
                continue
            seen[key] = max(seen.get(key, 0.0), times.user + times.system)
        series.append(Sample(time.perf_counter() - t0, sum(seen.values()), count_lines(progress)))

    def sampler() -> None:
        while not stop.wait(SAMPLE_EVERY_S):
            sample()

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    try:
        rc = proc.wait()
    finally:
        stop.set()
        thread.join()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        raise SystemExit(f"{' '.join(cmd[:4])} ... exited {rc}; the end of its output:\n{tail}")
    rusage = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    sampled = sum(seen.values())
    return Usage(wall, max(rusage, sampled), sampled, rusage, len(seen)), series


def steady_cpu_per_step(series: list[Sample], first: int) -> float | None:
    """CPU-seconds per step from the sample that first saw ``first`` steps done to the one that first saw the most.

    None when the samples saw too little progress to tell (a run of a step or two).
    """
    if not series:
        return None
    most = max(s.steps for s in series)
    a = next((s for s in series if s.steps >= first), None)
    b = next(s for s in series if s.steps == most)
    if a is None or b.steps <= a.steps:
        return None
    return (b.cpu_s - a.cpu_s) / (b.steps - a.steps)


# ------------------------------------------------------------------ the shared inputs


def compile_plan(work: Path, steps: int, staleness: int | None = None, seed: int | None = None) -> Any:
    from rlc.compiler.manifest import load_plan

    out = work / "plan"
    sets = {"output.dir": str(work / "run"), "algorithm.steps": str(steps), "output.checkpoint_every": str(steps)}
    if staleness is not None:
        sets["algorithm.max_staleness"] = str(staleness)
    if seed is not None:
        sets["algorithm.seed"] = str(seed)
    cmd = [sys.executable, "-m", "rlc", "compile", str(SPEC), "-o", str(out)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return load_plan(out)


def build_model(plan: Any, work: Path) -> Path:
    """The quickstart model, built once; rlc gets a copy where its plan looks, so TRL's stays untouched."""
    from rlc.runtime.tasks.model_builder import build_tiny_model

    if not plan.model.build_tiny:
        raise SystemExit("the quickstart plan no longer builds the tiny model; this benchmark expects it to")
    positions = plan.model.tiny_max_positions or 512
    model = build_tiny_model(work / "model", seed=plan.algorithm.seed, max_positions=positions)
    shutil.copytree(model, plan.model.path)
    return model


def write_prompts(plan: Any, model: Path, path: Path) -> None:
    """The plan's prompt stream, in order, enough for every step: the rows TRL trains on."""
    from transformers import AutoTokenizer

    from rlc.runtime.prompts import PromptStream

    tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    stream = PromptStream(plan.data, tokenizer, plan.algorithm.seed, plan.sampling.max_prompt_len)
    with path.open("w") as f:
        for item in stream.take(plan.schedule.steps * plan.schedule.batch_prompts):
            row = {"prompt": item.prompt, "answer": item.answer, "prompt_ids": list(item.prompt_ids)}
            f.write(json.dumps(row) + "\n")


# ------------------------------------------------------------------ the two systems


@dataclass
class Result:
    system: str
    steps: int
    step_s: float  # median after the warm-up share
    steps_per_s: float
    tokens_per_s: float
    cpu_s: float  # the whole run, start-up included
    cpu_per_step_s: float | None  # steady state: over the steps after the warm-up share
    wall_s: float
    reward_first: float  # mean reward of the first fifth of steps
    reward_last: float  # ... and of the last fifth
    usage: dict[str, Any]


def summarise(
    system: str, step_s: list[float], rewards: list[float], tokens: list[float], measured: tuple[Usage, list[Sample]]
) -> Result:
    usage, series = measured
    n = len(step_s)
    skip = max(1, math.ceil(WARMUP_SHARE * n)) if n > 1 else 0
    med = statistics.median(step_s[skip:])
    fifth = max(1, n // 5)
    return Result(
        system=system,
        steps=n,
        step_s=med,
        steps_per_s=1.0 / med,
        tokens_per_s=statistics.fmean(tokens[skip:]) / med,
        cpu_s=usage.cpu_s,
        cpu_per_step_s=steady_cpu_per_step(series, skip),
        wall_s=usage.wall_s,
        reward_first=statistics.fmean(rewards[:fifth]),
        reward_last=statistics.fmean(rewards[-fifth:]),
        usage=asdict(usage),
    )


def run_rlc(plan: Any, work: Path) -> Result:
    metrics = Path(plan.run_dir) / "metrics.jsonl"
    cmd = [sys.executable, "-m", "rlc", "run", str(work / "plan")]
    measured = run_measured(cmd, dict(os.environ), work / "rlc.log", metrics)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    samples = plan.schedule.batch_samples
    return summarise(
        f"rlc, max_staleness {plan.schedule.max_staleness}",
        [r["time/step_s"] for r in rows],
        [r["reward/mean"] for r in rows],
        [r["response_len/mean"] * samples for r in rows],
        measured,
    )


def run_trl(plan: Any, work: Path, python: str, model: Path, prompts: Path) -> tuple[Result, dict[str, Any]]:
    a, s = plan.algorithm, plan.sampling
    settings = {
        "model": str(model),
        "prompts": str(prompts),
        "output_dir": str(work / "trl"),
        "result": str(work / "trl-result.json"),
        "progress": str(work / "trl-progress.txt"),
        "steps": plan.schedule.steps,
        "batch_prompts": plan.schedule.batch_prompts,
        "group_size": plan.schedule.group_size,
        "max_tokens": s.max_response_len,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "lr": a.lr,
        "weight_decay": a.weight_decay,
        "grad_clip": a.grad_clip,
        "clip": a.clip,
        "kl_coef": a.kl_coef,
        "normalize_std": a.normalize_std,
        "seed": a.seed,
    }
    (work / "trl-settings.json").write_text(json.dumps(settings, indent=2))
    (work / "trl_grpo.py").write_text(TRL_PROGRAM)
    threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    env = {**os.environ, **threads, "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PYTHONPATH", None)  # nothing of rlc's environment leaks into TRL's
    cmd = [python, str(work / "trl_grpo.py"), str(work / "trl-settings.json")]
    measured = run_measured(cmd, env, work / "trl.log", Path(settings["progress"]))
    out = json.loads(Path(settings["result"]).read_text())
    calls = out["calls"]
    result = summarise(
        "TRL GRPOTrainer",
        out["step_s"],
        [c["reward"] for c in calls],
        [float(c["tokens"]) for c in calls],
        measured,
    )
    return result, {"versions": out["versions"], "torch_threads": out["threads"]}


def check_trl_python(python: str | None) -> str:
    if not python:
        raise SystemExit(
            "no TRL python: TRL runs from its own virtual environment, never rlc's. Make one with\n"
            "    python3 -m venv ~/trl-venv && ~/trl-venv/bin/pip install trl\n"
            "then pass --trl-python ~/trl-venv/bin/python or set RLC_TRL_PYTHON"
        )
    probe = subprocess.run([python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"{python} cannot import trl ({why}); pip install trl into that venv")
    return python


# ------------------------------------------------------------------ report


def report(results: list[Result], trl_info: dict[str, Any], steps: int) -> dict[str, float | None]:
    from rich.console import Console
    from rich.table import Table

    rlc, trl = results
    steady = None
    if rlc.cpu_per_step_s is not None and trl.cpu_per_step_s:
        steady = rlc.cpu_per_step_s / trl.cpu_per_step_s
    ratios = {"steps_per_s": rlc.steps_per_s / trl.steps_per_s, "cpu_s": rlc.cpu_s / trl.cpu_s, "cpu_per_step": steady}
    v = trl_info["versions"]
    table = Table(title=f"GRPO on the quickstart's work, {steps} steps each")
    columns = ("system", "s/step", "steps/s", "gen tok/s", "CPU-s", "CPU-s/step", "wall s", "reward 1st→last 5th")
    for name in columns:
        table.add_column(name, justify="left" if name == "system" else "right", no_wrap=True)
    for r in results:
        per_step = "-" if r.cpu_per_step_s is None else f"{r.cpu_per_step_s:.2f}"
        table.add_row(
            r.system,
            f"{r.step_s:.3f}",
            f"{r.steps_per_s:.2f}",
            f"{r.tokens_per_s:.0f}",
            f"{r.cpu_s:.0f}",
            per_step,
            f"{r.wall_s:.0f}",
            f"{r.reward_first:.2f} → {r.reward_last:.2f}",
        )
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)
    console.print(table)
    shown = "-" if steady is None else f"{steady:.2f}x"
    console.print(
        f"rlc/TRL: steps/s {ratios['steps_per_s']:.2f}x, CPU-seconds {ratios['cpu_s']:.2f}x (start-up included), "
        f"CPU-seconds per steady step {shown}\n"
        f"s/step: median after the first {WARMUP_SHARE:.0%} of steps; CPU-s: the process tree, start to end; "
        f"CPU-s/step: over the same steps. TRL {v['trl']}, transformers {v['transformers']}, torch {v['torch']}, "
        f"{trl_info['torch_threads']} torch thread"
    )
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="GRPO steps for each system (the quickstart's 600)")
    parser.add_argument(
        "--trl-python",
        default=os.environ.get("RLC_TRL_PYTHON"),
        help="python of a separate venv with trl installed (default: $RLC_TRL_PYTHON)",
    )
    parser.add_argument(
        "--staleness",
        type=int,
        help="rlc's algorithm.max_staleness (default: the quickstart's own); TRL is always on-policy",
    )
    parser.add_argument(
        "--seed",
        type=int,
        help="the plan's algorithm.seed (default: the quickstart's own): another model warm-up, prompt order and "
        "sampling stream for both systems, to see how far the reward curves move between seeds",
    )
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--work", type=Path, help="keep the plan, runs and logs in this (empty) folder")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.staleness is not None and args.staleness < 0:
        parser.error("--staleness must be at least 0")
    python = check_trl_python(args.trl_python)

    if args.work is not None and args.work.exists() and any(args.work.iterdir()):
        parser.error(f"--work {args.work} is not empty")
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rlc-bench-vs-trl-")))
        work = work.resolve()
        work.mkdir(parents=True, exist_ok=True)
        plan = compile_plan(work, args.steps, args.staleness, args.seed)
        if plan.data.reward != "exact_match":
            raise SystemExit(f"the quickstart's reward is {plan.data.reward!r}; the TRL side replicates exact_match")
        model = build_model(plan, work)
        prompts = work / "prompts.jsonl"
        write_prompts(plan, model, prompts)
        log(f"rlc: {args.steps} steps")
        rlc = run_rlc(plan, work)
        log(f"rlc done in {rlc.wall_s:.0f} s; TRL: {args.steps} steps")
        trl, trl_info = run_trl(plan, work, python, model, prompts)
        log(f"TRL done in {trl.wall_s:.0f} s")

    ratios = report([rlc, trl], trl_info, args.steps)
    if args.json:
        doc = {"steps": args.steps, "results": [asdict(rlc), asdict(trl)], "ratios_rlc_over_trl": ratios, **trl_info}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
