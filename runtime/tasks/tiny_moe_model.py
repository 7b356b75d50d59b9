"""A tiny Qwen3-MoE model: the quickstart model's sizes with every MLP replaced by 8 experts, top-2.

Mixture-of-experts models are what large RL runs train now. This is that shape small enough for two cores, with
the quickstart's character tokenizer and warm-up (`model_builder.build_tiny_model(architecture="moe")`), so expert
parallelism, MoE rollout and the engines' expert-weight reloads are tested on the real transformers and vLLM
classes without a download.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PretrainedConfig, Qwen3MoeConfig

from .tiny_model import SHARED_SIZES, save_model_folder, tiny_config, write_atomically

__all__ = [
    "TINY_MOE_EXPERTS",
    "TINY_MOE_TOP_K",
    "build_tiny_shared_moe_model",
    "tiny_moe_config",
    "tiny_shared_moe_config",
]

TINY_MOE_EXPERTS = 8
TINY_MOE_TOP_K = 2


def tiny_moe_config(max_positions: int = 512) -> Qwen3MoeConfig:
    """The quickstart model's sizes (`tiny_config`); each layer's MLP is 8 experts of width 64, 2 per token.

    The router's top-2 weights are renormalised (`norm_topk_prob`, as Qwen3-30B-A3B) and its load-balancing loss
    is left to the trainer (`output_router_logits` off: rlc adds it over the global batch when the plan asks).
    """
    base = tiny_config(max_positions)
    return Qwen3MoeConfig(
        **{name: getattr(base, name) for name in SHARED_SIZES},
        num_hidden_layers=base.num_hidden_layers,
        moe_intermediate_size=64,
        num_experts=TINY_MOE_EXPERTS,
        num_experts_per_tok=TINY_MOE_TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
        dtype="float32",
    )


def tiny_shared_moe_config(hybrid: bool = False) -> PretrainedConfig:
    """`tiny_moe_config`'s experts plus one always-on shared expert of width 96 behind a sigmoid gate: Qwen2-MoE, or
    with `hybrid` the Qwen3.5/3.6 MoE text model (`tiny_hybrid_config`'s Gated-DeltaNet layers, 3 to 1)."""
    from transformers import Qwen2MoeConfig, Qwen3_5MoeTextConfig

    from .tiny_hybrid_model import tiny_hybrid_config

    moe = tiny_moe_config()
    common = {
        "moe_intermediate_size": moe.moe_intermediate_size,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "norm_topk_prob": True,
        "shared_expert_intermediate_size": 96,
        "dtype": "float32",
        **{name: getattr(moe, name) for name in SHARED_SIZES},
    }
    if not hybrid:
        return Qwen2MoeConfig(
            num_hidden_layers=moe.num_hidden_layers, decoder_sparse_step=1, mlp_only_layers=[], **common
        )
    linear = tiny_hybrid_config()
    keys = (
        "num_hidden_layers",
        "layer_types",
        "linear_conv_kernel_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
    )
    return Qwen3_5MoeTextConfig(**{k: getattr(linear, k) for k in keys}, **common)


def build_tiny_shared_moe_model(out_dir: str | Path, hybrid: bool = False, seed: int = 0) -> Path:
    """A randomly initialised `tiny_shared_moe_config` model with the quickstart's tokenizer in `out_dir` (new or
    empty): for the numerics tests of MoE families with shared experts."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty; choose another directory")

    def write(tmp: Path) -> None:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_shared_moe_config(hybrid)).to(torch.float32)
        save_model_folder(model, tmp, 512)

    write_atomically(out, write)
    return out
