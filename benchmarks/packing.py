"""Packed (THD) against padded micro-batches in the trainer, and chunked against full-logit log-probs.

Run: python benchmarks/packing.py   (about two minutes on two cores; one torch thread)

Workload: 128 sequences, seed 0, each an 8-token prompt plus a response whose length is lognormal
(median 60 tokens, sigma 1.0) rounded and clipped to [1, 480], the long tail of RL rollouts. The
micro-batch token budget is 2048; the padded baseline takes ``2048 // longest`` sequences per
micro-batch in arrival order, so its worst micro-batch fits the same memory as a packed one.

1. Token utilisation: real tokens / tokens the model computes (packed rows hold no padding) and
   real tokens / (micro-batches × budget) (how full the memory slots are).
2. Real tokens per second of ``TrainerWorker.train_step`` (forward, backward, AdamW) on the
   quickstart model, packed and padded, one-rank FSDP2 over gloo, measured alternately in this run
   (median of 3 after a warm-up). The O(L²) block-causal-mask variant is shown for reference.
3. Peak memory of the log-prob head, forward + backward, on random hidden states: 8192 tokens,
   hidden 256, a 32768-token vocabulary; chunked (1024 tokens) against full logits. Each runs in a
   fresh subprocess and reports the rise of ``resource.getrusage`` peak RSS (ru_maxrss) over the
   RSS after its inputs were allocated (tracemalloc does not see torch's allocator).
"""

from __future__ import annotations

import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SEED, N_SEQS, PROMPT, RESP_MAX, RESP_MEDIAN, RESP_SIGMA = 0, 128, 8, 480, 60.0, 1.0
BUDGET, CHUNK = 2048, 1024
MEM_TOKENS, MEM_HIDDEN, MEM_VOCAB = 8192, 256, 32768
REPEATS = 3


def lengths() -> list[int]:
    """Prompt + lognormal response lengths (the workload above)."""
    g = torch.Generator().manual_seed(SEED)
    resp = torch.empty(N_SEQS).log_normal_(mean=float(torch.tensor(RESP_MEDIAN).log()), std=RESP_SIGMA, generator=g)
    return [PROMPT + int(min(max(round(float(r)), 1), RESP_MAX)) for r in resp]


def utilisation(lens: list[int], bins: list[list[int]], padded_size: int) -> dict[str, float]:
    """Real-token shares of computed tokens and of budget slots, packed and padded."""
    real = sum(lens)
    from rlc.runtime.packing import padded_micro_batches

    # As the trainer forms padded micro-batches (shortest first, under the budget, at most padded_size each).
    groups = [[lens[i] for i in b] for b in padded_micro_batches(lens, BUDGET, padded_size)]
    padded_computed = sum(len(g) * max(g) for g in groups)
    return {
        "packed_computed": real / real,
        "padded_computed": real / padded_computed,
        "packed_fill": real / (len(bins) * BUDGET),
        "padded_fill": real / (len(groups) * BUDGET),
        "packed_micro": len(bins),
        "padded_micro": len(groups),
    }


def _batch(lens: list[int]) -> dict:
    g = torch.Generator().manual_seed(SEED + 1)
    seqs = [torch.randint(3, 32, (n,), generator=g).tolist() for n in lens]
    masks = [[0] * PROMPT + [1] * (n - PROMPT) for n in lens]
    adv = torch.randn(len(lens), generator=g).tolist()
    return {"input_ids": seqs, "loss_mask": masks, "advantages": adv}


def throughput(lens: list[int], padded_size: int) -> dict[str, float]:
    """Median real tokens/s of train_step for each trainer configuration."""
    import torch.distributed as dist

    from rlc.runtime.tasks.model_builder import build_tiny_model
    from rlc.runtime.train.trainer import TrainerWorker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    base = {"lr": 1e-4, "micro_batch_tokens": BUDGET, "logprob_chunk_tokens": CHUNK}
    configs = {
        "padded": {"packing": False, "micro_batch_size": padded_size},
        "packed": {"packing": True, "packed_attention": "varlen"},
        "packed, 4D mask": {"packing": True, "packed_attention": "mask"},
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0)
        workers = {
            k: TrainerWorker(0, 1, "127.0.0.1", port, str(model_dir), "cpu", {**base, **c}) for k, c in configs.items()
        }
        batch = _batch(lens)
        lp = workers["packed"].compute_logprobs(batch)
        batch = {**batch, "behaviour_logprobs": lp}
        times: dict[str, list[float]] = {k: [] for k in configs}
        for rep in range(REPEATS + 1):
            for k, w in workers.items():
                if k == "packed, 4D mask" and rep > 1:
                    continue  # the slow reference: one warm-up and one timed step
                t0 = time.perf_counter()
                w.train_step(batch, {"clip": 0.2})
                if rep > 0:
                    times[k].append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return {k: sum(lens) / statistics.median(v) for k, v in times.items()}


def memory_child(kind: str) -> None:
    """Print the peak-RSS rise (MiB) of one log-prob head forward + backward."""
    from rlc.runtime.algo.logprobs import chunked_logprobs_entropy, logprobs_entropy_reference

    g = torch.Generator().manual_seed(SEED)
    hidden = torch.randn(MEM_TOKENS, MEM_HIDDEN, generator=g).requires_grad_()
    weight = (torch.randn(MEM_VOCAB, MEM_HIDDEN, generator=g) * 0.05).requires_grad_()
    targets = torch.randint(0, MEM_VOCAB, (MEM_TOKENS,), generator=g)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if kind == "chunked":
        lp, ent = chunked_logprobs_entropy(hidden, weight, targets, 1.0, CHUNK)
    else:
        lp, ent = logprobs_entropy_reference(hidden, weight, targets, 1.0)
    (lp.sum() + 0.01 * ent.sum()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mib": (peak - before) / 1024, "seconds": time.perf_counter() - t0}))


def memory(kind: str) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", kind], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from rlc.runtime.packing import pack_micro_batches

    torch.set_num_threads(1)
    lens = lengths()
    padded_size = max(1, BUDGET // max(lens))
    bins = pack_micro_batches(lens, BUDGET)
    u = utilisation(lens, bins, padded_size)
    print(
        f"workload: {N_SEQS} sequences = {PROMPT}-token prompt + lognormal response (median {RESP_MEDIAN:g}, "
        f"sigma {RESP_SIGMA}, clipped [1, {RESP_MAX}]), seed {SEED}; {sum(lens)} real tokens, "
        f"mean {sum(lens) / len(lens):.1f}, max {max(lens)}"
    )
    print(f"budget {BUDGET} tokens/micro-batch; padded baseline: {padded_size} sequences/micro-batch (arrival order)")
    print()
    print(f"{'token utilisation':<34}{'packed':>10}{'padded':>10}{'ratio':>8}")
    for label, key in (("real / computed tokens", "computed"), ("real / (micro-batches x budget)", "fill")):
        p, q = u[f"packed_{key}"], u[f"padded_{key}"]
        print(f"{label:<34}{p:>10.1%}{q:>10.1%}{p / q:>8.2f}")
    print(f"{'micro-batches':<34}{u['packed_micro']:>10}{u['padded_micro']:>10}")
    print()
    tps = throughput(lens, padded_size)
    print(f"{'train_step real tokens/s':<34}{'tok/s':>10}{'vs padded':>10}")
    for k, v in tps.items():
        print(f"{k:<34}{v:>10.0f}{v / tps['padded']:>10.2f}")
    print()
    mem = {k: memory(k) for k in ("chunked", "full")}
    logits_mib = MEM_TOKENS * MEM_VOCAB * 4 / 2**20
    print(
        f"log-prob head fwd+bwd, {MEM_TOKENS} tokens x vocab {MEM_VOCAB} (hidden {MEM_HIDDEN}); "
        f"fp32 logits {logits_mib:.0f} MiB"
    )
    print(f"{'peak RSS rise (ru_maxrss)':<34}{'MiB':>10}{'seconds':>10}")
    for k, label in (("chunked", f"chunked ({CHUNK} tokens)"), ("full", "full logits")):
        print(f"{label:<34}{mem[k]['peak_mib']:>10.0f}{mem[k]['seconds']:>10.1f}")
    print(f"{'full / chunked':<34}{mem['full']['peak_mib'] / mem['chunked']['peak_mib']:>10.1f}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--memory-child":
        torch.set_num_threads(1)
        memory_child(sys.argv[2])
    else:
        main()
