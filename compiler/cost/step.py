"""Colocated switches and the whole step: how the phases of one RL step compose into its time."""

from __future__ import annotations

from dataclasses import dataclass

from rlc.compiler.cost.rollout import RolloutTime
from rlc.compiler.cost.workload import Workload
from rlc.compiler.memory import ModelSizes, dtype_bytes
from rlc.schemas.target import TargetProfile

__all__ = [
    "ENGINE_CYCLE_S",
    "StepTime",
    "engine_offload_s",
    "step_time",
    "switch_s",
    "teacher_time_s",
]

#: Fixed seconds a colocated step spends cycling its engines, whatever the model's size: sleep (vLLM sleep
#: level 2 drops the weights and the KV cache), wake (its allocator maps the weight and KV-cache pools again:
#: the KV cache is re-allocated every step) and the first request's re-warm after waking. gpu: 2.7 s, the
#: vLLM blog "Zero-Reload Model Switching with vLLM Sleep Mode" (2025-10-26): level-2 wake 0.8-2.6 s over
#: 0.6B-235B models on A4000-A100 (midpoint 1.7 s), first prompt after a wake 0.96 s with the 1-token warm-up.
#: [estimate] npu: vllm-ascend's sleep mode (its CaMem allocator) does the same work; no published timing, so
#: the gpu figure. cpu: 0 (rlc's cpu engines do not sleep: vLLM refuses sleep mode there).
ENGINE_CYCLE_S = {"gpu": 1.7 + 0.96, "npu": 1.7 + 0.96, "cpu": 0.0}


def switch_s(target: TargetProfile, train_state_gib: float) -> float:
    """Colocated phase switch per step: training state to host before rollout and back before training.

    2 × state bytes / host↔device bandwidth, plus the engines' sleep / wake cycle (ENGINE_CYCLE_S: the
    weights are discarded at sleep level 2 and refilled by the in-place sync, the KV cache dropped and
    re-allocated, the first request re-warmed), a fixed cost that dominates small models' switches. 0 on
    cpu, where nothing moves.
    """
    if target.kind == "cpu":
        return 0.0
    moves = 2 * train_state_gib * 1024**3 / (target.host_to_device_bandwidth_gbps * 1e9)
    return moves + ENGINE_CYCLE_S[target.kind]


def engine_offload_s(sizes: ModelSizes, target: TargetProfile, engine_share: float) -> float:
    """An adapter-serving colocated engine's base weights to host and back each step (vLLM sleep level 1: an
    adapter sync never resends the base, so it cannot be discarded as at level 2):
    2 × its device's share of the weights / host↔device bandwidth, every device at once. 0 on cpu."""
    if target.kind == "cpu":
        return 0.0
    return 2 * sizes.total * dtype_bytes(target) * engine_share / (target.host_to_device_bandwidth_gbps * 1e9)


def teacher_time_s(sizes: ModelSizes, devices: int, target: TargetProfile, work: Workload, share: float) -> float:
    """Forward-only teacher scoring: 2 · active params · (share of samples · mean length) / (devices · peak · MFU)."""
    flops = 2 * sizes.active * work.samples * share * work.context_tokens
    return flops / (devices * target.bf16_tflops * 1e12 * target.efficiency.prefill_mfu)


@dataclass(frozen=True)
class StepTime:
    """One RL step's estimate and its split."""

    step_s: float
    rollout_s: float
    train_s: float
    teacher_s: float
    sync_s: float
    switch_s: float
    tokens_per_s: float
    overhead_s: float = 0.0


def step_time(
    mode: str,
    work: Workload,
    rollout: RolloutTime,
    train_s: float,
    teacher_s: float,
    sync_s: float,
    switch: float,
    overhead_s: float = 0.0,
) -> StepTime:
    """Combine the phases.

    Disaggregated with staleness > 0 (AReaL-style asynchrony): rollout runs while the trainer works, so
    step ≈ max(rollout, teachers, train) + sync, the rollout streamed without a tail (`rollout_time`). A
    trajectory whose turns run one after another (`rollout.chain_s`: agent turns and their tool waits) is
    admitted once version v exists and must be trained by the step at version v + s (`StalenessGate`), so
    from its admission to that step's start pass s + 1 periods less one step's training and sync:
    (s + 1) · step ≥ chain + train + sync. Staleness spreads a sequential chain over s + 1 steps; it never
    hides it.
    Staleness 0 serialises them: rollout (waiting for the batch's long tail) + teachers + train + sync.
    Colocated: rollout + teachers + train + sync + switch. Every step also pays
    the target's fixed `step_overhead_s` (controller bookkeeping, rewards, Python).
    """
    if mode == "disaggregated" and work.staleness > 0:
        r = rollout.async_s
        step = max(r, teacher_s, train_s) + sync_s
        step = max(step, (rollout.chain_s + train_s + sync_s) / (work.staleness + 1))
    else:
        r = rollout.sync_s
        step = r + teacher_s + train_s + sync_s + (switch if mode == "colocated" else 0.0)
    step += overhead_s
    if mode != "colocated":
        switch = 0.0
    return StepTime(step, r, train_s, teacher_s, sync_s, switch, work.trained_tokens / step, overhead_s)
