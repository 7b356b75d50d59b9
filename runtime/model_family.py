"""Which model families the runtime builds exactly, checked against the model folder before any actor starts.

The trainer's tensor-parallel plan, its packed forwards, its expert parallelism and the engines' weight names are
built and tested per family; a folder of another family would load through transformers' auto classes and then
train with layers rlc does not know (shared experts its expert parallelism leaves out, a linear-attention layer
whose packed rows leak). So `rlc run` reads config.json and refuses what it has not been built for, and a folder
whose layers disagree with the plan the compiler made (a hybrid, MoE or latent-attention model served under a
dense model's plan, other expert counts or latent widths, or the reverse). Nothing here imports torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlc.runtime.errors import RunError
from rlc.schemas.plan import ModelSettings

__all__ = [
    "DENSE_FAMILIES",
    "HYBRID_FAMILIES",
    "LATENT_FAMILIES",
    "MOE_FAMILIES",
    "check_model_family",
    "model_type",
]

#: transformers ``model_type``s whose every layer is softmax attention with a dense MLP.
DENSE_FAMILIES = ("llama", "qwen2", "qwen3")
#: Gated-DeltaNet hybrids (Qwen3.5/3.6): the text model, and the multimodal checkpoint whose text model is trained.
HYBRID_FAMILIES = ("qwen3_5_text", "qwen3_5")
#: Mixture-of-experts families whose routed experts are transformers' fused weights (what
#: `runtime/train/expert_parallel` splits and the engines' expert reload repacks), with or without an always-on
#: shared expert (a dense MLP FSDP2 shards like any weight): Qwen3-MoE, Qwen2-MoE and the Qwen3.5/3.6 MoE models
#: (text and multimodal checkpoints; also hybrids, see HYBRID_FAMILIES).
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "qwen3_5_moe_text", "qwen3_5_moe")
#: Multi-head latent attention with DeepSeek's mixture of experts (fused experts, a shared expert, a grouped sigmoid
#: router that `runtime/train/router` reproduces): DeepSeek-V3 and R1.
LATENT_FAMILIES = ("deepseek_v3",)
BUILT = DENSE_FAMILIES + HYBRID_FAMILIES + MOE_FAMILIES + LATENT_FAMILIES
#: Families known and not built yet, with what is missing.
UNTESTED = "a mixture-of-experts family whose layers have not been tested with rlc's expert parallelism"
NOT_BUILT = {
    "qwen3_next": UNTESTED,
    "mixtral": UNTESTED,
}
#: ``architectures`` entries that name a family when config.json has no ``model_type``.
ARCHITECTURE_FAMILY = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


def model_type(config: dict[str, Any]) -> str | None:
    """The folder's family: config.json's ``model_type``, else its first architecture's."""
    found = config.get("model_type")
    if isinstance(found, str) and found:
        return found
    archs = config.get("architectures") or []
    return ARCHITECTURE_FAMILY.get(archs[0]) if archs and isinstance(archs[0], str) else None


def _linear_layers(config: dict[str, Any]) -> int:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    types = text.get("layer_types") or []  # type: ignore[union-attr]
    return sum(1 for t in types if t == "linear_attention")


def _experts(config: dict[str, Any]) -> tuple[int, int] | None:
    """(routed experts, experts per token) of an MoE config.json; None for a dense one."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    experts = (
        text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts")  # type: ignore[union-attr]
    )
    if not experts:
        return None
    return int(experts), int(text.get("num_experts_per_tok") or 0)  # type: ignore[union-attr]


def _latent(config: dict[str, Any]) -> tuple[int, int, int] | None:
    """(kv latent rank, query/key head width, value head width) of a latent-attention config.json; None otherwise."""
    rank = config.get("kv_lora_rank")
    if not rank:
        return None
    qk = int(config.get("qk_nope_head_dim") or 0) + int(config.get("qk_rope_head_dim") or 0)
    return int(rank), qk, int(config.get("v_head_dim") or 0)


def check_model_family(folder: Path, model: ModelSettings) -> str:
    """RunError unless `folder` holds a family the runtime builds and its layers match the plan; returns the family.

    `folder`'s config.json must already be valid JSON (`preflight.check_model_folder`).
    """
    config = json.loads((folder / "config.json").read_text())
    family = model_type(config) if isinstance(config, dict) else None
    built = ", ".join(BUILT)
    if family in NOT_BUILT:
        raise RunError(f"{folder} holds {family}, {NOT_BUILT[family]}; this runtime trains {built}")
    if family not in BUILT:
        named = f"model_type {family!r}" if family else "no model_type"
        raise RunError(
            f"{folder}'s config.json has {named}: this runtime is built and tested for {built} only, and will not "
            "train another family with layers it does not know"
        )
    linear = _linear_layers(config)
    planned = model.linear_attention.layers if model.linear_attention else 0
    if linear != planned:
        raise RunError(
            f"{folder} has {linear} linear-attention layer(s) but the plan was compiled for {model.id} with "
            f"{planned}: compile the spec with the catalog entry of the model in this folder"
        )
    latent = _latent(config)
    planned_latent = model.latent_attention
    want_latent = (
        (planned_latent.kv_lora_rank, planned_latent.qk_head_dim, planned_latent.v_head_dim) if planned_latent else None
    )
    if latent != want_latent:

        def heads(x: tuple[int, int, int] | None) -> str:
            return (
                f"latent attention (kv rank {x[0]}, q/k heads {x[1]}, v heads {x[2]})" if x else "no latent attention"
            )

        raise RunError(
            f"{folder} has {heads(latent)} but the plan was compiled for {model.id} with {heads(want_latent)}: "
            "compile the spec with the catalog entry of the model in this folder"
        )
    found = _experts(config)
    want = (model.experts.num_experts, model.experts.experts_per_token) if model.experts else None
    if found != want:

        def says(x: tuple[int, int] | None) -> str:
            return f"{x[0]} experts, top-{x[1]}" if x else "no experts (dense)"

        raise RunError(
            f"{folder} has {says(found)} but the plan was compiled for {model.id} with {says(want)}: compile the "
            "spec with the catalog entry of the model in this folder"
        )
    return family
