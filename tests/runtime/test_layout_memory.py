"""The planner's per-device trainer estimate against the peak a trainer rank really reaches, on the cpu target.

For four layouts of rlc-tiny-long (CP 1, Ulysses CP 2, TP 2, full recompute) and two of the tiny MoE model
(EP 2, and plain FSDP2 over both ranks) the spec is compiled by the
planner, the trainer ranks are started as Ray actors from the plan's layout, settings and environment (as
`rlc run` starts them), and one decoupled-PPO step runs on micro-batches filled to the plan's token budget.
The measured train-phase peak (``memory_probe``: resident set above the pre-load baseline) must be within 25%
of the plan's estimate.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow

BUDGET = 12288  # tokens per micro-batch; two 6,144-token sequences fill it
SPEC = """\
name: layout-memory
target: cpu
cluster: {{devices_per_node: 3}}
model: {{name: rlc-tiny-long}}
mode: disaggregated
algorithm: {{group_size: 2, batch_prompts: 2, max_staleness: 0}}
data: {{train: arithmetic}}
rollout: {{max_prompt_len: 6140, max_response_len: 4}}
train: {{micro_batch_tokens: {budget}, logprob_chunk_tokens: 1024}}
placement:
  train: {pins}
"""
LAYOUTS = {
    "cp1": "{devices: 1, cp: 1, tp: 1, recompute: none}",
    "cp2-ulysses": "{devices: 2, cp: 2, tp: 1, recompute: none}",
    "tp2": "{devices: 2, cp: 1, tp: 2, recompute: none}",
    "recompute-full": "{devices: 1, cp: 1, tp: 1, recompute: full}",
}


def _plan(pins: str):  # type: ignore[no-untyped-def]
    return _plan_of(SPEC.format(budget=BUDGET, pins=pins))


def _plan_of(spec: str):  # type: ignore[no-untyped-def]
    from rlc.compiler.planner import build_plan
    from rlc.compiler.validate import check_text

    checked = check_text(textwrap.dedent(spec), "spec.yaml")
    assert checked.problem is not None, checked.report.diagnostics
    plan, diags = build_plan(checked.problem, checked.lines, "spec.yaml")
    assert plan is not None, [d.message for d in diags]
    return plan


def _batch(dp: int, budget: int = BUDGET, micro_batches: int = 1) -> dict:
    """Per data-parallel share, `micro_batches` micro-batches of sequences that fill each exactly: two of half the
    budget, or 512-token ones (the tiny MoE model's positions) for budgets below rlc-tiny-long's."""
    g = torch.Generator().manual_seed(0)
    per = max(2, budget // 512) if budget < BUDGET else 2
    n = budget // per
    count = per * dp * micro_batches
    return {
        "input_ids": [torch.randint(4, 19, (n,), generator=g).tolist() for _ in range(count)],
        "loss_mask": [[0] * (n - 4) + [1] * 4 for _ in range(count)],
        "advantages": [1.0, -1.0] * (count // 2),
    }


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlc.runtime.tasks.model_builder import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("long") / "model", seed=0, max_positions=8192)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_trainer_peak_is_within_a_quarter_of_the_plan(name: str, long_model: Path, ray_cluster) -> None:  # type: ignore[no-untyped-def]
    plan = _plan(LAYOUTS[name])
    _assert_peak_as_planned(name, plan, long_model, BUDGET)


#: The tiny MoE model under expert parallelism: its 512 positions fill a 2,048-token budget with four sequences.
MOE_BUDGET = 2048
MOE_LAYOUTS = {
    "moe-ep2": "{devices: 2, ep: 2, recompute: none}",
    "moe-dp2": "{devices: 2, ep: 1, recompute: none}",
    "moe-pp2": "{devices: 2, pp: 2, recompute: none}",
}


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlc.runtime.tasks.model_builder import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe") / "model", seed=0, architecture="moe")


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_moe_trainer_peak_is_within_a_quarter_of_the_plan(name: str, moe_model: Path, ray_cluster) -> None:  # type: ignore[no-untyped-def]
    spec = (
        SPEC.format(budget=MOE_BUDGET, pins=MOE_LAYOUTS[name])
        .replace("rlc-tiny-long", "rlc-tiny-moe")
        .replace("max_prompt_len: 6140", "max_prompt_len: 508")
    )
    _assert_peak_as_planned(name, _plan_of(spec), moe_model, MOE_BUDGET)


def _assert_peak_as_planned(name: str, plan, model_dir: Path, budget: int) -> None:  # type: ignore[no-untyped-def]
    from rlc.runtime.role_actors import train_config
    from rlc.runtime.train.group import TrainerGroup

    role = plan.role("actor")
    layout = role.layout
    assert layout is not None
    # Ray actors with the plan's environment and settings, as `rlc run` starts them (no engines needed here, and
    # no weight-sync group: its sender would load the group's library, the plan's `sync_group` item left out below).
    group = TrainerGroup(
        layout.world_size,
        str(model_dir),
        "cpu",
        {**train_config(plan, role), "weight_sync": None},
        layout=layout,
        num_cpus=1,
        env={**plan.env, **role.env},
    )
    try:
        # Pipeline stages: as many micro-batches as stages, so the first holds pp in flight (1F1B), as planned.
        batch = _batch(layout.dp, budget, micro_batches=layout.pp)
        lp = group.compute_logprobs(batch)
        group.train_step({**batch, "behaviour_logprobs": lp, "proximal_logprobs": lp}, {"clip": 0.2})
        built = group.built_layouts()
    finally:
        group.shutdown()
    peaks = [rank["memory"]["peak_gib"]["train"] for rank in built]
    # This harness forms no weight-sync group, so the one item it does not exercise is left out.
    predicted = role.memory.total_gib - role.memory.items.get("sync_group", 0.0)
    ratio = max(peaks) / predicted
    print(f"{name}: {layout.summary()} predicted {predicted:.3f} GiB, measured {max(peaks):.3f} ({ratio:.2f}x)")
    assert 0.75 <= ratio <= 1.25, (name, predicted, peaks, role.memory.items)
