"""Semantic checks of the algorithm's loss and sampling settings (RLC222): combinations that contradict each
other or the advantage estimator, or that the runtime would silently ignore.

Registered into `rule_registry.RULES` like every other rule.
"""

from __future__ import annotations

from collections.abc import Iterator

from rlc.compiler.diagnostics import Diagnostic
from rlc.compiler.rule_registry import RuleContext, rule, set_off_default

CODE = "RLC222"


@rule(CODE, "Algorithm settings must fit the estimator and each other")
def check_algorithm(ctx: RuleContext) -> Iterator[Diagnostic]:
    spec = ctx.problem.spec
    algo = spec.algorithm
    yield from _estimator(ctx)
    yield from _clipping(ctx)
    yield from _correction_and_aggregation(ctx)
    if algo.dynamic_sampling is not None:
        yield from _dynamic_sampling(ctx)
    if algo.overlong is not None:
        ov = algo.overlong
        if ov.buffer_len >= spec.rollout.max_response_len:
            yield ctx.diag(
                CODE,
                "algorithm.overlong.buffer_len",
                f"overlong buffer_len {ov.buffer_len} >= rollout.max_response_len {spec.rollout.max_response_len}: "
                "every response, however short, would be punished",
                f"use a buffer below max_response_len (DAPO: 4096 of 20480, i.e. {spec.rollout.max_response_len // 5})",
            )
        if ov.buffer_len == 0 and not ov.filter_truncated:
            yield ctx.diag(
                CODE,
                "algorithm.overlong",
                "the overlong block does nothing: buffer_len 0 (no soft punishment) and filter_truncated false",
                "set buffer_len > 0, filter_truncated: true, or drop the block",
                "warning",
            )
    if spec.rollout.agent is not None:
        yield from _set_keys(
            ctx,
            ("dynamic_sampling", "overlong"),
            "algorithm.{key} applies to single-completion rollouts; agent rollouts do not implement it",
            "drop algorithm.{key}, or rollout.agent",
        )


def _set_keys(ctx: RuleContext, keys: tuple[str, ...], message: str, fix: str) -> Iterator[Diagnostic]:
    """An error for each of ``keys`` the algorithm section sets; ``{key}`` in the texts names it."""
    algo = ctx.problem.spec.algorithm
    for key in keys:
        if getattr(algo, key) is not None:
            yield ctx.diag(CODE, f"algorithm.{key}", message.format(key=key), fix.format(key=key))


def _estimator(ctx: RuleContext) -> Iterator[Diagnostic]:
    algo = ctx.problem.spec.algorithm
    yield from _reward_kl(ctx)
    if "group_std" in algo.model_fields_set and (algo.name != "grpo" or not algo.normalize_std):
        yield ctx.diag(
            CODE,
            "algorithm.group_std",
            f"group_std is the std grpo divides by; {algo.name}"
            + (" with normalize_std false" if algo.name == "grpo" else "")
            + " divides by none, so it has no effect",
            "drop group_std",
            "warning",
        )
    if algo.name != "grpo" and "normalize_std" in algo.model_fields_set:
        if algo.name == "dr_grpo" and algo.normalize_std:
            yield ctx.diag(
                CODE,
                "algorithm.normalize_std",
                "normalize_std: true with name dr_grpo: Dr. GRPO is GRPO without the std division",
                "drop normalize_std, or use name: grpo",
            )
        elif algo.name != "dr_grpo":
            yield ctx.diag(
                CODE,
                "algorithm.normalize_std",
                f"normalize_std applies to name grpo only; {algo.name} ignores it",
                "drop normalize_std",
                "warning",
            )


def _reward_kl(ctx: RuleContext) -> Iterator[Diagnostic]:
    algo = ctx.problem.spec.algorithm
    if algo.name != "reinforce_pp":
        yield from _set_keys(
            ctx,
            ("reward_kl_coef", "reward_kl_estimator"),
            f"{{key}} shapes reinforce_pp's per-token KL reward; {algo.name} has no KL in its reward",
            "use name: reinforce_pp, or kl_coef for a KL loss term, or drop {key}",
        )
    elif algo.reward_kl_coef is None:
        yield ctx.diag(
            CODE,
            "algorithm.name",
            "reinforce_pp is REINFORCE++ as published: a per-token KL penalty to a reference policy in the reward "
            f"(reward_kl_coef {algo.reward_kl[0]:g}, {algo.reward_kl[1]}), so the run holds a frozen copy of the "
            "policy's weights as its reference (more memory per trainer device) and scores every batch under it; "
            "earlier rlc versions meant the batch-normalised reward by the name, now reinforce_pp_batchnorm",
            "set reward_kl_coef to state β, or name: reinforce_pp_batchnorm for the former meaning (no reference)",
            "warning",
        )


def _clipping(ctx: RuleContext) -> Iterator[Diagnostic]:
    algo = ctx.problem.spec.algorithm
    if algo.clip_low is not None and set_off_default(algo, "clip"):
        yield ctx.diag(
            CODE,
            "algorithm.clip_low",
            f"both clip ({algo.clip:g}) and clip_low ({algo.clip_low:g}) set the token ratio's ε_low",
            "keep one of them",
        )
    low, high = algo.clip_range
    if algo.importance_ratio == "sequence":
        for key in ("clip_low", "clip_high"):
            if getattr(algo, key) is not None:
                yield ctx.diag(
                    CODE,
                    f"algorithm.{key}",
                    f"{key} clips the token ratio, but importance_ratio is sequence (GSPO): the sequence ratio is "
                    "clipped by sequence_clip_low/sequence_clip_high instead",
                    f"use sequence_{key} (GSPO: 3e-4 / 4e-4), or importance_ratio: token",
                )
        if set_off_default(algo, "clip"):
            yield ctx.diag(
                CODE,
                "algorithm.clip",
                f"clip {algo.clip:g} clips the token ratio, which importance_ratio sequence (GSPO) does not use",
                "use sequence_clip_low/sequence_clip_high (GSPO: 3e-4 / 4e-4)",
            )
        seq_low, seq_high = algo.sequence_clip_range
        if seq_low > 0.05 or seq_high > 0.05:
            yield ctx.diag(
                CODE,
                "algorithm.sequence_clip_high" if seq_high > 0.05 else "algorithm.sequence_clip_low",
                f"sequence clip range ({seq_low:g}, {seq_high:g}) is token-sized: the length-normalised sequence "
                "ratio stays within about 1e-3 of 1, so it would almost never clip",
                "GSPO uses sequence_clip_low 3e-4 and sequence_clip_high 4e-4",
                "warning",
            )
    else:
        for key in ("sequence_clip_low", "sequence_clip_high"):
            if getattr(algo, key) is not None:
                yield ctx.diag(
                    CODE,
                    f"algorithm.{key}",
                    f"{key} clips GSPO's sequence ratio, but importance_ratio is token",
                    "set importance_ratio: sequence, or drop it",
                )
        if high < low:
            yield ctx.diag(
                CODE,
                "algorithm.clip_high",
                f"clip_high {high:g} < ε_low {low:g}: the trust region lets ratios fall further than rise, the "
                "opposite of DAPO's clip-higher",
                "use clip_high >= clip (DAPO: 0.28 with 0.2)",
                "warning",
            )


def _correction_and_aggregation(ctx: RuleContext) -> Iterator[Diagnostic]:
    algo = ctx.problem.spec.algorithm
    if not algo.decoupled_loss and set_off_default(algo, "behave_correction"):
        yield ctx.diag(
            CODE,
            "algorithm.behave_correction",
            f"behave_correction {algo.behave_correction} corrects the decoupled loss' behaviour weight, but "
            "decoupled_loss is false (the ratio is taken against the behaviour policy itself: no weight to correct)",
            "set decoupled_loss: true, or drop behave_correction",
        )
    agg = algo.aggregation
    if algo.loss_norm_tokens is not None and agg != "seq-mean-token-sum-norm":
        yield ctx.diag(
            CODE,
            "algorithm.loss_norm_tokens",
            f"loss_norm_tokens is the constant of loss_agg seq-mean-token-sum-norm, but the aggregation is {agg}",
            "set loss_agg: seq-mean-token-sum-norm, or drop loss_norm_tokens",
        )
    if algo.importance_ratio == "sequence" and agg in ("token-mean", "seq-mean-token-sum"):
        yield ctx.diag(
            CODE,
            "algorithm.loss_agg",
            f"loss_agg {agg} with importance_ratio sequence: GSPO's objective averages each response's sequence "
            "ratio once (seq-mean-token-mean); this weights long responses more",
            "use loss_agg: seq-mean-token-mean (the default with importance_ratio sequence)",
            "warning",
        )


def _dynamic_sampling(ctx: RuleContext) -> Iterator[Diagnostic]:
    algo = ctx.problem.spec.algorithm
    ds = algo.dynamic_sampling
    assert ds is not None
    if algo.group_size < 2:
        yield ctx.diag(
            CODE,
            "algorithm.dynamic_sampling",
            "dynamic_sampling with group_size 1: every one-sample group has all-equal rewards, so every group "
            "would be dropped",
            "use group_size >= 2, or drop dynamic_sampling",
        )
    elif algo.name in ("reinforce_pp", "reinforce_pp_batchnorm"):
        yield ctx.diag(
            CODE,
            "algorithm.dynamic_sampling",
            f"dynamic_sampling with {algo.name}: its baseline is the batch, so a group whose rewards are all equal "
            "still has non-zero advantages, and dropping it throws signal away",
            "use reinforce_pp_baseline or a group estimator, or drop dynamic_sampling",
            "warning",
        )
    if 1.0 / ds.expected_keep_rate > ds.max_draws:
        yield ctx.diag(
            CODE,
            "algorithm.dynamic_sampling.max_draws",
            f"expected_keep_rate {ds.expected_keep_rate:g} needs about {1 / ds.expected_keep_rate:.2f} groups per "
            f"kept one, more than max_draws {ds.max_draws:g}: most steps would train zero-signal groups",
            f"raise max_draws to at least {1 / ds.expected_keep_rate:.2f}, or check the keep rate",
            "warning",
        )
