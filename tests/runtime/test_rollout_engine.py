"""The vLLM rollout engine in a Ray actor: sampling log-probs, weight updates by file and broadcast.

One engine serves the whole session (start-up is ~40 s on two cores). It runs n-gram speculative
decoding so the metrics path is covered too. Log-probs are compared with the Hugging Face model
(or the FSDP2 trainer) on the same weights; on this CPU they agree to ~1e-5, we assert 1e-4.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from hf_reference import hf_logprobs, hf_model

from rlc.compiler.engine_config import CPU_ENGINE_ARGS
from rlc.runtime.platform import get_platform
from rlc.runtime.rollout.weight_sync import (
    iter_safetensors,
    plan_buckets,
    tensor_meta,
    write_safetensors,
)
from rlc.runtime.train.group import split_batch
from rlc.schemas.engine_args import RL_ENGINE_ARGS, SPEC_DECODE_EXTENSION_CLS

TOL = 1e-4
PROMPTS = ["3+4=", "1+1=", "9+8=", "5+0="]


# ------------------------------------------------------------------ fast unit tests (no engine)


def test_platforms() -> None:
    cpu, npu = get_platform("cpu"), get_platform("npu")
    assert (cpu.dist_backend, cpu.vllm_dtype, cpu.supports_sleep_mode) == ("gloo", "float32", False)
    assert (npu.dist_backend, npu.vllm_dtype, npu.visible_devices_env) == (
        "hccl",
        "bfloat16",
        "ASCEND_RT_VISIBLE_DEVICES",
    )
    assert cpu.device_for_rank(3) == torch.device("cpu")
    cpu.empty_cache()  # no-op, must not import anything device-specific
    assert get_platform(cpu) is cpu
    with pytest.raises(ValueError, match="unknown platform"):
        get_platform("tpu")


def test_plan_buckets_groups_by_dtype_and_size() -> None:
    meta = [("a", (4,), "float32"), ("b", (4,), "float32"), ("c", (2,), "bfloat16"), ("d", (100,), "bfloat16")]
    assert plan_buckets(meta, bucket_bytes=32) == [[0, 1], [2], [3]]
    assert plan_buckets(meta, bucket_bytes=1 << 20) == [[0, 1], [2, 3]]
    assert plan_buckets([], 8) == []


def test_write_safetensors_is_atomic_and_roundtrips(tmp_path: Path) -> None:
    w = torch.randn(3, 4)
    sd = {"x": w, "tied": w, "y": torch.arange(6, dtype=torch.int64).view(2, 3).t()}  # shared + strided
    path = write_safetensors(sd, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["model.safetensors"]  # no temp left
    back = dict(iter_safetensors(path.parent))
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k])
    assert tensor_meta(sd, torch.bfloat16)[0] == ("x", (3, 4), "bfloat16")


def test_split_batch_keeps_order_and_shared_keys() -> None:
    batch = {"input_ids": [[1], [2], [3]], "loss_mask": [[0], [1], [1]], "temperature": 0.7}
    a, b = split_batch(batch, 2)
    assert a["input_ids"] + b["input_ids"] == batch["input_ids"]
    assert a["temperature"] == b["temperature"] == 0.7


def test_minibatch_shares_give_every_optimizer_step_samples_on_every_split() -> None:
    """Minibatches are split across the ranks, not ranks' shares into minibatches: with 5 sequences, 3
    minibatches and 2 ranks no optimizer step is empty, and rank by rank, minibatch by minibatch, every
    sequence is trained once, in order."""
    from rlc.runtime.train.group import minibatch_shares

    batch = {"input_ids": [[i] for i in range(5)], "loss_mask": [[1]] * 5, "temperature": 0.7}
    shares = minibatch_shares(batch, 3, 2)
    assert len(shares) == 2 and all(len(rank) == 3 for rank in shares)
    steps = [shares[0][m]["input_ids"] + shares[1][m]["input_ids"] for m in range(3)]
    assert all(steps) and [s for step in steps for s in step] == batch["input_ids"]
    assert minibatch_shares(batch, 1, 2) == split_batch(batch, 2)  # one minibatch: one share per rank
    for bad in (0, 6):
        with pytest.raises(ValueError, match="minibatches for a batch of 5"):
            minibatch_shares(batch, bad, 2)


def test_in_place_updates_only_where_every_weight_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """An update copies in place only when the plan chose torch GEMMs and no layer freed its weight for a packed
    copy; otherwise it re-runs vLLM's weight processing."""
    from rlc.runtime.rollout.cpu_gemm import ENV, apply_cpu_gemm_choice, keeps_weights

    model = torch.nn.Linear(4, 4)
    monkeypatch.delenv(ENV, raising=False)
    assert not keeps_weights(model)
    monkeypatch.setenv(ENV, "torch")
    assert keeps_weights(model)
    model.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # what a packing layer leaves
    assert not keeps_weights(model)
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match="expected one of onednn, torch"):
        apply_cpu_gemm_choice()


def test_plain_weight_dispatch_keeps_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the torch GEMM path vLLM's weight parameters skip their Python torch-function detour; an op on one gives
    the same plain tensor as before. Elsewhere nothing changes."""
    from vllm.model_executor.parameter import BasevLLMParameter, ModelWeightParameter

    from rlc.runtime.rollout.cpu_gemm import ENV, plain_weight_dispatch

    original = BasevLLMParameter.__dict__["__torch_function__"]
    # Built without __init__, which needs vLLM's tensor-parallel group; the class decides the dispatch.
    weight = ModelWeightParameter.__new__(ModelWeightParameter, data=torch.randn(3, 4))
    x = torch.randn(2, 4)
    before = torch.nn.functional.linear(x, weight)
    monkeypatch.setattr(BasevLLMParameter, "__torch_function__", original)  # restored after the test
    monkeypatch.delenv(ENV, raising=False)
    assert not plain_weight_dispatch()
    assert BasevLLMParameter.__dict__["__torch_function__"] is original
    monkeypatch.setenv(ENV, "torch")
    assert plain_weight_dispatch()
    after = torch.nn.functional.linear(x, weight)
    assert type(after) is torch.Tensor and torch.equal(after, before)
    assert isinstance(weight, BasevLLMParameter)  # vLLM's loaders still recognise it


# ------------------------------------------------------------------ engine fixtures


@pytest.fixture(scope="module")
def engine(ray_cluster, tiny_model_dir: Path):
    from rlc.runtime.rollout.engine import rollout_engine_actor

    args = {
        "model": str(tiny_model_dir),
        "max_model_len": 128,
        "max_num_seqs": 32,
        "enable_prefix_caching": True,
        "seed": 0,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        **CPU_ENGINE_ARGS,  # as cpu plans run engines
        **RL_ENGINE_ARGS,
        "dtype": "float32",  # as cpu plans state it
        "worker_extension_cls": SPEC_DECODE_EXTENSION_CLS,  # as cpu plans with speculative decoding state it
    }
    # As cpu plans run engines: layers keep their weights (torch GEMMs), so updates copy in place.
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "RLC_VLLM_CPU_GEMM": "torch"}
    actor = rollout_engine_actor(num_cpus=1, runtime_env={"env_vars": env}).remote(args, "cpu")
    t0 = time.perf_counter()
    startup = ray_cluster.get(actor.ready.remote())
    print(f"engine actor ready in {time.perf_counter() - t0:.1f}s (LLM() {startup:.1f}s)")
    yield actor
    ray_cluster.get(actor.shutdown.remote())
    ray_cluster.kill(actor)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _reset_to_base(ray, engine, tiny_model_dir: Path) -> None:
    ray.get(engine.update_weights_from_path.remote(str(tiny_model_dir / "model.safetensors"), 0))


# ------------------------------------------------------------------ engine tests


@pytest.mark.slow
def test_generate_returns_ids_logprobs_and_version(ray_cluster, engine, tiny_model_dir, tokenizer) -> None:
    ray = ray_cluster
    _reset_to_base(ray, engine, tiny_model_dir)
    eos = tokenizer.eos_token_id
    reqs = [
        {"prompt_ids": tokenizer(p).input_ids, "n": 4, "temperature": 0.7, "max_tokens": 8, "stop_token_ids": [eos]}
        for p in PROMPTS
    ]
    t0 = time.perf_counter()
    groups = ray.get(engine.generate.remote(reqs))
    dt = time.perf_counter() - t0
    assert len(groups) == len(PROMPTS) and all(len(g) == 4 for g in groups)
    model = hf_model(tiny_model_dir)
    worst = 0.0
    n_tokens = 0
    for req, group in zip(reqs, groups, strict=True):
        for s in group:
            n_tokens += len(s.output_ids)
            assert s.version == 0
            assert s.prompt_ids == req["prompt_ids"]
            assert len(s.logprobs) == len(s.output_ids) >= 1
            assert s.finish_reason in ("stop", "length")
            if s.finish_reason == "stop":
                assert s.output_ids[-1] == eos
            # processed_logprobs: the sampled token's log-prob under the tempered distribution.
            ref = hf_logprobs(model, s.prompt_ids + s.output_ids, 0.7)[len(s.prompt_ids) - 1 :]
            worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
    print(f"sampling log-prob max |vLLM - HF| at T=0.7: {worst:.2e}; {n_tokens} tokens in {dt:.2f}s")
    assert worst < TOL


@pytest.mark.slow
def test_update_from_path_matches_hf(ray_cluster, engine, tiny_model_dir, tokenizer, tmp_path) -> None:
    ray = ray_cluster
    model = hf_model(tiny_model_dir)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    path = write_safetensors(model.state_dict(), tmp_path / "v1")
    seq = [*tokenizer("7+2=9").input_ids, tokenizer.eos_token_id]
    before = torch.tensor(ray.get(engine.prompt_logprobs.remote([seq]))[0])
    took = ray.get(engine.update_weights_from_path.remote(str(path), 1))
    after = torch.tensor(ray.get(engine.prompt_logprobs.remote([seq]))[0])
    ref = hf_logprobs(model, seq)
    diff = (after - ref).abs().max().item()
    print(f"reload from path {took * 1e3:.1f} ms; prompt log-prob max |vLLM - HF| {diff:.2e}")
    assert (before - ref).abs().max().item() > 1e-3  # the update really changed something
    assert diff < TOL
    assert ray.get(engine.get_version.remote()) == 1
    s = ray.get(engine.generate.remote([{"prompt_ids": seq[:4], "max_tokens": 2}]))[0][0]
    assert s.version == 1


@pytest.mark.slow
def test_interrupted_samples_continue_under_the_new_weights(ray_cluster, engine, tiny_model_dir, tokenizer, tmp_path):
    """A weight update lands while samples decode (the plan's weight_update: interrupt): every sample comes back
    whole, its tokens labelled version 0 then version 1, in order; the tokens before the update carry the old
    policy's log-probs and those after the new policy's on the whole prefix, so the frozen sequences were
    prefilled again under the new weights (their cached KV was the old weights')."""
    ray = ray_cluster
    base = hf_model(tiny_model_dir)
    new = hf_model(tiny_model_dir)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    path = write_safetensors(new.state_dict(), tmp_path / "v1")
    # The whole state dict (the tied head too, which the model folder's file leaves out): loading the folder's
    # file after `path` would leave the engine's head at v1.
    base_path = write_safetensors(base.state_dict(), tmp_path / "v0")
    prompt = tokenizer("3+4=").input_ids
    req = {"prompt_ids": prompt, "n": 8, "temperature": 1.0, "max_tokens": 120, "ignore_eos": True, "seed": 5}
    for attempt in range(6):
        ray.get(engine.update_weights_from_path.remote(str(base_path), 0))
        running = engine.generate.remote([req])
        time.sleep(0.02 * (attempt + 1))
        ray.get(engine.update_weights_from_path.remote(str(path), 1))
        samples = ray.get(running)[0]
        interrupted = [s for s in samples if s.interrupted]
        if interrupted:
            break
    else:
        pytest.fail("no weight update landed mid-sample in 6 attempts")
    worst_old = worst_new = 0.0
    for s in interrupted:
        assert len(s.output_ids) == len(s.logprobs) == len(s.versions) == 120
        switch = s.versions.index(1)
        assert s.versions == [0] * switch + [1] * (120 - switch) and s.version == 0
        ids = s.prompt_ids + s.output_ids
        old_ref = hf_logprobs(base, ids)[len(prompt) - 1 :]
        new_ref = hf_logprobs(new, ids)[len(prompt) - 1 :]
        got = torch.tensor(s.logprobs)
        worst_old = max(worst_old, (got[:switch] - old_ref[:switch]).abs().max().item())
        worst_new = max(worst_new, (got[switch:] - new_ref[switch:]).abs().max().item())
    print(f"{len(interrupted)} interrupted; max |vLLM - HF| before {worst_old:.2e}, after {worst_new:.2e}")
    assert worst_old < TOL and worst_new < TOL
    ray.get(engine.update_weights_from_path.remote(str(base_path), 0))


@pytest.mark.slow
def test_broadcast_from_trainer_group_matches_trainer(ray_cluster, engine, tiny_model_dir, tokenizer) -> None:
    """Two FSDP2 ranks train a step, rank 0 broadcasts to the engine, both score a sequence alike."""
    from rlc.runtime.train.group import TrainerGroup

    ray = ray_cluster
    group = TrainerGroup(2, str(tiny_model_dir), "cpu", {"lr": 1e-3, "micro_batch_size": 2})
    try:
        seqs = [
            tokenizer(p).input_ids + tokenizer(str(i), add_special_tokens=False).input_ids
            for i, p in enumerate(PROMPTS)
        ]
        masks = [[0] * (len(s) - 1) + [1] for s in seqs]
        batch = {"input_ids": seqs, "loss_mask": masks}
        lp = group.compute_logprobs(batch)
        batch.update(behaviour_logprobs=lp, advantages=[1.0, -1.0, 1.0, -1.0])
        group.train_step(batch, {"clip": 0.2})

        meta = group.weight_meta()
        host, port = group.weight_sync_address()
        t0 = time.perf_counter()
        joined = engine.init_sync_group.remote(host, port, 1, 2, "gloo")
        received = engine.update_weights_broadcast.remote(meta, 2)
        sent = group.sync_weights_broadcast_async(host, port, 2, meta)
        ray.get([joined, received, *sent])
        first = time.perf_counter() - t0
        t0 = time.perf_counter()  # a second sync reuses the group
        received = engine.update_weights_broadcast.remote(meta, 3)
        ray.get([received, *group.sync_weights_broadcast_async(host, port, 2, meta)])
        again = time.perf_counter() - t0

        probe = [*seqs[0], tokenizer.eos_token_id]
        trainer_lp = torch.tensor(
            group.compute_logprobs({"input_ids": [probe], "loss_mask": [[0] * len(probe)]})[0][1:]
        )
        engine_lp = torch.tensor(ray.get(engine.prompt_logprobs.remote([probe]))[0])
        diff = (trainer_lp - engine_lp).abs().max().item()
        print(f"broadcast sync {first:.3f}s (incl. join), {again:.3f}s after; max |vLLM - trainer| {diff:.2e}")
        assert diff < TOL
        assert ray.get(engine.get_version.remote()) == 3
        ray.get(engine.close_sync_group.remote())
    finally:
        group.shutdown()


@pytest.mark.slow
def test_post_sync_check_sees_a_stale_engine(ray_cluster, engine, tiny_model_dir, tokenizer, tmp_path) -> None:
    """The post-sync check (`SyncCheck.verify`, the quickstart's float32 plan numbers) on this engine, after one GRPO
    step of the quickstart model at the quickstart's lr: the new weights pass; an engine stamped with the new version
    but serving the weights before the step, or with decoder layer 0 left on them, stops the run."""
    import types

    from test_sync_check import LR, Trainer, _half_synced, _plan_schedule, _step

    from rlc.runtime.errors import RunError
    from rlc.runtime.rollout.client import EngineClient
    from rlc.runtime.sync_check import SyncCheck

    ray = ray_cluster
    old = hf_model(tiny_model_dir)
    new, seqs = _step(old, LR, tokenizer)
    # Whole state dicts (the tied head too): the model folder's file leaves it out.
    paths = {
        name: str(write_safetensors(model.state_dict(), tmp_path / name))
        for name, model in (("old", old), ("new", new), ("half", _half_synced(new, old, 0)))
    }
    schedule = _plan_schedule("cpu")
    trainer = Trainer(old, bf16=False)
    pool = types.SimpleNamespace(engines=[EngineClient(engine)])
    check = SyncCheck(
        trainer, pool, schedule.sync_check_max_gap, schedule.sync_check_noise, schedule.sync_check_min_step
    )
    check.before_step(seqs)
    trainer.model = new
    check.expect(seqs)
    try:
        ray.get(engine.update_weights_from_path.remote(paths["new"], 1))
        fresh = check.verify(1)
        print(f"the step moved the probe {check.moved:.3f} nats; the synced engine is {fresh:.1e} off")
        assert fresh < TOL and check.moved > schedule.sync_check_min_step
        for version, name, why in ((2, "old", "nearer its weights before the step"), (3, "half", "did not take")):
            ray.get(engine.update_weights_from_path.remote(paths[name], version))
            with pytest.raises(RunError, match=why):
                check.verify(version)
    finally:
        ray.get(engine.update_weights_from_path.remote(paths["old"], 0))


@pytest.mark.slow
def test_spec_decode_metrics(ray_cluster, engine, tokenizer) -> None:
    ray = ray_cluster
    prompt = tokenizer("1+2=3+1+2=3+1+2=").input_ids
    req = {"prompt_ids": prompt, "n": 2, "temperature": 1.0, "max_tokens": 32, "ignore_eos": True}
    t0 = time.perf_counter()
    out = ray.get(engine.generate.remote([req]))[0]
    dt = time.perf_counter() - t0
    assert all(len(s.output_ids) == 32 for s in out)
    m = ray.get(engine.spec_decode_metrics.remote())
    print(f"spec decode: {m}; {64 / dt:.0f} tokens/s for one request, n=2")
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] > 0
    assert 0 <= m["num_accepted_tokens"] <= m["num_draft_tokens"]
    # The derived figures are vLLM's counters' ratios, not figures of their own.
    assert m["acceptance_rate"] == pytest.approx(m["num_accepted_tokens"] / m["num_draft_tokens"])
    assert m["mean_acceptance_length"] == pytest.approx(1.0 + m["num_accepted_tokens"] / m["num_drafts"])


@pytest.mark.slow
def test_sleep_mode_refused_on_cpu(ray_cluster, engine) -> None:
    from rlc.runtime.rollout.engine import NotSupported

    with pytest.raises(NotSupported, match="not supported on cpu"):
        ray_cluster.get(engine.sleep.remote(1))
    with pytest.raises(NotSupported):
        ray_cluster.get(engine.wake_up.remote())


def test_engine_refuses_sleep_mode_before_starting_vllm() -> None:
    from rlc.runtime.rollout.engine import NotSupported, RolloutEngine

    with pytest.raises(NotSupported):
        RolloutEngine({"model": os.devnull, "dtype": "float32", "enable_sleep_mode": True, **RL_ENGINE_ARGS}, "cpu")


def test_engine_refuses_args_that_would_bias_the_behaviour_logprobs() -> None:
    """vLLM's default log-probs are the untempered model's, and its 'auto' dtype halves a float32 checkpoint: an
    engine whose args leave either to vLLM would feed every importance weight a wrong denominator, so it is
    refused before starting."""
    from rlc.runtime.rollout.engine import RolloutEngine

    args = {"model": os.devnull, "dtype": "float32", **RL_ENGINE_ARGS}
    for key, value, why in [
        ("logprobs_mode", None, "processed_logprobs"),
        ("logprobs_mode", "raw_logprobs", "processed_logprobs"),
        ("dtype", None, "no dtype"),
        ("dtype", "auto", "no dtype"),
    ]:
        broken = {k: v for k, v in args.items() if k != key} | ({key: value} if value else {})
        with pytest.raises(ValueError, match=why):
            RolloutEngine(broken, "cpu")
