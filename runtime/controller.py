"""The single controller: asynchronous GRPO over rollout engines and an FSDP2 trainer group.

One driver thread runs the streaming loop: a workflow (`runtime.workflows`: generate-and-score, replay, agent
episodes) admits work to the engines under the staleness bound (`StalenessGate`) and hands back finished
groups. A second thread owns every trainer call (reference log-probs, the optimizer step, the weight sync through
`WeightPush`, checkpoints), because trainer calls are collective and must reach all ranks in the same order.
While it trains, engines keep generating with the weights they hold, and each token carries the policy version
that produced it. The engines are a `RolloutPool`.

Modes ride on the same loop: colocated runs alternate (no rollout is admitted while training, and the
plan's sleep/offload moves happen around each train phase, `colocate.PhaseSwitcher`); LoRA runs sync an
adapter (or merged weights) and take the KL reference from the trainer with adapters disabled; MOPD runs
score each batch with the teachers (`distill.TeacherPool`) while the trainer steps; and
speculative decoding's counters are read from the engines after every step (`spec_decode`).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rlc.runtime.algo.policy import PolicyLoss
from rlc.runtime.checkpoint import ControllerState, finalize, staging_dir
from rlc.runtime.colocate import PhaseSwitcher
from rlc.runtime.distill import teacher_metrics
from rlc.runtime.metrics import MetricsLogger
from rlc.runtime.nonfinite import SkipCount, skip_metrics
from rlc.runtime.prompts import PromptStream
from rlc.runtime.rollout.pool import RolloutPool
from rlc.runtime.rollout_log import RolloutLog
from rlc.runtime.spec_decode import SpecDecodeDelta
from rlc.runtime.staleness import StalenessGate
from rlc.runtime.stall import StallError, StallWatch
from rlc.runtime.sync_check import SyncCheck
from rlc.runtime.tasks.rewards import RewardGuard
from rlc.runtime.trace import StepTrace
from rlc.runtime.trackers import plan_config
from rlc.runtime.weight_push import WeightPush
from rlc.runtime.workflows import Workflow
from rlc.runtime.workflows.generate import GenerateWorkflow
from rlc.schemas.plan import Plan


class Controller:
    """Runs a plan's training loop; see the module docstring for the concurrency design.

    ``workflow`` builds the run's workflow from this loop (default: generate-and-score).
    """

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
        workflow: Callable[[Controller], Workflow] | None = None,
    ) -> None:
        self.plan = plan
        self.run_dir = run_dir
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.rollout = rollout
        self.trainer = trainer
        sched = plan.schedule
        self.colocated = sched.mode == "colocated"
        #: How many versions a trained token may lag the policy (the plan's; colocated plans state 0).
        self.staleness = sched.max_staleness
        self.step = start.step if start else 0
        self.total_steps = sched.steps  # a replay stops at the last recorded step
        self.version = start.version if start else 0
        self.gate = StalenessGate(sched.batch_samples, self.staleness, submitted=self.version * sched.batch_samples)
        self.prompts = PromptStream(
            plan.data, tokenizer, plan.algorithm.seed, plan.sampling.max_prompt_len, start.data_cursor if start else 0
        )
        if start and start.rng:
            random.setstate(_rng_from_json(start.rng))
        else:
            random.seed(plan.algorithm.seed)
        self._trainer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlc-trainer")
        #: The trainer thread's step in progress, if any.
        self.training: Future | None = None
        self._training_since = 0.0
        self.stall = StallWatch(sched.stall_timeout_s)
        #: Engines restarting: no work goes to them until they hold the run's weights again.
        self.warming: set[int] = set()
        self.reference: Any = None
        self.teachers: Any = None  # a distill.TeacherPool when the plan distills
        self.spec_decode = SpecDecodeDelta() if plan.sampling.speculative else None
        self._stop = threading.Event()
        self._checkpointed_step = self.step  # the step of the newest checkpoint (a resumed run starts at one)
        self._step_started = time.perf_counter()
        #: Tokens generated and samples a weight update interrupted since the last step (the workflow counts them).
        self.rollout_tokens = 0
        self.interrupted_samples = 0
        #: Driver-thread time per step outside the engines and the trainer: taking finished requests' results
        #: (gather; Ray delivers them through their futures off this thread) and scoring them (reward); the
        #: trainer thread adds batch, train and sync.
        self.timeline = dict.fromkeys(("time/gather_s", "time/reward_s"), 0.0)
        self.logger = MetricsLogger(
            run_dir, plan.loggers, plan.schedule.steps, self.step, run_name=plan.name, config=plan_config(plan)
        )
        self.weights = WeightPush(plan, trainer, rollout, run_dir, self.logger.message, self.version)
        self.sync_check = SyncCheck(
            trainer, rollout, sched.sync_check_max_gap, sched.sync_check_noise, sched.sync_check_min_step
        )
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
        #: Steps in a row whose update a non-finite loss or gradient norm skipped (the trainer skips them).
        self.nonfinite = SkipCount(sched.max_nonfinite_steps, run_dir)
        self.workflow: Workflow = (workflow or GenerateWorkflow)(self)

    # ------------------------------------------------------------------ what workflows ask of the loop

    def may_admit(self) -> bool:
        """Whether new rollouts may start now: always, except while a colocated run trains (its engines yield the
        devices to the trainer)."""
        return not (self.colocated and self.training is not None)

    def engine_load(self, engines_in_flight: Iterable[int]) -> dict[int, int]:
        """Work items each serving engine holds, from the engine index of every item in flight (engines restarting
        are left out: they take no work)."""
        load = {i: 0 for i in range(self.rollout.replicas) if i not in self.warming}
        for engine in engines_in_flight:
            if engine in load:
                load[engine] += 1
        return load

    def restart_engine(self, index: int) -> None:
        """Restart a dead engine and bring it to the current weights; it takes no work until then."""
        self.warming.add(index)
        # Forced: the actor may be alive around a dead vLLM core. A workflow drops the engine's other in-flight
        # work before asking, so this runs once per death.
        for restarted in self.rollout.revive([index], force=True):
            self._forget_engine(restarted)
        # The trainer thread loads the current weights, then the engine takes new work again.
        self._trainer_thread.submit(self._load_current_weights, index)

    def _forget_engine(self, index: int) -> None:
        """A restarted engine holds none of the run's weights: the weight path forgets it too."""
        self.weights.forget(index)

    def _load_current_weights(self, engine: int) -> None:
        # Runs on the trainer thread, after any sync already queued there: the weights it pushes are those
        # of the last completed sync, which can be one ahead of `self.version` until the driver records it.
        try:
            self.weights.push_files([engine], self.weights.synced_version)
        finally:
            self.warming.discard(engine)

    # ------------------------------------------------------------------ trainer side (one thread)

    def _train_and_sync(self, groups: list[Any]) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
        """Train on a batch and sync the new weights; returns the step's metrics and the trainer thread's spans
        (batch building, training, weight sync) for the trace."""
        algo = self.plan.algorithm
        t_batch = time.perf_counter()
        batch, stats, domains = self.workflow.build_batch(groups)
        stats["time/batch_s"] = time.perf_counter() - t_batch
        stats["data/truncated_prompts"] = float(self.prompts.truncated)
        self.phases.before_train()
        t0 = time.perf_counter()
        # Teachers score on their own devices while the trainer works. The trainer computes the proximal
        # log-probs of the decoupled loss itself (`TrainerWorker.train_step`).
        scoring = self.teachers.score(batch["input_ids"], domains) if self.teachers is not None else None
        loss_cfg: dict[str, Any] = {"policy": PolicyLoss.from_plan(algo, self.plan.sampling.max_response_len)}
        if algo.kl_coef > 0:
            if "ref_logprobs" not in batch:  # reinforce_pp's advantages may have asked for them already
                batch["ref_logprobs"] = self.reference_logprobs(batch)
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
        t_check = time.perf_counter()
        self.sync_check.before_step(batch["input_ids"])  # the probe under the weights before the step
        before_s = time.perf_counter() - t_check
        result = self.trainer.train_step(batch, loss_cfg, minibatches=minibatches)
        stats["train/optimizer_steps"] = result["optimizer_steps"]
        stats.update(skip_metrics(result))  # updates a non-finite loss or gradient norm skipped
        train_s = time.perf_counter() - t0
        t_check = time.perf_counter()
        self.sync_check.expect(batch["input_ids"])
        check_s = before_s + time.perf_counter() - t_check
        t1 = time.perf_counter()
        self.phases.before_sync()
        self._sync_weights(self.version + 1)
        t2 = time.perf_counter()
        sync_s = t2 - t1
        self.phases.after_sync()
        t_check = time.perf_counter()
        stats["sync_check/gap"] = self.sync_check.verify(self.version + 1)
        stats["sync_check/step_moved"] = self.sync_check.moved
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
                "dual_clip_fraction": result.get("dual_clip_fraction", 0.0),
                # Share of trained tokens the off-policy correction dropped (masked) or down-weighted (truncated).
                "off_policy/masked_tokens": result.get("behave_masked_fraction", 0.0),
                "off_policy/truncated_tokens": result.get("behave_truncated_fraction", 0.0),
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

    def reference_logprobs(self, batch: dict[str, Any]) -> list[list[float]]:
        """The reference policy's log-probs of every sequence (trainer thread): the LoRA base model with adapters
        disabled (no second copy), else the reference actors the plan placed."""
        if self.plan.lora is not None:
            return self.trainer.compute_logprobs(batch, adapters=False)
        return self.reference.compute_logprobs(batch)

    def _sync_weights(self, version: int) -> None:
        """Move the trainer's weights into every engine (`WeightPush.sync`); restarted engines are forgotten."""
        self.weights.sync(version, self._forget_engine)

    def prepare_weight_path(self) -> None:
        """Check, before any step, that the plan's weight path works here (`WeightPush.prepare`)."""
        self.weights.prepare()

    def _checkpoint(self) -> None:
        step = self.step
        staged = staging_dir(self.run_dir, step)
        self.trainer.save_checkpoint(str(staged))
        state = ControllerState(
            step=step,
            version=self.version,
            data_cursor=self.workflow.resume_cursor(),
            rng=_rng_to_json(random.getstate()),
            plan_hash=self.plan.spec_hash,
        )
        finalize(self.run_dir, staged, state, self.plan.schedule.keep_checkpoints)
        self._checkpointed_step = step

    # ------------------------------------------------------------------ the loop

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> int:
        total = self.total_steps
        try:
            while self.step < total and not self._stop.is_set():
                self.workflow.fill()
                self.workflow.collect(timeout=self._collect_timeout())
                if self.training is None:
                    self._start_training()
                if self.training is not None and self.training.done():
                    done, self.training = self.training, None
                    self.stall.progress()
                    self._finish_step(done)
                self.stall.check(self._in_flight)
            return self.step
        finally:
            # A stopped run keeps the step its trainer is in (`finish_after_stop`); anything else drops it.
            if self.training is not None and not self._stop.is_set():
                self.training.cancel()

    def finish_after_stop(self) -> int:
        """After `stop`: finish and record the step the trainer was in (its update is already in the weights), then
        checkpoint the last step unless that is done; returns the step reached. The loop itself checkpoints only
        every `checkpoint_every` steps and at its last one."""
        from concurrent.futures import TimeoutError as FutureTimeout

        training, self.training = self.training, None
        if training is not None and not training.cancelled():
            try:
                training.result(timeout=self.stall.limit_s)
            except FutureTimeout:
                raise StallError(
                    f"step {self.step + 1} did not finish within the plan's stall bound of {self.stall.limit_s:.0f} s "
                    "after the stop request (schedule.stall_timeout_s)"
                ) from None
            self._finish_step(training)
        if self.step > self._checkpointed_step:
            self._wait_checkpoint(self._trainer_thread.submit(self._checkpoint))
        return self.step

    def _in_flight(self) -> str:
        """What the run is waiting for, for a stall's message: the workflow's work in flight, the step."""
        since = self._training_since if self.training is not None else None
        return in_flight_text(self.workflow.in_flight(), self.step, since)

    def _collect_timeout(self) -> float:
        return collect_timeout(self.training is not None, self.workflow.has_batch())

    def _start_training(self) -> None:
        """Hand the next batch to the trainer thread, once the workflow has one."""
        groups = self.workflow.next_batch()
        if groups is None:
            return
        rollout_wait = time.perf_counter() - self._step_started
        self.training = self._trainer_thread.submit(self._train_and_sync, groups)
        self._training_since = time.monotonic()
        self.training.rollout_wait = rollout_wait  # type: ignore[attr-defined]
        self.training.groups = self.workflow.batch_record(groups)  # type: ignore[attr-defined]

    def _finish_step(self, future: Future) -> None:
        stats, spans = future.result()
        self.version += 1
        self.step += 1
        now = time.perf_counter()
        step_s = now - self._step_started
        self._step_started = now
        every = self.plan.schedule.checkpoint_every
        checkpoint_due = self.step % every == 0 or self.step == self.total_steps
        stats.update(self.nonfinite.record(self.step, stats))
        stopping = self.nonfinite.exhausted  # no further step starts; this one is logged, then the run stops
        if self.step < self.total_steps and not self._stop.is_set() and not stopping:
            # The next rollouts, and the next training when its batch is ready, start before this step's
            # bookkeeping (logging, trace); not past a checkpoint, which must save this step's weights.
            self.workflow.fill()
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
            "throughput/rollout_tokens_per_s": self.rollout_tokens / step_s if step_s > 0 else 0.0,
            "rollout/engine_restarts": float(self.rollout.restarts),
            "rollout/interrupted_samples": float(self.interrupted_samples),
            "reward/failed": float(self.scorer.take_failed()),
            **self._spec_decode_metrics(),
        }
        metrics.update(self.timeline)
        self.timeline = dict.fromkeys(self.timeline, 0.0)
        self.rollout_tokens = 0
        self.interrupted_samples = 0
        self.logger.log(metrics)
        if stopping:
            raise self.nonfinite.error(self.step)
        if checkpoint_due:
            self._wait_checkpoint(self._trainer_thread.submit(self._checkpoint))

    def _wait_checkpoint(self, saving: Future) -> None:
        wait_checkpoint(saving, self.stall.limit_s, self.step)

    def _spec_decode_metrics(self) -> dict[str, float]:
        """This step's speculative-decoding figures, summed over engines (empty without spec decode)."""
        import ray

        if self.spec_decode is None:
            return {}
        try:
            snaps = ray.get([e.spec_decode_metrics() for e in self.rollout.engines], timeout=120)
        except Exception as exc:  # a dying engine: the restart path deals with it
            self.logger.message(f"spec-decode counters unavailable this step ({type(exc).__name__})")
            return {}
        return self.spec_decode.step(dict(enumerate(snaps)))

    def close(self) -> None:
        self.workflow.close()
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


def in_flight_text(work: list[str], step: int, training_since: float | None) -> str:
    """A stall's account of what is in flight: the workflow's work, and the trainer's step while it runs
    (`training_since`: when it started, monotonic)."""
    parts = list(work)
    if training_since is not None:
        parts.append(f"the trainer: step {step + 1}, {time.monotonic() - training_since:.0f} s")
    return "; ".join(parts)


def collect_timeout(training: bool, has_batch: bool) -> float:
    """How long one loop turn may wait for a rollout (or the trainer) to finish.

    A finished rollout or the trainer's end cuts the wait short, so the bound only paces the loop's other
    checks (a stop request, an engine back from a restart). Not at all while the trainer is idle with a
    whole batch waiting, or an asynchronous run would leave it idle while the next batch generates.
    """
    return 0.0 if not training and has_batch else 0.05


def wait_checkpoint(saving: Future, limit_s: float, step: int) -> None:
    """Wait for a step's checkpoint within the stall bound (a write to a hung filesystem never returns)."""
    from concurrent.futures import TimeoutError as FutureTimeout

    try:
        saving.result(timeout=limit_s)
    except FutureTimeout:
        raise StallError(
            f"the checkpoint of step {step} did not finish within the plan's stall bound of "
            f"{limit_s:.0f} s (schedule.stall_timeout_s); is the run directory's filesystem answering?"
        ) from None
