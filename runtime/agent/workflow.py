"""The agent-episode workflow: agent trajectories instead of generate requests.

The trainer side (proximal log-probs, the step, weight sync, checkpoints) is the loop's (`Controller`); this
workflow feeds it. Under the loop's staleness gate it admits tasks (a GRPO group is `group_size`
trajectories of one task), opens a session per trajectory on the least-loaded engine, hands the trajectory to
an environment worker, and, when the agent returns, closes the session and turns the engine's record into
training rows (`trajectory`). Every wait is bounded: a runner that does not answer within the episode's
timeout plus a grace period counts as a timed-out trajectory.
"""

from __future__ import annotations

import json
import secrets
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from rlc.agents.llm import Endpoint
from rlc.runtime.agent.failures import AgentGuard
from rlc.runtime.agent.runner import Episode
from rlc.runtime.agent.sessions import SessionRecord
from rlc.runtime.agent.trajectory import Row, Segments, segment_calls, trajectory_rows, turn_rows
from rlc.runtime.errors import RunError
from rlc.runtime.nonfinite import check_engine_logprobs
from rlc.runtime.prompts import PromptItem
from rlc.runtime.result_futures import ResultFutures
from rlc.runtime.workflows import Loop

__all__ = ["AgentGroup", "AgentWorkflow", "Trajectory"]

#: Seconds past an episode's timeout_s before the controller stops waiting for its runner.
RUNNER_GRACE_S = 30.0


@dataclass
class Trajectory:
    key: str
    engine: int
    episode: Episode
    record: SessionRecord
    segments: Segments
    rows: list[Row]
    reward: float

    @property
    def reward_failed(self) -> bool:
        """The agent returned no usable reward (not a number, non-finite, past `MAX_REWARD`) or its runner failed:
        there is no reward to learn from, so its group trains with zero advantages. (An agent that raised keeps its
        0: what the policy did led there.)"""
        return self.episode.status == "error" and not self.episode.where

    @property
    def calls(self) -> int:
        return sum(len(s) for s in self.segments.segments)

    @property
    def min_version(self) -> int | None:
        versions = [v for row in self.rows for v, m in zip(row.versions, row.loss_mask, strict=True) if m]
        return min(versions) if versions else None


@dataclass
class AgentGroup:
    """One task's trajectories: the unit of GRPO advantage normalisation."""

    item: PromptItem
    size: int
    trajectories: list[Trajectory] = field(default_factory=list)
    timeouts: int = 0  # trajectories dropped and re-issued
    errors: int = 0  # trajectories scored 0 because the agent failed
    request: int = -1  # no generate request made it (RUN/rollouts.jsonl's batch records take the cursor)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def complete(self) -> bool:
        return len(self.trajectories) >= self.size


@dataclass
class _Pending:
    key: str
    engine: int
    group: AgentGroup
    deadline: float


class AgentWorkflow:
    """Agent episodes over the loop's rollout engines; `runners` are the environment workers' actors."""

    def __init__(self, loop: Loop, runners: list[Any]) -> None:
        import ray

        self.loop = loop
        agent = loop.plan.agent
        if agent is None:
            raise ValueError("AgentWorkflow needs a plan with an agent")
        self.agent = agent
        self.group_size = loop.plan.schedule.group_size
        self.batch_prompts = loop.plan.schedule.batch_prompts
        self.finished: list[AgentGroup] = []
        self.runners = runners
        self.endpoints: list[str] = ray.get([e.endpoint() for e in self.loop.rollout.engines])
        self.episodes: dict[Any, _Pending] = {}
        self._episode_results = ResultFutures()  # woken by a finished episode or the trainer's step
        self._open: list[AgentGroup] = []  # groups with trajectories still to come
        self._slots: list[AgentGroup] = []  # one entry per trajectory to start (new groups and re-issues)
        self._runner_load = [0] * len(runners)
        self._runner_of: dict[Any, int] = {}  # episode ref -> runner index
        self.guard = AgentGuard(
            agent.run, self.loop.plan.schedule.batch_samples, agent.max_failed_share, self.loop.logger.message
        )
        self.capacity = agent.inflight_per_engine * self.loop.rollout.replicas

    # ------------------------------------------------------------------ admission

    def _engine_load(self) -> dict[int, int]:
        return self.loop.engine_load(p.engine for p in self.episodes.values())

    def fill(self) -> None:
        """Admit tasks while the staleness bound allows; start their trajectories up to the planned capacity."""
        if not self.loop.may_admit():
            return
        load = self._engine_load()
        if not load:
            return  # every engine is restarting
        room = self.capacity - len(self.episodes)
        while len(self._slots) < room:
            if not self.loop.gate.can_admit(self.group_size, self.loop.version):
                break
            self.loop.gate.admit(self.group_size)
            group = AgentGroup(self.loop.prompts.next(), self.group_size)
            self._open.append(group)
            self._slots += [group] * self.group_size
        starting, self._slots = self._slots[:room], self._slots[room:]
        if starting:
            self._start(starting, load)

    def _start(self, groups: list[AgentGroup], load: dict[int, int]) -> None:
        import ray

        plan: list[tuple[str, int, AgentGroup]] = []
        for group in groups:
            engine = min(load, key=lambda i: (load[i], i))
            load[engine] += 1
            plan.append((secrets.token_hex(16), engine, group))
        by_engine: dict[int, list[str]] = {}
        for key, engine, _ in plan:
            by_engine.setdefault(engine, []).append(key)
        timeout = self.agent.timeout_s
        ray.get([self.loop.rollout.engines[e].open_sessions(keys, timeout) for e, keys in by_engine.items()])
        now = time.monotonic()
        for key, engine, group in plan:
            runner = min(range(len(self.runners)), key=lambda i: (self._runner_load[i], i))
            self._runner_load[runner] += 1
            endpoint = Endpoint(
                base_url=self.endpoints[engine],
                api_key=key,
                model=self.agent.served_model_name,
                max_tokens=self.agent.max_tokens_per_turn,
                max_turns=self.agent.max_turns,
                timeout_s=timeout,
                options=dict(self.agent.options),
            )
            task = {
                "prompt": group.item.prompt,
                "answer": group.item.answer,
                "domain": group.item.domain,
                "index": group.item.cursor,
            }
            ref = self.runners[runner].run_episode.remote(task, endpoint.to_dict(), timeout)
            self.episodes[ref] = _Pending(key, engine, group, now + timeout + RUNNER_GRACE_S)
            self.loop.trace.submitted(key, f"episode {group.item.cursor}", engine)
            self._runner_of[ref] = runner

    # ------------------------------------------------------------------ collection

    def collect(self, timeout: float) -> None:
        import ray

        if not self.episodes:
            self._episode_results.wait({}, self.loop.training, timeout)  # nothing in flight: wait for the trainer
            return
        done: list[tuple[_Pending, Episode]] = []
        for ref, future in self._episode_results.wait(self.episodes, self.loop.training, timeout):
            pending = self.episodes.pop(ref)
            self._runner_load[self._runner_of.pop(ref)] -= 1
            try:
                episode = future.result()
            except Exception as exc:  # the runner actor died or the task was cancelled
                episode = Episode(pending.key, "error", error=f"runner failed: {type(exc).__name__}: {exc}")
            done.append((pending, episode))
        now = time.monotonic()
        for ref, pending in list(self.episodes.items()):
            if now > pending.deadline:  # the runner itself is stuck: stop waiting for it
                del self.episodes[ref]
                self._runner_load[self._runner_of.pop(ref)] -= 1
                ray.cancel(ref, force=False)
                done.append((pending, Episode(pending.key, "timeout", error="its runner did not answer in time")))
        for pending, episode in done:
            self.loop.trace.finished(pending.key, status=episode.status)
        if done:
            self.loop.stall.progress()
            self._finish_episodes(done)

    def in_flight(self) -> list[str]:
        per_engine: dict[int, int] = {}
        for pending in self.episodes.values():
            per_engine[pending.engine] = per_engine.get(pending.engine, 0) + 1
        return [f"engine {e}: {n} agent episode(s)" for e, n in sorted(per_engine.items())]

    def _finish_episodes(self, done: list[tuple[_Pending, Episode]]) -> None:
        import ray

        by_engine: dict[int, list[tuple[_Pending, Episode]]] = {}
        for pending, episode in done:
            by_engine.setdefault(pending.engine, []).append((pending, episode))
        refs = {
            e: self.loop.rollout.engines[e].close_sessions([p.key for p, _ in items]) for e, items in by_engine.items()
        }
        for engine, items in by_engine.items():
            records = ray.get(refs[engine], timeout=120)
            for (pending, episode), record in zip(items, records, strict=True):
                self._file(pending, episode, record)

    def _file(self, pending: _Pending, episode: Episode, record: SessionRecord | None) -> None:
        group = pending.group
        record = record or SessionRecord(pending.key, [], None, 0, 0.0, 0)
        if episode.status == "error" and record.truncated in ("turns", "context"):
            # The agent raised on the server's budget refusal: a truncated trajectory, not an agent fault.
            episode = Episode(episode.key, "ok", 0.0, wall_s=episode.wall_s)
        self.guard.record(episode, group.item.prompt)
        if episode.status == "timeout":
            group.timeouts += 1
            self._slots.insert(0, group)  # re-issued first; its slot was admitted already
            return
        group.errors += episode.status == "error"
        found = segment_calls(record.calls)
        rows = (
            trajectory_rows(found) if self.agent.export == "trajectory" else turn_rows(found, self.agent.turn_discount)
        )
        source = f"an agent trajectory of task {group.item.cursor}"
        check_engine_logprobs((r.logprobs for r in rows), pending.engine, self.loop.step + 1, source)  # before any loss
        reward = episode.reward if episode.status == "ok" else 0.0
        group.trajectories.append(Trajectory(pending.key, pending.engine, episode, record, found, rows, reward))
        self.loop.rollout_tokens += sum(r.sampled for r in rows)
        if group.complete:
            self._open.remove(group)
            if not self._group_too_stale(group):
                self.finished.append(group)

    def _group_too_stale(self, group: AgentGroup) -> bool:
        """A group with tokens older than the staleness bound allows (a restarted engine) is played again."""
        versions = [v for t in group.trajectories if (v := t.min_version) is not None]
        if not versions or min(versions) >= self.loop.version - self.loop.staleness:
            return False
        fresh = AgentGroup(group.item, group.size)
        self._open.append(fresh)
        self._slots = [fresh] * group.size + self._slots
        return True

    def resume_cursor(self) -> int:
        pending = [g.item for g in self._open] + [g.item for g in self.finished]
        return min((item.cursor for item in pending), default=self.loop.prompts.cursor)

    # ------------------------------------------------------------------ the batch

    def has_batch(self) -> bool:
        return len(self.finished) >= self.batch_prompts

    def next_batch(self) -> list[AgentGroup] | None:
        """The oldest tasks' groups first, once a batch of them has finished."""
        if len(self.finished) < self.batch_prompts:
            return None
        self.finished.sort(key=lambda g: g.item.cursor)
        groups, self.finished = self.finished[: self.batch_prompts], self.finished[self.batch_prompts :]
        return groups

    def batch_record(self, groups: list[AgentGroup]) -> list[tuple[int, int]]:
        return [(g.request, g.item.cursor) for g in groups]

    def build_batch(self, groups: list[Any]) -> tuple[dict[str, Any], dict[str, float], list[str | None]]:
        import torch

        from rlc.runtime.algo.advantages import compromised, kl_reward_advantages, plan_advantages

        algo = self.loop.plan.algorithm
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        trajectories = [t for g in groups for t in g.trajectories]
        # A trajectory's tokens are its rows' sampled tokens: batch moments weigh each trajectory by them, as a
        # single-turn batch weighs each sample by its response.
        lengths = [sum(r.sampled for r in t.rows) for t in trajectories]
        failed = [t.reward_failed for t in trajectories]  # such a group trains with zero advantages
        advantages = plan_advantages(algo, rewards, self.group_size, lengths, failed)
        batch: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "behaviour_logprobs": [], "advantages": []}
        domains: list[str | None] = []
        lags: list[int] = []
        samples: list[list[int]] = []  # each trajectory's rows in the batch
        for g_index, group in enumerate(groups):
            for t_index, traj in enumerate(group.trajectories):
                samples.append([])
                for row in traj.rows:
                    samples[-1].append(len(batch["input_ids"]))
                    batch["input_ids"].append(row.input_ids)
                    batch["loss_mask"].append(row.loss_mask)
                    batch["behaviour_logprobs"].append(row.logprobs)
                    batch["advantages"].append(float(advantages[g_index, t_index]) * row.weight)
                    domains.append(group.item.domain)
                    lags += [self.loop.version - v for v, m in zip(row.versions, row.loss_mask, strict=True) if m]
        if not batch["input_ids"]:
            raise RunError(
                f"agent {self.agent.run!r}: no trajectory of this batch made a model call, so there is nothing to "
                "train on; check that the agent calls llm.base_url with llm.api_key"
            )
        routed = [row.routed_experts for t in trajectories for row in t.rows]
        if any(r is not None for r in routed):  # the engines' experts per row position, for rollout routing replay
            batch["routed_experts"] = routed
        if algo.name == "reinforce_pp":
            weights = [row.weight for t in trajectories for row in t.rows]
            token_adv = kl_reward_advantages(
                algo,
                batch,
                rewards.flatten().tolist(),
                samples,
                batch["loss_mask"],
                self.loop.reference_logprobs,
                compromised(failed, self.group_size),
            )
            batch["advantages"] = [[a * w for a in row] for row, w in zip(token_adv, weights, strict=True)]
        self._write_sample(trajectories)
        flat = rewards.flatten().tolist()
        rows = [r for t in trajectories for r in t.rows]
        stats = {
            "reward/mean": statistics.fmean(flat),
            "reward/std": statistics.pstdev(flat),
            "staleness/mean": statistics.fmean(lags) if lags else 0.0,
            "staleness/max": float(max(lags, default=0)),
            "response_len/mean": statistics.fmean([sum(r.sampled for r in t.rows) for t in trajectories]),
            "train/tokens": float(sum(len(x) for x in batch["input_ids"])),
            **agent_metrics(groups, trajectories, rows),
            "agent/reward_failed": float(sum(failed)),
        }
        return batch, stats, domains  # type: ignore[return-value]

    def _write_sample(self, trajectories: list[Trajectory]) -> None:
        """One trajectory per step in RUN/agent_samples.jsonl: its rows' ids, masks, text and tokens (one per id),
        to see what the agent and the policy did and which tokens trained."""
        if not trajectories:
            return
        traj = trajectories[0]
        sample = {
            "step": self.loop.step + 1,
            "reward": traj.reward,
            "status": traj.episode.status,
            "truncated": traj.record.truncated,
            "rows": [
                {
                    "input_ids": row.input_ids,
                    "loss_mask": row.loss_mask,
                    "versions": row.versions,
                    "text": self.loop.tokenizer.decode(row.input_ids, skip_special_tokens=False),
                    "tokens": self.loop.tokenizer.convert_ids_to_tokens(row.input_ids),
                }
                for row in traj.rows
            ],
        }
        with (self.loop.run_dir / "agent_samples.jsonl").open("a") as fh:
            fh.write(json.dumps(sample) + "\n")

    def close(self) -> None:
        import ray

        for ref in list(self.episodes):
            ray.cancel(ref, force=False)
        self.episodes.clear()


def agent_metrics(groups: list[AgentGroup], trajectories: list[Trajectory], rows: list[Row]) -> dict[str, float]:
    """The step's agent figures: turns, environment replies, masked tokens, breaks, truncations, failures, time."""
    n = max(1, len(trajectories))
    model_s = [t.record.model_s for t in trajectories]
    wall_s = [t.episode.wall_s for t in trajectories]
    return {
        "agent/turns": sum(t.calls for t in trajectories) / n,
        # Calls that continued after the environment answered (a tool result or user turn in between).
        "agent/tool_calls": sum(max(0, len(s) - 1) for t in trajectories for s in t.segments.segments) / n,
        "agent/tokens_sampled": float(sum(r.sampled for r in rows)),
        "agent/tokens_masked": float(sum(r.masked for r in rows)),
        "agent/prefix_breaks": float(sum(t.segments.prefix_breaks for t in trajectories)),
        "agent/retries_dropped": float(sum(t.segments.retries_dropped for t in trajectories)),
        "agent/truncated": float(sum(t.record.truncated is not None for t in trajectories)),
        "agent/refused_calls": float(sum(t.record.refused for t in trajectories)),
        "agent/errors": float(sum(g.errors for g in groups)),
        "agent/timeouts": float(sum(g.timeouts for g in groups)),
        "time/agent_model_s": statistics.fmean(model_s) if model_s else 0.0,
        "time/agent_tools_s": statistics.fmean(max(0.0, w - m) for w, m in zip(wall_s, model_s, strict=True))
        if wall_s
        else 0.0,
        "time/agent_episode_s": statistics.fmean(wall_s) if wall_s else 0.0,
    }
