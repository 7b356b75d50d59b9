"""Generate-and-score: each prompt's group is one generate request to an engine, scored by the run's reward.

The workflow admits prompts one group at a time while the staleness bound allows (`StalenessGate`), keeps each
engine holding the plan's number of requests (`schedule.rollout_chunks_per_engine`, each of
`schedule.rollout_chunk_prompts` prompts), takes each request's samples as soon as it returns, scores them and
files the groups; batches take the oldest prompts first (by stream position), whichever engine finished first, so
a synchronous run trains on exactly the batch admitted for its version. An engine that dies is restarted by the
loop and its prompts are issued again; a group older than the staleness bound allows (a restarted engine's) is
generated again.

`ReplayWorkflow` (`replay.py`) reuses this workflow and replaces its public hooks: `fill` (what to send),
`on_request` (a request came back), `requeue` (an engine died with requests), `keep` (where a finished group goes)
and `next_batch`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from rlc.runtime.nonfinite import check_engine_logprobs
from rlc.runtime.prompts import PromptItem
from rlc.runtime.result_futures import ResultFutures
from rlc.runtime.rollout.failures import engine_is_dead
from rlc.runtime.rollout.versions import version_spans
from rlc.runtime.seeds import request_seed
from rlc.runtime.workflows import Loop

__all__ = ["Chunk", "GenerateWorkflow", "Group"]


@dataclass
class Group:
    """One prompt's samples: the unit of GRPO advantage normalisation."""

    item: PromptItem
    output_ids: list[list[int]]
    logprobs: list[list[float]]
    versions: list[int]  # per sample, the oldest version among its tokens (what the staleness bound counts)
    rewards: list[float] = field(default_factory=list)
    failed: list[bool] = field(default_factory=list)  # per sample, its reward failed (scored 0, no signal)
    request: int = -1  # the generate request that produced it (RUN/rollouts.jsonl)
    token_versions: list[list[int]] = field(default_factory=list)  # per sample, each token's version
    # Per sample, the experts the engine's routers chose for each input position (`rollout.routing_capture`), or
    # None: what rollout routing replay (R3) has the trainer use.
    routed_experts: list[Any] = field(default_factory=list)

    def sample_versions(self, index: int) -> list[int]:
        """Each token's policy version of sample `index` (one version throughout where none was recorded)."""
        if self.token_versions:
            return self.token_versions[index]
        return [self.versions[index]] * len(self.output_ids[index])


@dataclass
class Chunk:
    """One generate request in flight: its engine and prompts."""

    engine: int
    items: list[PromptItem]
    id: int = -1  # submission order, as RUN/rollouts.jsonl records it
    admitted_at: int = 0  # the trainer version when it was admitted
    submitted_s: float = field(default_factory=time.monotonic)


class GenerateWorkflow:
    """Generate-and-score over the loop's rollout engines; `loop` is the `Controller` that runs it."""

    def __init__(self, loop: Loop) -> None:
        self.loop = loop
        sched = loop.plan.schedule
        self.group_size = sched.group_size
        self.batch_prompts = sched.batch_prompts
        # The planner sizes generate requests (its rollout estimate assumes exactly this feed).
        self.chunk_prompts = sched.rollout_chunk_prompts
        self.chunks_per_engine = sched.rollout_chunks_per_engine
        self.finished: list[Group] = []
        self.inflight: dict[Any, Chunk] = {}
        self._results = ResultFutures()  # the in-flight requests' results, waited on with the trainer's step
        self._reissue: list[list[PromptItem]] = []
        self.eos_ids = [i for i in [loop.tokenizer.eos_token_id] if i is not None]
        # DAPO dynamic sampling: groups without signal dropped since the last batch, and the bound on them.
        ds = loop.plan.algorithm.dynamic_sampling
        self.max_drops = int((ds.max_draws - 1.0) * self.batch_prompts + 1e-9) if ds is not None else None
        self.dropped = 0
        self.zero_signal_kept = 0
        self.dropped_rewards: list[float] = []
        # (dropped, zero-signal kept, the dropped groups' rewards) of each batch taken, in order
        self._batch_draws: list[tuple[int, int, list[float]]] = []

    # ------------------------------------------------------------------ admission

    def requests(self, items: list[PromptItem]) -> list[dict[str, Any]]:
        """The generate request of these prompts: a group of group_size samples each, seeded by stream position."""
        plan = self.loop.plan
        s = plan.sampling
        seeded = plan.reproducibility.seeded_sampling
        return [
            {
                "prompt_ids": list(item.prompt_ids),
                "n": self.group_size,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "max_tokens": s.max_response_len,
                "stop_token_ids": self.eos_ids,
                "seed": request_seed(plan.algorithm.seed, item.cursor) if seeded else None,
            }
            for item in items
        ]

    def submit(self, engine: int, items: list[PromptItem], request_id: int | None = None) -> None:
        """Send one generate request to `engine`; it is filed under `request_id` (default: the next one)."""
        loop = self.loop
        ref = loop.rollout.engines[engine].generate(self.requests(items))
        rid = loop.rollout_log.new_id() if request_id is None else request_id
        chunk = Chunk(engine, items, rid, loop.version)
        self.inflight[ref] = chunk
        loop.trace.submitted(chunk.id, f"generate #{chunk.id}", engine)

    def engine_slots(self) -> dict[int, int]:
        """Requests each serving engine holds now (engines restarting are left out)."""
        return self.loop.engine_load(c.engine for c in self.inflight.values())

    def fill(self) -> None:
        """Admit requests while the staleness bound allows (colocated: only between train phases), the emptiest
        engine first, up to the plan's requests per engine."""
        loop = self.loop
        if not loop.may_admit():
            return
        per_engine = self.engine_slots()
        for engine in sorted(per_engine, key=per_engine.get):  # type: ignore[arg-type]
            while per_engine[engine] < self.chunks_per_engine:
                if self._reissue:  # already admitted: their slots were counted when first submitted
                    self.submit(engine, self._reissue.pop(0))
                    per_engine[engine] += 1
                    continue
                # The last request before the bound may be short: when requests do not divide the batch, a whole
                # one would never fit and the batch would never complete.
                prompts = min(self.chunk_prompts, loop.gate.room(loop.version) // self.group_size)
                if prompts == 0:
                    return
                loop.gate.admit(prompts * self.group_size)
                self.submit(engine, loop.prompts.take(prompts))
                per_engine[engine] += 1
                notice = loop.prompts.pop_notice()
                if notice:
                    loop.logger.message(notice)

    # ------------------------------------------------------------------ collection

    def collect(self, timeout: float) -> None:
        """Take in every finished request; wait up to ``timeout`` for one, or for the trainer to finish
        (``ResultFutures``: either wakes the wait, with no polling)."""
        loop = self.loop
        for ref, future in self._results.wait(self.inflight, loop.training, timeout):
            chunk = self.inflight.pop(ref, None)
            if chunk is None:  # dropped with its engine when an earlier request of this turn found it dead
                continue
            loop.stall.progress()
            t0 = time.perf_counter()
            try:
                results = future.result()
            except Exception as exc:
                if not engine_is_dead(exc):
                    raise
                self._engine_died(chunk)
                continue
            loop.timeline["time/gather_s"] += time.perf_counter() - t0
            # A NaN or infinite behaviour log-prob stops the run here, before it can reach a loss.
            rows = (s.logprobs for samples in results for s in samples)
            check_engine_logprobs(rows, chunk.engine, loop.step + 1, f"generate request {chunk.id}")
            self.on_request(chunk, results)
            loop.trace.finished(chunk.id, prompts=len(chunk.items))
            for item, samples in zip(chunk.items, results, strict=True):
                group = Group(
                    item,
                    [list(s.output_ids) for s in samples],
                    [list(s.logprobs) for s in samples],
                    [int(s.version) for s in samples],
                    request=chunk.id,
                    token_versions=[list(s.versions) for s in samples],
                    routed_experts=[getattr(s, "routed_experts", None) for s in samples],
                )
                t0 = time.perf_counter()
                completions = [loop.tokenizer.decode(ids, skip_special_tokens=True) for ids in group.output_ids]
                group.rewards, group.failed = loop.scorer.score_flagged(completions, item.answer, prompt=item.prompt)
                loop.timeline["time/reward_s"] += time.perf_counter() - t0
                loop.rollout_tokens += sum(len(ids) for ids in group.output_ids)
                self.keep(group)

    def on_request(self, chunk: Chunk, results: list[Any]) -> None:
        """Log a finished request with the oldest version among its tokens, and the token versions of every
        sample a weight update interrupted."""
        version = min(int(s.version) for samples in results for s in samples)
        cursors = [item.cursor for item in chunk.items]
        interrupted = [
            (p, i, version_spans(s.versions))
            for p, samples in enumerate(results)
            for i, s in enumerate(samples)
            if len(set(s.versions)) > 1
        ]
        self.loop.interrupted_samples += len(interrupted)
        self.loop.rollout_log.request(chunk.id, cursors, version, chunk.admitted_at, chunk.engine, interrupted)

    def _engine_died(self, chunk: Chunk) -> None:
        """Have the loop restart the engine, and issue every request it held again."""
        lost = [chunk] + [c for c in self.inflight.values() if c.engine == chunk.engine]
        for c in lost:
            self.loop.trace.finished(c.id, prompts=len(c.items), lost=True)
        for ref in [r for r, c in self.inflight.items() if c.engine == chunk.engine]:
            del self.inflight[ref]
        self.loop.logger.message(
            f"rollout engine {chunk.engine} died; restarting it and re-issuing {len(lost)} request(s)"
        )
        self.requeue(lost)
        self.loop.restart_engine(chunk.engine)

    def requeue(self, lost: list[Chunk]) -> None:
        """Requests lost with their engine go out again (their prompts were admitted already)."""
        self._reissue.extend(c.items for c in lost)

    def keep(self, group: Group) -> None:
        """File a finished group for a batch; one older than the staleness bound allows (e.g. from a restarted
        engine) is generated again instead.

        With dynamic sampling a group whose rewards are all equal or include a failed one (zero advantage, no
        gradient) is dropped and gives its samples' slots back to the staleness gate, so replacements are admitted,
        generated and counted under the same bound; past the plan's `max_draws` for this batch such groups are
        kept instead.
        """
        if min(group.versions) < self.loop.version - self.loop.staleness:
            self._reissue.append([group.item])
            return
        if self.max_drops is not None and (len(set(group.rewards)) <= 1 or any(group.failed)):
            if self.dropped < self.max_drops:
                self.dropped += 1
                self.dropped_rewards += group.rewards
                self.loop.gate.retract(len(group.output_ids))
                return
            self.zero_signal_kept += 1
        self.finished.append(group)

    # ------------------------------------------------------------------ batches

    def has_batch(self) -> bool:
        return len(self.finished) >= self.batch_prompts

    def next_batch(self) -> list[Group] | None:
        """The next step's groups once enough have finished: the oldest prompts first, whichever engine
        finished first (with max_staleness 0 exactly the batch admitted for this version)."""
        if len(self.finished) < self.batch_prompts:
            return None
        self.finished.sort(key=lambda g: (g.item.cursor, g.request))
        groups, self.finished = self.finished[: self.batch_prompts], self.finished[self.batch_prompts :]
        if self.max_drops is not None:
            self._batch_draws.append((self.dropped, self.zero_signal_kept, self.dropped_rewards))
            self.dropped = self.zero_signal_kept = 0
            self.dropped_rewards = []
        return groups

    def batch_record(self, groups: list[Group]) -> list[tuple[int, int]]:
        return [(g.request, g.item.cursor) for g in groups]

    def build_batch(self, groups: list[Group]) -> tuple[dict[str, Any], dict[str, float], list[str | None]]:
        """One sequence per sample: prompt + response, the loss on the response, each token's behaviour log-prob,
        the sample's advantage (reinforce_pp: one per token, from the reference policy's log-probs)."""
        import torch

        from rlc.runtime.algo.advantages import compromised, kl_reward_advantages, plan_advantages
        from rlc.runtime.algo.overlong import is_truncated, overlong_penalty

        plan = self.loop.plan
        algo, max_len = plan.algorithm, plan.sampling.max_response_len
        version = self.loop.version
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        lengths_all = [len(out) for g in groups for out in g.output_ids]
        truncated = [is_truncated(out, max_len, self.eos_ids) for g in groups for out in g.output_ids]
        shaped = rewards.flatten()
        overlong = algo.overlong
        if overlong is not None and overlong.buffer_len > 0:  # DAPO's soft overlong punishment
            shaped = shaped + torch.tensor(
                [overlong_penalty(n, max_len, overlong.buffer_len, overlong.penalty) for n in lengths_all]
            )
        # A group with a failed reward trains with zero advantages: 0 is not that sample's reward.
        failed = [bool(g.failed and g.failed[i]) for g in groups for i in range(len(g.output_ids))]
        advantages = plan_advantages(algo, shaped.reshape(rewards.shape), self.group_size, lengths_all, failed)
        masked = overlong is not None and overlong.filter_truncated
        input_ids, loss_mask, behaviour, adv, lags, lengths, responses = [], [], [], [], [], [], []
        sample = 0
        for g_index, group in enumerate(groups):
            prompt = list(group.item.prompt_ids)
            for s_index, (out, lps) in enumerate(zip(group.output_ids, group.logprobs, strict=True)):
                input_ids.append(prompt + out)
                # Overlong filtering: a truncated response keeps its place in the baseline but trains nothing.
                trained = 0 if masked and truncated[sample] else 1
                sample += 1
                loss_mask.append([0] * len(prompt) + [trained] * len(out))
                responses.append([0] * len(prompt) + [1] * len(out))  # a filtered sample keeps its baseline place
                # Each token's behaviour log-prob is the one the version that sampled it produced: an interrupted
                # sample's tokens before the update carry the old policy's, those after the new one's.
                behaviour.append([0.0] * len(prompt) + list(lps))
                adv.append(float(advantages[g_index, s_index]))
                lags += [version - v for v in group.sample_versions(s_index)]
                lengths.append(len(out))
        batch = {
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "behaviour_logprobs": behaviour,
            "advantages": adv,
        }
        routed = [r for g in groups for r in (g.routed_experts or [None] * len(g.output_ids))]
        if any(r is not None for r in routed):  # the engines' experts per input position, for R3
            batch["routed_experts"] = routed
        if algo.name == "reinforce_pp":
            samples = [[i] for i in range(len(input_ids))]
            batch["advantages"] = kl_reward_advantages(
                algo,
                batch,
                shaped.tolist(),
                samples,
                responses,
                self.loop.reference_logprobs,
                compromised(failed, self.group_size),
            )
        domains = [g.item.domain for g in groups for _ in g.output_ids]
        flat = rewards.flatten().tolist()
        stats = {
            "reward/mean": statistics.fmean(flat),
            "reward/std": statistics.pstdev(flat),
            # Over trained tokens: an interrupted sample's tokens are as old as the version that sampled each.
            "staleness/mean": statistics.fmean(lags) if lags else 0.0,
            "staleness/max": float(max(lags, default=0)),
            "response_len/mean": statistics.fmean(lengths),
            "train/tokens": float(sum(len(x) for x in input_ids)),
            "rollout/truncated": sum(truncated) / max(len(truncated), 1),
        }
        if overlong is not None:
            stats["reward/shaped_mean"] = float(shaped.mean())
            stats["rollout/filtered_truncated"] = float(sum(truncated)) if masked else 0.0
        if self.max_drops is not None and self._batch_draws:
            dropped, zero_kept, dropped_rewards = self._batch_draws.pop(0)
            # reward/mean is over the trained groups, which dynamic sampling biases towards 0.5; this is over every
            # group generated for the step (the policy's own success rate).
            stats["reward/generated_mean"] = statistics.fmean(flat + dropped_rewards)
            # Groups generated per group trained this step: 1 when every group carried signal.
            stats["rollout/generated_per_kept"] = (len(groups) + dropped) / max(len(groups), 1)
            stats["rollout/dropped_groups"] = float(dropped)
            stats["rollout/zero_signal_kept"] = float(zero_kept)
        return batch, stats, domains

    # ------------------------------------------------------------------ state

    def resume_cursor(self) -> int:
        """Where a resumed run restarts the prompt stream: the oldest prompt not yet trained on.

        Prompts in flight, finished but not yet trained, or waiting to be re-issued would otherwise be lost
        on resume. (Called while the loop waits for the checkpoint, so these collections are stable.)
        """
        pending = [c.items for c in self.inflight.values()] + [[g.item] for g in self.finished] + self._reissue
        return min((item.cursor for items in pending for item in items), default=self.loop.prompts.cursor)

    def in_flight(self) -> list[str]:
        """Requests per engine with their ages."""
        now = time.monotonic()
        oldest: dict[int, float] = {}
        count: dict[int, int] = {}
        for chunk in self.inflight.values():
            count[chunk.engine] = count.get(chunk.engine, 0) + 1
            oldest[chunk.engine] = max(oldest.get(chunk.engine, 0.0), now - chunk.submitted_s)
        return [f"engine {e}: {count[e]} generate request(s), the oldest {oldest[e]:.0f} s" for e in sorted(count)]

    def close(self) -> None:
        self.inflight.clear()
