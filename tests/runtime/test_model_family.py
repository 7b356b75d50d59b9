"""`rlc run` refuses, before any actor starts, a model folder of a family the runtime has not been built for,
and one whose layers disagree with the plan (a hybrid checkpoint under a dense model's plan, or the reverse)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlc.runtime.errors import RunError
from rlc.runtime.model_family import check_model_family
from rlc.schemas.plan import ExpertLayers, LatentAttention, LinearAttentionLayers, ModelSettings

DENSE = ModelSettings(id="rlc-tiny", path="m", hf_architecture="Qwen3ForCausalLM", params_b=0.0003, vocab_size=32)
HYBRID = DENSE.model_copy(
    update={
        "id": "qwen3.6-27b",
        "hf_architecture": "Qwen3_5ForConditionalGeneration",
        "linear_attention": LinearAttentionLayers(layers=3, full_attention_interval=4, key_heads=2, value_heads=4),
    }
)
HYBRID_LAYERS = ["linear_attention"] * 3 + ["full_attention"]
MOE = DENSE.model_copy(
    update={
        "id": "rlc-tiny-moe",
        "hf_architecture": "Qwen3MoeForCausalLM",
        "experts": ExpertLayers(layers=2, num_experts=8, experts_per_token=2),
    }
)

#: The tiny DeepSeek-V3's plan record (`runtime/tasks/tiny_mla_model`).
MLA = DENSE.model_copy(
    update={
        "id": "rlc-tiny-mla",
        "hf_architecture": "DeepseekV3ForCausalLM",
        "experts": ExpertLayers(layers=2, num_experts=8, experts_per_token=2),
        "latent_attention": LatentAttention(
            kv_lora_rank=32, q_lora_rank=64, qk_head_dim=48, qk_rope_head_dim=16, v_head_dim=32
        ),
    }
)
DEEPSEEK = {
    "model_type": "deepseek_v3",
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
}


def _folder(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_dense_and_hybrid_folders_that_match_their_plans_pass(tmp_path: Path, tiny_model_dir: Path) -> None:
    assert check_model_family(tiny_model_dir, DENSE) == "qwen3"
    multimodal = {"model_type": "qwen3_5", "text_config": {"layer_types": HYBRID_LAYERS}}
    assert check_model_family(_folder(tmp_path, multimodal), HYBRID) == "qwen3_5"
    # No model_type: the architecture names the family.
    assert check_model_family(_folder(tmp_path, {"architectures": ["Qwen3ForCausalLM"]}), DENSE) == "qwen3"


def test_the_tiny_moe_folder_matches_its_plan(tiny_moe_model_dir: Path) -> None:
    assert check_model_family(tiny_moe_model_dir, MOE) == "qwen3_moe"


def test_the_tiny_deepseek_folder_matches_its_plan(tiny_mla_model_dir: Path) -> None:
    assert check_model_family(tiny_mla_model_dir, MLA) == "deepseek_v3"


@pytest.mark.parametrize(
    ("config", "plan", "needle"),
    [
        ({"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2}, DENSE, "8 experts, top-2 but"),
        ({"model_type": "qwen3"}, MOE, "no experts (dense) but the plan was compiled for rlc-tiny-moe with 8"),
        ({"model_type": "qwen3_moe", "num_experts": 16, "num_experts_per_tok": 2}, MOE, "16 experts"),
        ({"model_type": "qwen3_next"}, MOE, "not been tested"),
        (DEEPSEEK, MOE, "latent attention (kv rank 32, q/k heads 48, v heads 32) but the plan was compiled for "),
        ({"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2}, MLA, "has no latent attention but"),
        ({**DEEPSEEK, "v_head_dim": 16}, MLA, "v heads 16) but the plan was compiled for rlc-tiny-mla with latent"),
        ({**DEEPSEEK, "n_routed_experts": 16}, MLA, "16 experts, top-2 but"),
        # A Qwen3.5 MoE checkpoint is a hybrid too: its linear-attention layers must be in the plan.
        (
            {
                "model_type": "qwen3_5_moe",
                "text_config": {"num_experts": 8, "num_experts_per_tok": 2, "layer_types": HYBRID_LAYERS},
            },
            MOE,
            "3 linear-attention layer(s)",
        ),
        ({"model_type": "gpt2"}, DENSE, "model_type 'gpt2'"),
        ({}, DENSE, "no model_type"),
        ({"model_type": "qwen3_5_text", "layer_types": HYBRID_LAYERS}, DENSE, "3 linear-attention layer(s)"),
        ({"model_type": "qwen3"}, HYBRID, "compiled for qwen3.6-27b with 3"),
    ],
)
def test_other_families_and_mismatched_layers_are_refused(tmp_path: Path, config: dict, plan, needle: str) -> None:
    with pytest.raises(RunError) as caught:
        check_model_family(_folder(tmp_path, config), plan)
    assert needle in str(caught.value)


def test_the_dry_run_refuses_moe_layouts_the_fsdp2_trainer_does_not_build(tmp_path: Path) -> None:
    """Pinned EP, CP and TP 1 that the trainer's EP groups cannot take compile (with RLC303) and the plan-only dry run
    refuses them; with TP 2 beside the (whole) experts it runs, and so does LoRA (adapters beside the experts)."""
    from typer.testing import CliRunner

    from rlc.cli import app

    head = (
        "name: moe\ntarget: a2\ncluster: {nodes: 2}\nmodel: {name: qwen3-30b-a3b, path: /models/Qwen3-30B-A3B}\n"
        "data: {train: /data/math.jsonl}\ntrain: {backend: fsdp2}\n"
    )
    runner = CliRunner()
    outcomes = {}
    for name, tail in (
        ("ep-cp", "placement: {train: {devices: 8, ep: 2, cp: 4, tp: 1}}\n"),
        ("tp", "placement: {train: {tp: 2}}\n"),
        ("lora", "lora: {rank: 8}\n"),
    ):
        (tmp_path / f"{name}.yaml").write_text(head + tail)
        compiled = runner.invoke(app, ["compile", str(tmp_path / f"{name}.yaml"), "-o", str(tmp_path / name)])
        dry = runner.invoke(app, ["run", str(tmp_path / name), "--dry-run"]) if compiled.exit_code == 0 else None
        outcomes[name] = (compiled, dry)
    compiled, dry = outcomes["ep-cp"]
    assert compiled.exit_code == 0 and dry is not None and dry.exit_code == 2
    assert "EP 2 with TP 1, CP 4" in dry.output
    compiled, dry = outcomes["tp"]
    assert dry is not None and dry.exit_code == 0, dry.output  # TP beside the (whole) experts is built
    compiled, dry = outcomes["lora"]
    assert dry is not None and dry.exit_code == 0, compiled.output + (dry.output if dry else "")
