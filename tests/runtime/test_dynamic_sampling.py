"""DAPO in the generate workflow: dynamic sampling drops groups without signal (within the plan's bound, through
the staleness gate), overlong shaping and filtering change rewards and loss masks, the estimator is the plan's."""

from __future__ import annotations

import types

import pytest
from loop_fixtures import fake_loop

from rlc.runtime.prompts import PromptItem
from rlc.runtime.staleness import StalenessGate
from rlc.runtime.workflows.generate import GenerateWorkflow, Group
from rlc.schemas.plan import DynamicSamplingSettings, OverlongSettings

pytest.importorskip("torch")


def _algorithm(**kw):  # type: ignore[no-untyped-def]
    base = {"name": "grpo", "normalize_std": True, "dynamic_sampling": None, "overlong": None}
    return types.SimpleNamespace(**{**base, **kw})


def _workflow(max_staleness: int = 0, max_len: int = 64, **algo):  # type: ignore[no-untyped-def]
    loop = fake_loop(gate=StalenessGate(batch_samples=20 * 2, max_staleness=max_staleness))
    loop.plan.algorithm = _algorithm(**algo)
    loop.plan.sampling.max_response_len = max_len
    loop.staleness = max_staleness
    return GenerateWorkflow(loop)  # type: ignore[arg-type]


def _group(cursor: int, rewards: list[float], outputs: list[list[int]] | None = None) -> Group:
    item = PromptItem(cursor=cursor, prompt="1+1=", answer="2", domain=None, prompt_ids=(5, 6))
    outputs = outputs or [[7, 1] for _ in rewards]
    return Group(item, outputs, [[-0.5] * len(o) for o in outputs], [0] * len(rewards), rewards=list(rewards))


def test_groups_without_signal_are_dropped_and_give_their_slots_back() -> None:
    ds = DynamicSamplingSettings(expected_keep_rate=0.5, max_draws=1.5, expected_generated_per_kept=1.5)
    wf = _workflow(dynamic_sampling=ds)  # 20 prompts a batch: at most 10 dropped per batch
    wf.loop.gate.admit(40)
    wf.keep(_group(0, [1.0, 1.0]))
    wf.keep(_group(1, [0.0, 1.0]))
    assert [g.item.cursor for g in wf.finished] == [1]
    assert wf.loop.gate.submitted == 38  # the dropped group's two samples are admitted again as new prompts
    for cursor in range(2, 14):
        wf.keep(_group(cursor, [0.0, 0.0]))
    assert wf.dropped == 10 and wf.zero_signal_kept == 3  # past the bound, zero-signal groups train
    for cursor in range(14, 30):
        wf.keep(_group(cursor, [1.0, 0.0]))
    groups = wf.next_batch()
    assert groups is not None and len(groups) == 20 and wf.dropped == 0
    _, stats, _ = wf.build_batch(groups)
    assert stats["rollout/generated_per_kept"] == pytest.approx(30 / 20)
    assert stats["rollout/dropped_groups"] == 10 and stats["rollout/zero_signal_kept"] == 3
    # Trained: 3 all-zero groups and 17 half-right ones; dropped: 1 all-one group and 9 all-zero ones.
    assert stats["reward/mean"] == pytest.approx(17 / 40)
    assert stats["reward/generated_mean"] == pytest.approx((17 + 2) / 60)


def test_without_dynamic_sampling_every_group_is_kept() -> None:
    wf = _workflow()
    wf.keep(_group(0, [1.0, 1.0]))
    assert len(wf.finished) == 1
    _, stats, _ = wf.build_batch(wf.finished)
    assert "rollout/generated_per_kept" not in stats


def test_overlong_shaping_and_filtering() -> None:
    """max_response_len 4, buffer 2: a 3-token response loses 0.5, a 4-token one (truncated: no EOS) 1.0 and is
    masked; the 2-token one ends with EOS (id 1) and keeps its reward."""
    overlong = OverlongSettings(buffer_len=2, penalty=1.0, filter_truncated=True)
    wf = _workflow(max_len=4, overlong=overlong, name="dr_grpo")
    wf.group_size = 3
    group = _group(0, [1.0, 1.0, 1.0], outputs=[[7, 1], [7, 8, 1], [7, 8, 9, 10]])
    batch, stats, _ = wf.build_batch([group])
    shaped = [1.0, 0.5, 0.0]  # mean 0.5: dr_grpo advantages are shaped − mean
    assert batch["advantages"] == pytest.approx([s - 0.5 for s in shaped])
    assert batch["loss_mask"][2] == [0, 0, 0, 0, 0, 0] and batch["loss_mask"][1] == [0, 0, 1, 1, 1]
    assert stats["reward/mean"] == 1.0 and stats["reward/shaped_mean"] == pytest.approx(0.5)
    assert stats["rollout/truncated"] == pytest.approx(1 / 3) and stats["rollout/filtered_truncated"] == 1.0


def test_the_plans_estimator_makes_the_advantages() -> None:
    wf = _workflow(name="rloo")  # groups of two: 3 − 1 and 1 − 3 (GRPO would give ±1)
    batch, _, _ = wf.build_batch([_group(0, [3.0, 1.0]), _group(1, [2.0, 2.0])])
    assert batch["advantages"] == pytest.approx([2.0, -2.0, 0.0, 0.0])


def test_explain_and_calibrate_show_the_measured_over_sampling(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A DAPO plan states its expected over-sampling; a run's measured generated-per-kept is shown beside it by
    `rlc explain RUN --measured`, prices the calibration's workload, and the calibration record names the keep rate."""
    from run_dir_fixtures import write_run_dir
    from typer.testing import CliRunner

    from rlc.cli import app
    from rlc.compiler import calibrate
    from rlc.compiler.pipeline import compile_text
    from rlc.schemas.registry import load_target

    spec = """name: ds
target: cpu
model: {name: rlc-tiny}
mode: disaggregated
algorithm: {group_size: 8, batch_prompts: 16, max_staleness: 0, dynamic_sampling: {expected_keep_rate: 0.5}}
data: {train: arithmetic, digits: 1}
reward: {fn: exact_match}
rollout: {max_prompt_len: 8, max_response_len: 4}
"""
    plan = compile_text(spec, "ds.yaml").plan
    assert plan is not None and plan.algorithm.dynamic_sampling is not None
    assert plan.algorithm.dynamic_sampling.expected_generated_per_kept == 2.0
    truth = {"rollout": 0.1, "train": 0.05, "sync": 0.02, "step": 0.2}
    extra = {"rollout/generated_per_kept": 1.25, "response_len/mean": 2.0}
    run = write_run_dir(tmp_path / "run", plan, truth, 7.0 * 128, 12, **extra)
    loaded = calibrate.load_run(run)
    assert loaded.generated_per_kept == 1.25 and loaded.work.oversample == 1.25
    assert calibrate.measured_phases(run)["generated per kept (x)"] == 1.25
    fitted = calibrate.calibrate(load_target("cpu"), [loaded])
    assert "expected_keep_rate 0.8 for this task" in fitted.calibration["run.run.dynamic_sampling"]
    result = CliRunner().invoke(app, ["explain", str(run)], terminal_width=200)
    assert result.exit_code == 0, result.output
    (line,) = [ln for ln in result.output.splitlines() if "generated per kept" in ln]
    assert "2" in line and "1.25" in line
