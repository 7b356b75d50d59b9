"""Colocated phase switches: who holds the shared devices, the engines (rollout) or the trainer (train).

The plan's ``schedule.offload`` lists the moves at each switch. Before training the engines sleep (vLLM
sleep mode: ``sleep rollout_weights`` is level 2, which drops weights and KV cache since a full weight sync
follows; ``offload rollout_weights`` is level 1, which keeps the base weights in host memory, as a
LoRA-adapter run needs) and the trainer brings its state back. After the
step the engines wake their weights, the new weights are synced in, the trainer moves its state to host,
and only then does the KV cache come back, so the two phases' peaks never overlap.

On cpu the planner emits no moves: vLLM refuses sleep mode there and trainer state already lives in host
memory. Nothing is pretended: the times are recorded as 0 and the run says so once.
"""

from __future__ import annotations

import time
from typing import Any

from rlc.runtime.errors import RunError
from rlc.schemas.plan import Plan

TRAINER_STATE = ("params", "grads", "optimizer")


def sleep_level(weights: set[str]) -> int:
    """vLLM's sleep level for what the plan does with the engine's weights before training: discard them
    (sleep: level 2) or keep them in host memory (offload: level 1). vLLM has no level that keeps them on the
    device, so a plan that sleeps the KV cache and says nothing else of the weights is refused."""
    if weights == {"sleep"}:
        return 2
    if weights == {"offload"}:
        return 1
    raise RunError(
        f"the plan's colocated moves do {sorted(weights) or 'nothing'} with the engine weights before training; "
        "this runtime knows `sleep rollout_weights` (vLLM sleep level 2) and `offload rollout_weights` (level 1): "
        "recompile the plan"
    )


class PhaseSwitcher:
    """Carries out the plan's offload steps around each colocated train phase, timing them."""

    def __init__(self, plan: Plan, rollout: Any, trainer: Any, log) -> None:  # type: ignore[no-untyped-def]
        self.rollout = rollout
        self.trainer = trainer
        self.active = plan.schedule.mode == "colocated"
        steps = plan.schedule.offload if self.active else []
        self.sleep = any(s.action == "sleep" for s in steps)
        weights = {s.action for s in steps if s.phase == "before_train" and s.what == "rollout_weights"}
        self.level = sleep_level(weights) if self.sleep else 0
        self.offload_what = [s.what for s in steps if s.action == "offload" and s.what in TRAINER_STATE]
        self.onload_what = [s.what for s in steps if s.action == "onload" and s.what in TRAINER_STATE]
        self.offload_s = 0.0
        self.onload_s = 0.0
        self._asleep = False
        if self.active and not steps:
            log(
                f"colocated on {plan.platform}: the plan has no offload steps (vLLM sleep mode is not supported "
                "on cpu, and trainer state already lives in host memory), so engines keep their memory between "
                "phases and trainer offload is a no-op; time/offload_s and time/onload_s are recorded as 0"
            )

    def _engines(self, method: str, *args: Any) -> None:
        import ray

        ray.get([getattr(e, method)(*args) for e in self.rollout.engines])

    def before_train(self) -> None:
        """Engines release the devices (sleep), the trainer takes its state back (onload)."""
        if self.sleep:
            t0 = time.perf_counter()
            self._engines("sleep", self.level)
            self._asleep = True
            self.offload_s += time.perf_counter() - t0
        if self.onload_what:
            self.onload_s += self._timed(self.trainer.onload, self.onload_what)

    def before_sync(self) -> None:
        """Engines wake their weights so the sync can write into them (the KV cache stays released)."""
        if self._asleep:
            t0 = time.perf_counter()
            self._engines("wake_up", ["weights"])
            self.onload_s += time.perf_counter() - t0

    def after_sync(self) -> None:
        """The trainer moves its state to host, then the engines take their KV cache back for rollout."""
        if self.offload_what:
            self.offload_s += self._timed(self.trainer.offload, self.offload_what)
        if self._asleep:
            t0 = time.perf_counter()
            self._engines("wake_up", ["kv_cache"])
            self._asleep = False
            self.onload_s += time.perf_counter() - t0

    @staticmethod
    def _timed(fn, *args: Any) -> float:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        fn(*args)
        return time.perf_counter() - t0

    def take_times(self) -> dict[str, float]:
        """This step's switch times (seconds), then reset."""
        out = {"time/offload_s": self.offload_s, "time/onload_s": self.onload_s}
        self.offload_s = self.onload_s = 0.0
        return out
