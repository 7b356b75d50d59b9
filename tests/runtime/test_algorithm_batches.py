"""The estimators as the workflows apply them: reinforce_pp's per-token advantages reach the batch aligned with its
tokens (scored under the reference only when β > 0), and an agent batch gets the same advantages as a single-turn
batch of the same samples, token-weighted alike."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from loop_fixtures import fake_loop

from rlc.runtime.agent.runner import Episode
from rlc.runtime.agent.sessions import SessionRecord
from rlc.runtime.agent.trajectory import Call, segment_calls, trajectory_rows
from rlc.runtime.agent.workflow import AgentGroup, AgentWorkflow, Trajectory
from rlc.runtime.prompts import PromptItem
from rlc.runtime.workflows.generate import GenerateWorkflow, Group

torch = pytest.importorskip("torch")

PROMPT = (5, 6, 7)
#: Two groups of two samples of different lengths, their behaviour log-probs and rewards.
OUTPUTS = [[[8, 1], [8, 9, 9, 1]], [[9, 1, 1], [1]]]
LOGPROBS = [[[-0.5, -1.0], [-0.2, -0.3, -0.9, -1.1]], [[-2.0, -0.1, -0.4], [-0.6]]]
REWARDS = [[1.0, 0.0], [1.0, 0.25]]


def _reference(batch: dict) -> list[list[float]]:
    """A reference policy that scores token x at position t as −0.1·x − 0.01·t (any fixed rule will do)."""
    _reference.calls += 1  # type: ignore[attr-defined]
    return [[-0.1 * x - 0.01 * t for t, x in enumerate(ids)] for ids in batch["input_ids"]]


def _algorithm(name: str, **extra) -> types.SimpleNamespace:  # type: ignore[no-untyped-def]
    base = {"name": name, "normalize_std": True, "group_std": "population", "dynamic_sampling": None}
    return types.SimpleNamespace(**{**base, "overlong": None, "kl_coef": 0.0, **extra})


def _generate(algo: types.SimpleNamespace, only: tuple[int, ...] = (0, 1), failed: tuple = ()) -> dict:
    """The single-turn batch of groups ``only``; ``failed``: (group, sample) pairs whose reward failed (scored 0)."""
    loop = fake_loop(reference_logprobs=_reference)
    loop.plan.algorithm = algo
    wf = GenerateWorkflow(loop)  # type: ignore[arg-type]
    groups = []
    for g in only:
        item = PromptItem(cursor=g, prompt="p", answer="a", domain=None, prompt_ids=PROMPT)
        flags = [(g, s) in failed for s in range(len(OUTPUTS[g]))]
        rewards = [0.0 if f else r for f, r in zip(flags, REWARDS[g], strict=True)]
        groups.append(Group(item, OUTPUTS[g], LOGPROBS[g], [0] * len(OUTPUTS[g]), rewards=rewards, failed=flags))
    return wf.build_batch(groups)[0]


def _agent(algo: types.SimpleNamespace, tmp_path: Path, only: tuple[int, ...] = (0, 1), failed: tuple = ()) -> dict:
    tokenizer = types.SimpleNamespace(decode=lambda ids, **_: "", convert_ids_to_tokens=lambda ids: [""] * len(ids))
    loop = fake_loop(reference_logprobs=_reference, run_dir=tmp_path, tokenizer=tokenizer, step=0)
    loop.plan.algorithm = algo
    wf = AgentWorkflow.__new__(AgentWorkflow)  # the batch side only: no runners, no engines
    wf.loop, wf.group_size, wf.agent = loop, 2, types.SimpleNamespace(run="agent")
    groups = []
    for g in only:
        item = PromptItem(cursor=g, prompt="p", answer="a", domain=None, prompt_ids=PROMPT)
        group = AgentGroup(item, 2)
        for s, (out, lp, reward) in enumerate(zip(OUTPUTS[g], LOGPROBS[g], REWARDS[g], strict=True)):
            calls = [Call(PROMPT, tuple(out), tuple(lp), (0,) * len(out))]
            record = SessionRecord(f"{g}-{s}", calls, None, 0, 0.0, 0)
            found = segment_calls(calls)
            episode = Episode(f"{g}-{s}", "ok", reward)
            if (g, s) in failed:  # the agent returned no usable reward
                episode, reward = Episode(f"{g}-{s}", "error", error="returned inf"), 0.0
            group.trajectories.append(Trajectory(f"{g}-{s}", 0, episode, record, found, trajectory_rows(found), reward))
        groups.append(group)
    return wf.build_batch(groups)[0]


def _per_token(batch: dict) -> list[list[float]]:
    """Each row's advantage per position (a per-sequence number spread over the row, as the trainer does)."""
    rows = zip(batch["advantages"], batch["input_ids"], strict=True)
    return [a if isinstance(a, list) else [a] * len(ids) for a, ids in rows]


def test_reinforce_pp_gives_each_token_its_return() -> None:
    _reference.calls = 0  # type: ignore[attr-defined]
    batch = _generate(_algorithm("reinforce_pp", reward_kl_coef=0.5, reward_kl_estimator="k1"))
    assert _reference.calls == 1 and "ref_logprobs" not in batch  # no KL loss: the trainer need not get them
    rows = _per_token(batch)
    assert all(len(r) == len(ids) for r, ids in zip(rows, batch["input_ids"], strict=True))
    assert all(r[: len(PROMPT)] == [0.0] * len(PROMPT) for r in rows)
    # By hand: G_t = reward − β·Σ_{i≥t} (behaviour_i − reference_i), whitened over all ten response tokens.
    returns = []
    for outs, lps, rewards in zip(OUTPUTS, LOGPROBS, REWARDS, strict=True):
        for out, lp, reward in zip(outs, lps, rewards, strict=True):
            ids = list(PROMPT) + out
            kl = [lp[k] - (-0.1 * ids[len(PROMPT) + k] - 0.01 * (len(PROMPT) + k)) for k in range(len(out))]
            returns += [reward - 0.5 * sum(kl[k:]) for k in range(len(out))]
    flat = torch.tensor(returns, dtype=torch.float64)
    want = ((flat - flat.mean()) / (flat.std(unbiased=False) + 1e-6)).tolist()
    assert [a for r in rows for a in r[len(PROMPT) :]] == pytest.approx(want, abs=1e-6)
    # Within one response the advantage changes token by token (the KL still to come), unlike a sequence reward.
    assert len(set(rows[1][len(PROMPT) :])) > 1


def test_reinforce_pp_shares_the_reference_with_a_kl_loss_and_skips_it_without_beta() -> None:
    _reference.calls = 0  # type: ignore[attr-defined]
    batch = _generate(_algorithm("reinforce_pp", reward_kl_coef=0.5, reward_kl_estimator="k1", kl_coef=0.1))
    assert _reference.calls == 1 and batch["ref_logprobs"] == _reference(batch)
    _reference.calls = 0  # type: ignore[attr-defined]
    _generate(_algorithm("reinforce_pp", reward_kl_coef=0.0, reward_kl_estimator="k1"))
    assert _reference.calls == 0


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("reinforce_pp", {"reward_kl_coef": 0.5, "reward_kl_estimator": "k1"}),
        ("reinforce_pp_batchnorm", {}),
        ("reinforce_pp_baseline", {}),
        ("grpo", {"group_std": "sample"}),
        ("rloo", {}),
    ],
)
def test_agent_and_single_turn_estimators_agree(name: str, extra: dict, tmp_path: Path) -> None:
    """The same samples as single-turn rows and as one-call agent trajectories get the same advantage per token:
    batch moments are token-weighted on both paths."""
    algo = _algorithm(name, **extra)
    single, agent = _per_token(_generate(algo)), _per_token(_agent(algo, tmp_path))
    assert len(single) == len(agent) == 4
    for s, a in zip(single, agent, strict=True):
        assert s[len(PROMPT) :] == pytest.approx(a[len(PROMPT) :], abs=1e-6)


ESTIMATORS = [
    ("reinforce_pp", {"reward_kl_coef": 0.5, "reward_kl_estimator": "k1"}),
    ("reinforce_pp_batchnorm", {}),
    ("reinforce_pp_baseline", {}),
    ("grpo", {}),
    ("dr_grpo", {}),
    ("rloo", {}),
]


@pytest.mark.parametrize(("name", "extra"), ESTIMATORS)
@pytest.mark.parametrize("path", ["single_turn", "agent"])
def test_a_failed_reward_leaves_its_group_without_signal(name: str, extra: dict, path: str, tmp_path: Path) -> None:
    """One failed reward (scored 0): every token of its group gets advantage 0, so the group's tokens give no policy
    gradient; the other group's advantages are those of a batch without the failed group."""
    algo = _algorithm(name, **extra)

    def build(**kw) -> list[list[float]]:  # type: ignore[no-untyped-def]
        return _per_token(_generate(algo, **kw) if path == "single_turn" else _agent(algo, tmp_path, **kw))

    rows = build(failed={(1, 1)})
    assert all(a == 0.0 for row in rows[2:] for a in row)
    alone = build(only=(0,))
    assert any(a != 0.0 for row in alone for a in row)
    for got, want in zip(rows[:2], alone, strict=True):
        assert got == pytest.approx(want, abs=1e-6)
