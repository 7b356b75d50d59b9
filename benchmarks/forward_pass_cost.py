"""What a forward-only pass costs against a training pass: the evidence for the time model's 1/3.

Run: python benchmarks/forward_pass_cost.py   (about half a minute on two cores; one torch thread)

The planner prices each forward-only pass over a micro-batch (the proximal log-probs of several minibatches, a KL
reference) at a third of a forward+backward pass's fixed cost (`compiler/cost/train.py` train_time). This measures the
ratio on the quickstart model, where fixed costs dominate: `TrainerWorker.compute_logprobs` (one forward-only
pass) against `TrainerWorker.train_step` (forward, backward and the AdamW step) over the same micro-batch of 12-token
sequences, one-rank FSDP2 over gloo, measured alternately in this run (median of 20 after a warm-up), for a
quickstart-sized micro-batch (128 sequences) and a quarter of it (a four-minibatch step's).
"""

from __future__ import annotations

import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch

SEED, REPEATS, SEQ_LEN, PROMPT = 0, 20, 12, 8


def _batch(n: int, g: torch.Generator) -> dict:
    seqs = [torch.randint(3, 30, (SEQ_LEN,), generator=g).tolist() for _ in range(n)]
    masks = [[0] * PROMPT + [1] * (SEQ_LEN - PROMPT) for _ in seqs]
    return {"input_ids": seqs, "loss_mask": masks, "advantages": torch.randn(n, generator=g).tolist()}


def main() -> None:
    import torch.distributed as dist

    from rlc.runtime.tasks.model_builder import build_tiny_model
    from rlc.runtime.train.trainer import TrainerWorker

    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    g = torch.Generator().manual_seed(SEED)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=SEED)
        worker = TrainerWorker(0, 1, "127.0.0.1", port, str(model_dir), "cpu", {"lr": 1e-4, "micro_batch_tokens": 2048})
        for n in (128, 32):
            batch = _batch(n, g)
            batch["behaviour_logprobs"] = worker.compute_logprobs(batch)
            forward, train = [], []
            for rep in range(REPEATS + 1):
                t0 = time.perf_counter()
                worker.compute_logprobs(batch)
                t1 = time.perf_counter()
                worker.train_step(batch, {"clip": 0.2})
                t2 = time.perf_counter()
                if rep:
                    forward.append(t1 - t0)
                    train.append(t2 - t1)
            f, t = statistics.median(forward), statistics.median(train)
            print(f"{n:4d} sequences: forward-only pass {f * 1e3:.1f} ms, training pass {t * 1e3:.1f} ms: {f / t:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
