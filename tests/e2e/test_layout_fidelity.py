"""The run executes the plan: the dry run shows the plan's layout, a real run builds it, and what the runtime
cannot execute is refused before anything starts.

Fast tests compile every cpu example and pinned cpu layouts (CP 2 of both kinds, TP 2, offload, bf16) and read
`rlc run --dry-run`; slow ones run the pinned layouts for two steps and the long-context example, whose CP 2
the planner chooses by itself, and compare RUN/layout.json with the plan.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from paths import REPO
from typer.testing import CliRunner

from rlc.cli import app
from rlc.compiler.manifest import load_plan

CPU_EXAMPLES = sorted(p.stem for p in (REPO / "examples").glob("*.yaml") if p.stem.startswith(("cpu-", "quickstart")))
PINNED_BASE = """\
name: pinned-{name}
target: cpu
cluster: {{devices_per_node: 3}}
model: {{name: rlc-tiny}}
mode: disaggregated
algorithm: {{group_size: 4, batch_prompts: 4, max_staleness: 0, lr: 5.0e-4, steps: 2}}
data: {{train: arithmetic}}
reward: {{fn: exact_match}}
rollout: {{max_prompt_len: 8, max_response_len: 4}}
train: {{micro_batch_tokens: 256{train}}}
placement:
  train: {pins}
output: {{checkpoint_every: 100}}
"""
PINNED = {
    "cp2-ulysses-bf16": ("{devices: 2, cp: 2, cp_kind: ulysses}", ", precision: bfloat16"),
    "cp2-ring-offload-recompute": (
        "{devices: 2, cp: 2, cp_kind: ring, recompute: full, offload: {params: true, optimizer: true}}",
        "",
    ),
    "tp2": ("{devices: 2, tp: 2}", ""),
}
runner = CliRunner()


def _pinned_text(name: str) -> str:
    pins, train = PINNED[name]
    return PINNED_BASE.format(name=name, pins=pins, train=train)


def _compile(spec: Path, out: Path, *sets: str) -> Path:
    args = ["compile", str(spec), "-o", str(out)]
    for item in sets:
        args += ["--set", item]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


def _spec_for(name: str, tmp_path: Path) -> Path:
    if name in PINNED:
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(_pinned_text(name))
        return spec
    return REPO / "examples" / f"{name}.yaml"


@pytest.mark.parametrize("name", CPU_EXAMPLES + list(PINNED))
def test_dry_run_shows_the_plans_layout(name: str, tmp_path: Path) -> None:
    plan_dir = _compile(_spec_for(name, tmp_path), tmp_path / "plan", f"output.dir={tmp_path / 'run'}")
    plan = load_plan(plan_dir)
    layout = plan.roles_of("train")[0].layout
    assert layout is not None
    result = runner.invoke(app, ["run", str(plan_dir), "--dry-run", "--format", "json"])
    assert result.exit_code == 0, result.output
    request = json.loads(result.output)
    ranks = [a for a in request["actors"] if a["kind"] == "trainer"]
    assert [a["detail"]["rank"] for a in ranks] == list(range(layout.world_size))
    assert [a["detail"]["mesh"] for a in ranks] == [layout.coordinates(r) for r in range(layout.world_size)]
    assert {a["detail"]["layout"] for a in ranks} == {layout.summary()}
    groups = {g["name"]: g["bundles"] for g in request["placement_groups"]}
    for role in plan.roles:
        # on several nodes each bundle also asks for its plan node (`rlc_node_n<k>`)
        asked = groups[role.ray.placement_group]
        pins = [[k for k in b if k.startswith("rlc_node_n")] for b in asked]
        assert all(len(p) == (1 if plan.cluster.nodes > 1 else 0) for p in pins)
        assert [{k: v for k, v in b.items() if not k.startswith("rlc_node_n")} for b in asked] == role.ray.bundles
        mine = [a for a in request["actors"] if a["role"] == role.name and a["kind"] != "reference"]
        assert [a["bundle_index"] for a in mine] == role.ray.bundle_indices
        assert all(a["resources"] == role.ray.actor_resources for a in mine)
    assert request["refusals"] == [] and request["weight_sync"]["method"]
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
    text = runner.invoke(app, ["run", str(plan_dir), "--dry-run"])
    assert text.exit_code == 0 and f"trainer layout: {layout.summary()}" in text.output
    assert "nothing started (dry run)" in text.output


def test_dry_run_shows_the_plans_optimizer_steps(tmp_path: Path) -> None:
    """`algorithm.minibatches` is part of what the dry run says will execute, in text and JSON."""
    spec = _spec_for("quickstart", tmp_path)
    plan_dir = _compile(spec, tmp_path / "plan", f"output.dir={tmp_path / 'run'}", "algorithm.minibatches=4")
    request = json.loads(runner.invoke(app, ["run", str(plan_dir), "--dry-run", "--format", "json"]).output)
    assert request["optimizer_steps"] == 4
    text = runner.invoke(app, ["run", str(plan_dir), "--dry-run"]).output
    assert "; 4 optimizer steps per training step" in text


def test_pinned_layouts_are_what_the_plan_states(tmp_path: Path) -> None:
    """The pins reach the plan's layout unchanged (the planner fills in only what is not pinned)."""
    expected = {
        "cp2-ulysses-bf16": ("ulysses", 2, 1, "bfloat16", False, "none"),
        "cp2-ring-offload-recompute": ("ring", 2, 1, "float32", True, "full"),
        "tp2": ("ulysses", 1, 2, "float32", False, "none"),
    }
    for name, (kind, cp, tp, dtype, offload, recompute) in expected.items():
        plan = load_plan(_compile(_spec_for(name, tmp_path), tmp_path / name, f"output.dir={tmp_path / name}-run"))
        lay = plan.roles_of("train")[0].layout
        assert (lay.cp_kind, lay.cp, lay.tp, lay.precision.compute_dtype) == (kind, cp, tp, dtype), name
        assert (lay.offload_params, lay.offload_optimizer, lay.recompute) == (offload, offload, recompute), name


def test_a_plan_edited_to_other_degrees_is_caught_by_the_built_layout_check() -> None:
    """`rlc run` compares what the ranks built with the plan: a rank reporting other degrees is a mismatch."""
    from plan_fixtures import cpu_plan

    from rlc.runtime.launch import check_built_layout

    plan = cpu_plan()
    built = {
        "coords": {"pp": 0, "dp": 0, "cp": 0, "tp": 0},
        "mesh": {"dp": 1, "cp": 1, "tp": 1},
        "tp": 1,
        "ep": 1,
        "pp": 1,
        "shard_group": 1,
        "cp_kind": None,
        "param_dtype": "float32",
        "compute_dtype": "float32",
        "reduce_dtype": "float32",
        "recompute": "none",
        "offload_params": False,
        "offload_optimizer": False,
    }
    assert check_built_layout(plan, [{"built": built}]) == []
    wrong = check_built_layout(plan, [{"built": {**built, "compute_dtype": "bfloat16", "tp": 2}}])
    assert len(wrong) == 2 and any("compute_dtype is 'bfloat16', the plan says 'float32'" in w for w in wrong)


# ------------------------------------------------------------------ real runs (slow)


def _run(plan_dir: Path, run_dir: Path) -> tuple[object, list[dict]]:
    from rlc.runtime.launch import run_plan

    plan = load_plan(plan_dir)
    steps = run_plan(plan, run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert steps == plan.schedule.steps == len(rows)
    return plan, rows


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PINNED))
def test_short_run_builds_the_pinned_layout(name: str, tmp_path: Path) -> None:
    from layout_record import assert_layout_as_planned

    run_dir = tmp_path / "run"
    plan, rows = _run(_compile(_spec_for(name, tmp_path), tmp_path / "plan", f"output.dir={run_dir}"), run_dir)
    assert_layout_as_planned(run_dir, plan)
    # The engine runs fp32 on cpu: an fp32 trainer agrees with it closely, a bf16 one within bf16's rounding.
    gap = 0.5 if "bf16" in name else 1e-3
    assert all(r["logprob_gap/max"] < gap for r in rows), [r["logprob_gap/max"] for r in rows]


@pytest.mark.slow
def test_long_context_run_chooses_cp2_and_completes(tmp_path: Path) -> None:
    """Under 0.25 GiB per device one device cannot hold a 7K-token micro-batch's activations: the planner splits
    it over two (Ulysses CP 2) by itself, and the run agrees with vLLM on log-probs and with its own estimate."""
    from layout_record import assert_layout_as_planned

    spec = REPO / "examples" / "cpu-long-context.yaml"
    pinned = tmp_path / "cp1.yaml"
    pinned.write_text(spec.read_text() + textwrap.dedent("placement: {train: {backend: fsdp2, cp: 1, tp: 1}}\n"))
    refused = runner.invoke(app, ["compile", str(pinned), "-o", str(tmp_path / "cp1")])
    assert refused.exit_code == 1 and "RLC301" in refused.output  # the same layout without CP does not fit
    run_dir = tmp_path / "run"
    plan_dir = _compile(spec, tmp_path / "plan", f"output.dir={run_dir}", "algorithm.steps=2")
    plan = load_plan(plan_dir)
    layout = plan.roles_of("train")[0].layout
    assert (layout.cp, layout.cp_kind, layout.world_size) == (2, "ulysses", 2)
    plan, rows = _run(plan_dir, run_dir)
    record = assert_layout_as_planned(run_dir, plan)
    assert all(r["train/tokens"] > 40_000 for r in rows)  # 8 sequences of about 7K tokens per step
    assert all(r["logprob_gap/max"] < 1e-3 for r in rows), [r["logprob_gap/max"] for r in rows]
    measured = max(rank["memory"]["peak_gib"]["train"] for rank in record["ranks"])
    assert 0.75 <= measured / record["predicted_memory_gib"]["total"] <= 1.25, record


def test_the_capability_table_for_mixture_of_experts_and_pipeline_layouts() -> None:
    """What the fsdp2 trainer builds for MoE models and pipeline stages, and the sentence for what it does not."""
    from rlc.schemas.layout import TrainLayout, runtime_gaps

    def gaps(**kw):  # type: ignore[no-untyped-def]
        flags = {k: kw.pop(k) for k in ("lora", "moe", "colocated", "linear_heads") if k in kw}
        return runtime_gaps(TrainLayout(**kw), "cpu", **flags)

    assert gaps(world_size=4, ep=2, moe=True) == []
    assert gaps(world_size=4, ep=4, cp=2, moe=True) == []  # EP spans both CP ranks of two data-parallel ranks
    assert gaps(world_size=8, pp=2, tp=2, cp=2, recompute="full") == []
    assert gaps(world_size=4, pp=2, ep=2, moe=True) == []
    assert "EP 2 with TP 1, CP 4" in gaps(world_size=4, ep=2, cp=4, moe=True)[0]
    assert gaps(world_size=4, tp=2, ep=2, moe=True) == []  # TP splits attention; experts stay whole (ETP 1)
    assert gaps(world_size=4, tp=2, ep=4, moe=True) == []  # EP over both TP ranks, then the 2 data-parallel ones
    assert "EP 4 with TP 1, CP 1 and DP 2" in gaps(world_size=2, ep=4, moe=True)[0]
    assert gaps(world_size=2, ep=2, moe=True, lora=True) == []  # adapters beside the experts, which stay frozen
    assert "needs a mixture-of-experts model" in gaps(world_size=2, ep=2)[0]
    refused = gaps(world_size=2, pp=2, lora=True, colocated=True, linear_heads=(2, 4))
    assert "not built with Gated-DeltaNet layers" in refused[0]
    assert gaps(world_size=8, pp=2, tp=2, lora=True) == []  # LoRA's adapters go with their stage and TP split
    assert gaps(world_size=2, pp=2, colocated=True) == []
