"""Would `rlc run --dry-run` start the published runs? Each expressible one, free and with its published degrees.

What: every published run rlc can express as a spec (tests/compile/test_deployments.py `PINNED`, the shared
deployments.yaml entries, and benchmarks/published_runs.yaml, the held-out runs) is compiled twice on its
target, the same model, nodes and batch:

  free     placement left to rlc (no `placement:` section, `mode: auto`), as tests/compile/test_deployments.py does;
  pinned   the published degrees pinned (train and rollout `devices`, `tp`, `pp`, `ep`, `cp`) in the published
           mode, everything else in `placement` (backend, recompute, micro-batch tokens, memory shares,
           offload) left to rlc; `--full-pin` keeps all of it except `backend`.

Each compiled plan goes the way a user's does: `rlc compile` writes the plan directory (`emit_plan_dir`), and
`rlc run PLAN --dry-run` verifies it (`verify_plan_dir`), loads it (`load_plan`) and asks the runtime what it
would start (`runtime.launch_request.launch_request(plan)`); its `refusals` are what `rlc run` would refuse
(the dry run exits 2 when there are any). A row reads `ok`, `refused: <first refusal>` or `no plan: <first
compile error>`; the summary counts each column and groups the refusals by reason (numbers masked, so "PP 4"
and "PP 16" are one reason). A second table states each plan's weight sync: the method it runs (`schedule.
weight_sync`, its senders and slicing), the estimate and the bytes each engine worker receives, marking plans
whose workers each receive the whole model; the DeepSeek-V3/R1 and Qwen3-235B ones are listed apart.

Entries of deployments.yaml not measured: tests/compile/test_deployments.py `NOT_EXPRESSIBLE` (printed with their
reason) and the OOM reports (`OOM_REPORTS`: they did not run, so there is nothing to start).

The compile path only (no torch): well under a minute of CPU.

Run: python benchmarks/published_dry_runs.py [--full-pin] [--only SUBSTRING] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import re
import sys
import tempfile
import textwrap
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
#: The placement keys that are the published parallel degrees (what `pinned` keeps).
DEGREES = ("devices", "tp", "pp", "ep", "cp")
#: Runs whose models are too large for every engine worker to receive all of it each sync (issue: weight sync that
#: scales): their plans should send each worker a shard.
BIG_MOE = re.compile(r"deepseek|671b|235b", re.IGNORECASE)


@dataclass
class Case:
    """One expressible published run: where it is written, its target and its spec (without name and data)."""

    id: str
    source: str
    target: str
    spec: dict[str, Any]


@dataclass
class Outcome:
    """A dry run: `ok`, `refused` (the runtime's refusals) or `no plan` (the compiler's errors); with a plan, its
    weight sync: the method, its estimate and the bytes each engine worker receives (`sync`), and whether that is
    a shard of the model or the whole of it (`whole`)."""

    status: str
    reasons: list[str]
    summary: str = ""
    sync: str = ""
    whole: bool = False

    def cell(self, width: int) -> str:
        if self.status == "ok":
            return "ok"
        text = f"{self.status}: {self.reasons[0]}" if self.reasons else self.status
        return text if len(text) <= width else text[: width - 1] + "…"


def _module(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cases() -> tuple[list[Case], dict[str, str]]:
    """The expressible runs, and the deployments.yaml entries not measured with the reason."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))  # the test module imports its helpers (paths.py) from there
    deployments = _module("test_deployments", ROOT / "tests" / "compile" / "test_deployments.py")
    accuracy = _module("estimate_accuracy", ROOT / "benchmarks" / "estimate_accuracy.py")
    found = [
        Case(dep_id, "deployments", target, yaml.safe_load(textwrap.dedent(body)))
        for dep_id, (target, body) in sorted(deployments.PINNED.items())
    ]
    found += [
        Case(run["id"], "published_runs", run["target"], yaml.safe_load(run["spec"])) for run in accuracy.load_runs()
    ]
    skipped = {k: f"not expressible: {v}" for k, v in deployments.NOT_EXPRESSIBLE.items()}
    skipped.update({k: f"OOM report: {v}" for k, v in deployments.OOM_REPORTS.items()})
    return found, skipped


def free_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The run with placement left to rlc: no `placement`, mode auto (as test_deployments.py's free plan)."""
    out = {k: copy.deepcopy(v) for k, v in spec.items() if k != "placement"}
    if out.get("mode") in ("colocated", "disaggregated"):
        out["mode"] = "auto"
    return out


def pinned_spec(spec: dict[str, Any], full: bool = False) -> dict[str, Any]:
    """The run with its published degrees pinned and the backend left to rlc (`full`: every other published
    placement setting kept too)."""
    out = copy.deepcopy(spec)
    placement = out.get("placement") or {}
    kept: dict[str, Any] = {}
    for role in ("train", "rollout"):
        section = placement.get(role) or {}
        if full:
            chosen = {k: v for k, v in section.items() if k != "backend"}
        else:
            chosen = {k: v for k, v in section.items() if k in DEGREES}
        if chosen:
            kept[role] = chosen
    if full:
        kept.update({k: v for k, v in placement.items() if k not in ("train", "rollout")})
    if kept:
        out["placement"] = kept
    else:
        out.pop("placement", None)
    return out


def dry_run(name: str, target: str, spec: dict[str, Any], workdir: Path) -> Outcome:
    """`rlc compile` then `rlc run --dry-run`, through the entry points the CLI calls."""
    from rlc.compiler.emit import emit_plan_dir
    from rlc.compiler.manifest import load_plan, verify_plan_dir
    from rlc.compiler.pipeline import compile_text
    from rlc.compiler.provenance import compute_provenance
    from rlc.runtime.launch_request import launch_request

    text = yaml.safe_dump({"name": name, "data": {"train": "arithmetic"}, **spec}, sort_keys=False)
    compiled = compile_text(text, "spec.yaml", target=target)
    if compiled.plan is None or not compiled.ok or compiled.problem is None:
        errors = [f"{d.code} {d.message}" for d in compiled.report.diagnostics if d.severity == "error"]
        return Outcome("no plan", errors or ["the planner found no plan"])
    plan_dir = workdir / name
    provenance = compute_provenance(compiled.problem.spec, [], target_given=True)
    emit_plan_dir(compiled.plan, compiled.problem.spec, plan_dir, provenance=provenance)
    problems = [d for d in verify_plan_dir(plan_dir) if d.severity == "error"]
    if problems:
        return Outcome("no plan", [f"{d.code} {d.message}" for d in problems])
    plan = load_plan(plan_dir)
    request = launch_request(plan)
    summary = ", ".join(f"{r.name} {r.devices}" for r in plan.roles) + f"; {plan.schedule.mode}"
    train = plan.role("actor").layout
    if train is not None:
        summary += f"; train {train.summary()}"
    engine = plan.role("rollout").engine
    summary += f"; rollout engines TP {engine['tensor_parallel_size']} x DP {engine.get('data_parallel_size', 1)}"
    if engine.get("data_parallel_size_local"):
        summary += f" ({engine['data_parallel_size_local']} cores per node)"
    elif engine.get("distributed_executor_backend") == "ray":
        summary += " (TP across nodes)"
    sync, whole = sync_cell(plan)
    if request.refusals:
        return Outcome("refused", list(request.refusals), summary, sync, whole)
    return Outcome("ok", [], summary, sync, whole)


def sync_cell(plan: Any) -> tuple[str, bool]:
    """`broadcast (8 senders) 1.9 s, 16.4 GB/worker` and whether each worker receives the whole model (what a
    whole-tensor broadcast would send it) rather than a shard."""
    from rlc.compiler.sync_lines import sync_bytes, sync_label

    s, e = plan.schedule, plan.estimates
    per_worker = e.weight_sync_bytes_per_worker
    dtype = plan.role("rollout").engine.get("dtype", "bfloat16")
    model = plan.model.params_b * 1e9 * (4 if dtype == "float32" else 2)
    whole = plan.lora is None and per_worker >= 0.9 * model
    method = "adapter" if plan.lora is not None and plan.lora.rollout == "adapter" else s.weight_sync
    label = sync_label(method, s.weight_sync_senders, s.weight_sync_slicing)
    return f"{label} {e.weight_sync_s:.3g} s, {sync_bytes(per_worker)}/worker{' (whole model)' if whole else ''}", whole


def reason_key(reason: str) -> str:
    """A refusal with its numbers and layout summaries masked, so that one cause groups as one reason."""
    key = re.sub(r"\s*\(this layout: .*\)$", "", reason)
    key = re.sub(r"\b\d+(\.\d+)?\b", "N", key)
    return key if len(key) <= 150 else key[:149] + "…"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full-pin", action="store_true", help="pin every published placement setting but backend")
    parser.add_argument("--only", default="", help="measure the runs whose id contains this")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--width", type=int, default=70, help="width of a free / pinned cell")
    args = parser.parse_args(argv)

    started = time.process_time()
    found, skipped = cases()
    found = [c for c in found if args.only in c.id]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rlc-dry-runs-") as tmp:
        work = Path(tmp)
        for case in found:
            free = dry_run(f"{case.id}-free", case.target, free_spec(case.spec), work)
            pinned = dry_run(f"{case.id}-pinned", case.target, pinned_spec(case.spec, args.full_pin), work)
            rows.append(
                {
                    "id": case.id,
                    "source": case.source,
                    "target": case.target,
                    "free": free,
                    "pinned": pinned,
                }
            )

    width = args.width
    id_w = max(len(r["id"]) for r in rows) if rows else 2
    header = f"{'id':<{id_w}}  {'target':<7} {'free':<{width}}  pinned"
    print(header)
    print("-" * len(header) + "-" * width)
    for r in rows:
        print(f"{r['id']:<{id_w}}  {r['target']:<7} {r['free'].cell(width):<{width}}  {r['pinned'].cell(width)}")

    print()
    print("weight sync per plan (the method the plan runs, its estimate, the bytes each engine worker receives):")
    for r in rows:
        print(f"{r['id']:<{id_w}}  {r['target']:<7} {r['free'].sync:<{width}}  {r['pinned'].sync}")
    wholes = [f"{r['id']} ({c})" for r in rows for c in ("free", "pinned") if r[c].whole and BIG_MOE.search(r["id"])]
    print(f"DeepSeek-V3/R1 and Qwen3-235B plans whose engine workers each receive the whole model: {len(wholes)}")
    for w in wholes:
        print(f"  {w}")

    print()
    for column in ("free", "pinned"):
        counts = Counter(r[column].status for r in rows)
        print(f"{column:>6}: " + ", ".join(f"{counts.get(s, 0)} {s}" for s in ("ok", "refused", "no plan")))
    print()
    print("first refusal / compile error, by reason (free, pinned):")
    by_reason: dict[str, dict[str, list[str]]] = defaultdict(lambda: {"free": [], "pinned": []})
    for r in rows:
        for column in ("free", "pinned"):
            outcome: Outcome = r[column]
            if outcome.status != "ok":
                by_reason[f"{outcome.status}: {reason_key(outcome.reasons[0])}"][column].append(r["id"])
    for reason, cols in sorted(by_reason.items(), key=lambda kv: -len(kv[1]["free"]) - len(kv[1]["pinned"])):
        print(f"  {len(cols['free']):>2} {len(cols['pinned']):>2}  {reason}")
    print()
    print("every refusal (a plan can have several), by reason (free, pinned):")
    every: dict[str, Counter[str]] = defaultdict(Counter)
    for r in rows:
        for column in ("free", "pinned"):
            outcome = r[column]
            if outcome.status == "refused":
                for reason in dict.fromkeys(reason_key(x) for x in outcome.reasons):
                    every[reason][column] += 1
    for reason, c in sorted(every.items(), key=lambda kv: -sum(kv[1].values())):
        print(f"  {c['free']:>2} {c['pinned']:>2}  {reason}")
    print()
    print(f"not measured ({len(skipped)} deployments.yaml entries):")
    for dep_id, why in sorted(skipped.items()):
        print(f"  {dep_id}: {why if len(why) <= 110 else why[:109] + '…'}")
    print(f"\n{len(rows)} runs, {2 * len(rows)} dry runs, {time.process_time() - started:.1f} s CPU")

    if args.json:
        out = [
            {
                **{k: v for k, v in r.items() if k not in ("free", "pinned")},
                "free": asdict(r["free"]),
                "pinned": asdict(r["pinned"]),
            }
            for r in rows
        ]
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
