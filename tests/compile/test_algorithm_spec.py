"""The algorithm's loss and sampling keys: defaults keep old plans, diagnostics catch nonsense, the plan carries
every choice resolved (estimator, clip range, GSPO, off-policy correction, aggregation, DAPO sampling)."""

from __future__ import annotations

import textwrap

import pytest

from rlc.compiler.validate import check_text
from rlc.runtime.algo.policy import PolicyLoss, aggregation_weights

BASE = "name: t\ntarget: cpu\nmodel: {name: rlc-tiny}\ndata: {train: arithmetic}\n"
BASE += "rollout: {max_prompt_len: 8, max_response_len: 16}\n"


def report(algorithm: str):
    return check_text(textwrap.dedent(BASE + f"algorithm: {algorithm}\n"), "spec.yaml").report


def found(algorithm: str, code: str = "RLC222") -> list[tuple[str, str]]:
    return [(d.path, d.severity) for d in report(algorithm).diagnostics if d.code == code]


@pytest.mark.parametrize(
    ("algorithm", "expected"),
    [
        ("{importance_ratio: sequence, clip_low: 0.2}", [("algorithm.clip_low", "error")]),
        ("{importance_ratio: sequence, clip: 0.3}", [("algorithm.clip", "error")]),
        ("{sequence_clip_low: 0.001}", [("algorithm.sequence_clip_low", "error")]),
        ("{importance_ratio: sequence, sequence_clip_high: 0.2}", [("algorithm.sequence_clip_high", "warning")]),
        ("{importance_ratio: sequence, loss_agg: token-mean}", [("algorithm.loss_agg", "warning")]),
        ("{clip: 0.3, clip_low: 0.2}", [("algorithm.clip_low", "error")]),
        ("{clip_high: 0.1}", [("algorithm.clip_high", "warning")]),
        ("{decoupled_loss: false, behave_correction: token_truncate}", [("algorithm.behave_correction", "error")]),
        ("{loss_norm_tokens: 64}", [("algorithm.loss_norm_tokens", "error")]),
        ("{name: dr_grpo, normalize_std: true}", [("algorithm.normalize_std", "error")]),
        ("{name: rloo, normalize_std: false}", [("algorithm.normalize_std", "warning")]),
        (
            "{group_size: 1, name: reinforce_pp_batchnorm, dynamic_sampling: {}}",
            [("algorithm.dynamic_sampling", "error")],
        ),
        ("{name: reinforce_pp_batchnorm, dynamic_sampling: {}}", [("algorithm.dynamic_sampling", "warning")]),
        (
            "{name: reinforce_pp, reward_kl_coef: 0.01, dynamic_sampling: {}}",
            [("algorithm.dynamic_sampling", "warning")],
        ),
        # reinforce_pp changed meaning: a spec that names it without stating β is warned of the rename and the
        # reference copy it now costs.
        ("{name: reinforce_pp}", [("algorithm.name", "warning")]),
        ("{reward_kl_coef: 0.1}", [("algorithm.reward_kl_coef", "error")]),
        ("{name: reinforce_pp_batchnorm, reward_kl_estimator: k1}", [("algorithm.reward_kl_estimator", "error")]),
        ("{name: rloo, group_std: sample}", [("algorithm.group_std", "warning")]),
        ("{normalize_std: false, group_std: sample}", [("algorithm.group_std", "warning")]),
        (
            "{dynamic_sampling: {expected_keep_rate: 0.2, max_draws: 2}}",
            [("algorithm.dynamic_sampling.max_draws", "warning")],
        ),
        ("{overlong: {buffer_len: 16}}", [("algorithm.overlong.buffer_len", "error")]),
        ("{overlong: {}}", [("algorithm.overlong", "warning")]),
    ],
)
def test_nonsense_combinations_are_reported(algorithm: str, expected: list[tuple[str, str]]) -> None:
    assert found(algorithm) == expected


@pytest.mark.parametrize(
    "algorithm",
    [
        "{name: dr_grpo}",
        "{name: rloo}",
        "{name: reinforce_pp_baseline}",
        "{name: reinforce_pp_batchnorm}",
        "{name: reinforce_pp, reward_kl_coef: 0.05, reward_kl_estimator: k1}",
        "{group_std: sample}",
        "{dual_clip: null, log_ratio_clamp: null}",
        "{importance_ratio: sequence, sequence_clip_low: 0.0003, sequence_clip_high: 0.0004}",
        "{clip_low: 0.2, clip_high: 0.28, dual_clip: 3.0, behave_correction: sequence_mask}",
        "{dynamic_sampling: {expected_keep_rate: 0.5}, overlong: {buffer_len: 4, filter_truncated: true}}",
        "{clip: 0.2, clip_low: 0.2}",  # the default spelled out (as spec.resolved.yaml does) is no conflict
    ],
)
def test_sensible_settings_pass_clean(algorithm: str) -> None:
    r = report(algorithm)
    assert r.ok and not [d for d in r.diagnostics if d.code in ("RLC222", "RLC216")], r.diagnostics


def test_group_baselines_need_two_samples_but_reinforce_pp_does_not() -> None:
    """RLC216: rloo and reinforce_pp_baseline have no baseline in a group of one; reinforce_pp's is the batch."""
    assert found("{name: rloo, group_size: 1}", "RLC216") == [("algorithm.group_size", "error")]
    assert found("{name: reinforce_pp_baseline, group_size: 1}", "RLC216") == [("algorithm.group_size", "error")]
    assert found("{name: reinforce_pp, group_size: 1}", "RLC216") == []
    assert found("{name: reinforce_pp_batchnorm, group_size: 1}", "RLC216") == []


def test_out_of_range_values_are_diagnostics_not_tracebacks() -> None:
    for bad, path in [
        ("{dual_clip: 1.0}", "algorithm.dual_clip"),
        ("{name: dapo}", "algorithm.name"),
        ("{loss_agg: seq-mean}", "algorithm.loss_agg"),
        ("{dynamic_sampling: {expected_keep_rate: 0}}", "algorithm.dynamic_sampling.expected_keep_rate"),
        ("{behave_correction: geometric}", "algorithm.behave_correction"),
    ]:
        r = report(bad)
        assert not r.ok and any(d.path == path and d.code == "RLC104" for d in r.diagnostics), (bad, r.diagnostics)


def test_policy_loss_from_plan_resolves_every_choice() -> None:
    from rlc.compiler.plan_sections import algorithm_settings
    from rlc.schemas.spec import Spec

    def settings(algorithm: dict):
        spec = Spec.model_validate(
            {
                "name": "t",
                "model": {"name": "rlc-tiny"},
                "data": {"train": "arithmetic"},
                "rollout": {"max_response_len": 16},
                "algorithm": algorithm,
            }
        )
        return algorithm_settings(spec)

    old = settings({})
    assert (old.clip, old.clip_high, old.loss_agg, old.behave_correction) == (0.2, 0.2, "token-mean", "token_mask")
    assert old.dynamic_sampling is None and old.overlong is None and old.importance_ratio == "token"
    assert PolicyLoss.from_plan(old, 16) == PolicyLoss(clip_low=0.2, clip_high=0.2, behave_imp_weight_cap=5.0)
    # Bounded by default, and the plan says so; the spec can turn either bound off.
    assert (old.dual_clip, old.log_ratio_clamp, old.group_std) == (3.0, 20.0, "population")
    assert (old.reward_kl_coef, old.reward_kl_estimator, old.needs_reference) == (None, None, False)
    off = PolicyLoss.from_plan(settings({"dual_clip": None, "log_ratio_clamp": None}), 16)
    assert (off.dual_clip, off.log_ratio_clamp) == (None, None)
    assert settings({"group_std": "sample"}).group_std == "sample"

    dr = settings({"name": "dr_grpo"})
    assert dr.loss_agg == "seq-mean-token-sum-norm" and dr.loss_norm_tokens == 16
    assert PolicyLoss.from_plan(dr, 16).agg_norm_tokens == 16

    gspo = settings({"importance_ratio": "sequence"})
    policy = PolicyLoss.from_plan(gspo, 16)
    assert (policy.ratio, policy.clip_low, policy.high, policy.agg) == ("sequence", 3e-4, 4e-4, "seq-mean-token-mean")

    dapo = settings({"clip_high": 0.28, "dynamic_sampling": {"expected_keep_rate": 0.4, "max_draws": 2.0}})
    assert dapo.clip == 0.2 and dapo.clip_high == 0.28
    assert dapo.dynamic_sampling is not None and dapo.dynamic_sampling.expected_generated_per_kept == 2.0


def test_dynamic_sampling_is_priced_in_the_step_time() -> None:
    """The plan's rollout estimate generates the expected over-sampling: more groups, a longer rollout."""
    from rlc.compiler.planner import build_plan

    def rollout_s(extra: str) -> float:
        text = BASE + "mode: disaggregated\nalgorithm: {group_size: 8, batch_prompts: 16" + extra + "}\n"
        checked = check_text(text, "spec.yaml")
        plan, _ = build_plan(checked.problem, checked.lines, "spec.yaml")
        return plan.estimates.rollout_s

    plain, dapo = rollout_s(""), rollout_s(", dynamic_sampling: {expected_keep_rate: 0.5}")
    assert dapo > 1.5 * plain


def test_aggregation_weights_formulas() -> None:
    counts = [3, 1, 0, 2]  # the third sequence has no loss token
    assert aggregation_weights(counts, "token-mean", 12, 6, None) == [1 / 12] * 4
    assert aggregation_weights(counts, "seq-mean-token-sum", 12, 6, None) == [1 / 6] * 4
    assert aggregation_weights(counts, "seq-mean-token-mean", 12, 6, None) == [1 / 18, 1 / 6, 0.0, 1 / 12]
    assert aggregation_weights(counts, "seq-mean-token-sum-norm", 12, 6, 8) == [1 / 48] * 4
    with pytest.raises(ValueError, match="constant normaliser"):
        aggregation_weights(counts, "seq-mean-token-sum-norm", 12, 6, None)


def test_a_sequence_ratio_with_context_parallelism_is_a_runtime_gap() -> None:
    """GSPO's ratio needs whole sequences, which CP splits over ranks: `rlc run` must refuse such a plan."""
    from rlc.compiler.planner import build_plan

    def gaps(algorithm: str) -> list[str]:
        text = (
            "name: t\ntarget: a2\nmodel: {name: qwen3-8b, path: /m}\ndata: {train: arithmetic}\n"
            f"algorithm: {algorithm}\nplacement: {{train: {{devices: 4, cp: 2}}}}\n"
        )
        checked = check_text(text, "spec.yaml")
        assert checked.problem is not None, checked.report.diagnostics
        plan, _ = build_plan(checked.problem, checked.lines, "spec.yaml")
        return [g for g in plan.runtime_gaps if "sequence-level" in g]

    assert gaps("{importance_ratio: sequence}") and gaps("{behave_correction: sequence_truncate}")
    assert gaps("{behave_correction: token_truncate}") == []


def test_reinforce_pp_states_its_kl_reward_and_plans_a_reference() -> None:
    """The plan names β and the estimator, and places (and prices) the reference policy the advantages need."""
    from rlc.compiler.planner import build_plan

    def plan(algorithm: str):  # type: ignore[no-untyped-def]
        checked = check_text(BASE + f"mode: disaggregated\nalgorithm: {algorithm}\n", "spec.yaml")
        assert checked.problem is not None, checked.report.diagnostics
        return build_plan(checked.problem, checked.lines, "spec.yaml")[0]

    pp = plan("{name: reinforce_pp}")
    algo = pp.algorithm
    assert (algo.name, algo.reward_kl_coef, algo.reward_kl_estimator, algo.needs_reference) == (
        "reinforce_pp",
        0.01,
        "k1",
        True,
    )
    actor = next(r for r in pp.roles if r.name == "actor")
    assert actor.ray is not None and actor.ray.reference_resources
    assert "reference" in actor.memory.items
    plain = plan("{name: reinforce_pp, reward_kl_coef: 0}")
    assert not plain.algorithm.needs_reference
    plain_actor = next(r for r in plain.roles if r.name == "actor")
    assert plain_actor.ray is not None and plain_actor.ray.reference_resources is None
    assert pp.estimates.train_s > plain.estimates.train_s  # one more forward pass per step


def test_older_plans_keep_their_meaning() -> None:
    """A plan written before these fields: no dual clip, no log-ratio clamp, and reinforce_pp the batch-normalised
    reward it then meant (now reinforce_pp_batchnorm)."""
    from rlc.schemas.plan import AlgorithmSettings

    older = {
        "name": "reinforce_pp",
        "decoupled_loss": True,
        "clip": 0.2,
        "behave_imp_weight_cap": 5.0,
        "kl_coef": 0.0,
        "kl_estimator": "k3",
        "normalize_std": True,
        "lr": 1e-6,
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        "seed": 0,
    }
    algo = AlgorithmSettings.model_validate(older)
    assert algo.name == "reinforce_pp_batchnorm" and not algo.needs_reference and algo.group_std == "population"
    policy = PolicyLoss.from_plan(algo, 16)
    assert (policy.dual_clip, policy.log_ratio_clamp) == (None, None)
    current = AlgorithmSettings.model_validate({**older, "reward_kl_coef": 0.01, "reward_kl_estimator": "k1"})
    assert current.name == "reinforce_pp" and current.needs_reference
