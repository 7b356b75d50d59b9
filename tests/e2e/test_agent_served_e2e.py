"""A served engine in its Ray actor, driven like agents drive it (slow: it starts vLLM).

One engine (the calculator model) serves every test here: the chat endpoint's latency and its token-exact
record (the response's ids equal the recorded ones; the engine's log-probs equal the trainer model's), an agent
that is a separate OS process using only `openai`, a weight update during a long in-flight call (the call
completes and each token carries the version that sampled it), agents that fail in every way (bounded, counted),
and mini-swe-agent (a dev dependency) on the `local` environment.
"""

from __future__ import annotations

import concurrent.futures
import json
import secrets
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from rlc.agents.llm import Endpoint  # noqa: E402
from rlc.runtime.agent.trajectory import segment_calls, trajectory_rows  # noqa: E402
from rlc.schemas.engine_args import RL_ENGINE_ARGS  # noqa: E402

MAX_LEN = 128
AGENT = {"served_model_name": "rlc-tiny-agent", "max_turns": 3, "max_tokens_per_turn": 96}


@pytest.fixture(scope="module")
def agent_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlc.runtime.tasks.model_builder import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("agent") / "model", seed=0, task="calculator")


@pytest.fixture(scope="module")
def served(ray_cluster, agent_model_dir: Path):  # type: ignore[no-untyped-def]
    from rlc.runtime.rollout.engine import rollout_engine_actor

    args = {
        "model": str(agent_model_dir),
        "dtype": "float32",
        "max_model_len": MAX_LEN,
        "max_num_seqs": 32,
        "enable_prefix_caching": True,
        "max_logprobs": 1,
        "seed": 0,
        **RL_ENGINE_ARGS,
    }
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    actor = rollout_engine_actor(num_cpus=0, runtime_env={"env_vars": env}).remote(
        args, "cpu", env, 0, "interrupt", AGENT, {"temperature": 1.0, "top_p": 1.0}
    )
    ray_cluster.get(actor.ready.remote(), timeout=900)
    yield actor
    ray_cluster.get(actor.shutdown.remote(), timeout=60)
    ray_cluster.kill(actor)


def session(ray, actor, timeout_s: float = 120.0) -> Endpoint:  # type: ignore[no-untyped-def]
    key = secrets.token_hex(8)
    ray.get(actor.open_sessions.remote([key], timeout_s))
    return Endpoint(ray.get(actor.endpoint.remote()), key, "rlc-tiny-agent", 8, 3, timeout_s)


def close(ray, actor, llm: Endpoint):  # type: ignore[no-untyped-def]
    (record,) = ray.get(actor.close_sessions.remote([llm.api_key]))
    return record


def trainer_logprobs(model_dir: Path, ids: list[int]) -> list[float]:
    """log p(x_t | x_<t) under the Hugging Face model (what the trainer computes), position-aligned (0 at t=0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    return [0.0, *logp.tolist()]


def test_chat_calls_are_recorded_token_exact(ray_cluster, served, agent_model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    llm = session(ray_cluster, served)
    client = llm.openai()
    messages = [{"role": "user", "content": "47+38="}]
    latencies = []
    seen_ids = []
    for _ in range(2):
        t0 = time.perf_counter()
        reply = client.chat.completions.create(
            model=llm.model, messages=messages, extra_body={"return_token_ids": True, "skip_special_tokens": False}
        )
        latencies.append(time.perf_counter() - t0)
        seen_ids.append((reply.model_extra["prompt_token_ids"], reply.choices[0].model_extra["token_ids"]))
        text = reply.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": "(85)", "tool_call_id": "c"}]
    record = close(ray_cluster, served, llm)
    print(f"chat call latency: first {latencies[0] * 1000:.0f} ms, second {latencies[1] * 1000:.0f} ms")
    assert [(list(c.prompt_ids), list(c.output_ids)) for c in record.calls] == seen_ids
    found = segment_calls(record.calls)
    assert found.prefix_breaks == 0  # the template renders what the model sampled
    (row,) = trajectory_rows(found)
    tool = row.input_ids.index(21)  # "(" opens the tool's reply
    assert row.loss_mask[tool : tool + 4] == [0, 0, 0, 0]
    want = trainer_logprobs(agent_model_dir, row.input_ids)
    gap = max(abs(a - b) for a, b, m in zip(row.logprobs, want, row.loss_mask, strict=True) if m)
    print(f"engine vs trainer log-prob gap on sampled tokens: {gap:.2e}")
    assert gap < 1e-4


def test_an_agent_in_its_own_process_drives_the_endpoint(ray_cluster, served) -> None:  # type: ignore[no-untyped-def]
    from rlc.runtime.agent.runner import agent_runner_actor

    runner = agent_runner_actor().remote("tests.agent_fixtures:separate_process", 2, {})
    try:
        llm = session(ray_cluster, served)
        task = {"prompt": "47+38=", "answer": "85", "index": 0}
        episode = ray_cluster.get(runner.run_episode.remote(task, llm.to_dict(), 120.0), timeout=180)
        record = close(ray_cluster, served, llm)
    finally:
        ray_cluster.kill(runner)
    assert episode.status == "ok", episode.error
    assert 1 <= len(record.calls) <= 3 and record.calls[0].prompt_ids[1:] == (8, 11, 14, 7, 12, 17)
    assert segment_calls(record.calls).prefix_breaks == 0


def test_a_weight_update_during_a_long_call(ray_cluster, served, agent_model_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The call completes; tokens before the update carry version 0, after it version 1, each with the log-prob
    of the weights that sampled it (the frozen call is prefilled again under the new weights)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(agent_model_dir / "model.safetensors"))
    new = {k: (v * 1.5 if k.endswith("mlp.down_proj.weight") else v).contiguous() for k, v in weights.items()}
    new.setdefault("lm_head.weight", new["model.embed_tokens.weight"].clone())  # tied: always send both
    save_file(new, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    folders = [tmp_path, agent_model_dir]  # updates alternate between the changed and the original weights
    spanned: list[list[tuple[int, ...]]] = []
    # A loaded machine may start the calls after the update lands, a fast one finish them before: each try gives
    # the calls a different head start, short and long.
    head_starts = (0.3, 0.1, 0.6, 0.0, 0.2)
    for attempt, head_start in enumerate(head_starts):
        llm = session(ray_cluster, served)
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
        before = ray_cluster.get(served.get_version.remote())

        def long_call(client: openai.OpenAI = client) -> str:  # 96 tokens: about a second on two cores
            body = {"ignore_eos": True, "min_tokens": 0}
            reply = client.completions.create(model="rlc-tiny-agent", prompt="1+1=", max_tokens=96, extra_body=body)
            return reply.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(llm.max_turns) as pool:
            calls = [pool.submit(long_call) for _ in range(llm.max_turns)]
            time.sleep(head_start)
            update = served.update_weights_from_path.remote(str(folders[attempt % 2]), before + 1)
            ray_cluster.get(update, timeout=120)
            outs = [c.result(timeout=120) for c in calls]
        record = close(ray_cluster, served, llm)
        assert len(record.calls) == llm.max_turns, outs
        versions = [tuple(c.versions) for c in record.calls]
        assert all(set(v) <= {before, before + 1} for v in versions), versions
        assert all(list(v) == sorted(v) for v in versions), versions  # old weights' tokens first, then the new
        if any(len(set(v)) == 2 for v in versions):  # in flight when the update landed
            break
        spanned.append(versions)
    else:
        pytest.fail(f"no call was in flight during any of {len(head_starts)} updates: {spanned}")
    if attempt % 2 == 0:  # the changed weights are loaded: put the original back for the other tests
        version = ray_cluster.get(served.get_version.remote())
        ray_cluster.get(served.update_weights_from_path.remote(str(agent_model_dir), version + 1), timeout=120)


@pytest.mark.parametrize(
    ("fn", "status"), [("raises", "error"), ("hangs", "timeout"), ("returns_text", "error"), ("one_call", "ok")]
)
def test_failing_agents_are_bounded_and_named(ray_cluster, served, fn: str, status: str) -> None:  # type: ignore[no-untyped-def]
    from rlc.runtime.agent.runner import agent_runner_actor

    runner = agent_runner_actor().remote(f"tests.agent_fixtures:{fn}", 2, {})
    ray_cluster.get(runner.ready.remote(), timeout=120)  # the session's clock starts when it opens
    limit = 3.0 if fn == "hangs" else 20.0  # a real call on a cold or loaded engine can take seconds
    llm = session(ray_cluster, served, timeout_s=limit)
    # Bounded well past the episode's clock: a runner that ignored its clock fails here, not by hanging.
    episode = ray_cluster.get(
        runner.run_episode.remote({"prompt": "1+", "answer": "1"}, llm.to_dict(), limit), timeout=120
    )
    record = close(ray_cluster, served, llm)
    ray_cluster.kill(runner)
    assert episode.status == status, episode
    assert len(record.calls) == (1 if fn == "one_call" else 0)


def test_mini_swe_agent_runs_against_the_endpoint(ray_cluster, served, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from rlc.runtime.agent.runner import agent_runner_actor

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / "test_calc.py").write_text("from calc import add\nassert add(2, 3) == 5\n")
    config = tmp_path / "mini.yaml"
    config.write_text(
        "agent:\n  system_template: '1+1='\n  instance_template: '{{task}}'\n  max_consecutive_format_errors: 0\n"
        "model:\n  format_error_template: '(0)'\n  observation_template: '({{output.returncode}})'\n"
    )
    runner = agent_runner_actor().remote("rlc.agents.mini_swe:run", 2, {"MSWEA_COST_TRACKING": "ignore_errors"})
    llm = session(ray_cluster, served)
    llm = Endpoint(**{**llm.to_dict(), "options": {"environment": "local", "config": str(config)}})
    task = {"prompt": "2+3=", "answer": json.dumps({"repo": str(repo), "test": "python test_calc.py"})}
    episode = ray_cluster.get(runner.run_episode.remote(task, llm.to_dict(), 120.0), timeout=180)
    record = close(ray_cluster, served, llm)
    ray_cluster.kill(runner)
    assert episode.status == "ok", episode.error
    assert episode.reward == 0.0  # the tiny model does not fix `add`; the reward is the tests' verdict
    assert 1 <= len(record.calls) <= llm.max_turns  # mini-swe-agent's step limit is max_turns
    rows = trajectory_rows(segment_calls(record.calls))
    assert rows and all(r.loss_mask[0] == 0 for r in rows)  # the system prompt never trains
    assert (repo / "calc.py").read_text().endswith("a - b\n")  # the agent worked on a private copy
