"""The plan's sections that restate the spec with every default resolved: algorithm, sampling, data, LoRA,
distillation, and the step estimates of the chosen layout."""

from __future__ import annotations

from typing import Any

from rlc.compiler.engine_config import speculative_config
from rlc.compiler.resolve import Problem
from rlc.compiler.rounding import r3
from rlc.schemas.plan import (
    AlgorithmSettings,
    DataSettings,
    DistillSettings,
    DynamicSamplingSettings,
    Estimates,
    LoraSettings,
    OverlongSettings,
    Sampling,
    TeacherSettings,
)
from rlc.schemas.spec import Spec
from rlc.schemas.target import TargetProfile

__all__ = [
    "algorithm_settings",
    "data_settings",
    "distill_settings",
    "estimates",
    "lora_settings",
    "sampling_settings",
]


def algorithm_settings(spec: Spec) -> AlgorithmSettings:
    """The plan's algorithm section: every loss and sampling choice with its default resolved."""
    algo = spec.algorithm
    low, high = algo.clip_range
    sequence = algo.importance_ratio == "sequence"
    seq_low, seq_high = algo.sequence_clip_range if sequence else (None, None)
    agg = algo.aggregation
    ds, overlong = algo.dynamic_sampling, algo.overlong
    beta, estimator = algo.reward_kl
    reinforce_pp = algo.name == "reinforce_pp"
    return AlgorithmSettings(
        name=algo.name,
        minibatches=algo.minibatches,
        decoupled_loss=algo.decoupled_loss,
        clip=low,
        clip_high=high,
        dual_clip=algo.dual_clip,
        log_ratio_clamp=algo.log_ratio_clamp,
        importance_ratio=algo.importance_ratio,
        sequence_clip_low=seq_low,
        sequence_clip_high=seq_high,
        behave_imp_weight_cap=algo.behave_imp_weight_cap,
        behave_correction=algo.behave_correction,
        loss_agg=agg,  # type: ignore[arg-type]
        loss_norm_tokens=(algo.loss_norm_tokens or spec.rollout.max_response_len)
        if agg == "seq-mean-token-sum-norm"
        else None,
        kl_coef=algo.kl_coef,
        kl_estimator=algo.kl_estimator,
        reward_kl_coef=beta if reinforce_pp else None,
        reward_kl_estimator=estimator if reinforce_pp else None,  # type: ignore[arg-type]
        normalize_std=algo.normalize_std,
        group_std=algo.group_std,
        dynamic_sampling=None
        if ds is None
        else DynamicSamplingSettings(
            expected_keep_rate=ds.expected_keep_rate,
            max_draws=ds.max_draws,
            expected_generated_per_kept=round(algo.expected_oversample, 6),
        ),
        overlong=None
        if overlong is None
        else OverlongSettings(
            buffer_len=overlong.buffer_len, penalty=overlong.penalty, filter_truncated=overlong.filter_truncated
        ),
        lr=algo.lr,
        weight_decay=algo.weight_decay,
        grad_clip=algo.grad_clip,
        seed=algo.seed,
    )


def sampling_settings(problem: Problem) -> Sampling:
    """The engines' sampling: lengths, temperature, top-p and speculative decoding."""
    rollout = problem.spec.rollout
    return Sampling(
        max_prompt_len=rollout.max_prompt_len,
        max_response_len=rollout.max_response_len,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        speculative=speculative_config(problem),
        draft_acceptance=rollout.mtp.acceptance_rate if rollout.mtp else None,
    )


def data_settings(spec: Spec) -> DataSettings:
    """The prompts and the reward."""
    data = spec.data
    return DataSettings(
        train=data.train,
        builtin=data.is_builtin,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        domain_key=data.domain_key,
        digits=data.digits,
        shots=data.shots,
        reward=spec.reward.fn,
        reward_timeout_s=spec.reward.timeout_s,
        reward_max_failed_share=spec.reward.max_failed_share,
    )


def lora_settings(spec: Spec, rollout_mode: str) -> LoraSettings | None:
    """The adapters, and how the engines serve them (`rollout_mode`: the search's choice)."""
    if not spec.lora:
        return None
    lora = spec.lora
    return LoraSettings(
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules=lora.target_modules,
        rollout=rollout_mode,  # type: ignore[arg-type]
    )


def distill_settings(spec: Spec, teachers: list[TeacherSettings]) -> DistillSettings | None:
    """Multi-teacher distillation: routing, loss and the teachers the plan serves."""
    if not spec.distill:
        return None
    return DistillSettings(
        routing=spec.distill.routing, loss=spec.distill.loss, coef=spec.distill.coef, teachers=teachers
    )


def estimates(step: Any, target: TargetProfile, sync_bytes_per_worker: float = 0.0) -> Estimates:
    """The chosen layout's step time, split by phase, the bytes each engine worker receives per weight sync, and
    the target's stated uncertainty band."""
    return Estimates(
        step_time_s=r3(step.step_s),
        rollout_s=r3(step.rollout_s),
        train_s=r3(step.train_s),
        weight_sync_s=r3(step.sync_s),
        weight_sync_bytes_per_worker=round(sync_bytes_per_worker),
        switch_s=r3(step.switch_s),
        tokens_per_s=r3(step.tokens_per_s),
        overhead_s=r3(step.overhead_s),
        uncertainty=r3(target.estimate_uncertainty),
        uncertainty_fast=r3(target.uncertainty_below),
    )
