"""The plan's schedule: batch, staleness, feed, weight sync and update mode, the post-sync check's bound, the stall
bound, the bound on steps skipped for non-finite numbers."""

from __future__ import annotations

from rlc.compiler import cost, search
from rlc.compiler.engine_config import engine_dtype
from rlc.compiler.resolve import Problem
from rlc.compiler.roles import offload_steps
from rlc.schemas.plan import Schedule

#: Engine-trainer mean |log-prob difference| on the post-sync probe that stops a run, by engine dtype. Same
#: weights in float32 agree to ~1e-6 (measured on the cpu target: dense 1e-6, MoE 5e-6 over a run); bfloat16
#: engine and trainer kernels differ by a few 1e-2 on average (why RL frameworks correct for the mismatch). A
#: sync that leaves an engine on other weights is off by nats: 1.9-5.8 measured for vLLM's unrepacked CPU experts.
SYNC_CHECK_MAX_GAP = {"float32": 1e-3, "bfloat16": 0.25}


def sync_check_max_gap(problem: Problem, train_compute_dtype: str) -> float:
    """The spec's `rollout.sync_check_max_gap`, else the default for the lower precision of the two sides: the
    engines' (`engine_config.engine_dtype`) and the trainer's compute dtype."""
    if problem.spec.rollout.sync_check_max_gap is not None:
        return problem.spec.rollout.sync_check_max_gap
    return max(SYNC_CHECK_MAX_GAP[engine_dtype(problem)], SYNC_CHECK_MAX_GAP[train_compute_dtype])


#: The stall bound (`Schedule.stall_timeout_s`) covers this many of the slowest steps the estimate allows (the
#: first steps warm caches and build kernels, a shared machine runs slower), and never less than STALL_FLOOR_S.
STALL_STEPS = 10


STALL_FLOOR_S = 600.0


#: Steps in a row whose update a non-finite loss or gradient norm skipped before the run stops
#: (`Schedule.max_nonfinite_steps`): one such step is an accident of a batch (an outlier reward, a rare overflow) and
#: costs only its update; several in a row mean the policy or its inputs are broken, and more skipped steps cost time.
MAX_NONFINITE_STEPS = 3


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
        weight_sync=search.sync_method(ctx, best.mode),  # type: ignore[arg-type]
        weight_update=search.weight_update(problem),  # type: ignore[arg-type]
        sync_check_max_gap=sync_check_max_gap(problem, best.train.layout.precision.compute_dtype),
        offload=offload_steps(problem, colocated, best, keeps_base=ctx.lora_adapter),
        checkpoint_every=spec.output.checkpoint_every,
        keep_checkpoints=spec.output.keep_checkpoints,
        stall_timeout_s=stall_timeout_s(best.step.step_s, ctx.target.estimate_uncertainty),
        max_nonfinite_steps=MAX_NONFINITE_STEPS,
    )
