"""The single controller: asynchronous GRPO over rollout engines and an FSDP2 trainer group.

One driver thread feeds prompts to the engines and collects finished groups; it admits new rollouts only
under the staleness bound (`StalenessGate`). A second thread owns every trainer call (reference log-probs,
the optimizer step, the weight sync through `WeightPush`, checkpoints), because trainer calls are collective
and must reach all ranks in the same order. While it trains, engines keep generating with the weights they
hold, and each sample carries the policy version that produced it. The engines are a `RolloutPool`.

Modes ride on the same loop: colocated runs alternate (no rollout is admitted while training, and the
plan's sleep/offload moves happen around each train phase, `colocate.PhaseSwitcher`); LoRA runs sync an
adapter (or merged weights) and take the KL reference from the trainer with adapters disabled; MOPD runs
score each batch with the teachers (`distill.TeacherPool`) while the trainer steps; and
speculative decoding's counters are read from the engines after every step (`spec_decode`).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlc.runtime.checkpoint import ControllerState, finalize, staging_dir
from rlc.runtime.colocate import PhaseSwitcher
from rlc.runtime.distill import teacher_metrics
from rlc.runtime.metrics import MetricsLogger
from rlc.runtime.prompts import PromptItem, PromptStream
from rlc.runtime.result_futures import ResultFutures
from rlc.runtime.rollout.failures import engine_is_dead
from rlc.runtime.rollout.pool import RolloutPool
from rlc.runtime.rollout.versions import version_spans
from rlc.runtime.rollout_log import RolloutLog
from rlc.runtime.seeds import request_seed
from rlc.runtime.spec_decode import SpecDecodeDelta
from rlc.runtime.staleness import StalenessGate
from rlc.runtime.stall import StallError, StallWatch
from rlc.runtime.sync_check import SyncCheck
from rlc.runtime.tasks.rewards import RewardGuard
from rlc.runtime.trace import StepTrace
from rlc.runtime.weight_push import WeightPush
from rlc.schemas.plan import Plan


@dataclass
class Group:
    """One prompt's samples: the unit of GRPO advantage normalisation."""

    item: PromptItem
    output_ids: list[list[int]]
    logprobs: list[list[float]]
    versions: list[int]  # per sample, the oldest version among its tokens (what the staleness bound counts)
    rewards: list[float] = field(default_factory=list)
    request: int = -1  # the generate request that produced it (RUN/rollouts.jsonl)
    token_versions: list[list[int]] = field(default_factory=list)  # per sample, each token's version

    def sample_versions(self, index: int) -> list[int]:
        """Each token's policy version of sample `index` (one version throughout where none was recorded)."""
        if self.token_versions:
            return self.token_versions[index]
        return [self.versions[index]] * len(self.output_ids[index])


@dataclass
class Chunk:
    engine: int
    items: list[PromptItem]
    id: int = -1  # submission order, as RUN/rollouts.jsonl records it
    admitted_at: int = 0  # the trainer version when it was admitted
    submitted_s: float = field(default_factory=time.monotonic)


class Controller:
    """Runs a plan's training loop; see the module docstring for the concurrency design."""

    def __init__(
        self,
        plan: Plan,
        run_dir: Path,
        tokenizer: Any,
        reward_fn: Any,
        rollout: RolloutPool,
        trainer: Any,
        *,
        start: ControllerState | None = None,
    ) -> None:
        self.plan = plan
        self.run_dir = run_dir
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.rollout = rollout
        self.trainer = trainer
        sched = plan.schedule
        self.batch_prompts = sched.batch_prompts
        self.group_size = sched.group_size
        self.colocated = sched.mode == "colocated"
        staleness = 0 if self.colocated else sched.max_staleness
        self.step = start.step if start else 0
        self.total_steps = sched.steps  # a replay stops at the last recorded step
        self.version = start.version if start else 0
        self.gate = StalenessGate(sched.batch_samples, staleness, submitted=self.version * sched.batch_samples)
        self.prompts = PromptStream(
            plan.data, tokenizer, plan.algorithm.seed, plan.sampling.max_prompt_len, start.data_cursor if start else 0
        )
        if start and start.rng:
            random.setstate(_rng_from_json(start.rng))
        else:
            random.seed(plan.algorithm.seed)
        # The planner sizes generate requests (its rollout estimate assumes exactly this feed).
        self.chunk_prompts = sched.rollout_chunk_prompts
        self.chunks_per_engine = sched.rollout_chunks_per_engine
        self.finished: list[Group] = []
        self.inflight: dict[Any, Chunk] = {}
        self._result_futures = ResultFutures()  # the in-flight requests' results, waited on with the trainer's step
        self._trainer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlc-trainer")
        self._training: Future | None = None
        self._training_since = 0.0
        self.stall = StallWatch(sched.stall_timeout_s)
        self._warming: set[int] = set()
        self._reissue: list[list[PromptItem]] = []
        self.reference: Any = None
        self.teachers: Any = None  # a distill.TeacherPool when the plan distills
        self.spec_decode = SpecDecodeDelta() if plan.sampling.speculative else None
        self._stop = threading.Event()
        self.eos_ids = [i for i in [tokenizer.eos_token_id] if i is not None]
        self._step_started = time.perf_counter()
        self._rollout_tokens = 0
        self._interrupted = 0  # samples a weight update interrupted since the last step
        # Driver-thread time per step outside the engines and the trainer: taking finished requests' results
        # (gather; Ray delivers them through their futures off this thread) and scoring them (reward); the
        # trainer thread adds batch, train and sync.
        self._timeline = dict.fromkeys(("time/gather_s", "time/reward_s"), 0.0)
        self.logger = MetricsLogger(run_dir, plan.loggers, plan.schedule.steps, self.step)
        self.weights = WeightPush(plan, trainer, rollout, run_dir, self.logger.message, self.version)
        self.sync_check = SyncCheck(trainer, rollout, sched.sync_check_max_gap)
        self.rollout_log = RolloutLog(run_dir, self.step)
        self.trace = StepTrace(run_dir, self.step)
        self.scorer = RewardGuard(
            reward_fn,
            plan.data.reward,
            sched.batch_samples,
            self.logger.message,
            timeout_s=plan.data.reward_timeout_s,
            max_failed_share=plan.data.reward_max_failed_share,
        )
        self.phases = PhaseSwitcher(plan, rollout, trainer, self.logger.message)

    # ------------------------------------------------------------------ rollout side

    def _requests(self, items: list[PromptItem]) -> list[dict[str, Any]]:
        s = self.plan.sampling
        seeded = self.plan.reproducibility.seeded_sampling
        return [
            {
                "prompt_ids": list(item.prompt_ids),
                "n": self.group_size,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "max_tokens": s.max_response_len,
                "stop_token_ids": self.eos_ids,
                "seed": request_seed(self.plan.algorithm.seed, item.cursor) if seeded else None,
            }
            for item in items
        ]

    def _submit(self, engine: int, items: list[PromptItem]) -> None:
        ref = self.rollout.engines[engine].generate.remote(self._requests(items))
        chunk = Chunk(engine, items, self.rollout_log.new_id(), self.version)
        self.inflight[ref] = chunk
        self.trace.submitted(chunk.id, f"generate #{chunk.id}", engine)

    def _fill(self) -> None:
        """Admit chunks while the staleness bound allows (and, colocated, only between train phases)."""
        if self.colocated and self._training is not None:
            return
        per_engine = {i: 0 for i in range(self.rollout.replicas) if i not in self._warming}
        for chunk in self.inflight.values():
            if chunk.engine in per_engine:
                per_engine[chunk.engine] += 1
        for engine in sorted(per_engine, key=per_engine.get):  # type: ignore[arg-type]
            while per_engine[engine] < self.chunks_per_engine:
                if self._reissue:  # already admitted: their slots were counted when first submitted
                    self._submit(engine, self._reissue.pop(0))
                    per_engine[engine] += 1
                    continue
                # The last request before the bound may be short: when chunks do not divide the batch, a whole
                # one would never fit and the batch would never complete.
                prompts = min(self.chunk_prompts, self.gate.room(self.version) // self.group_size)
                if prompts == 0:
                    return
                self.gate.admit(prompts * self.group_size)
                self._submit(engine, self.prompts.take(prompts))
                per_engine[engine] += 1
                notice = self.prompts.pop_notice()
                if notice:
                    self.logger.message(notice)

    def _collect(self, timeout: float) -> None:
        """Take in every finished request; wait up to ``timeout`` for one, or for the trainer to finish
        (``ResultFutures``: either wakes the wait, with no polling)."""
        for ref, future in self._result_futures.wait(self.inflight, self._training, timeout):
            chunk = self.inflight.pop(ref, None)
            if chunk is None:  # dropped with its engine when an earlier request of this turn found it dead
                continue
            self.stall.progress()
            t0 = time.perf_counter()
            try:
                results = future.result()
            except Exception as exc:
                if not engine_is_dead(exc):
                    raise
                self._engine_died(chunk)
                continue
            self._timeline["time/gather_s"] += time.perf_counter() - t0
            self._record(chunk, results)
            self.trace.finished(chunk.id, prompts=len(chunk.items))
            for item, samples in zip(chunk.items, results, strict=True):
                group = Group(
                    item,
                    [list(s.output_ids) for s in samples],
                    [list(s.logprobs) for s in samples],
                    [int(s.version) for s in samples],
                    request=chunk.id,
                    token_versions=[list(s.versions) for s in samples],
                )
                t0 = time.perf_counter()
                completions = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in group.output_ids]
                group.rewards = self.scorer.score_group(completions, item.answer, prompt=item.prompt)
                self._timeline["time/reward_s"] += time.perf_counter() - t0
                self._rollout_tokens += sum(len(ids) for ids in group.output_ids)
                if not self._drop_too_stale(group):
                    self.finished.append(group)

    def _record(self, chunk: Chunk, results: list[Any]) -> None:
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
        self._interrupted += len(interrupted)
        self.rollout_log.request(chunk.id, cursors, version, chunk.admitted_at, chunk.engine, interrupted)

    def _engine_died(self, chunk: Chunk) -> None:
        """Restart the engine, bring it to the current weights, and re-issue every prompt it held."""
        lost = [chunk] + [c for c in self.inflight.values() if c.engine == chunk.engine]
        for c in lost:
            self.trace.finished(c.id, prompts=len(c.items), lost=True)
        for ref in [r for r, c in self.inflight.items() if c.engine == chunk.engine]:
            del self.inflight[ref]
        self.logger.message(f"rollout engine {chunk.engine} died; restarting it and re-issuing {len(lost)} chunk(s)")
        self._reissue.extend(c.items for c in lost)
        self._warming.add(chunk.engine)
        # Forced: the actor may be alive around a dead vLLM core. Other in-flight chunks of this engine
        # were dropped above, so this runs once per death.
        for index in self.rollout.revive([chunk.engine], force=True):
            self._forget_engine(index)
        # The trainer thread loads the current weights, then the engine takes new work again.
        self._trainer_thread.submit(self._load_current_weights, chunk.engine)

    def _forget_engine(self, index: int) -> None:
        """A restarted engine holds none of the run's weights: the weight path forgets it too."""
        self.weights.forget(index)

    def _load_current_weights(self, engine: int) -> None:
        # Runs on the trainer thread, after any sync already queued there: the weights it pushes are those
        # of the last completed sync, which can be one ahead of `self.version` until the driver records it.
        try:
            self.weights.push_files([engine], self.weights.synced_version)
        finally:
            self._warming.discard(engine)

    def _drop_too_stale(self, group: Group) -> bool:
        """Samples older than the staleness bound allows (e.g. from a restarted engine) are regenerated."""
        bound = 0 if self.colocated else self.plan.schedule.max_staleness
        if min(group.versions) >= self.version - bound:
            return False
        self._reissue.append([group.item])
        return True

    # ------------------------------------------------------------------ trainer side (one thread)

    def _build_batch(self, groups: list[Group]) -> tuple[dict[str, Any], dict[str, float], list[str | None]]:
        import torch

        from rlc.runtime.algo.advantages import group_advantages

        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        advantages = group_advantages(
            rewards.flatten(), self.group_size, scale_by_std=self.plan.algorithm.normalize_std
        ).reshape(rewards.shape)
        input_ids, loss_mask, behaviour, adv, lags, lengths = [], [], [], [], [], []
        for g_index, group in enumerate(groups):
            prompt = list(group.item.prompt_ids)
            for s_index, (out, lps) in enumerate(zip(group.output_ids, group.logprobs, strict=True)):
                input_ids.append(prompt + out)
                loss_mask.append([0] * len(prompt) + [1] * len(out))
                # Each token's behaviour log-prob is the one the version that sampled it produced: an interrupted
                # sample's tokens before the update carry the old policy's, those after the new one's.
                behaviour.append([0.0] * len(prompt) + list(lps))
                adv.append(float(advantages[g_index, s_index]))
                lags += [self.version - v for v in group.sample_versions(s_index)]
                lengths.append(len(out))
        batch = {
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "behaviour_logprobs": behaviour,
            "advantages": adv,
        }
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
        }
        return batch, stats, domains

    def _train_and_sync(self, groups: list[Group]) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
        """Train on a batch and sync the new weights; returns the step's metrics and the trainer thread's spans
        (batch building, training, weight sync) for the trace."""
        algo = self.plan.algorithm
        t_batch = time.perf_counter()
        batch, stats, domains = self._build_batch(groups)
        stats["time/batch_s"] = time.perf_counter() - t_batch
        stats["data/truncated_prompts"] = float(self.prompts.truncated)
        self.phases.before_train()
        t0 = time.perf_counter()
        # Teachers score on their own devices while the trainer works. The trainer computes the proximal
        # log-probs of the decoupled loss itself (`TrainerWorker.train_step`).
        scoring = self.teachers.score(batch["input_ids"], domains) if self.teachers is not None else None
        loss_cfg = {
            "clip": algo.clip,
            "behave_imp_weight_cap": algo.behave_imp_weight_cap,
            "decoupled": algo.decoupled_loss,
        }
        if algo.kl_coef > 0:
            if self.plan.lora is not None:  # the base model with adapters disabled: no second copy
                batch["ref_logprobs"] = self.trainer.compute_logprobs(batch, adapters=False)
            else:
                batch["ref_logprobs"] = self.reference.compute_logprobs(batch)
            loss_cfg["kl_coef"] = algo.kl_coef
            loss_cfg["kl_estimator"] = algo.kl_estimator
        if scoring is not None:
            t_teach = time.perf_counter()
            rows, distill_inputs = self.teachers.collect(scoring, batch["input_ids"])
            batch.update(distill_inputs)
            loss_cfg["distill_coef"] = self.plan.distill.coef  # type: ignore[union-attr]
            stats.update(teacher_metrics(rows, batch["behaviour_logprobs"], batch["loss_mask"]))
            stats["time/teacher_wait_s"] = time.perf_counter() - t_teach
            stats["distill/teacher_restarts"] = float(self.teachers.restarts)
        # An agent batch holds one sequence per model call, so one whose trajectories made few calls can have fewer
        # sequences than the plan's minibatches: each optimizer step then takes one (the metric says how many ran).
        minibatches = min(algo.minibatches, len(batch["input_ids"]))
        if minibatches < algo.minibatches:
            self.logger.message(
                f"step {self.step + 1}: {len(batch['input_ids'])} sequence(s) for {algo.minibatches} minibatches; "
                f"taking {minibatches} optimizer step(s)"
            )
        result = self.trainer.train_step(batch, loss_cfg, minibatches=minibatches)
        stats["train/optimizer_steps"] = result["optimizer_steps"]
        train_s = time.perf_counter() - t0
        t_check = time.perf_counter()
        self.sync_check.expect(batch["input_ids"])
        check_s = time.perf_counter() - t_check
        t1 = time.perf_counter()
        self.phases.before_sync()
        self._sync_weights(self.version + 1)
        t2 = time.perf_counter()
        sync_s = t2 - t1
        self.phases.after_sync()
        t_check = time.perf_counter()
        stats["sync_check/gap"] = self.sync_check.verify(self.version + 1)
        stats["time/sync_check_s"] = check_s + time.perf_counter() - t_check
        spans = {"build batch": (t_batch, t0), "train": (t0, t1), "weight sync": (t1, t2)}
        if self.colocated:
            stats.update(self.phases.take_times())
        if "kl_ref" in result:
            stats["kl_ref"] = result["kl_ref"]
        # MoE routers: expert load, routing drift between the proximal and policy passes, load-balancing loss.
        stats.update({k: v for k, v in result.items() if k.startswith("moe/")})
        if "behaviour_gap" in result:
            # Engine vs trainer log-probs of the sampled tokens under the weights that are about to step: on
            # policy (staleness 0) their numerical agreement, off policy also the lag.
            stats["logprob_gap/mean"] = result["behaviour_gap"]
            stats["logprob_gap/max"] = result["behaviour_gap_max"]
        stats.update(
            {
                "loss/policy": result.get("loss", float("nan")),
                "grad_norm": result.get("grad_norm", float("nan")),
                "entropy": result.get("entropy", float("nan")),
                "behave_imp_weight/mean": result.get("behave_imp_weight_mean", 1.0),
                "behave_imp_weight/max": result.get("behave_imp_weight_max", 1.0),
                "clip_fraction": result.get("clip_fraction", 0.0),
                # k3 KL of the trained policy from the proximal one (the behaviour policy without the decoupled
                # loss), token mean over the step. With the decoupled loss and one minibatch it is 0 (each token
                # trains before the only update); with several it shows how far the earlier updates moved the
                # policy, diluted by the first minibatch's tokens.
                "approx_kl": result.get("approx_kl", 0.0),
                "time/train_s": train_s,
                "time/weight_sync_s": sync_s,
                "throughput/train_tokens_per_s": stats["train/tokens"] / train_s if train_s > 0 else 0.0,
            }
        )
        return stats, spans

    def _sync_weights(self, version: int) -> None:
        """Move the trainer's weights into every engine (`WeightPush.sync`); restarted engines are forgotten."""
        self.weights.sync(version, self._forget_engine)

    def prepare_weight_path(self) -> None:
        """Check, before any step, that the plan's weight path works here (`WeightPush.prepare`)."""
        self.weights.prepare()

    def _resume_cursor(self) -> int:
        """Where a resumed run restarts the prompt stream: the oldest prompt not yet trained on.

        Prompts in flight, finished but not yet trained, or waiting to be re-issued would otherwise be lost
        on resume. (Called while the driver waits for the checkpoint, so these collections are stable.)
        """
        pending = [c.items for c in self.inflight.values()] + [[g.item] for g in self.finished] + self._reissue
        return min((item.cursor for items in pending for item in items), default=self.prompts.cursor)

    def _checkpoint(self) -> None:
        staged = staging_dir(self.run_dir, self.step)
        self.trainer.save_checkpoint(str(staged))
        state = ControllerState(
            step=self.step,
            version=self.version,
            data_cursor=self._resume_cursor(),
            rng=_rng_to_json(random.getstate()),
            plan_hash=self.plan.spec_hash,
        )
        finalize(self.run_dir, staged, state, self.plan.schedule.keep_checkpoints)

    # ------------------------------------------------------------------ the loop

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> int:
        total = self.total_steps
        try:
            while self.step < total and not self._stop.is_set():
                self._fill()
                self._collect(timeout=self._collect_timeout())
                if self._training is None:
                    self._start_training()
                if self._training is not None and self._training.done():
                    done, self._training = self._training, None
                    self.stall.progress()
                    self._finish_step(done)
                self.stall.check(self._in_flight)
            return self.step
        finally:
            if self._training is not None:
                self._training.cancel()

    def _in_flight(self) -> str:
        """What the run is waiting for, for a stall's message: requests per engine with their ages, the step."""
        now = time.monotonic()
        oldest: dict[int, float] = {}
        count: dict[int, int] = {}
        for chunk in self.inflight.values():
            count[chunk.engine] = count.get(chunk.engine, 0) + 1
            oldest[chunk.engine] = max(oldest.get(chunk.engine, 0.0), now - chunk.submitted_s)
        parts = [f"engine {e}: {count[e]} generate request(s), the oldest {oldest[e]:.0f} s" for e in sorted(count)]
        if self._training is not None:
            parts.append(f"the trainer: step {self.step + 1}, {now - self._training_since:.0f} s")
        return "; ".join(parts)

    def _collect_timeout(self) -> float:
        """How long one loop turn may wait for a rollout (or the trainer) to finish.

        A finished rollout or the trainer's end cuts the wait short, so the bound only paces the loop's other
        checks (a stop request, an engine back from a restart). Not at all while the trainer is idle with a
        whole batch waiting, or an asynchronous run would leave it idle while the next batch generates.
        """
        if self._training is None and len(self.finished) >= self.batch_prompts:
            return 0.0
        return 0.05

    def _next_batch(self) -> list[Group] | None:
        """The next step's groups once enough have finished: the oldest prompts first, whichever engine
        finished first (with max_staleness 0 exactly the batch admitted for this version)."""
        if len(self.finished) < self.batch_prompts:
            return None
        self.finished.sort(key=lambda g: (g.item.cursor, g.request))
        groups, self.finished = self.finished[: self.batch_prompts], self.finished[self.batch_prompts :]
        return groups

    def _start_training(self) -> None:
        """Hand the next batch to the trainer thread, once enough groups have finished."""
        groups = self._next_batch()
        if groups is None:
            return
        rollout_wait = time.perf_counter() - self._step_started
        self._training = self._trainer_thread.submit(self._train_and_sync, groups)
        self._training_since = time.monotonic()
        self._training.rollout_wait = rollout_wait  # type: ignore[attr-defined]
        self._training.groups = [(g.request, g.item.cursor) for g in groups]  # type: ignore[attr-defined]

    def _finish_step(self, future: Future) -> None:
        stats, spans = future.result()
        self.version += 1
        self.step += 1
        now = time.perf_counter()
        step_s = now - self._step_started
        self._step_started = now
        every = self.plan.schedule.checkpoint_every
        checkpoint_due = self.step % every == 0 or self.step == self.total_steps
        if self.step < self.total_steps and not self._stop.is_set():
            # The next rollouts, and the next training when its batch is ready, start before this step's
            # bookkeeping (logging, trace); not past a checkpoint, which must save this step's weights.
            self._fill()
            if not checkpoint_due:
                self._start_training()
        for name, (begin, end) in spans.items():
            self.trace.trainer_span(name, begin, end, self.step)
        # Rollout that ran while this step trained and synced (about 0 when the run is synchronous).
        stats["time/overlap_s"] = self.trace.overlap(spans["build batch"][0], spans["weight sync"][1])
        self.rollout_log.batch(self.step, future.groups)  # type: ignore[attr-defined]
        metrics = {
            "step": self.step,
            "version": self.version,
            **stats,
            "time/rollout_s": future.rollout_wait,  # type: ignore[attr-defined]
            "time/step_s": step_s,
            "throughput/rollout_tokens_per_s": self._rollout_tokens / step_s if step_s > 0 else 0.0,
            "rollout/engine_restarts": float(self.rollout.restarts),
            "rollout/interrupted_samples": float(self._interrupted),
            "reward/failed": float(self.scorer.take_failed()),
            **self._spec_decode_metrics(),
        }
        metrics.update(self._timeline)
        self._timeline = dict.fromkeys(self._timeline, 0.0)
        self._rollout_tokens = 0
        self._interrupted = 0
        self.logger.log(metrics)
        if checkpoint_due:
            self._wait_checkpoint(self._trainer_thread.submit(self._checkpoint))

    def _wait_checkpoint(self, saving: Future) -> None:
        """Wait for the step's checkpoint within the stall bound (a write to a hung filesystem never returns)."""
        from concurrent.futures import TimeoutError as FutureTimeout

        try:
            saving.result(timeout=self.stall.limit_s)
        except FutureTimeout:
            raise StallError(
                f"the checkpoint of step {self.step} did not finish within the plan's stall bound of "
                f"{self.stall.limit_s:.0f} s (schedule.stall_timeout_s); is the run directory's filesystem answering?"
            ) from None

    def _spec_decode_metrics(self) -> dict[str, float]:
        """This step's speculative-decoding figures, summed over engines (empty without spec decode)."""
        import ray

        if self.spec_decode is None:
            return {}
        try:
            snaps = ray.get([e.spec_decode_metrics.remote() for e in self.rollout.engines], timeout=120)
        except Exception as exc:  # a dying engine: the restart path deals with it
            self.logger.message(f"spec-decode counters unavailable this step ({type(exc).__name__})")
            return {}
        return self.spec_decode.step(dict(enumerate(snaps)))

    def close(self) -> None:
        for rank, folder in sorted(self.weights.written_dirs.items()):  # each on the node of the rank that wrote it
            try:
                self.trainer.remove_dir(folder, rank)
            except Exception as exc:  # the trainer is gone: say what is left behind
                self.logger.message(f"could not remove {folder} ({type(exc).__name__}); delete it by hand")
        self.logger.close()
        self.rollout_log.close()
        self.trace.close()
        self._trainer_thread.shutdown(wait=False, cancel_futures=True)


def _rng_to_json(state: tuple) -> dict[str, Any]:
    version, internal, gauss = state
    return {"version": version, "internal": list(internal), "gauss": gauss}


def _rng_from_json(data: dict[str, Any]) -> tuple:
    return (data["version"], tuple(data["internal"]), data["gauss"])
