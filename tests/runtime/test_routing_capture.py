"""Rollout routing replay's capture: the experts the engine's MoE routers chose, per sample and position.

The position logic (chunked prefill, prefix-cache hits, speculative drafts, preemption, request ids, the replies'
trip through vLLM's serialisation) is checked on made-up steps; one real engine on the tiny Qwen3-MoE in float32
(n-gram speculative decoding and prefix caching on, so rejected drafts and cached prompts occur) checks that
every sample's rows are the experts a transformers forward of the same tokens chooses, for n > 1, a cached prompt
and a sample a weight update interrupted.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from rlc.compiler.engine_config import CPU_ENGINE_ARGS
from rlc.runtime.rollout import routing_capture as rc
from rlc.runtime.rollout.routing_capture import RoutingRecorder, missing, normalize_rows, take_routing
from rlc.schemas.engine_args import RL_ENGINE_ARGS, SPEC_DECODE_EXTENSION_CLS

M8 = missing(np.uint8)


def _step(values: list[int], layers: int = 3, k: int = 2) -> np.ndarray:
    """One step's router rows: token i's experts are all ``values[i]`` (int32, as vLLM's step buffer holds them)."""
    return np.repeat(np.array(values, np.int32)[:, None, None], layers * k, axis=1).reshape(len(values), layers, k)


def _commit(rec: RoutingRecorder, batch: list[tuple[str, int, list[int], int]]) -> None:
    """File one step of (worker request id, computed before, values of its scheduled tokens, its tokens)."""
    values = [v for _, _, vals, _ in batch for v in vals]
    starts = np.cumsum([0] + [len(vals) for _, _, vals, _ in batch])
    rec.commit_step(
        _step(values, rec.num_layers, rec.top_k),
        [rid for rid, *_ in batch],
        np.array([n0 for _, n0, _, _ in batch]),
        starts,
        np.array([nt for *_, nt in batch]),
    )


def _rows(rec: RoutingRecorder, ext: str) -> dict[int, list[int]]:
    """What `take` hands out for ``ext``, one value per row (the first MoE layer's first expert)."""
    return {i: a[:, 0, 0].tolist() for i, a in rec.take([ext])[ext].items()}


# ------------------------------------------------------------------ made-up steps


def test_worker_request_ids_name_their_front_end_request() -> None:
    """vLLM's workers see ``{id}-{8 hex}`` (and ``{index}_`` before it for the completions of an n > 1 request);
    ids without the random suffix (vLLM's randomisation turned off) and ids that end in hex themselves still
    resolve to the id the front end gave."""
    from vllm.utils import random_uuid

    rec = RoutingRecorder(3, 2, 8, [0, 2])
    ids = {
        "rlc-7": [f"rlc-7-{random_uuid():.8}"],
        "rlc-8": [f"{i}_rlc-8-{random_uuid():.8}" for i in range(3)],
        "chatcmpl-deadbeef": ["chatcmpl-deadbeef-0a1b2c3d"],
        "cmpl-x-0": ["cmpl-x-0"],
        "cmpl-y-1": ["0_cmpl-y-1", "1_cmpl-y-1"],
    }
    for n, workers in enumerate(ids.values()):
        _commit(rec, [(w, 0, [10 * n + i, 1], 2) for i, w in enumerate(workers)])
    assert _rows(rec, "rlc-7") == {0: [0, 1]}
    assert _rows(rec, "rlc-8") == {0: [10, 1], 1: [11, 1], 2: [12, 1]}
    assert _rows(rec, "chatcmpl-deadbeef") == {0: [20, 1]}
    assert _rows(rec, "cmpl-x-0") == {0: [30, 1]}
    assert _rows(rec, "cmpl-y-1") == {0: [40, 1], 1: [41, 1]}
    assert rec.requests == {} and rec._by_ext == {}  # taken is freed
    assert _rows(rec, "rlc-7") == {}  # and handed out once


def test_steps_file_rows_at_their_positions() -> None:
    """Chunked prefill, a prompt prefix served from the prefix cache (missing), decoding, and speculative drafts:
    a rejected draft's row is replaced when its position is computed again, and rows past the sample's last input
    position are cut by `normalize_rows`. Dense layers stay missing."""
    rec = RoutingRecorder(3, 2, 8, [0, 2])
    a, b = "rlc-0-0a1b2c3d", "rlc-1-0a1b2c3d"
    _commit(rec, [(a, 0, [1, 2, 3], 5)])  # 5-token prompt, first chunk
    _commit(rec, [(a, 3, [4, 5], 5), (b, 4, [40, 41], 6)])  # b: 4 positions from the cache
    _commit(rec, [(a, 5, [6, 7, 8, 9], 6), (b, 6, [42], 7)])  # a: its last token and three drafts
    _commit(rec, [(a, 7, [70], 8)])  # one draft accepted: position 7 (a rejected draft's) computed again
    got = asyncio.run(take_routing(_Workers(rec), ["rlc-0", "rlc-1"]))
    assert got["rlc-0"][0][:, 0, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 70, 9]  # 9: the other rejected draft
    fitted = normalize_rows(got["rlc-0"][0], 8, 8, 3, 2)  # T = 9 tokens: 8 rows
    assert fitted[:, 0, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 70]
    assert (fitted[:, 1] == M8).all() and (fitted[:, 2] == fitted[:, 0]).all()  # layer 1 is dense
    assert got["rlc-1"][0][:, 0, 0].tolist() == [M8] * 4 + [40, 41, 42]


def test_a_recomputed_position_keeps_the_row_of_its_first_accepted_computation() -> None:
    """rlc's interrupting weight update prefills the frozen sequences again under the new weights: the positions
    whose next token the old version sampled keep the old version's rows (drafts accepted just before the update
    too), the new computation fills rows never captured (a prefix-cache hit) and files the rest."""
    rec = RoutingRecorder(3, 2, 8, [0, 2])
    c, d, e = "rlc-2-0a1b2c3d", "rlc-3-0a1b2c3d", "rlc-4-0a1b2c3d"
    _commit(rec, [(c, 0, [1, 2, 3], 3), (d, 0, [1, 2, 3], 3), (e, 4, [5], 5)])  # e: 4 cached positions
    _commit(rec, [(c, 3, [4], 4), (d, 3, [4, 5, 6, 7], 4)])  # d: three drafts, two of them accepted
    _commit(rec, [(c, 4, [5], 5)])
    # The update: every sequence is prefilled again from position 0 (c has 6 tokens, d 7, e 6).
    _commit(rec, [(c, 0, [101, 102, 103, 104, 105, 106], 6), (d, 0, [101, 102, 103, 104, 105, 106, 107], 7)])
    _commit(rec, [(e, 0, [201, 202, 203, 204, 205, 206], 6)])
    _commit(rec, [(c, 6, [107], 7)])
    assert _rows(rec, "rlc-2") == {0: [1, 2, 3, 4, 5, 106, 107]}
    assert _rows(rec, "rlc-3") == {0: [1, 2, 3, 4, 5, 6, 107]}  # 7 was the rejected draft's
    assert _rows(rec, "rlc-4") == {0: [201, 202, 203, 204, 5, 206]}


def test_rows_grow_past_any_length_and_scoring_requests_are_not_captured() -> None:
    rec = RoutingRecorder(3, 2, 300, [0, 1, 2], ignore_prefixes=("rlc-score-",))
    assert rec.dtype == np.uint16  # 300 experts
    rid = "rlc-5-0a1b2c3d"
    _commit(rec, [(rid, 0, [7, 8], 2), ("rlc-score-0-0a1b2c3d", 0, [1, 2, 3], 3)])
    for pos in range(2, 300):
        _commit(rec, [(rid, pos, [pos + 1], pos + 1)])
    rows = rec.take(["rlc-5"])["rlc-5"][0]
    assert rows.shape == (300, 3, 2) and rows[:, 2, 1].tolist() == [7, 8, *range(3, 301)]
    assert list(rec.requests) == []


def test_routing_never_taken_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """An aborted request's routing is never taken: finished requests are dropped after a grace period, and the
    oldest beyond a bound at once; running (or preempted) ones are kept."""
    monkeypatch.setattr(rc, "MAX_UNTAKEN", 2)
    rec = RoutingRecorder(3, 2, 8, [0])
    ids = [f"rlc-{i}-0a1b2c3d" for i in range(5)]
    _commit(rec, [(rid, 0, [i], 1) for i, rid in enumerate(ids)])
    assert rec.sweep(set(ids), now=0.0) == 0
    assert rec.sweep({ids[0]}, now=1.0) == 2  # four finished, two kept
    assert sorted(rec.requests) == [ids[0], ids[3], ids[4]]
    assert rec.sweep({ids[0]}, now=1.0 + rc.UNTAKEN_GRACE_S / 2) == 0
    assert rec.sweep({ids[0]}, now=2.0 + rc.UNTAKEN_GRACE_S) == 2
    assert list(rec.requests) == [ids[0]] and list(rec._by_ext) == ["rlc-0-0a1b2c3d", "rlc-0"]


class _Workers:
    """A front end's view of some workers' recorders: ``collective_rpc`` answers as vLLM's utility calls do, after
    a round trip through its msgpack serialisation (numpy arrays would arrive as lists; bytes arrive as bytes)."""

    def __init__(self, *recorders: RoutingRecorder, experts: int = 8, layers: int = 3, top_k: int = 2) -> None:
        self.recorders = recorders
        self.model_config = SimpleNamespace(
            get_num_experts=lambda: experts,
            get_total_num_hidden_layers=lambda: layers,
            get_num_experts_per_tok=lambda: top_k,
        )
        self.calls: list[str] = []

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult

        assert method == "take_routing"
        self.calls.append(method)
        replies = [r.encode(r.take(*args)) for r in self.recorders]
        return MsgpackDecoder(UtilityResult).decode(MsgpackEncoder().encode(UtilityResult(replies))).result


def test_pipeline_stages_merge_and_tensor_parallel_ranks_send_once() -> None:
    """Each pipeline stage captures its own layers; tensor-parallel ranks but the first send nothing (they hold the
    same rows). The front end puts every layer of every completion together."""
    first, second = RoutingRecorder(3, 2, 8, [0]), RoutingRecorder(3, 2, 8, [1, 2])
    twin = RoutingRecorder(3, 2, 8, [1, 2], send=False)
    for rec, base in ((first, 0), (second, 10), (twin, 10)):
        _commit(rec, [(f"{i}_rlc-9-0a1b2c3d", 0, [base + i, base + i + 1, base + i + 2], 4) for i in range(2)])
    workers = _Workers(first, second, twin)
    got = asyncio.run(take_routing(workers, ["rlc-9", "rlc-10"]))
    assert got["rlc-10"] == {} and sorted(got["rlc-9"]) == [0, 1]
    for i, rows in got["rlc-9"].items():
        assert rows.dtype == np.uint8 and rows.shape == (3, 3, 2)
        assert rows[:, :, 0].tolist() == [[i + t, 10 + i + t, 10 + i + t] for t in range(3)]
    assert not (first.requests or second.requests or twin.requests)


def test_fetch_routing_fits_each_completion_to_its_tokens() -> None:
    rec = RoutingRecorder(3, 2, 8, [0, 1, 2])
    _commit(rec, [("0_chatcmpl-abc-0a1b2c3d", 0, [1, 2, 3, 4], 4), ("1_chatcmpl-abc-0a1b2c3d", 0, [5, 6], 2)])
    workers = _Workers(rec)
    fitted = asyncio.run(rc.fetch_routing(workers, "chatcmpl-abc", 3, num_tokens=[4, 5, 2]))
    assert [a.shape for a in fitted] == [(3, 3, 2), (4, 3, 2), (1, 3, 2)]
    assert fitted[0][:, 0, 0].tolist() == [1, 2, 3]  # a trailing draft row cut
    assert fitted[1][:, 0, 0].tolist() == [5, 6, M8, M8]  # never captured: missing
    assert (fitted[2] == M8).all()  # no such completion
    assert asyncio.run(rc.fetch_routing(workers, "chatcmpl-abc", 1)) == [None]


def test_vllms_own_rows_become_the_contracts() -> None:
    """vLLM's capture comes with each completion (``routed_experts``, T - 1 rows); it sends uint8 up to 256
    experts: with 256, 255 is an expert, kept as such in uint16."""
    own = np.array([[[255, 3]], [[0, 254]]], np.uint8)
    fitted = normalize_rows(own, 3, 256, 1, 2)
    assert fitted.dtype == np.uint16 and fitted.tolist() == [[[255, 3]], [[0, 254]], [[65535, 65535]]]
    assert normalize_rows(own, 1, 64, 1, 2).tolist() == [[[255, 3]]]
    comps = [SimpleNamespace(index=i, token_ids=[7] * (i + 1), routed_experts=own[: i + 1]) for i in range(2)]
    output = SimpleNamespace(request_id="r", prompt_token_ids=[1], outputs=comps)
    llm = _Workers(experts=256, layers=1)
    got = asyncio.run(rc.output_routing(llm, output, "vllm"))
    assert [a.tolist() for a in got] == [own[:1].tolist(), own.tolist()] and not llm.calls


# ------------------------------------------------------------------ the engine's front end, without vLLM


class _FakeLLM(_Workers):
    """vLLM's front end for `RolloutEngine.generate`: each request's worker computes its positions in one step."""

    def __init__(self, rec: RoutingRecorder | None) -> None:
        super().__init__(*([rec] if rec else []))
        self.rec = rec

    async def generate(self, prompt: dict, params: Any, request_id: str, **_: Any) -> Any:
        ids = prompt["prompt_token_ids"]
        outputs = []
        for index in range(params.n):
            out_ids = [5 + index, 6]
            worker = f"{index}_{request_id}-0a1b2c3d" if params.n > 1 else f"{request_id}-0a1b2c3d"
            if self.rec is not None:  # the worker computes every input position but the last sampled token's
                count = len(ids) + len(out_ids) - 1
                _commit(self.rec, [(worker, 0, [index] * count, count)])
            logprobs = [{t: SimpleNamespace(logprob=-1.0)} for t in out_ids]
            outputs.append(SimpleNamespace(index=index, token_ids=out_ids, logprobs=logprobs, finish_reason="length"))
        yield SimpleNamespace(request_id=request_id, prompt_token_ids=ids, outputs=outputs[::-1])

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        if self.rec is None:
            raise AssertionError(f"{method} asked of an engine that captures nothing")
        return await super().collective_rpc(method, args)


def _engine(routing_capture: str | None, llm: Any) -> Any:
    from rlc.runtime.rollout.engine import RolloutEngine

    engine = RolloutEngine({"model": "m", "dtype": "float32", **RL_ENGINE_ARGS}, "cpu", routing_capture=routing_capture)
    engine.llm = llm
    return engine


def _generate(engine: Any, req: dict) -> list[Any]:
    async def run() -> list[Any]:
        engine._open = asyncio.Event()
        engine._open.set()
        return (await engine.generate([req]))[0]

    return asyncio.run(run())


def test_generate_returns_each_samples_routing_with_one_call_per_request() -> None:
    """Capture on: every sample gets its own ``[T - 1, layers, top_k]`` rows, the n completions from one call to
    the workers. Off: None, and the workers are never asked."""
    llm = _FakeLLM(RoutingRecorder(3, 2, 8, [0, 1, 2]))
    samples = _generate(_engine("rlc", llm), {"prompt_ids": [1, 2, 3], "n": 3, "max_tokens": 2})
    assert [s.output_ids[0] for s in samples] == [5, 6, 7] and llm.calls == ["take_routing"]
    for i, s in enumerate(samples):
        assert s.routed_experts.shape == (4, 3, 2) and (s.routed_experts == i).all()
    off = _generate(_engine(None, _FakeLLM(None)), {"prompt_ids": [1, 2, 3], "n": 2, "max_tokens": 2})
    assert [s.routed_experts for s in off] == [None, None]


def test_capture_is_refused_where_it_cannot_work() -> None:
    """A model without an MoE router gets a clear refusal (and its engine is stopped); an unknown mode, and vLLM's
    capture without its engine argument, are refused before vLLM starts."""
    from rlc.runtime.rollout.engine import NotSupported
    from rlc.runtime.rollout.routing_capture import RoutingCaptureExtension

    class Runner:
        model_config = SimpleNamespace(get_total_num_hidden_layers=lambda: 2, enforce_eager=True)

        def get_model(self) -> torch.nn.Module:
            return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))  # dense

    class Worker(RoutingCaptureExtension):
        model_runner = Runner()

    class DenseLLM:
        stopped = False

        async def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
            return [getattr(Worker(), method)(*args)]

        def shutdown(self) -> None:
            self.stopped = True

    llm = DenseLLM()
    engine = _engine("rlc", llm)
    with pytest.raises(NotSupported, match="no mixture-of-experts router"):
        asyncio.run(engine._start_routing_capture())
    assert llm.stopped and engine.llm is None
    with pytest.raises(ValueError, match="routing_capture must be"):
        _engine("sglang", None)
    with pytest.raises(ValueError, match="enable_return_routed_experts"):
        _engine("vllm", None)


# ------------------------------------------------------------------ one real engine


@pytest.fixture(scope="module")
def engine(ray_cluster, tiny_moe_model_dir: Path):
    from rlc.runtime.rollout.engine import rollout_engine_actor

    # As cpu plans with speculative decoding run engines (their dtype, worker extension and executor) ...
    args = {**CPU_ENGINE_ARGS, **RL_ENGINE_ARGS, "dtype": "float32", "worker_extension_cls": SPEC_DECODE_EXTENSION_CLS}
    # ... with n-gram drafts (rejected ones occur) and prefix caching on, which cpu plans with R3 turn off: the
    # capture must be right with it on. Blocks of 32 tokens let a 40-token prompt hit the cache.
    drafts = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    args |= {"model": str(tiny_moe_model_dir), "max_model_len": 256, "max_num_seqs": 32, "seed": 0}
    args |= {"speculative_config": drafts, "enable_prefix_caching": True, "block_size": 32}
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "RLC_VLLM_CPU_GEMM": "torch"}
    actor = rollout_engine_actor(num_cpus=1, runtime_env={"env_vars": env}).remote(args, "cpu", routing_capture="rlc")
    ray_cluster.get(actor.ready.remote(), timeout=600)
    yield actor
    ray_cluster.get(actor.shutdown.remote(), timeout=120)
    ray_cluster.kill(actor)


def _hf(model_dir: Path, perturb: float = 0.0) -> torch.nn.Module:
    """The model in float32; ``perturb``: noise added to its routers, so that they choose other experts."""
    from hf_reference import hf_model

    model = hf_model(model_dir)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.add_(torch.randn(layer.mlp.gate.weight.shape, generator=gen) * perturb)
    return model


@torch.no_grad()
def _hf_routing(model: torch.nn.Module, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The experts transformers' routers choose per position and layer ``[T, layers, top_k]``, and each choice's
    margin: the router probability of the last chosen expert minus that of the first one left out."""
    chosen, margins = [], []

    def keep(_module: Any, _inputs: Any, out: Any) -> None:
        logits, _, indices = out
        top = torch.softmax(logits.float(), -1).topk(indices.shape[-1] + 1, -1).values
        chosen.append(indices)
        margins.append(top[:, -2] - top[:, -1])

    hooks = [layer.mlp.gate.register_forward_hook(keep) for layer in model.model.layers]
    try:
        model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(chosen, 1).numpy(), torch.stack(margins, 1).numpy()


def _agreement(rows: np.ndarray, model: torch.nn.Module, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per (position, layer): whether the engine's experts are transformers' (as sets), and the router margin."""
    ref, margin = _hf_routing(model, ids)
    same = (np.sort(rows.astype(np.int64), -1) == np.sort(ref[:-1], -1)).all(-1)
    return same, margin[:-1]


@pytest.mark.slow
def test_every_sample_carries_the_experts_its_engine_chose(ray_cluster, engine, tiny_moe_model_dir: Path) -> None:
    """(T - 1) rows per sample, every one captured, each the experts transformers' routers choose on the same
    tokens; the n completions of a prompt share their prompt's rows and part where their tokens do. The few
    disagreements float32 allows are near ties between the last chosen expert and the next."""
    reqs = [
        {"prompt_ids": p, "n": 3, "temperature": 0.3, "max_tokens": 32, "ignore_eos": True, "seed": 7}
        for p in ([3, 4, 5, 6], [7, 8, 9, 7, 8, 9, 7, 8], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20])
    ]
    t0 = time.perf_counter()
    groups = ray_cluster.get(engine.generate.remote(reqs))
    took = time.perf_counter() - t0
    model = _hf(tiny_moe_model_dir)
    same, margins = [], []
    for req, group in zip(reqs, groups, strict=True):
        assert len(group) == 3
        for s in group:
            ids = s.prompt_ids + s.output_ids
            assert s.routed_experts.shape == (len(ids) - 1, 2, 2) and s.routed_experts.dtype == np.uint8
            assert (s.routed_experts != M8).all() and (s.routed_experts < 8).all()
            agree, margin = _agreement(s.routed_experts, model, ids)
            same.append(agree.ravel())
            margins.append(margin.ravel())
        prompt = len(req["prompt_ids"]) - 1
        assert all((s.routed_experts[:prompt] == group[0].routed_experts[:prompt]).all() for s in group)
        assert len({s.routed_experts.tobytes() for s in group}) > 1  # each completion its own
    same_all, margin_all = np.concatenate(same), np.concatenate(margins)
    drafts = ray_cluster.get(engine.spec_decode_metrics.remote())
    print(
        f"{len(same_all)} (position, layer) choices in {took:.2f} s: {same_all.mean():.4%} as transformers' "
        f"(largest router margin where they differ: {margin_all[~same_all].max(initial=0):.1e}; smallest margin "
        f"overall {margin_all.min():.1e}); drafts {drafts['num_draft_tokens']:.0f}, "
        f"accepted {drafts['num_accepted_tokens']:.0f}"
    )
    assert drafts["num_draft_tokens"] > drafts["num_accepted_tokens"] > 0  # drafts were rejected and accepted
    assert same_all.mean() >= 0.99
    assert (margin_all[~same_all] < 1e-4).all()


@pytest.mark.slow
def test_a_prompt_served_from_the_prefix_cache_has_missing_rows(ray_cluster, engine, tiny_moe_model_dir) -> None:
    """The second sample of a 40-token prompt reads its first 32-token block from the cache: those rows are missing
    (the trainer routes them itself), the rest captured."""
    prompt = [3 + (7 * i) % 28 for i in range(40)]
    req = {"prompt_ids": prompt, "n": 1, "temperature": 1.0, "max_tokens": 8, "ignore_eos": True}
    first = ray_cluster.get(engine.generate.remote([req]))[0][0]
    again = ray_cluster.get(engine.generate.remote([req]))[0][0]
    assert (first.routed_experts != M8).all()
    assert (again.routed_experts[:32] == M8).all() and (again.routed_experts[32:] != M8).all()
    agree, _ = _agreement(again.routed_experts, _hf(tiny_moe_model_dir), again.prompt_ids + again.output_ids)
    assert agree[32:].mean() >= 0.99


@pytest.mark.slow
def test_an_interrupted_sample_carries_each_versions_routing(ray_cluster, engine, tiny_moe_model_dir, tmp_path):
    """A weight update lands while samples decode (weight_update: interrupt, which prefills them again under the
    new weights): the rows whose next token the old version sampled are the old routers' choices, the rest the new
    routers'."""
    from rlc.runtime.rollout.weight_sync import write_safetensors

    old, new = _hf(tiny_moe_model_dir), _hf(tiny_moe_model_dir, perturb=0.5)
    old_path = write_safetensors(old.state_dict(), tmp_path / "v0")
    new_path = write_safetensors(new.state_dict(), tmp_path / "v1")
    req = {"prompt_ids": [3, 4, 5], "n": 4, "temperature": 1.0, "max_tokens": 120, "ignore_eos": True, "seed": 5}
    for attempt in range(6):
        ray_cluster.get(engine.update_weights_from_path.remote(str(old_path), 0))
        running = engine.generate.remote([req])
        time.sleep(0.05 * (attempt + 1))
        ray_cluster.get(engine.update_weights_from_path.remote(str(new_path), 1))
        interrupted = [s for s in ray_cluster.get(running)[0] if s.interrupted]
        if interrupted:
            break
    else:
        pytest.fail("no weight update landed mid-sample in 6 attempts")
    ray_cluster.get(engine.update_weights_from_path.remote(str(old_path), 0))
    as_old, as_new, differ = [], [], []
    for s in interrupted:
        ids = s.prompt_ids + s.output_ids
        # Row r sampled token r + 1: the prompt's rows and those before the first new-version token are the old's.
        switch = len(s.prompt_ids) - 1 + s.versions.index(1)
        old_same, _ = _agreement(s.routed_experts, old, ids)
        new_same, _ = _agreement(s.routed_experts, new, ids)
        as_old.append(old_same[:switch].ravel())
        as_new.append(new_same[switch:].ravel())
        differ.append(~new_same[:switch].ravel())
    as_old_all, as_new_all, differ_all = map(np.concatenate, (as_old, as_new, differ))
    print(
        f"{len(interrupted)} interrupted: before the update {as_old_all.mean():.2%} as the old routers "
        f"({differ_all.mean():.0%} unlike the new ones), after {as_new_all.mean():.2%} as the new"
    )
    assert as_old_all.mean() >= 0.99 and as_new_all.mean() >= 0.99
    assert differ_all.mean() > 0.2  # the two versions' routers really differ
